"""The ways of running one target that the simulator compares, built from a cluster config.

- `ours`: the config's pools with model routing (`choose_pool`) and our autoscaling
  (`desired_replicas` per pool towards its per-user rate target, `within_budget` across them);
- `ray_default_static_<k>`: the same two pools with rule v1 routing and Serve's default
  autoscaling, the budget split statically: at most `k` speculative and `budget - k` throughput
  replicas (one run per k; the best of them is "Ray's default autoscaler with the best static
  split");
- `all_speculative` / `all_throughput`: one pool of that kind with the whole budget, Serve's
  default autoscaling.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean

from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.policy import PoolScalingTarget
from cluster.config import ClusterConfig, PoolConfig
from cluster.simulate.engine import PoolSetup, Strategy
from cluster.simulate.result import SimulationResult
from cluster.slo import Slo

OURS = "ours"
STATIC_PREFIX = "ray_default_static_"
SLO_TIE = 0.005
"""SLO attainments this close count as equal when picking the best static split."""


def _setup(
    config: ClusterConfig,
    pool: PoolConfig,
    max_replicas: int,
    target: PoolScalingTarget | None,
    name: str | None = None,
) -> PoolSetup:
    scaling = pool.autoscaling
    return PoolSetup(
        name=name or pool.name,
        role=pool.role,
        min_replicas=min(scaling.min_replicas, max_replicas),
        max_replicas=max_replicas,
        max_batch=pool.engine.max_num_seqs,
        max_queued=pool.max_queued_requests,
        queue_timeout_s=pool.queue_timeout_s,
        gpus_per_replica=config.target(pool.target).accelerators_per_replica,
        upscale_delay_s=scaling.upscale_delay_s,
        downscale_delay_s=scaling.downscale_delay_s,
        target_ongoing_requests=scaling.target_ongoing_requests,
        scaling_target=target,
    )


TARGET_HEADROOM = 1.25
"""Without a configured `target_per_user_tok_s`, our policy aims this much above the SLO's rate
(the margin an operator would give it: at the SLO itself half the requests would miss it)."""


def our_target(pool: PoolConfig, max_replicas: int, slo: Slo) -> PoolScalingTarget:
    """Our policy's target for a pool: its `target_per_user_tok_s`, else the SLO's rate with
    `TARGET_HEADROOM`."""
    scaling = pool.autoscaling
    rate = scaling.target_per_user_tok_s or slo.per_user_tok_s * TARGET_HEADROOM
    return PoolScalingTarget(
        min_replicas=min(scaling.min_replicas, max_replicas),
        max_replicas=max_replicas,
        target_per_user_tok_s=rate,
        context_tokens=scaling.context_tokens,
        max_batch=pool.engine.max_num_seqs,
        utilization=scaling.target_utilization,
        demand_window_s=scaling.demand_window_s,
        upscale_cooldown_s=scaling.upscale_cooldown_s,
        downscale_cooldown_s=scaling.downscale_cooldown_s,
    )


def static_splits(budget: int) -> list[int]:
    """The speculative replicas of the static splits compared: every split up to 8 replicas,
    eighths of the budget beyond (a sweep to 64 replicas would otherwise run 63 of them)."""
    if budget <= 8:
        return list(range(1, budget))
    return sorted({max(1, min(budget - 1, round(budget * i / 8))) for i in range(1, 8)})


def strategies(
    config: ClusterConfig, model: PerformanceModel, slo: Slo, budget: int
) -> list[Strategy]:
    """Every strategy for the config's first target with `budget` replicas at most."""
    target_id = config.targets[0].id
    by_role = {p.role: p for p in config.pools if p.target == target_id}
    if set(by_role) != {"speculative", "throughput"}:
        raise ValueError(f"{target_id}: the simulator compares a speculative and a throughput pool")
    spec, thr = by_role["speculative"], by_role["throughput"]
    caps = {p.name: min(p.autoscaling.max_replicas, budget) for p in (spec, thr)}
    ours = Strategy(
        name=OURS,
        pools=tuple(
            _setup(config, p, caps[p.name], our_target(p, caps[p.name], slo)) for p in (spec, thr)
        ),  # fmt: skip
        routing=config.routing,
        routing_model=model,
        budget=budget,
        description="model routing on the scaled profile; per-pool rate targets (the "
        "config's, else the SLO's rate x 1.25); pools sized together within the budget (what "
        "the preset deploys once it has a calibrated routing.profile)",
    )
    static = [
        Strategy(
            name=f"{STATIC_PREFIX}{k}",
            pools=(_setup(config, spec, k, None), _setup(config, thr, budget - k, None)),
            routing=config.routing,
            routing_model=None,
            description=f"rule v1 routing; Ray's default autoscaler; at most {k} speculative + "
            f"{budget - k} throughput replicas",
        )
        for k in static_splits(budget)
    ]
    single = [
        Strategy(
            name=f"all_{pool.role}",
            pools=(_setup(config, pool, budget, None),),
            routing=config.routing,
            routing_model=None,
            description=f"every request to the {pool.role} pool; Ray's default autoscaler; "
            f"up to {budget} replicas",
        )
        for pool in (spec, thr)
    ]
    return [ours, *static, *single]


def best_static(results: list[SimulationResult]) -> SimulationResult:
    """Ray's default with the best static split on one trace (`best_static_over` that trace)."""
    name = best_static_over([results])
    return next(r for r in results if r.strategy == name)


def best_static_over(runs: Sequence[Sequence[SimulationResult]]) -> str:
    """The static split an operator would fix for every day: the highest SLO attainment
    averaged over `runs` (each every strategy on one trace), then the fewest mean GPU-hours
    among those within `SLO_TIE` of it."""
    names = [r.strategy for r in runs[0] if r.strategy.startswith(STATIC_PREFIX)]
    if not names:
        raise ValueError("no static split to compare with: --budget must be at least 2")

    def mean(name: str, field: str) -> float:
        return fmean(getattr(r, field) for run in runs for r in run if r.strategy == name)

    top = max(mean(name, "slo_attainment") for name in names)
    tied = [name for name in names if mean(name, "slo_attainment") >= top - SLO_TIE]
    return min(tied, key=lambda name: mean(name, "gpu_hours"))
