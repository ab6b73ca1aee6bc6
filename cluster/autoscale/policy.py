"""Autoscaling decisions from the performance model: pure functions, no Ray.

Per pool (`desired_replicas`): the fewest replicas at which the requests the pool holds
(running + waiting on every replica, plus those queued before one) decode at the target
per-user rate, spread evenly over the replicas. A band (`hysteresis`) and cool-downs keep it
from flapping: it scales up as soon as the target is missed (after `upscale_cooldown_s`), and
down only when the smaller count beats the target by the band, `downscale_cooldown_s` after the
last change. Stale or missing stats hold the current count; no model: an ongoing-requests
target like Ray's default.

A target's pools under a shared budget: `cluster.autoscale.budget`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.autoscale.model import PoolModel

KV_PRESSURE = 0.8
"""KV cache usage from which a replica's slowdown grows with it: below, blocks are free and
usage costs nothing the request count does not already carry; above, new requests soon wait
for blocks or preempt others."""

KV_FULL = 0.95
"""KV pressure (the share of the cache above `KV_PRESSURE` in use) treated as full: the
slowdown divides by `1 - pressure` and never by less than `1 - KV_FULL`, so a full replica
scores 20x worse rather than infinitely."""


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
    utilization: float = 1.0
    """Share of a replica's capacity (its requests at the target rate, at most `max_batch`)
    the sizing fills; the rest takes the arrivals that come while a new replica starts."""
    demand_window_s: float = 0.0
    """Size for the most requests held over this many seconds (`DemandWindow`), not the
    latest count: a dip between bursts does not give back replicas that take minutes to
    return. 0: the latest count."""
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

    def sized_batch(self, batch: int) -> int:
        """Requests the sizing lets a replica hold when it could run `batch`: `utilization`
        of it, at least 1."""
        return max(1, math.floor(batch * self.utilization))

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
    replica_ids: tuple[str, ...] = ()
    """Which replica each entry of `stats` came from (empty: unknown)."""
    peak_demand: int | None = None
    """Most requests the pool held over the target's `demand_window_s` (`DemandWindow`, kept
    by the caller); None: `demand` alone."""

    @property
    def demand(self) -> int:
        """Requests the pool holds: running and waiting on its replicas, and queued for it."""
        held = sum(s.get("running", 0) + s.get("waiting", 0) for s in self.stats)
        return int(held) + self.queued

    @property
    def sizing_demand(self) -> int:
        """The demand the pool is sized for: the window's peak, at least the latest count."""
        return max(self.demand, self.peak_demand or 0)

    @property
    def stats_age_s(self) -> float:
        return math.inf if self.stats_at_s is None else self.now_s - self.stats_at_s


