"""Pool choice per request: pure policy, no Ray, so the simulator and unit tests use it as is.

With a performance model (`routing.profile`), each request goes to the pool that maximises its
predicted per-user decode rate given every pool's load *including the request itself*
(speculation pays while a replica's batch is small and costs once it is compute-bound, so the
answer moves with load), among the pools that meet the optional TTFT / TPOT SLOs. With SLOs,
a request first stays on the pool of its kind (rule v1's choice by prompt length) while that
pool meets them with `routing.slo_headroom` to spare: the goal is then the most requests
within the SLOs, not each request as fast as it can be now.

Fallbacks, in order:
- a pool that is down (no running replica and it cannot scale from zero) or not configured is
  never chosen while the other one is up (`spec_pool_down`, `throughput_pool_down`); when both
  are down the rule's preference is returned, so the caller sees the pool's own answer;
- a pool at zero replicas that scales from zero is up: its first request wakes it, and its
  prediction carries the cold start (`routing.cold_start_s`) spread over the request's output;
  likewise a pool whose replicas are full carries the wait for a slot (the requests queued
  ahead, a slot freeing each time a running request ends);
- no model: rule v1 (below) with its own reasons; a model that lacks one of the pools: rule v1,
  reason `no_model`; load older than `routing.max_stats_age_s`: rule v1, reason `stale_stats`.

Rule v1: a request whose prompt has at least `long_context_tokens` goes to the speculative pool
while that pool's in-flight requests per replica stay below `spec_max_concurrency_per_replica`;
everything else goes to the throughput pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from cluster.autoscale.model import PerformanceModel
from cluster.config import RoutingConfig

SPECULATIVE, THROUGHPUT = "speculative", "throughput"


class Reason(StrEnum):
    """Why a pool was chosen; the value is what `x-cluster-route-reason` starts with."""

    LONG_CONTEXT = "long_context"
    """Rule v1: long prompt and the speculative pool has headroom."""
    SHORT_PROMPT = "short_prompt"
    """Rule v1: prompt below the long-context threshold."""
    SPEC_SATURATED = "spec_pool_saturated"
    """Rule v1: long prompt, but the speculative pool is too busy for speculation to pay off."""
    SPEC_POOL_DOWN = "spec_pool_down"
    """The speculative pool has no running replica (or none is configured)."""
    THROUGHPUT_POOL_DOWN = "throughput_pool_down"
    """The throughput pool has no running replica (or none is configured)."""
    HOME_POOL = "home_pool"
    """SLOs set: the pool of the request's kind (by prompt length) meets them with headroom."""
    PREDICTED_FASTER = "predicted_faster"
    """The model predicts this pool the highest per-user rate (and it meets any SLO)."""
    SLO = "slo"
    """A pool predicted faster would miss an SLO; this one is the fastest that meets them."""
    SLO_INFEASIBLE = "slo_infeasible"
    """No pool is predicted to meet the SLOs; this one misses them by the least."""
    STALE_STATS = "stale_stats"
    """A pool's load is older than `max_stats_age_s`: rule v1 decided."""
    NO_MODEL = "no_model"
    """The performance model does not cover a pool: rule v1 decided."""


@dataclass(frozen=True)
class RequestFeatures:
    """What routing knows about a request before it runs."""

    prompt_tokens: int
    max_tokens: int | None = None
    """The request's output limit, if it set one (else the model's typical output length)."""


@dataclass(frozen=True)
class PoolLoad:
    """What the router knows about one pool right now."""

    role: str
    """`speculative` or `throughput`."""
    running_replicas: int
    in_flight: int
    """Sequences sent to the pool and not finished, those waiting at its gate included (a
    request with `n` > 1 counts `n` for each prompt)."""
    scales_from_zero: bool = False
    """`min_replicas: 0`: no replica may be running, yet a request starts one."""
    stats_age_s: float = 0.0
    """How old `running_replicas` / `in_flight` are (seconds since measured)."""
    max_batch: int | None = None
    """Requests one replica runs at once (its engine's `max_num_seqs`, at most
    `max_ongoing_requests`); more wait for a slot."""

    @property
    def up(self) -> bool:
        return self.running_replicas > 0 or self.scales_from_zero

    @property
    def cold(self) -> bool:
        return self.running_replicas == 0 and self.scales_from_zero

    @property
    def in_flight_per_replica(self) -> float:
        if not self.up:
            return float("inf")
        return self.in_flight / max(self.running_replicas, 1)

    def batch_with(self, requests: int = 1) -> int:
        """Requests on a replica once `requests` more arrive (spread evenly by the pool's
        router), capped at what a replica runs at once."""
        batch = int(self.in_flight_per_replica) + requests
        return min(batch, self.max_batch) if self.max_batch else batch

    def queued_ahead(self, requests: int = 1) -> float:
        """Requests per replica that wait for a slot before the `requests`-th new one runs
        (0 while a replica has a free slot)."""
        if not self.max_batch:
            return 0.0
        return max(0.0, self.in_flight_per_replica + requests - self.max_batch)


