"""Autoscaling decisions from the performance model: pure functions, no Ray.

Per pool (`desired_replicas`): the fewest replicas at which the requests the pool holds
(running + waiting on every replica, plus those queued before one) decode at the target
per-user rate, spread evenly over the replicas. A band (`hysteresis`) and cool-downs keep it
from flapping: it scales up as soon as the target is missed (after `upscale_cooldown_s`), and
down only when the smaller count beats the target by the band, `downscale_cooldown_s` after the
last change. Stale or missing stats hold the current count; no model: an ongoing-requests
target like Ray's default.

Per target (`share_budget`): a budget of replicas (e.g. GPUs / GPUs per replica) split between
the speculative and the throughput pool so that the mean per-user rate of the requests in
flight, routed at best between the pools, is highest. Speculation wins while batches are
small, so as concurrency rises capacity moves to the throughput pool and back as it falls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.autoscale.model import PoolModel

KV_FULL = 0.95
"""KV cache usage treated as full: the free fraction a slowdown divides by never drops below
`1 - KV_FULL`, so a full replica scores 20x worse rather than infinitely."""

SHARE_HYSTERESIS = 0.05
"""`share_budget` moves replicas only for a mean per-user rate this much higher."""


@dataclass(frozen=True)
class PoolScalingTarget:
    """What one pool's autoscaling aims at."""

    min_replicas: int = 0
    max_replicas: int = 1
    target_per_user_tok_s: float | None = None
    """Per-user decode rate every request should see; None: from `tpot_slo_s`."""
    tpot_slo_s: float | None = None
    """Time per output token a user should see (target rate = 1 / this)."""
    context_tokens: int = 1024
    """Context the prediction assumes for the requests in flight."""
    max_batch: int | None = None
    """Requests one replica runs at once; more per replica wait, which misses any target."""
    ongoing_requests_per_replica: float = 4
    """Without a model: Ray's default target (in-flight requests per replica)."""
    hysteresis: float = 0.2
    """Scale down only when the smaller count is predicted at least this much above target."""
    upscale_cooldown_s: float = 30
    """Least time between two scale-ups."""
    downscale_cooldown_s: float = 300
    """Least time from any change to a scale-down (a drain takes time, churn costs)."""
    max_stats_age_s: float = 30
    """Stats older than this are stale: the count holds."""

    @property
    def target_rate(self) -> float | None:
        if self.target_per_user_tok_s is not None:
            return self.target_per_user_tok_s
        return 1 / self.tpot_slo_s if self.tpot_slo_s else None


@dataclass(frozen=True)
class PoolScalingState:
    """What the policy sees of one pool."""

    replicas: int
    """Replicas now (running or starting)."""
    stats: list[dict[str, float]] = field(default_factory=list)
    """Per replica, `EngineStats.as_metrics()` (running, waiting, kv_cache_usage, ...)."""
    now_s: float = 0.0
    stats_at_s: float | None = None
    """When `stats` were taken (same clock as `now_s`); None: never."""
    queued: int = 0
    """Requests waiting for the pool outside its replicas (ingress / Serve queue)."""
    last_scale_up_s: float | None = None
    last_scale_down_s: float | None = None

    @property
    def demand(self) -> int:
        """Requests the pool holds: running and waiting on its replicas, and queued for it."""
        held = sum(s.get("running", 0) + s.get("waiting", 0) for s in self.stats)
        return int(held) + self.queued

    @property
    def stats_age_s(self) -> float:
        return math.inf if self.stats_at_s is None else self.now_s - self.stats_at_s


@dataclass(frozen=True)
class ScalingDecision:
    replicas: int
    reason: str
    """`hold`, `scale_up`, `scale_down`, `cooldown`, `stale_stats`, `slo_infeasible`,
    `no_model`, `wake` or `idle`."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """What the decision saw, for the log line."""


def meets(model: PoolModel, demand: int, replicas: int, target: PoolScalingTarget, rate: float):
    """Whether `replicas` serve `demand` requests at `rate` per user or faster."""
    if replicas <= 0:
        return demand == 0
    batch = math.ceil(demand / replicas)
    if target.max_batch and batch > target.max_batch:
        return False
    return batch == 0 or model.per_user_rate(batch, target.context_tokens) >= rate


def fewest_replicas(
    model: PoolModel, demand: int, target: PoolScalingTarget, rate: float
) -> int | None:
    """The fewest replicas in the target's range that meet `rate`; None: none does."""
    for replicas in range(target.min_replicas, target.max_replicas + 1):
        if meets(model, demand, replicas, target, rate):
            return replicas
    return None


