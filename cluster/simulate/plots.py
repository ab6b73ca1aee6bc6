"""The simulator's plots: replicas per pool over a run, and ours against the best static split
across cluster sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.simulate import trace as traces


def plot(timelines: dict[str, list[dict[str, Any]]], spec: traces.TraceSpec | None, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(10, 4.5))
    for strategy, timeline in timelines.items():
        pools = [k for k in timeline[0] if k != "t_s"]
        hours = [point["t_s"] / 3600 for point in timeline]
        for pool in pools:
            axis.step(hours, [p[pool] for p in timeline], where="post", label=f"{strategy}: {pool}")
    axis.set(xlabel="simulated hours", ylabel="replicas (running or starting)")
    axis.grid(alpha=0.3)
    if spec is not None:
        rate_axis = axis.twinx()
        xs = [i * spec.duration_s / 400 for i in range(401)]
        rate_axis.plot(
            [x / 3600 for x in xs],
            [spec.rate_at(x) for x in xs],
            color="grey",
            alpha=0.4,
            label="arrivals/s",
        )
        rate_axis.set_ylabel("arrivals per second")
    axis.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [row["gpus"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ratios = [row["gpu_hours_ratio"] for row in rows]
    spread = [  # the per-trace range around the ratio of the means
        [r - row["gpu_hours_ratio_min"] for r, row in zip(ratios, rows, strict=True)],
        [row["gpu_hours_ratio_max"] - r for r, row in zip(ratios, rows, strict=True)],
    ]
    left.errorbar(gpus, ratios, yerr=spread, marker="o", capsize=4)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="GPUs (budget)", ylabel="GPU-hours, ours / best static",
             title="cost (bars: range over the traces)")  # fmt: skip
    right.plot(gpus, [row["slo_attainment_ours"] for row in rows], marker="o", label="ours")
    right.plot(gpus, [row["slo_attainment_ray_default"] for row in rows], marker="s",
               label="Ray default, best static split")  # fmt: skip
    right.set(xscale="log", xlabel="GPUs (budget)", ylabel="SLO attainment", title="service")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.set_xticks(gpus, [str(g) for g in gpus])
        axis.minorticks_off()  # the log axis's own labels (2x10^2, ...) overlap the budgets'
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
