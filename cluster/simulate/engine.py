"""The simulated cluster: pools of replicas serving a trace, in fixed time steps.

The decisions are the deployed code's, imported: `cluster.routing.choose_pool` picks the pool of
each arrival, `cluster.autoscale.policy.desired_replicas` and `within_budget` (our policy) or
`ray_default_replicas` (Serve's default) size each pool every control interval, and `gated`
applies Serve's bounds and `upscale_delay_s` / `downscale_delay_s` on top, as Serve's wrapper
does for any policy. What a real cluster measures, the simulator predicts with the performance
model:

- a replica runs up to `max_batch` requests; all of them decode at
  `per_user_rate(batch, mean context)`, so a replica's progress is one number and a request
  finishes when that passes its output length;
- an admitted request first spends `ttft_s(batch, prompt)` in prefill (it counts in the batch);
- requests beyond the running replicas' slots wait in the pool's queue (FIFO, bounded by
  `max_queued`, abandoned after `queue_timeout_s`: both count as rejected);
- a new replica serves `replica_start_s` after the decision (its GPUs count from the
  decision); a removed replica drains (takes no new requests) and is released when empty;
- the first `warmup_s` bring every strategy from its minimum replicas to the trace's load: its
  requests and GPU time are not counted.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.autoscale.budget import within_budget
from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.policy import (
    DemandWindow,
    PoolScalingState,
    PoolScalingTarget,
    desired_replicas,
)
from cluster.config import RoutingConfig
from cluster.routing import Decision, PoolLoad, RequestFeatures, choose_pool
from cluster.simulate.result import SimulatedRequest, SimulationResult
from cluster.simulate.trace import TraceRequest
from cluster.slo import Slo

CONTEXT_BUCKET_TOKENS = 256
"""Rates are computed once per (batch, mean context rounded to this) and reused."""


@dataclass(frozen=True)
class PoolSetup:
    """One pool as a strategy deploys it."""

    name: str
    role: str
    min_replicas: int
    max_replicas: int
    max_batch: int
    max_queued: int
    queue_timeout_s: float
    gpus_per_replica: int
    upscale_delay_s: float
    downscale_delay_s: float
    target_ongoing_requests: float
    """Serve's default policy: in-flight requests per replica it steers towards."""
    scaling_target: PoolScalingTarget | None = None
    """Our policy's target for the pool; None: Serve's default policy sizes it."""
    initial_replicas: int | None = None


@dataclass(frozen=True)
class Strategy:
    """A way to run the cluster: its pools, how requests pick one, how pools are sized."""

    name: str
    pools: tuple[PoolSetup, ...]
    routing: RoutingConfig
    routing_model: PerformanceModel | None
    """Model routing when set (two pools); None: rule v1."""
    budget: int | None = None
    """Most replicas of the pools together (`within_budget`)."""
    description: str = ""


@dataclass
class _Replica:
    ready_s: float
    draining: bool = False
    active: int = 0
    context_sum: int = 0
    progress: float = 0.0
    """Tokens one request of this replica has decoded since it started (shared by all)."""
    prefilling: list[tuple[float, int, SimulatedRequest]] = field(default_factory=list)
    """Heap of (time of the first token, tie-break, request)."""
    decoding: list[tuple[float, int, SimulatedRequest]] = field(default_factory=list)
    """Heap of (progress at which the request is done, tie-break, request)."""


@dataclass
class _Pool:
    setup: PoolSetup
    model: Any
    replicas: list[_Replica] = field(default_factory=list)
    queue: deque = field(default_factory=deque)
    last_up_s: float | None = None
    last_down_s: float | None = None
    window: DemandWindow | None = None
    """Our policy's demand window (None: Serve's default policy sizes the pool)."""
    pending_direction: int = 0
    pending_since_s: float = 0.0

    def running(self, now: float) -> list[_Replica]:
        return [r for r in self.replicas if r.ready_s <= now and not r.draining]

    def counted(self) -> int:
        """Replicas Serve counts (running or starting, not draining)."""
        return sum(1 for r in self.replicas if not r.draining)

    def release_drained(self) -> None:
        self.replicas = [r for r in self.replicas if not (r.draining and r.active == 0)]


def ray_default_replicas(ongoing: float, target_ongoing_requests: float) -> float:
    """Serve's default policy (`replica_queue_length_autoscaling_policy`): replicas such that
    each holds `target_ongoing_requests` of the deployment's ongoing requests (before Serve's
    bounds, rounding up and delays)."""
    return ongoing / target_ongoing_requests


def gated(pool: _Pool, wanted: int, now: float, interval_s: float) -> int:
    """Serve's wrapper around any policy: bounds, then a change only after the same direction
    was wanted for `upscale_delay_s` / `downscale_delay_s` (asked every `interval_s`)."""
    setup, current = pool.setup, pool.counted()
    wanted = min(max(wanted, setup.min_replicas), setup.max_replicas)
    if not pool.running(now) and wanted > 0 and current == 0:
        pool.pending_direction = 0  # Serve's cold-start path: one replica, no delay
        return 1
    direction = (wanted > current) - (wanted < current)
    if direction != pool.pending_direction:
        pool.pending_direction, pool.pending_since_s = direction, now
    if direction == 0:
        return current
    delay = setup.upscale_delay_s if direction > 0 else setup.downscale_delay_s
    if now - pool.pending_since_s + interval_s > delay:
        pool.pending_direction = 0
        return wanted
    return current