@dataclass(frozen=True)
class Decision:
    pool: str
    role: str
    """`speculative` or `throughput`."""
    reason: Reason
    predicted: dict[str, float] = field(default_factory=dict)
    """Pool -> predicted per-user decode tok/s for this request (empty: the rule decided)."""

    @property
    def header(self) -> str:
        """`x-cluster-route-reason`: the reason, then the predictions (`reason; a=1.2 b=3.4`)."""
        if not self.predicted:
            return self.reason.value
        rates = " ".join(f"{pool}={rate:.1f}" for pool, rate in sorted(self.predicted.items()))
        return f"{self.reason.value}; {rates}"


def choose_pool(
    request: RequestFeatures,
    loads: dict[str, PoolLoad],
    model: PerformanceModel | None,
    config: RoutingConfig,
) -> Decision:
    """Choose the pool for one request among one target's pools (`loads`, by pool name, at
    most one per role)."""
    by_role = {load.role: name for name, load in loads.items()}
    spec, thr = by_role.get(SPECULATIVE), by_role.get(THROUGHPUT)
    if spec is None and thr is None:
        raise ValueError("the target has no pool")
    spec_up = spec is not None and loads[spec].up
    thr_up = thr is not None and loads[thr].up
    if spec is None or (not spec_up and thr_up):
        return Decision(thr, THROUGHPUT, Reason.SPEC_POOL_DOWN)
    if thr is None or (not thr_up and spec_up):
        return Decision(spec, SPECULATIVE, Reason.THROUGHPUT_POOL_DOWN)
    if model is None or not (spec_up and thr_up):
        return _rule(request, spec, thr, loads, config, None)
    if any(name not in model.pools for name in (spec, thr)):
        return _rule(request, spec, thr, loads, config, Reason.NO_MODEL)
    if any(loads[name].stats_age_s > config.max_stats_age_s for name in (spec, thr)):
        return _rule(request, spec, thr, loads, config, Reason.STALE_STATS)
    return _predicted(request, loads, model, config)


def _rule(
    request: RequestFeatures,
    spec: str,
    thr: str,
    loads: dict[str, PoolLoad],
    config: RoutingConfig,
    why: Reason | None,
) -> Decision:
    if _kind(request, config) == THROUGHPUT:
        pool, reason = thr, Reason.SHORT_PROMPT
    elif loads[spec].in_flight_per_replica < config.spec_max_concurrency_per_replica:
        pool, reason = spec, Reason.LONG_CONTEXT
    else:
        pool, reason = thr, Reason.SPEC_SATURATED
    return Decision(pool, loads[pool].role, why or reason)


def _kind(request: RequestFeatures, config: RoutingConfig) -> str:
    """The role a request belongs to by its prompt length (rule v1's preference)."""
    return SPECULATIVE if request.prompt_tokens >= config.long_context_tokens else THROUGHPUT


def _home_pool(
    request: RequestFeatures, loads: dict[str, PoolLoad], config: RoutingConfig
) -> str | None:
    """The pool of the request's kind, whatever the load."""
    role = _kind(request, config)
    return next((name for name, load in loads.items() if load.role == role), None)


def _predicted(
    request: RequestFeatures,
    loads: dict[str, PoolLoad],
    model: PerformanceModel,
    config: RoutingConfig,
) -> Decision:
    rates: dict[str, float] = {}
    misses: dict[str, float] = {}  # worst predicted / SLO ratio; <= 1 meets every SLO
    for name, load in loads.items():
        pool = model.pools[name]
        batch = load.batch_with(1)
        output = request.max_tokens or pool.typical_output_tokens
        rate = pool.per_user_rate(batch, request.prompt_tokens, output)
        # TTFT queues behind everything in flight, not only what runs at once.
        ttft = pool.ttft_s(int(load.in_flight_per_replica) + 1, request.prompt_tokens)
        wait_s = config.cold_start_s if load.cold else 0.0  # the wait for a first replica
        if load.queued_ahead():  # full replicas: a slot frees as each running request ends
            wait_s += load.queued_ahead() * pool.typical_output_tokens / rate / load.max_batch
        if wait_s:  # spread over the output like a slow start
            ttft += wait_s
            rate = output / (wait_s + output / rate)
        rates[name] = rate
        misses[name] = max(
            ttft / config.ttft_slo_s if config.ttft_slo_s else 0.0,
            1 / rate / config.tpot_slo_s if config.tpot_slo_s else 0.0,
        )
    home = _home_pool(request, loads, config)
    if home and config.slo_headroom and (config.ttft_slo_s or config.tpot_slo_s):
        if misses[home] * config.slo_headroom <= 1:
            return Decision(home, loads[home].role, Reason.HOME_POOL, rates)
    # Ties go to the throughput pool: equal speed for less compute per token.
    fastest = max(loads, key=lambda n: (rates[n], loads[n].role == THROUGHPUT))
    feasible = [n for n in loads if misses[n] <= 1]
    if fastest in feasible:
        pool, reason = fastest, Reason.PREDICTED_FASTER
    elif feasible:
        pool = max(feasible, key=lambda n: (rates[n], loads[n].role == THROUGHPUT))
        reason = Reason.SLO
    else:
        pool, reason = min(loads, key=lambda n: (misses[n], -rates[n])), Reason.SLO_INFEASIBLE
    return Decision(pool, loads[pool].role, reason, rates)
