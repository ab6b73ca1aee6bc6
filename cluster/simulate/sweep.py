"""`cluster simulate --sweep`: the same comparison at several cluster sizes.

At each budget the trace's arrival rates scale with it (a budget 4x the base carries 4x the
traffic, same mix and shape), each pool may grow to the budget less the other pool's minimum,
and the static splits are eighths of the budget. Per budget: every strategy's GPU-hours and SLO
attainment, and ours against Ray's default with the best static split, each on one or more
traces of the same spec with different seeds: one trace's bursts and lulls decide a lot (the
best split on one trace is not the best on the next), so the split is the one best over all
of them, as an operator would fix it, and ours is reported per trace and on average.

The simulator is deterministic, so a sweep that changes only our policy can take every other
strategy's numbers from an earlier sweep (`baseline`): each row records a fingerprint of what
those numbers depend on besides the simulator's code (the other strategies as built from the
config, the performance model, the traces, the SLO and the settings), and a baseline row is
used only where it matches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from statistics import fmean
from typing import Any

from pydantic import BaseModel

from cluster.autoscale.model import PerformanceModel
from cluster.config import ClusterConfig, ConfigError
from cluster.simulate import trace as traces
from cluster.simulate.engine import Simulation, Strategy
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
    compared: Sequence[Strategy],
    model: PerformanceModel,
    requests: Sequence[traces.TraceRequest],
    slo: Slo,
    simulation_kwargs: dict[str, Any],
    progress: Callable[[str], None] = lambda _: None,
    only: str | None = None,
) -> list[SimulationResult]:
    """Each of the `compared` strategies (`strategies`: ours first) on one trace; `only`: that
    strategy alone."""
    results = []
    for strategy in compared:
        if only is not None and strategy.name != only:
            continue
        progress(strategy.name)
        results.append(Simulation(strategy, model.pools, slo, **simulation_kwargs).run(requests))
    return results


def baseline_fingerprint(
    compared: Sequence[Strategy],
    model: PerformanceModel,
    days: Sequence[traces.TraceSpec],
    slo: Slo,
    simulation_kwargs: Mapping[str, Any],
) -> str:
    """What the `compared` strategies other than ours yield depends on, besides the simulator's
    code: those strategies, the performance model their replicas run at, the traces, SLO and
    settings, as canonical JSON (`_canonical`)."""
    inputs = ([s for s in compared if s.name != OURS], model, list(days), slo,
              dict(simulation_kwargs))  # fmt: skip
    text = json.dumps(_canonical(inputs), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    """Plain data by fields, floats to 9 significant digits: not `repr`, which a pydantic or
    numpy release may spell differently, nor the last bits a fit may differ by elsewhere."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, BaseModel):
        return _canonical(value.model_dump(mode="json"))
    if isinstance(value, Mapping):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, Enum):
        return _canonical(value.value)
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(f"{float(value):.9g}")
    raise TypeError(f"cannot fingerprint a {type(value).__name__}")


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
        static = next(r for r in results if r.strategy == split)
        rows.append(_trace_row(
            seed, next(r for r in results if r.strategy == OURS), static.gpu_hours,
            static.slo_attainment, best_static(results).strategy,
        ))  # fmt: skip
    return _over_traces(rows, split)


def ours_against_baseline(ours: Sequence[SimulationResult], row: Mapping[str, Any]) -> dict:
    """`ours_against_static` for new runs of ours (one per trace, in the order of the baseline
    `row`'s traces), the static split's numbers taken from that row."""
    rows = [
        _trace_row(trace["seed"], result, trace["gpu_hours_ray_default"],
                   trace["slo_attainment_ray_default"], trace["best_split_of_this_trace"])
        for trace, result in zip(row["traces"], ours, strict=True)
    ]  # fmt: skip
    return _over_traces(rows, row["ray_default_split"])


def _trace_row(seed, ours: SimulationResult, static_gpu_hours, static_slo, best_split) -> dict:
    return {
        "seed": seed,
        "requests": ours.requests,
        "gpu_hours_ours": ours.gpu_hours,
        "gpu_hours_ray_default": static_gpu_hours,
        "gpu_hours_ratio": round(ours.gpu_hours / static_gpu_hours, 3),
        "slo_attainment_ours": ours.slo_attainment,
        "slo_attainment_ray_default": static_slo,
        "best_split_of_this_trace": best_split,
    }


def _over_traces(rows: list[dict[str, Any]], split: str) -> dict[str, Any]:
    """The means over the traces' rows, the range of the GPU-hour ratio and the traces won."""

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
    baseline: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per budget (replicas), the trace scaled by `budget / base_budget`, each on
    `seeds` traces (`seeded`). With `baseline` (an earlier sweep's rows) only ours runs; the
    other strategies' numbers come from the baseline row of the same budget and fingerprint
    (`ConfigError` when there is none)."""
    gpus_per_replica = config.targets[0].accelerators_per_replica
    rows = []
    for budget in budgets:
        sized = at_budget(config, budget)
        days = seeded(spec.scaled(budget / base_budget), seeds)
        compared = strategies(sized, model, slo, budget)
        fingerprint = baseline_fingerprint(compared, model, days, slo, simulation_kwargs)
        recorded = None
        if baseline is not None:
            recorded = next((r for r in baseline if r.get("budget_replicas") == budget
                             and r.get("fingerprint") == fingerprint), None)  # fmt: skip
            if recorded is None:
                raise ConfigError(
                    f"baseline: no row for {budget} replicas with the same static strategies, "
                    f"traces, SLO and settings (fingerprint {fingerprint}): run the full sweep"
                )
        runs, counts = [], []
        for day in days:
            requests = traces.generate(day)
            counts.append(len(requests))
            label = f"{budget} replicas, seed {day.seed}"
            runs.append(compare(
                compared, model, requests, slo, simulation_kwargs,
                lambda name, label=label: progress(f"{label}: {name}"),
                only=OURS if recorded else None,
            ))  # fmt: skip
        if recorded is None:
            comparison = ours_against_static(runs, [day.seed for day in days])
            by_strategy = mean_by_strategy(runs)
        else:
            comparison = ours_against_baseline([run[0] for run in runs], recorded)
            by_strategy = {**recorded["strategies"], **mean_by_strategy(runs)}
        rows.append({
            "budget_replicas": budget,
            "gpus": budget * gpus_per_replica,
            "requests": round(fmean(counts)),
            **comparison,
            "strategies": by_strategy,
            "fingerprint": fingerprint,
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