def desired_replicas(
    state: PoolScalingState, model: PoolModel | None, target: PoolScalingTarget
) -> ScalingDecision:
    """How many replicas the pool should have now."""
    current = min(max(state.replicas, target.min_replicas), target.max_replicas)
    demand = state.demand
    inputs: dict[str, Any] = {
        "replicas": state.replicas,
        "demand": demand,
        "stats_age_s": state.stats_age_s,
        "target_rate": target.target_rate,
    }
    if state.replicas == 0:  # no replica, no stats: only requests queued for it count
        if state.queued:
            return ScalingDecision(max(current, 1), "wake", inputs)
        return ScalingDecision(current, "idle", inputs)
    if state.stats_age_s > target.max_stats_age_s or not state.stats:
        return ScalingDecision(current, "stale_stats", inputs)
    rate = target.target_rate
    if model is None or rate is None:
        wanted = math.ceil(demand / target.ongoing_requests_per_replica)
        wanted = min(max(wanted, target.min_replicas), target.max_replicas)
        return _cooled(state, current, wanted, "no_model", inputs, target)
    up = fewest_replicas(model, demand, target, rate)
    down = fewest_replicas(model, demand, target, rate * (1 + target.hysteresis))
    inputs |= {"predicted_at_current": _rate(model, demand, state.replicas, target)}
    if up is None:  # even the most replicas miss the target: as many as requests can use
        wanted = min(target.max_replicas, max(demand, target.min_replicas, 1))
        return _cooled(state, current, wanted, "slo_infeasible", inputs, target)
    if up > current:
        return _cooled(state, current, up, "scale_up", inputs, target)
    if down is not None and down < current:
        return _cooled(state, current, down, "scale_down", inputs, target)
    return ScalingDecision(current, "hold", inputs)


def _rate(model: PoolModel, demand: int, replicas: int, target: PoolScalingTarget) -> float:
    batch = max(1, math.ceil(demand / max(replicas, 1)))
    return model.per_user_rate(batch, target.context_tokens)


def _cooled(
    state: PoolScalingState,
    current: int,
    wanted: int,
    reason: str,
    inputs: dict[str, Any],
    target: PoolScalingTarget,
) -> ScalingDecision:
    """`wanted` unless a cool-down forbids the change now (then `current`)."""
    last_change = max(
        (t for t in (state.last_scale_up_s, state.last_scale_down_s) if t is not None),
        default=None,
    )
    if wanted > current and state.last_scale_up_s is not None:
        if state.now_s - state.last_scale_up_s < target.upscale_cooldown_s:
            return ScalingDecision(current, "cooldown", inputs | {"wanted": wanted})
    if wanted < current and last_change is not None:
        if state.now_s - last_change < target.downscale_cooldown_s:
            return ScalingDecision(current, "cooldown", inputs | {"wanted": wanted})
    if wanted == current:
        return ScalingDecision(current, "hold", inputs)
    return ScalingDecision(wanted, reason, inputs)


def mean_rate(
    models: Mapping[str, PoolModel],
    replicas: Mapping[str, int],
    demand: int,
    targets: Mapping[str, PoolScalingTarget],
) -> float:
    """Mean per-user rate of `demand` requests over two pools with `replicas` each, split
    between them at best (in steps of whole per-replica batch levels); requests beyond what
    the replicas run at once count as rate 0 (they wait)."""
    if demand == 0:
        return 0.0
    first, second = sorted(models)

    def pool_total(name: str, requests: int) -> float:
        count = replicas[name]
        if requests == 0 or count == 0:
            return 0.0
        cap = targets[name].max_batch
        batch = math.ceil(requests / count)
        served = min(requests, count * cap) if cap else requests
        batch = min(batch, cap) if cap else batch
        return served * models[name].per_user_rate(batch, targets[name].context_tokens)

    splits = {0, demand}
    count = replicas[first]
    limit = targets[first].max_batch or demand
    splits |= {min(demand, count * level) for level in range(1, limit + 1)}
    best = max(pool_total(first, d) + pool_total(second, demand - d) for d in splits)
    return best / demand


