"""`cluster simulate --sweep`: the same comparison at several cluster sizes.

At each budget the trace's arrival rates scale with it (a budget 4x the base carries 4x the
traffic, same mix and shape), each pool may grow to the budget less the other pool's minimum,
and the static splits are eighths of the budget. Per budget: every strategy's GPU-hours and SLO
attainment, and ours against Ray's default with the best static split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cluster.autoscale.model import PerformanceModel
from cluster.config import ClusterConfig
from cluster.simulate import trace as traces
from cluster.simulate.engine import Simulation, Slo
from cluster.simulate.strategies import OURS, best_static, strategies


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


def sweep(
    config: ClusterConfig,
    model: PerformanceModel,
    spec: traces.TraceSpec,
    slo: Slo,
    base_budget: int,
    budgets: Sequence[int],
    simulation_kwargs: dict[str, Any],
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """One row per budget (replicas), the trace scaled by `budget / base_budget`."""
    gpus_per_replica = config.targets[0].accelerators_per_replica
    rows = []
    for budget in budgets:
        requests = traces.generate(spec.scaled(budget / base_budget))
        results = []
        for strategy in strategies(at_budget(config, budget), model, slo, budget):
            progress(f"{budget} replicas: {strategy.name}")
            simulation = Simulation(strategy, model.pools, slo, **simulation_kwargs)
            results.append(simulation.run(requests))
        ours = next(r for r in results if r.strategy == OURS)
        best = best_static(results)
        rows.append({
            "budget_replicas": budget,
            "gpus": budget * gpus_per_replica,
            "requests": len(requests),
            "gpu_hours_ours": ours.gpu_hours,
            "gpu_hours_ray_default": best.gpu_hours,
            "gpu_hours_ratio": round(ours.gpu_hours / best.gpu_hours, 3),
            "slo_attainment_ours": ours.slo_attainment,
            "slo_attainment_ray_default": best.slo_attainment,
            "ray_default_split": best.strategy,
            "strategies": {
                r.strategy: {"gpu_hours": r.gpu_hours, "slo_attainment": r.slo_attainment}
                for r in results
            },
        })  # fmt: skip
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| GPUs | requests | GPU-hours ours / best static (ratio) | SLO attainment ours / best "
        "static | best static split | all speculative GPU-h / SLO |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        spec = row["strategies"].get("all_speculative", {})
        lines.append(
            f"| {row['gpus']} | {row['requests']} | {row['gpu_hours_ours']:.0f} / "
            f"{row['gpu_hours_ray_default']:.0f} ({row['gpu_hours_ratio']:.3f}x) | "
            f"{row['slo_attainment_ours']:.3f} / {row['slo_attainment_ray_default']:.3f} | "
            f"{row['ray_default_split']} | {spec.get('gpu_hours', float('nan')):.0f} / "
            f"{spec.get('slo_attainment', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"
