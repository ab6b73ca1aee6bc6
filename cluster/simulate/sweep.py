"""`cluster simulate --sweep`: the same comparison at several cluster sizes.

At each budget the trace's arrival rates scale with it (a budget 4x the base carries 4x the
traffic, same mix and shape), each pool may grow to the budget less the other pool's minimum,
and the static splits are eighths of the budget. Per budget: every strategy's GPU-hours and SLO
attainment, and ours against Ray's default with the best static split, each on one or more
traces of the same spec with different seeds: one trace's bursts and lulls decide a lot (the
best split on one trace is not the best on the next), so the split is the one best over all
of them, as an operator would fix it, and ours is reported per trace and on average.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import fmean
from typing import Any

from cluster.autoscale.model import PerformanceModel
from cluster.config import ClusterConfig
from cluster.simulate import trace as traces
from cluster.simulate.engine import Simulation
from cluster.simulate.result import SimulationResult
from cluster.simulate.strategies import OURS, best_static, best_static_over, strategies
from cluster.slo import Slo


def at_budget(config: ClusterConfig, budget: int) -> ClusterConfig:
    """`config` whose first target's pools may use `budget` replicas together."""
    target = config.targets[0].id
    pools = [p for p in config.pools if p.target == target]
    resized = []
    for pool in config.pools:
        if pool.target == target:
            others = sum(o.autoscaling.min_replicas for o in pools if o is not pool)
            scaling = pool.autoscaling.model_copy(update={"max_replicas": budget - others})
            pool = pool.model_copy(update={"autoscaling": scaling})
        resized.append(pool)
    return config.model_copy(update={"pools": resized})


def seeded(spec: traces.TraceSpec, count: int) -> list[traces.TraceSpec]:
    """`spec` and `count - 1` more days like it: the same curve, bursts and mix, the seeds
    that follow its own."""
    return [spec.model_copy(update={"seed": spec.seed + i}) for i in range(count)]


def compare(
    config: ClusterConfig,
    model: PerformanceModel,
    requests: Sequence[traces.TraceRequest],
    slo: Slo,
    budget: int,
    simulation_kwargs: dict[str, Any],
    progress: Callable[[str], None] = lambda _: None,
) -> list[SimulationResult]:
    """Every strategy (ours first) on one trace."""
    results = []
    for strategy in strategies(config, model, slo, budget):
        progress(strategy.name)
        results.append(Simulation(strategy, model.pools, slo, **simulation_kwargs).run(requests))
    return results


def ours_against_static(
    runs: Sequence[Sequence[SimulationResult]], seeds: Sequence[int | None]
) -> dict[str, Any]:
    """Ours against Ray's default with the one static split best over all the traces
    (`best_static_over`; `runs[i]` is every strategy on the trace of `seeds[i]`): the means
    over the traces, the range of the per-trace GPU-hour ratio, the traces where ours met the
    goal (no lower SLO attainment, fewer GPU-hours), and per trace its numbers and the split
    that would have been best on that trace alone."""
    split = best_static_over(runs)
    rows = []
    for seed, results in zip(seeds, runs, strict=True):
        ours = next(r for r in results if r.strategy == OURS)
        static = next(r for r in results if r.strategy == split)
        rows.append({
            "seed": seed,
            "requests": ours.requests,
            "gpu_hours_ours": ours.gpu_hours,
            "gpu_hours_ray_default": static.gpu_hours,
            "gpu_hours_ratio": round(ours.gpu_hours / static.gpu_hours, 3),
            "slo_attainment_ours": ours.slo_attainment,
            "slo_attainment_ray_default": static.slo_attainment,
            "best_split_of_this_trace": best_static(results).strategy,
        })  # fmt: skip

    def mean(key: str, digits: int) -> float:
        return round(fmean(row[key] for row in rows), digits)

    ratios = [row["gpu_hours_ratio"] for row in rows]
    return {
        "gpu_hours_ours": mean("gpu_hours_ours", 3),
        "gpu_hours_ray_default": mean("gpu_hours_ray_default", 3),
        "gpu_hours_ratio": round(mean("gpu_hours_ours", 3) / mean("gpu_hours_ray_default", 3), 3),
        "gpu_hours_ratio_min": min(ratios),
        "gpu_hours_ratio_max": max(ratios),
        "slo_attainment_ours": mean("slo_attainment_ours", 4),
        "slo_attainment_ray_default": mean("slo_attainment_ray_default", 4),
        "ray_default_split": split,
        "traces_won": sum(
            row["gpu_hours_ours"] < row["gpu_hours_ray_default"]
            and row["slo_attainment_ours"] >= row["slo_attainment_ray_default"]
            for row in rows
        ),
        "traces": rows,
    }


def mean_by_strategy(runs: Sequence[Sequence[SimulationResult]]) -> dict[str, dict[str, float]]:
    """Each strategy's GPU-hours and SLO attainment, averaged over the traces."""
    return {
        result.strategy: {
            "gpu_hours": round(fmean(run[i].gpu_hours for run in runs), 3),
            "slo_attainment": round(fmean(run[i].slo_attainment for run in runs), 4),
        }
        for i, result in enumerate(runs[0])
    }


def sweep(
    config: ClusterConfig,
    model: PerformanceModel,
    spec: traces.TraceSpec,
    slo: Slo,
    base_budget: int,
    budgets: Sequence[int],
    simulation_kwargs: dict[str, Any],
    progress: Callable[[str], None] = lambda _: None,
    seeds: int = 1,
) -> list[dict[str, Any]]:
    """One row per budget (replicas), the trace scaled by `budget / base_budget`, each on
    `seeds` traces (`seeded`)."""
    gpus_per_replica = config.targets[0].accelerators_per_replica
    rows = []
    for budget in budgets:
        days = seeded(spec.scaled(budget / base_budget), seeds)
        runs, counts = [], []
        for day in days:
            requests = traces.generate(day)
            counts.append(len(requests))
            label = f"{budget} replicas, seed {day.seed}"
            runs.append(compare(
                at_budget(config, budget), model, requests, slo, budget, simulation_kwargs,
                lambda name, label=label: progress(f"{label}: {name}"),
            ))  # fmt: skip
        rows.append({
            "budget_replicas": budget,
            "gpus": budget * gpus_per_replica,
            "requests": round(fmean(counts)),
            **ours_against_static(runs, [day.seed for day in days]),
            "strategies": mean_by_strategy(runs),
        })  # fmt: skip
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| GPUs | requests per trace | GPU-hours ours / best static (ratio; per trace) | SLO "
        "attainment ours / best static | best static split | traces won | all speculative "
        "GPU-h / SLO |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        spec = row["strategies"].get("all_speculative", {})
        lines.append(
            f"| {row['gpus']} | {row['requests']} | {row['gpu_hours_ours']:.0f} / "
            f"{row['gpu_hours_ray_default']:.0f} ({row['gpu_hours_ratio']:.3f}x; "
            f"{row['gpu_hours_ratio_min']:.3f}-{row['gpu_hours_ratio_max']:.3f}) | "
            f"{row['slo_attainment_ours']:.3f} / {row['slo_attainment_ray_default']:.3f} | "
            f"{row['ray_default_split']} | {row['traces_won']} of {len(row['traces'])} | "
            f"{spec.get('gpu_hours', float('nan')):.0f} / "
            f"{spec.get('slo_attainment', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"