def share_budget(
    pools: Mapping[str, PoolScalingState],
    models: Mapping[str, PoolModel | None],
    budget: int,
    targets: Mapping[str, PoolScalingTarget],
    previous: Mapping[str, int] | None = None,
    hysteresis: float = SHARE_HYSTERESIS,
) -> dict[str, int]:
    """Split `budget` replicas between a target's two pools (`pools`, `models`, `targets` by
    pool name). Each pool keeps its `min_replicas` and at most its `max_replicas`. The split
    with the highest `mean_rate` for the requests in flight wins (ties: more replicas for the
    pool listed first in `pools`, the speculative one by convention); it replaces `previous`
    only when better by `hysteresis` (an idle target returns to it at once). Without a model
    for each pool: `previous` (or the most the first pool may have)."""
    names = list(pools)
    if len(names) != 2:
        raise ValueError(f"share_budget splits between two pools, got {names}")
    first, second = names
    low = {n: targets[n].min_replicas for n in names}
    splits = [
        {first: a, second: budget - a}
        for a in range(low[first], budget - low[second] + 1)
        if a <= targets[first].max_replicas and budget - a <= targets[second].max_replicas
    ]
    if not splits:
        raise ValueError(f"budget {budget} cannot meet the pools' min/max replicas")
    if any(models.get(n) is None for n in names):
        return dict(previous) if previous else splits[-1]
    demand = sum(state.demand for state in pools.values())
    fitted = {n: models[n] for n in names}
    scored = [(mean_rate(fitted, split, demand, targets), split[first]) for split in splits]
    best_score, best_first = max(scored)
    best = {first: best_first, second: budget - best_first}
    if previous and previous in splits and demand:  # idle: straight back to the best
        kept = mean_rate(fitted, previous, demand, targets)
        if best_score <= kept * (1 + hysteresis):
            return dict(previous)
    return best


def _stat(stats: Mapping[str, float], key: str) -> float:
    value = stats.get(key, 0.0)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def replica_slowdown(stats: Mapping[str, float]) -> float:
    """Predicted slowdown of adding one request to a replica (lower is better).

    Each request in the batch lengthens every decode step about equally, so the new request's
    cost grows with `running + 1`; each waiting request is ahead of it in the scheduler queue
    and counts twice (it adds its prefill and then its decode). The result is divided by the
    free KV cache fraction: near a full cache new requests wait or preempt others.
    """
    load = 1.0 + _stat(stats, "running") + 2.0 * _stat(stats, "waiting")
    free_kv = 1.0 - min(_stat(stats, "kv_cache_usage"), KV_FULL)
    return load / free_kv


def fit_to_budget(
    wanted: Mapping[str, int], mins: Mapping[str, int], budget: int
) -> dict[str, int]:
    """Each pool's wanted replicas, cut until they fit `budget`: one replica at a time from the
    pool furthest above its minimum (ties: the later name), never below a minimum."""
    replicas = dict(wanted)
    while sum(replicas.values()) > budget:
        spare = {n: r - mins.get(n, 0) for n, r in replicas.items() if r > mins.get(n, 0)}
        if not spare:
            break
        most = max(spare.values())
        replicas[max(n for n, s in spare.items() if s == most)] -= 1
    return replicas


SPEC_COUNTERS = ("spec_drafts", "spec_accepted_tokens")
"""Cumulative engine counters (`EngineStats.as_metrics()`) behind the online acceptance."""


def observe_acceptance(
    model: PoolModel, previous: Mapping[str, float] | None, stats: list[dict[str, float]]
) -> dict[str, float]:
    """Fold the pool's acceptance since `previous` into `model` (`PoolModel.observe`) and
    return the new counter totals (pass them back next time).

    The engines' counters are cumulative per replica, so the drafts and accepted tokens since
    the last call are the change of their sums. A replica that left or restarted makes a sum
    shrink: that interval is skipped (the totals restart from now)."""
    totals = {name: sum(_stat(s, name) for s in stats) for name in SPEC_COUNTERS}
    if previous:
        drafts = totals["spec_drafts"] - previous.get("spec_drafts", 0.0)
        accepted = totals["spec_accepted_tokens"] - previous.get("spec_accepted_tokens", 0.0)
        if drafts > 0 and accepted >= 0:
            model.observe(1 + accepted / drafts, None)
    return totals


def capacity_at(model: PoolModel, target: PoolScalingTarget, rate: float) -> int:
    """Requests one replica runs at once with each at `rate` or faster (at most `max_batch`;
    0: not even one)."""
    fits = 0
    for batch in range(1, (target.max_batch or MAX_SEARCHED_BATCH) + 1):
        if model.per_user_rate(batch, target.context_tokens) < rate:
            break
        fits = batch
    return fits


MAX_SEARCHED_BATCH = 1024
"""`capacity_at` without a `max_batch`: the largest batch it tries."""


def rate_at_capacity(model: PoolModel, target: PoolScalingTarget) -> float:
    """Per-user rate of a replica running `capacity_at` requests (the target rate when it
    cannot run even one at it)."""
    rate = target.target_rate or 0.0
    fits = capacity_at(model, target, rate)
    return model.per_user_rate(fits, target.context_tokens) if fits else rate