class Simulation:
    """One strategy over one trace."""

    def __init__(
        self,
        strategy: Strategy,
        models: dict[str, Any],
        slo: Slo,
        step_s: float = 1.0,
        control_interval_s: float = 10.0,
        replica_start_s: float = 300.0,
        warmup_s: float = 0.0,
    ):
        self.strategy, self.slo = strategy, slo
        self.warmup_s = warmup_s
        self.step_s, self.control_interval_s = step_s, control_interval_s
        self.replica_start_s = replica_start_s
        self.pools = {p.name: _Pool(p, models[p.name]) for p in strategy.pools}
        for pool in self.pools.values():
            if pool.setup.scaling_target is not None:
                pool.window = DemandWindow(pool.setup.scaling_target.demand_window_s)
        for pool in self.pools.values():
            count = pool.setup.initial_replicas
            count = pool.setup.min_replicas if count is None else count
            pool.replicas = [_Replica(ready_s=0.0) for _ in range(count)]
        self._rates: dict[tuple[str, int, int], float] = {}
        self._tie = itertools.count()
        self.done: list[SimulatedRequest] = []
        self.timeline: list[dict[str, Any]] = []
        self.gpu_seconds = 0.0
        self.on_decision: Callable[[float, str, int, int], None] | None = None
        """Called with (time, pool, replicas before, after) on every change."""

    # -- requests ----------------------------------------------------------------------------

    def load(self, name: str, now: float) -> PoolLoad:
        """What the ingress would know of pool `name` now."""
        pool = self.pools[name]
        return PoolLoad(
            role=pool.setup.role,
            running_replicas=len(pool.running(now)),
            in_flight=sum(r.active for r in pool.replicas) + len(pool.queue),
            scales_from_zero=pool.setup.min_replicas == 0,
            max_batch=pool.setup.max_batch,
        )

    def decide(self, request: TraceRequest, now: float) -> Decision:
        """`choose_pool`'s decision for `request` given the pools' load now (the request's
        output length is its `max_tokens`)."""
        loads = {name: self.load(name, now) for name in self.pools}
        features = RequestFeatures(request.prompt_tokens, request.output_tokens)
        return choose_pool(features, loads, self.strategy.routing_model, self.strategy.routing)

    def route(self, request: TraceRequest, now: float) -> str:
        if len(self.pools) == 1:
            return next(iter(self.pools))
        return self.decide(request, now).pool

    def _arrive(self, request: TraceRequest, now: float) -> None:
        """Queue the request in its pool; when that queue is full, in the other pool's (the
        ingress spills to the target's other pool before answering 429); else reject it."""
        sim_request = SimulatedRequest(request, pool=self.route(request, now))
        chosen = self.pools[sim_request.pool]
        others = [p for p in self.pools.values() if p is not chosen]
        # As the ingress: a free slot in the chosen pool, else one in the other pool, else a
        # place in the chosen pool's queue, else the other's; else 429.
        order = [p for p in (chosen, *others) if self._free_slots(p, now)] or [chosen, *others]
        for pool in order:
            if len(pool.queue) < pool.setup.max_queued or self._free_slots(pool, now):
                sim_request.pool = pool.setup.name
                pool.queue.append(sim_request)
                return
        sim_request.rejected = True
        self.done.append(sim_request)

    def _free_slots(self, pool: _Pool, now: float) -> int:
        running = pool.running(now)
        held = sum(r.active for r in running) + len(pool.queue)
        return max(0, len(running) * pool.setup.max_batch - held)

    def _admit(self, pool: _Pool, now: float) -> None:
        timeout = pool.setup.queue_timeout_s
        while pool.queue and now - pool.queue[0].trace.arrival_s > timeout:
            expired = pool.queue.popleft()
            expired.rejected = True
            self.done.append(expired)
        running = pool.running(now)
        while pool.queue and running:
            replica = min(running, key=lambda r: r.active)
            if replica.active >= pool.setup.max_batch:
                return
            request = pool.queue.popleft()
            replica.active += 1
            replica.context_sum += request.trace.prompt_tokens
            prefill = pool.model.ttft_s(replica.active, request.trace.prompt_tokens)
            request.first_token_s = max(now, request.trace.arrival_s) + prefill
            # Decoding starts once the prefill is over; until then the request only adds load.
            heapq.heappush(replica.prefilling, (request.first_token_s, next(self._tie), request))

    def _rate(self, pool: _Pool, replica: _Replica) -> float:
        bucket = round(replica.context_sum / replica.active / CONTEXT_BUCKET_TOKENS)
        key = (pool.setup.name, replica.active, bucket)
        rate = self._rates.get(key)
        if rate is None:
            context = max(bucket * CONTEXT_BUCKET_TOKENS, 1)
            rate = self._rates[key] = pool.model.per_user_rate(replica.active, context)
        return rate

    def _advance(self, pool: _Pool, now: float) -> None:
        end = now + self.step_s
        for replica in pool.replicas:
            if not replica.active:
                continue
            rate = self._rate(pool, replica)
            before = replica.progress
            replica.progress += rate * self.step_s
            while replica.prefilling and replica.prefilling[0][0] <= end:
                first_token_s, tie, request = heapq.heappop(replica.prefilling)
                start = before + rate * max(first_token_s - now, 0.0)
                heapq.heappush(
                    replica.decoding, (start + request.trace.output_tokens, tie, request)
                )
            while replica.decoding and replica.decoding[0][0] <= replica.progress:
                done_at, _, request = heapq.heappop(replica.decoding)
                request.finished_s = max(now + (done_at - before) / rate, request.first_token_s)
                replica.active -= 1
                replica.context_sum -= request.trace.prompt_tokens
                self.done.append(request)
        pool.release_drained()

    # -- autoscaling -------------------------------------------------------------------------

    def _state(self, pool: _Pool, now: float) -> PoolScalingState:
        """What the policy sees of `pool` (call once per control tick: it feeds the window)."""
        state = PoolScalingState(
            replicas=pool.counted(),
            stats=[{"running": float(r.active), "waiting": 0.0} for r in pool.running(now)],
            now_s=now,
            stats_at_s=now,
            queued=len(pool.queue),
            last_scale_up_s=pool.last_up_s,
            last_scale_down_s=pool.last_down_s,
        )
        if pool.window is None or not state.stats:
            return state
        return replace(state, peak_demand=pool.window.observe(now, state.demand))

    def wanted(self, now: float) -> dict[str, int]:
        """Each pool's replica count as the strategy's policy decides it now (before Serve's
        delays)."""
        wanted: dict[str, int] = {}
        states = {name: self._state(pool, now) for name, pool in self.pools.items()}
        for name, pool in self.pools.items():
            target = pool.setup.scaling_target
            if target is None:
                ongoing = sum(r.active for r in pool.replicas) + len(pool.queue)
                wanted[name] = math.ceil(
                    ray_default_replicas(ongoing, pool.setup.target_ongoing_requests)
                )
            else:
                wanted[name] = desired_replicas(states[name], pool.model, target).replicas
        if self.strategy.budget is not None:
            targets = {n: p.setup.scaling_target or PoolScalingTarget()
                       for n, p in self.pools.items()}  # fmt: skip
            models = {n: p.model if p.setup.scaling_target else None
                      for n, p in self.pools.items()}  # fmt: skip
            wanted = within_budget(wanted, states, models, self.strategy.budget, targets)
        return wanted

    def _scale(self, now: float) -> None:
        for name, wanted in self.wanted(now).items():
            pool = self.pools[name]
            current = pool.counted()
            decided = gated(pool, wanted, now, self.control_interval_s)
            if decided > current:
                pool.replicas += [
                    _Replica(ready_s=now + self.replica_start_s) for _ in range(decided - current)
                ]
                pool.last_up_s = now
            elif decided < current:
                # Starting replicas go first (nothing to drain), then the least loaded.
                live = sorted((r for r in pool.replicas if not r.draining),
                              key=lambda r: (r.ready_s <= now, r.active))  # fmt: skip
                for replica in live[: current - decided]:
                    replica.draining = True
                pool.release_drained()
                pool.last_down_s = now
            if decided != current and self.on_decision:
                self.on_decision(now, name, current, decided)
        self.timeline.append({"t_s": now, **{n: p.counted() for n, p in self.pools.items()}})

    # -- the run -----------------------------------------------------------------------------

    def run(self, requests: Sequence[TraceRequest]) -> SimulationResult:
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        end = (ordered[-1].arrival_s if ordered else 0.0) + self.step_s
        arrivals, now, next_control = 0, 0.0, 0.0
        busy = True
        while now < end or busy:
            if now >= next_control:
                self._scale(now)
                next_control += self.control_interval_s
            while arrivals < len(ordered) and ordered[arrivals].arrival_s < now + self.step_s:
                self._arrive(ordered[arrivals], now)
                arrivals += 1
            busy = False
            for pool in self.pools.values():
                self._admit(pool, now)
                self._advance(pool, now)
                if now >= self.warmup_s:
                    self.gpu_seconds += (
                        len(pool.replicas) * pool.setup.gpus_per_replica * self.step_s
                    )
                busy = busy or bool(pool.queue) or any(r.active for r in pool.replicas)
            now += self.step_s
        return SimulationResult.of(
            self.strategy.name,
            self.strategy.description,
            self.done,
            self.gpu_seconds,
            self.slo,
            self.timeline,
            self.warmup_s,
        )
