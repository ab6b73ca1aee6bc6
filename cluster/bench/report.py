"""Tables and plots from a benchmark result document (see `runner.run`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cluster.bench.metrics import lift

BASELINE = "none"


def _measured(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: c for name, c in result["configs"].items() if "scenarios" in c}


def _workloads(result: dict[str, Any]) -> list[str]:
    return list(result["workloads"])


def _closed_loop(result: dict[str, Any], workload: str) -> list[int]:
    concurrencies = set()
    for config in _measured(result).values():
        for name in config["scenarios"]:
            base, _, load = name.partition("@")
            if base == workload and load.startswith("c"):
                concurrencies.add(int(load[1:]))
    return sorted(concurrencies)


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """Per workload: configs x concurrency, mean per-user tok/s with the lift over `none`
    (the EAGLE 3.1 release's format), then acceptance, open-loop and overhead tables."""
    configs = _measured(result)
    lines = [f"# cluster bench ({result['started']})", ""]
    machine, versions = result["machine"], result["versions"]
    lines.append(
        f"{machine['cpus']} CPUs ({machine['processor']}); "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    for name, config in result["configs"].items():
        if "skipped" in config:
            lines.append(f"- skipped `{name}`: {config['skipped']}")
        elif "failed" in config:
            lines.append(f"- `{name}` did not start: {config['failed'].splitlines()[0]}")
    for name, config in configs.items():
        for scenario, cell in config["scenarios"].items():
            if cell.get("unstreamed"):  # results written before it was counted lack it
                lines.append(
                    f"- `{name}` {scenario}: {cell['unstreamed']} of {cell['completed']} "
                    "responses arrived in one chunk (a CPU-starved proxy coalesces streams); "
                    "they are left out of TPOT and per-user tok/s"
                )
    for workload in _workloads(result):
        levels = _closed_loop(result, workload)
        if not levels:
            continue
        lines += ["", f"## {workload}: per-user output tok/s (lift vs `{BASELINE}`)", ""]
        lines.append("| config | " + " | ".join(f"c={c}" for c in levels) + " |")
        lines.append("|---|" + "---|" * len(levels))
        for name, config in configs.items():
            cells = []
            for c in levels:
                cell = config["scenarios"].get(f"{workload}@c{c}")
                base = configs.get(BASELINE, {}).get("scenarios", {}).get(f"{workload}@c{c}")
                if cell is None:
                    cells.append("-")
                    continue
                ratio = lift(cell, base)
                value = _fmt(cell["per_user_tok_s"]["mean"])
                cells.append(f"{value} ({ratio:.2f}x)" if ratio else value)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _acceptance_table(result)
    lines += _open_loop_table(result)
    lines += _pool_table(result)
    lines += _overhead_table(result)
    return "\n".join(lines) + "\n"


def _acceptance_table(result: dict[str, Any]) -> list[str]:
    rows = []
    for name, config in _measured(result).items():
        for scenario, cell in config["scenarios"].items():
            spec = cell["speculation"]
            if spec["mean_acceptance_length"] is None:
                continue
            per_pos = " / ".join(f"{p:.2f}" for p in spec["per_position_acceptance"])
            rows.append(
                f"| {name} | {scenario} | {spec['mean_acceptance_length']:.2f} | {per_pos} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Speculation (counter deltas over each scenario)",
        "",
        "| config | scenario | mean acceptance length | per-position acceptance |",
        "|---|---|---|---|",
        *rows,
    ]


def _open_loop_table(result: dict[str, Any]) -> list[str]:
    rows = []
    for name, config in _measured(result).items():
        for scenario, cell in config["scenarios"].items():
            if "@rate" not in scenario:
                continue
            routed = ", ".join(f"{p}: {n}" for p, n in cell["routed"].items()) or "-"
            rows.append(
                f"| {name} | {scenario} | {_fmt(cell['per_user_tok_s']['mean'])} | "
                f"{_fmt(cell['ttft_s']['p90'], 2)} | {_fmt(cell['latency_s']['p90'], 2)} | "
                f"{_fmt(cell['aggregate_tok_s'])} | {routed} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Open loop (Poisson arrivals)",
        "",
        "| config | scenario | per-user tok/s | p90 TTFT s | p90 latency s | aggregate tok/s "
        "| routed |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def _pool_table(result: dict[str, Any]) -> list[str]:
    """Where the router sent each scenario's requests, and how each pool served them."""
    rows = []
    for name, config in _measured(result).items():
        for scenario, cell in config["scenarios"].items():
            by_pool = cell.get("by_pool", {})  # absent in results from before per-request pools
            if len(by_pool) < 2:
                continue
            for pool, stats in by_pool.items():
                rows.append(
                    f"| {name} | {scenario} | {pool} | {stats['completed']} | "
                    f"{_fmt(stats['prompt_tokens']['mean'], 0)} | "
                    f"{_fmt(stats['per_user_tok_s']['mean'])} | {_fmt(stats['ttft_s']['p90'], 2)} |"
                )
    if not rows:
        return []
    return [
        "",
        "## Per pool (from each request's routing decision)",
        "",
        "| config | scenario | pool | requests | mean prompt tokens | per-user tok/s "
        "| p90 TTFT s |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def overhead(result: dict[str, Any]) -> dict[str, float]:
    """Per closed-loop scenario: aggregate tok/s of our cluster (`none`) over raw vLLM's."""
    configs = _measured(result)
    ours, raw = configs.get(BASELINE), configs.get("vllm")
    if not ours or not raw:
        return {}
    ratios = {}
    for scenario, cell in ours["scenarios"].items():
        other = raw["scenarios"].get(scenario)
        if other and other["aggregate_tok_s"] and "@c" in scenario:
            ratios[scenario] = cell["aggregate_tok_s"] / other["aggregate_tok_s"]
    return ratios


def _overhead_table(result: dict[str, Any]) -> list[str]:
    ratios = overhead(result)
    if not ratios:
        return []
    return [
        "",
        f"## Serving overhead: `{BASELINE}` (our cluster) vs `vllm` (its own server)",
        "",
        "| scenario | aggregate tok/s ratio |",
        "|---|---|",
        *(f"| {scenario} | {ratio:.3f} |" for scenario, ratio in ratios.items()),
    ]


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = _measured(result)
    written = []
    workloads = [w for w in _workloads(result) if _closed_loop(result, w)]
    if workloads:
        fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
        for axis, workload in zip(axes[0], workloads, strict=True):
            levels = _closed_loop(result, workload)
            for name, config in configs.items():
                values = [
                    config["scenarios"]
                    .get(f"{workload}@c{c}", {})
                    .get("per_user_tok_s", {})
                    .get("mean", math.nan)
                    for c in levels
                ]
                axis.plot(levels, values, marker="o", label=name)
            axis.set(title=workload, xlabel="concurrency", ylabel="per-user output tok/s")
            axis.set_xscale("log", base=2)
            axis.grid(alpha=0.3)
            axis.legend()
        written.append(_save(fig, out_dir / "per_user_tok_s.png"))

    contexts = [int(w.rsplit("-", 1)[1]) for w in workloads if w.startswith("code-long-")]
    fig, axis = plt.subplots(figsize=(6, 4))
    plotted = False
    for name, config in configs.items():
        lengths = [
            config["scenarios"]
            .get(f"code-long-{n}@c1", {})
            .get("speculation", {})
            .get("mean_acceptance_length")
            for n in contexts
        ]
        if any(v is not None for v in lengths):
            axis.plot(contexts, [v or math.nan for v in lengths], marker="o", label=name)
            plotted = True
    axis.set(
        title="Acceptance length vs context (c=1)",
        xlabel="prompt code tokens",
        ylabel="mean acceptance length",
    )
    axis.grid(alpha=0.3)
    if plotted:
        axis.legend()
    written.append(_save(fig, out_dir / "acceptance_vs_context.png"))

    fig, axis = plt.subplots(figsize=(6, 4))
    for name, config in configs.items():
        latencies = sorted(
            r["latency_s"] for cell in config["scenarios"].values() for r in cell["requests"]
        )
        if latencies:
            fractions = [(i + 1) / len(latencies) for i in range(len(latencies))]
            axis.step(latencies, fractions, where="post", label=name)
    axis.set(title="End-to-end latency CDF (all scenarios)", xlabel="seconds", ylabel="fraction")
    axis.grid(alpha=0.3)
    axis.legend()
    written.append(_save(fig, out_dir / "latency_cdf.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