class DemandWindow:
    """The most requests a pool held over the last `window_s` seconds (`observe` each tick)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._seen: deque[tuple[float, int]] = deque()

    def observe(self, now_s: float, demand: int) -> int:
        """Record `demand` at `now_s`; the peak of the window ending now (`demand` itself for
        a window of 0)."""
        if self.window_s <= 0:
            return demand
        # A monotonic deque: an older sample no larger than a newer one can never be the peak.
        while self._seen and self._seen[-1][1] <= demand:
            self._seen.pop()
        self._seen.append((now_s, demand))
        while self._seen[0][0] < now_s - self.window_s:
            self._seen.popleft()
        return self._seen[0][1]


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
    if target.max_batch and batch > target.sized_batch(target.max_batch):
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
    demand = state.sizing_demand
    inputs: dict[str, Any] = {
        "replicas": state.replicas,
        "demand": state.demand,
        "queued": state.queued,
        "sizing_demand": demand,
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
        return apply_cooldowns(state, current, wanted, "no_model", inputs, target)
    up = fewest_replicas(model, demand, target, rate)
    down = fewest_replicas(model, demand, target, rate * (1 + target.hysteresis))
    inputs |= {"predicted_at_current": _rate(model, demand, state.replicas, target)}
    if up is None:  # even the most replicas miss the target: as many as requests can use
        wanted = min(target.max_replicas, max(demand, target.min_replicas, 1))
        return apply_cooldowns(state, current, wanted, "slo_infeasible", inputs, target)
    if up > current:
        return apply_cooldowns(state, current, up, "scale_up", inputs, target)
    if down is not None and down < current:
        return apply_cooldowns(state, current, down, "scale_down", inputs, target)
    return ScalingDecision(current, "hold", inputs)


def _rate(model: PoolModel, demand: int, replicas: int, target: PoolScalingTarget) -> float:
    batch = max(1, math.ceil(demand / max(replicas, 1)))
    return model.per_user_rate(batch, target.context_tokens)


def apply_cooldowns(
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
    and counts twice (it adds its prefill and then its decode). Above `KV_PRESSURE` the result
    is divided by the free share of the cache above it: near a full cache new requests wait or
    preempt others. KV usage below that is not held against a replica: dividing by the whole
    free fraction made a one-core replica whose long prompts filled 16-34% of its cache count
    like 1.2-1.5x its requests (docs/routing.md, "Replica choice").
    """
    load = 1.0 + _stat(stats, "running") + 2.0 * _stat(stats, "waiting")
    pressure = max(_stat(stats, "kv_cache_usage") - KV_PRESSURE, 0.0) / (1.0 - KV_PRESSURE)
    return load / (1.0 - min(pressure, KV_FULL))


SPEC_COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
"""Cumulative engine counters (`EngineStats.as_metrics()`) behind the online acceptance."""

MIN_DRAFTS_PER_OBSERVATION = 50
"""Drafts the online acceptance waits for before it moves the model: each observation moves it
by the same weight (`model.EMA_ALPHA`), and the few drafts at a burst's tail (a dynamic schedule
drafts only at small batches) are no measure of a drafter. Fewer add up to the next time."""


def observe_acceptance(
    model: PoolModel,
    previous: Mapping[str, Mapping[str, float]] | None,
    stats: list[dict[str, float]],
    replica_ids: Sequence[str] = (),
) -> dict[str, dict[str, float]]:
    """Fold the pool's acceptance since `previous` into `model` (`PoolModel.observe`) and
    return the baseline counters per replica (pass them back next time).

    The engines' counters are cumulative per replica, so the drafts and accepted tokens since
    the last call are each replica's own change: a replica seen for the first time only sets
    its baseline, one whose counters went down (restarted) starts a new one, and one that left
    takes nothing with it. Fewer than `MIN_DRAFTS_PER_OBSERVATION` drafts in all leave the model
    and the baselines as they were, so they count with the next ones. `replica_ids` name
    `stats` in order (default: their positions). The acceptance is compared at the depth the
    engines drafted (drafted tokens / drafts): a dynamic schedule drafts less at larger batches,
    where fewer accepted tokens are no sign of a worse drafter."""
    ids = list(replica_ids) or [str(i) for i in range(len(stats))]
    current = {
        replica: {name: _stat(s, name) for name in SPEC_COUNTERS}
        for replica, s in zip(ids, stats, strict=True)
    }
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    baselines: dict[str, dict[str, float]] = {}
    for replica, counters in current.items():
        before = (previous or {}).get(replica)
        change = {name: counters[name] - (before or {}).get(name, 0.0) for name in SPEC_COUNTERS}
        if before is None or any(value < 0 for value in change.values()):
            baselines[replica] = counters  # first seen, or restarted: counts from now
            continue
        baselines[replica] = dict(before)
        for name, value in change.items():
            totals[name] += value
    drafts = totals["spec_drafts"]
    if drafts < MIN_DRAFTS_PER_OBSERVATION:  # too few to judge: they add up from the baselines
        return baselines
    depth = max(1, round(totals["spec_draft_tokens"] / drafts))
    model.observe(1 + totals["spec_accepted_tokens"] / drafts, None, depth=depth)
    return current
