"""A target's pools under one replica budget (pure functions, no Ray): sized together by
their capacity at the target rates (`within_budget`, the application-level policy), or a fixed
total split by the best mean per-user rate (`share_budget`), or each pool's own want cut to fit
(`fit_to_budget`). Speculation wins while batches are small, so as load rises capacity moves
to whichever pool holds more per replica at the target, and back as it falls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from cluster.autoscale.model import PoolModel
from cluster.autoscale.policy import PoolScalingState, PoolScalingTarget, apply_cooldowns

SHARE_HYSTERESIS = 0.05
"""`share_budget` moves replicas only for a mean per-user rate this much higher."""


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


def capacity_at(model: PoolModel, target: PoolScalingTarget, rate: float) -> int:
    """Requests one replica is sized to hold with each at `rate` or faster: the most it runs
    at that rate (at most `max_batch`) times the target's `utilization`, at least 1 (0: not
    even one runs at `rate`)."""
    fits = 0
    for batch in range(1, (target.max_batch or MAX_SEARCHED_BATCH) + 1):
        if model.per_user_rate(batch, target.context_tokens) < rate:
            break
        fits = batch
    return target.sized_batch(fits) if fits else 0


MAX_SEARCHED_BATCH = 1024
"""`capacity_at` without a `max_batch`: the largest batch it tries."""


class ReplicaCapacity(NamedTuple):
    """What one replica of a pool is sized to hold at its target rate."""

    requests: int
    """`capacity_at` the target rate."""
    rate: float
    """Per-user rate of a replica running `requests` (the target rate when it cannot run even
    one at it)."""

    @property
    def tokens_per_s(self) -> float:
        return self.requests * self.rate


def replica_capacity(model: PoolModel, target: PoolScalingTarget) -> ReplicaCapacity:
    rate = target.target_rate or 0.0
    fits = capacity_at(model, target, rate)
    return ReplicaCapacity(fits, model.per_user_rate(fits, target.context_tokens) if fits else rate)


def offered_tokens_per_s(state: PoolScalingState, capacity: ReplicaCapacity) -> float:
    """Output tokens/s the pool's requests need: each at the rate of a replica packed to its
    `capacity`. Not the rate they get now: that grows with the replicas the pool already has,
    and the pool would never shrink."""
    return state.sizing_demand * capacity.rate


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
    falls. A total below the current one, or a split of less capacity than the current one,
    must cover the load with `hysteresis` to spare. When even the budget cannot: the budget,
    split for the most capacity (within `SHARE_HYSTERESIS`, the current split, else the most
    speculative replicas). Each pool's cool-downs apply to its change, and a pool grows only
    into replicas the budget has free now (the other pool drains first). While a pool's stats
    are stale every pool holds.

    Otherwise: each pool's own `wanted` (`desired_replicas`) while together they fit; beyond the
    budget each want is cut to fit (`fit_to_budget`)."""
    names = list(pools)
    rated = all(models.get(n) is not None and targets[n].target_rate for n in names)
    stale = any(pools[n].replicas and pools[n].stats_age_s > targets[n].max_stats_age_s
                for n in names)  # fmt: skip
    if stale:  # a pool whose load is unknown must not be shrunk on it: each holds
        return {n: min(max(pools[n].replicas, targets[n].min_replicas), targets[n].max_replicas)
                for n in names}  # fmt: skip
    if len(names) == 2 and rated and any(state.sizing_demand for state in pools.values()):
        fitted = {n: models[n] for n in names}
        held = {n: replica_capacity(fitted[n], targets[n]) for n in names}
        capacity = {n: held[n].tokens_per_s for n in names}
        load = sum(offered_tokens_per_s(pools[n], held[n]) for n in names)
        replicas_now = {n: pools[n].replicas for n in names}
        current = sum(replicas_now.values())
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

        now = served(replicas_now)

        def covers(split: dict[str, int]) -> bool:
            # Less than now (fewer replicas, or the same moved to the pool that holds less)
            # must cover the load with the margin: else a load near a boundary flips the
            # split each tick, and each flip restarts a replica.
            less = sum(split.values()) < current or served(split) < now
            return served(split) >= (load * (1 + hysteresis) if less else load)

        chosen = None
        for total in range(1, budget + 1):
            feasible = [split for split in splits(total) if covers(split)]
            if feasible:
                chosen = max(feasible, key=lambda split: split[first])
                break
        if chosen is None and splits(budget):  # overloaded even at the budget
            most = max(served(split) for split in splits(budget))
            near = [s for s in splits(budget) if served(s) >= most * (1 - SHARE_HYSTERESIS)]
            # The current split while it is near the most: else a load around the budget's
            # capacity flips between this branch's choice and the covering split above.
            chosen = (
                replicas_now if replicas_now in near else max(near, key=lambda split: split[first])
            )
        if chosen is not None:
            cooled = {
                n: apply_cooldowns(
                    pools[n], replicas_now[n], chosen[n], "budget", {}, targets[n]
                ).replicas
                for n in names
            }
            return _grow_into_free_budget(cooled, replicas_now, budget)
    if sum(wanted.values()) <= budget:
        return dict(wanted)
    return fit_to_budget(wanted, {name: t.min_replicas for name, t in targets.items()}, budget)