def offered_tokens_per_s(
    state: PoolScalingState, model: PoolModel, target: PoolScalingTarget
) -> float:
    """Output tokens/s the pool's requests need: each at the rate of a replica packed to its
    capacity at the target rate. Not the rate they get now: that grows with the replicas the
    pool already has, and the pool would never shrink."""
    return state.demand * rate_at_capacity(model, target)


def _grow_into_free_budget(
    split: dict[str, int], current: Mapping[str, int], budget: int
) -> dict[str, int]:
    """A pool grows only into replicas the budget has free now: Serve shrinks the other pool
    after its `downscale_delay_s` (draining), so until then the budget holds both."""
    grown = dict(split)
    for name in grown:
        others = sum(max(current[o], split[o]) for o in grown if o != name)
        if grown[name] > current[name]:
            grown[name] = max(current[name], min(grown[name], budget - others))
    return grown


def within_budget(
    wanted: Mapping[str, int],
    pools: Mapping[str, PoolScalingState],
    models: Mapping[str, PoolModel | None],
    budget: int,
    targets: Mapping[str, PoolScalingTarget],
    hysteresis: float = 0.2,
) -> dict[str, int]:
    """A target's pools under a shared replica budget, sized together.

    With a model and a target rate for both pools: the load is the output tokens/s the pools'
    requests need (`offered_tokens_per_s`); a replica's capacity is the tokens/s it decodes with
    as many requests as it can run at its pool's target rate (`capacity_at`). The fewest
    replicas in all (up to `budget`) whose capacity covers the load win, with as many
    speculative replicas (the first pool) as that allows: at equal capacity they give each user
    more. As load rises the total grows and the split moves to whichever pool holds more per
    replica at the target (the throughput pool once speculation stops paying), and back as it
    falls. A total below the current one must cover the load with `hysteresis` to spare. When
    even the budget cannot: the budget, split for the most capacity (within `SHARE_HYSTERESIS`,
    the most speculative replicas). Each pool's cool-downs apply to its change, and a pool
    grows only into replicas the budget has free now (the other pool drains first). While a
    pool's stats are stale every pool holds.

    Otherwise: each pool's own `wanted` (`desired_replicas`) while together they fit; beyond the
    budget each want is cut to fit (`fit_to_budget`)."""
    names = list(pools)
    rated = all(models.get(n) is not None and targets[n].target_rate for n in names)
    stale = any(pools[n].replicas and pools[n].stats_age_s > targets[n].max_stats_age_s
                for n in names)  # fmt: skip
    if stale:  # a pool whose load is unknown must not be shrunk on it: each holds
        return {n: min(max(pools[n].replicas, targets[n].min_replicas), targets[n].max_replicas)
                for n in names}  # fmt: skip
    if len(names) == 2 and rated and any(state.demand for state in pools.values()):
        fitted = {n: models[n] for n in names}
        capacity = {n: capacity_at(fitted[n], targets[n], targets[n].target_rate)
                    * rate_at_capacity(fitted[n], targets[n]) for n in names}  # fmt: skip
        load = sum(offered_tokens_per_s(pools[n], fitted[n], targets[n]) for n in names)
        current = sum(state.replicas for state in pools.values())
        first, second = names
        budget = min(budget, sum(targets[n].max_replicas for n in names))

        def splits(total: int) -> list[dict[str, int]]:
            most = min(total, targets[first].max_replicas)
            return [
                {first: a, second: total - a}
                for a in range(targets[first].min_replicas, most + 1)
                if targets[second].min_replicas <= total - a <= targets[second].max_replicas
            ]

        def served(split: dict[str, int]) -> float:
            return sum(split[n] * capacity[n] for n in names)

        chosen = None
        for total in range(1, budget + 1):
            needed = load * (1 + hysteresis) if total < current else load
            feasible = [split for split in splits(total) if served(split) >= needed]
            if feasible:
                chosen = max(feasible, key=lambda split: split[first])
                break
        if chosen is None and splits(budget):  # overloaded even at the budget
            most = max(served(split) for split in splits(budget))
            near = [s for s in splits(budget) if served(s) >= most * (1 - SHARE_HYSTERESIS)]
            chosen = max(near, key=lambda split: split[first])
        if chosen is not None:
            cooled = {
                n: _cooled(
                    pools[n], pools[n].replicas, chosen[n], "budget", {}, targets[n]
                ).replicas
                for n in names
            }
            return _grow_into_free_budget(cooled, {n: pools[n].replicas for n in names}, budget)
    if sum(wanted.values()) <= budget:
        return dict(wanted)
    return fit_to_budget(wanted, {name: t.min_replicas for name, t in targets.items()}, budget)
