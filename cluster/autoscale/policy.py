"""Pure scaling and replica-choice decisions (no Ray import): the functions Ray adapters call.

`desired_replicas` sizes one pool from its replicas' engine stats (the `EngineStats.as_metrics()`
form) and a per-pool target; `share_budget` divides a replica budget between pools;
`replica_slowdown` scores a replica for the next request (lower is better). A performance
`model` may refine the capacity of a replica; without one (`None`) the target's
`target_running_per_replica` is the capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

KV_FULL = 0.95
"""KV cache usage treated as full: the free fraction a slowdown divides by never drops below
`1 - KV_FULL`, so a full replica scores 20x worse rather than infinitely."""

DOWNSCALE_HEADROOM = 0.7
"""A pool shrinks only when its load fits the smaller pool at this fraction of the target
(hysteresis: the load that triggers a scale-down cannot trigger a scale-up right after)."""


@dataclass(frozen=True)
class PoolScalingState:
    """What a pool looks like now."""

    current_replicas: int
    """Running replicas."""
    replica_stats: list[dict[str, float]] = field(default_factory=list)
    """Fresh engine stats of each running replica (`EngineStats.as_metrics()` form); replicas
    whose stats are missing or stale are left out."""
    now_s: float = 0.0
    """Clock of the decision (seconds)."""
    last_change_s: float | None = None
    """When the pool's replica count last changed; None = never."""


@dataclass(frozen=True)
class PoolScalingTarget:
    """Bounds and the target a pool is steered to."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_running_per_replica: float = 8.0
    """Engine requests (running + waiting) one replica should hold."""
    upscale_cooldown_s: float = 30.0
    """Least time between a change and the next scale-up."""
    downscale_cooldown_s: float = 300.0
    """Least time between a change and the next scale-down."""


@dataclass(frozen=True)
class ScalingDecision:
    replicas: int
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)


def _stat(stats: dict[str, float], key: str) -> float:
    value = stats.get(key, 0.0)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def replica_slowdown(stats: dict[str, float]) -> float:
    """Predicted slowdown of adding one request to a replica (lower is better).

    Each request in the batch lengthens every decode step about equally, so the new request's
    cost grows with `running + 1`; each waiting request is ahead of it in the scheduler queue
    and counts twice (it adds its prefill and then its decode). The result is divided by the
    free KV cache fraction: near a full cache new requests wait or preempt others.
    """
    load = 1.0 + _stat(stats, "running") + 2.0 * _stat(stats, "waiting")
    free_kv = 1.0 - min(_stat(stats, "kv_cache_usage"), KV_FULL)
    return load / free_kv


def _capacity(model: Any, target: PoolScalingTarget) -> float:
    """Requests one replica should hold: the model's answer when it gives one, else the
    target's. A model is any object with `capacity_per_replica(target) -> float`."""
    capacity = None
    if model is not None and hasattr(model, "capacity_per_replica"):
        capacity = model.capacity_per_replica(target)
    if capacity is None or not capacity > 0:
        capacity = target.target_running_per_replica
    return float(capacity)


def desired_replicas(
    state: PoolScalingState, model: Any, target: PoolScalingTarget
) -> ScalingDecision:
    """Replicas a pool should have: its engine load over one replica's capacity, within the
    bounds, with hysteresis on the way down and a cooldown after each change."""
    current = state.current_replicas
    bounds = (target.min_replicas, target.max_replicas)
    load = sum(_stat(s, "running") + _stat(s, "waiting") for s in state.replica_stats)
    capacity = _capacity(model, target)
    inputs: dict[str, Any] = {
        "current": current,
        "reporting": len(state.replica_stats),
        "load": round(load, 3),
        "capacity_per_replica": round(capacity, 3),
        "min": bounds[0],
        "max": bounds[1],
    }

    def clamp(n: int) -> int:
        return max(bounds[0], min(bounds[1], n))

    if current == 0:
        return ScalingDecision(clamp(0), "pool at zero: stays until requests arrive", inputs)
    if not state.replica_stats:
        return ScalingDecision(clamp(current), "no fresh stats: hold", inputs)
    # Replicas without stats are assumed as loaded as the mean reporting one.
    load *= current / len(state.replica_stats)
    inputs["load_scaled"] = round(load, 3)
    wanted = math.ceil(load / capacity) if load > 0 else 0
    if wanted <= current:  # shrink only with headroom: hysteresis against flapping
        fits = math.ceil(load / (capacity * DOWNSCALE_HEADROOM)) if load > 0 else 0
        wanted = min(current, fits)
    desired = clamp(wanted)
    if desired != wanted:
        reason = f"bounds {bounds[0]}..{bounds[1]} (load {load:.1f} wants {wanted})"
    elif desired > current:
        reason = f"load {load:.1f} > {current} x {capacity:g}"
    elif desired < current:
        reason = f"load {load:.1f} fits {desired} x {capacity:g} x {DOWNSCALE_HEADROOM}"
    else:
        reason = "within target"
    since = None if state.last_change_s is None else state.now_s - state.last_change_s
    inputs["since_change_s"] = None if since is None else round(since, 1)
    if desired > current and since is not None and since < target.upscale_cooldown_s:
        return ScalingDecision(current, f"upscale cooldown ({reason})", inputs)
    if desired < current and since is not None and since < target.downscale_cooldown_s:
        return ScalingDecision(current, f"downscale cooldown ({reason})", inputs)
    return ScalingDecision(desired, reason, inputs)


def share_budget(
    pools: dict[str, PoolScalingState],
    models: dict[str, Any] | None,
    budget: int,
    targets: dict[str, PoolScalingTarget] | None = None,
) -> dict[str, int]:
    """Replicas per pool when the pools together may hold at most `budget`.

    Each pool first gets what `desired_replicas` wants; if the sum exceeds the budget, every
    pool keeps its `min_replicas` and the rest of the budget goes out in proportion to what
    each pool wants above its minimum (largest remainders first, ties by name). A budget
    smaller than the minimums gives each pool its minimum (minimums are never broken)."""
    targets = targets or {}
    models = models or {}
    wanted = {
        name: desired_replicas(
            state, models.get(name), targets.get(name, PoolScalingTarget())
        ).replicas
        for name, state in pools.items()
    }
    if sum(wanted.values()) <= budget:
        return wanted
    minimum = {name: targets.get(name, PoolScalingTarget()).min_replicas for name in pools}
    extra = {name: max(0, wanted[name] - minimum[name]) for name in pools}
    left = max(0, budget - sum(minimum.values()))
    total_extra = sum(extra.values())
    shares = {name: left * extra[name] / total_extra if total_extra else 0.0 for name in pools}
    result = {name: minimum[name] + math.floor(shares[name]) for name in pools}
    remaining = left - sum(math.floor(s) for s in shares.values())
    for name in sorted(pools, key=lambda n: (-(shares[n] - math.floor(shares[n])), n)):
        if remaining <= 0:
            break
        if result[name] < wanted[name]:
            result[name] += 1
            remaining -= 1
    return result
