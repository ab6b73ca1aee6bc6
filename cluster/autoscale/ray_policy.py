"""Ray Serve autoscaling policies over `cluster.autoscale.policy` (thin adapters).

Serve's controller calls a deployment's policy every control-loop tick (0.1 s) with an
`AutoscalingContext`; `PoolAutoscalingPolicy` turns that context into a `PoolScalingState`
(from the engine stats each replica reports with `record_autoscaling_stats`) and returns
`desired_replicas(...)`. `BudgetAutoscalingPolicy` is the application-level form (Serve's app
config `autoscaling_policy`): it sees every pool at once and keeps each target's pools within a
replica budget (`within_budget`). Serve applies its own bounds, scaling factors and
`upscale_delay_s`/`downscale_delay_s` on top of what these return.

Both are classes so Serve instantiates them once, with `policy_kwargs` (plain JSON). Neither
may raise: an exception in a policy aborts the controller's whole application update, every
tick; a failing decision falls back to Ray's default policy and is logged.

Every decision is logged on the `ray.serve` logger (the controller's Serve log) when the
replica count or the reason changes, when requests start or stop waiting for the pool at the
ingress, and at least every `log_interval_s`:
`autoscale pool=<deployment> replicas=<current>-><decision> reason=<...> inputs=<json>`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import replace
from typing import Any

from cluster.autoscale.budget import within_budget
from cluster.autoscale.model import PerformanceModel, PoolModel
from cluster.autoscale.policy import (
    DemandWindow,
    PoolScalingState,
    PoolScalingTarget,
    ScalingDecision,
    desired_replicas,
    observe_acceptance,
)
from cluster.autoscale.signals import INGRESS_QUEUE_PREFIX, LOAD_GAUGES

logger = logging.getLogger("ray.serve")

DECISION_LOG_PREFIX = "autoscale pool="
"""Start of each logged decision (tests and operators grep for it)."""

DEFAULT_STALE_AFTER_S = 35.0
"""A replica's stats older than this are ignored: Serve pushes replica metrics every 10 s
(`RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S`), so three missed pushes."""

_STATE_KEY = "cluster"
"""Our key in Serve's per-deployment policy state (Serve keeps its own keys beside it)."""


def _latest_timestamps(ctx: Any) -> dict[Any, float]:
    """Newest sample time of each replica's custom metrics (`ctx.raw_metrics`:
    {metric: {replica_id: [TimeStampedValue]}})."""
    latest: dict[Any, float] = {}
    for series_by_replica in (ctx.raw_metrics or {}).values():
        for replica_id, series in series_by_replica.items():
            if series:
                latest[replica_id] = max(latest.get(replica_id, 0.0), series[-1].timestamp)
    return latest


def _now(ctx: Any) -> float:
    """The context's time (Serve's clock), or the wall clock where it gives none."""
    return ctx.current_time if ctx.current_time is not None else time.time()


def ingress_queues(ctx: Any, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> dict[str, int]:
    """Requests waiting at the ingress's gates, by pool deployment name, from the ingress
    deployment's context: each running ingress replica's latest report (`queued:<deployment>`,
    `ClusterIngress.record_autoscaling_stats`) within `stale_after_s`, summed. The latest, not
    Serve's average over its look-back: a burst's queue is what a scale-up must see now."""
    now = _now(ctx)
    queued: dict[str, float] = {}
    for name, series_by_replica in (ctx.raw_metrics or {}).items():
        if not name.startswith(INGRESS_QUEUE_PREFIX):
            continue
        deployment = name.removeprefix(INGRESS_QUEUE_PREFIX)
        for replica_id in ctx.running_replicas:
            series = series_by_replica.get(replica_id)
            if series and now - series[-1].timestamp <= stale_after_s:
                queued[deployment] = queued.get(deployment, 0.0) + float(series[-1].value)
    return {deployment: round(n) for deployment, n in queued.items()}


def pool_state(
    ctx: Any, stale_after_s: float = DEFAULT_STALE_AFTER_S, queued: int = 0
) -> PoolScalingState:
    """A `PoolScalingState` from Serve's `AutoscalingContext`: one stats dict per running replica
    that has reported (a replica's last report however old), taken at the newest report within
    `stale_after_s` (none: stale, the pool holds). A replica that stopped reporting counts at its
    last known load: dropped, a busy replica gone quiet would read as idle. The load gauges are
    Serve's time-weighted averages (`ctx.aggregated_metrics`); the counters are each report's
    latest value (`ctx.raw_metrics`): Serve weights a report's last sample by the time since it
    was taken, so an averaged counter moves every tick while no draft happened.
    `queued`: requests waiting for the pool before Serve sees them (`ingress_queues`)."""
    now = _now(ctx)
    aggregated = ctx.aggregated_metrics or {}
    raw = ctx.raw_metrics or {}
    latest = _latest_timestamps(ctx)
    stats, replica_ids = [], []
    for replica_id in ctx.running_replicas:
        if replica_id not in latest:
            continue
        values = {
            name: float(by_replica[replica_id])
            for name, by_replica in aggregated.items()
            if name in LOAD_GAUGES and replica_id in by_replica
        }
        values |= {
            name: float(by_replica[replica_id][-1].value)
            for name, by_replica in raw.items()
            if name not in LOAD_GAUGES and by_replica.get(replica_id)
        }
        if values:
            stats.append(values)
            replica_ids.append(str(replica_id))
    fresh = [t for t in latest.values() if now - t <= stale_after_s]
    if ctx.running_replicas:
        stats_at_s = max(fresh) if stats and fresh else None
    else:  # nothing runs, so nothing is missing: the load known is none (as the simulator
        # sees a pool whose replicas all start). Stale, a pool whose replica loads a large
        # model for minutes would hold its whole budget group all that time.
        stats_at_s = now
    return PoolScalingState(
        # Serve's target (running or starting): `current_num_replicas` counts running ones
        # only, and a decision below the target reads as a scale-down of a starting replica.
        replicas=ctx.target_num_replicas,
        stats=stats,
        replica_ids=tuple(replica_ids),
        now_s=now,
        stats_at_s=stats_at_s,
        queued=queued,
        last_scale_up_s=ctx.last_scale_up_time,
        last_scale_down_s=ctx.last_scale_down_time,
    )


def pool_target(ctx: Any, kwargs: dict[str, Any]) -> PoolScalingTarget:
    """Bounds from the context (capacity-adjusted by Serve), the rest from `policy_kwargs`."""
    defaults = PoolScalingTarget()
    return PoolScalingTarget(
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        target_per_user_tok_s=kwargs.get("target_per_user_tok_s"),
        context_tokens=int(kwargs.get("context_tokens", defaults.context_tokens)),
        max_batch=kwargs.get("max_batch"),
        utilization=float(kwargs.get("utilization", defaults.utilization)),
        demand_window_s=float(kwargs.get("demand_window_s", defaults.demand_window_s)),
        ongoing_requests_per_replica=float(
            kwargs.get("target_running_per_replica", defaults.ongoing_requests_per_replica)
        ),
        max_stats_age_s=float(kwargs.get("stale_after_s", DEFAULT_STALE_AFTER_S)),
        upscale_cooldown_s=float(kwargs.get("upscale_cooldown_s", defaults.upscale_cooldown_s)),
        downscale_cooldown_s=float(
            kwargs.get("downscale_cooldown_s", defaults.downscale_cooldown_s)
        ),
    )


def _ray_default(ctx: Any) -> int:
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    replicas, _ = replica_queue_length_autoscaling_policy(ctx)
    return math.ceil(replicas)


def _log_decision(
    pool: str, current: int, decision: ScalingDecision, memo: dict[str, Any], interval_s: float
) -> dict[str, Any]:
    """Log when the decision changes, requests start or stop waiting at the ingress, or
    `interval_s` passed; returns the new memo."""
    now = time.time()
    key = f"{decision.replicas}|{decision.reason}|{bool(decision.inputs.get('queued'))}"
    if memo.get("key") != key or now - memo.get("at", 0.0) >= interval_s:
        logger.info(
            f"{DECISION_LOG_PREFIX}{pool} replicas={current}->{decision.replicas} "
            f"reason={decision.reason} inputs={json.dumps(decision.inputs, sort_keys=True)}"
        )
        return {"key": key, "at": now}
    return memo


def load_pool_model(kwargs: dict[str, Any]) -> PoolModel | None:
    """The calibrated model of the pool named in `policy_kwargs` (`profile`, `pool`); None
    without one, or when it cannot be loaded (logged: the policy then steers by requests)."""
    profile, pool = kwargs.get("profile"), kwargs.get("pool")
    if not profile or not pool:
        return None
    try:
        return PerformanceModel.load(profile).pools[pool]
    except Exception:
        logger.exception(f"{DECISION_LOG_PREFIX}{pool} cannot load its model from {profile}")
        return None


class _Pool:
    """What a policy keeps of one pool between ticks: its model (corrected online from the
    engines' acceptance counters) and the counter totals last seen."""

    def __init__(self, kwargs: dict[str, Any]):
        self.kwargs = kwargs
        self.model = load_pool_model(kwargs)
        self.counters: dict[str, dict[str, float]] | None = None
        self.window = DemandWindow(float(kwargs.get("demand_window_s", 0.0)))

    def state(self, ctx: Any, queued: int = 0) -> PoolScalingState:
        """The pool's state now (`queued` at the ingress), with the peak demand of its window
        (updated once per call: call it once per tick)."""
        stale_after_s = float(self.kwargs.get("stale_after_s", DEFAULT_STALE_AFTER_S))
        state = pool_state(ctx, stale_after_s, queued)
        if not state.stats:  # stale or no replica: no demand was measured
            return state
        return replace(state, peak_demand=self.window.observe(state.now_s, state.demand))

    def decide(self, ctx: Any, state: PoolScalingState | None = None) -> ScalingDecision:
        """This pool's own decision (`state`: this tick's, when the caller already took it)."""
        try:
            state = state or self.state(ctx)
            if self.model is not None and state.stats:
                self.counters = observe_acceptance(
                    self.model, self.counters, state.stats, state.replica_ids
                )
            decision = desired_replicas(state, self.model, pool_target(ctx, self.kwargs))
            inputs = {**decision.inputs, "reporting": len(state.stats)}
            if self.model is not None:
                inputs["acceptance_scale"] = round(self.model.acceptance_scale, 3)
            # `reporting`: how many replicas fed the decision, the proof Serve's metrics reach it.
            return replace(decision, inputs=inputs)
        except Exception as error:  # a policy must never raise into Serve's controller
            logger.exception(f"{DECISION_LOG_PREFIX}{ctx.deployment_name} policy failed")
            replicas = ctx.target_num_replicas
            try:
                replicas = _ray_default(ctx)
            except Exception:
                pass
            low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
            with contextlib.suppress(TypeError):
                replicas = max(low, min(high, replicas))
            return ScalingDecision(
                replicas, f"fallback to Ray's default policy ({type(error).__name__}: {error})"
            )


class PoolAutoscalingPolicy:
    """Deployment-level policy of one pool (`AutoscalingPolicy(policy_function=
    "cluster.autoscale.ray_policy:PoolAutoscalingPolicy", policy_kwargs={...})`).

    kwargs: `target_running_per_replica`, `upscale_cooldown_s`, `downscale_cooldown_s`,
    `stale_after_s`, `log_interval_s`; with a model also `profile` (path), `pool` (its name in
    the profile), `target_per_user_tok_s`, `context_tokens`, `max_batch` (see
    `PoolScalingTarget`)."""

    def __init__(self, **kwargs: Any):
        self.pool = _Pool(kwargs)
        self.log_interval_s = float(kwargs.get("log_interval_s", 60.0))

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision = self.pool.decide(ctx)
        state = dict(ctx.policy_state or {})
        state[_STATE_KEY] = _log_decision(
            ctx.deployment_name,
            ctx.current_num_replicas,
            decision,
            state.get(_STATE_KEY) or {},
            self.log_interval_s,
        )
        return decision.replicas, state


class BudgetAutoscalingPolicy:
    """Application-level policy (Serve app config `autoscaling_policy: {policy_function:
    "cluster.autoscale.ray_policy:BudgetAutoscalingPolicy", policy_kwargs: {...}}`).

    kwargs: `pools`: {deployment name: {"group": target id, "role": `speculative` or
    `throughput`, plus `PoolAutoscalingPolicy` kwargs}}, `budgets`: {target id: most replicas
    of that target's pools together}, `ingress`: the ingress deployment's name, whose reports
    (`ingress_queues`) add the requests waiting at its gates to each pool's demand,
    `log_interval_s`. Deployments not in `pools` are left alone (no decision)."""

    def __init__(self, **kwargs: Any):
        self.pools: dict[str, dict[str, Any]] = kwargs.get("pools", {})
        self.budgets: dict[str, int] = kwargs.get("budgets", {})
        self.ingress: str | None = kwargs.get("ingress")
        self.log_interval_s = float(kwargs.get("log_interval_s", 60.0))
        self.tracked = {name: _Pool(pool_kwargs) for name, pool_kwargs in self.pools.items()}

    def _ingress_queues(self, contexts: dict[Any, Any]) -> dict[str, int]:
        """Requests waiting at the ingress for each pool (unknown: none)."""
        ingress = next((c for c in contexts.values() if c.deployment_name == self.ingress), None)
        if ingress is None:
            return {}
        try:  # the ingress's own staleness: the pools' settings are about engine stats
            return ingress_queues(ingress)
        except Exception:
            logger.exception(f"{DECISION_LOG_PREFIX}* cannot read the ingress's queues")
            return {}

    def _role_order(self, ctx: Any) -> int:
        return 0 if self.pools[ctx.deployment_name].get("role") == "speculative" else 1

    def __call__(self, contexts: dict[Any, Any]) -> tuple[dict[Any, int], dict[Any, dict]]:
        ours = {d: ctx for d, ctx in contexts.items() if ctx.deployment_name in self.pools}
        queued = self._ingress_queues(contexts)
        states: dict[Any, PoolScalingState] = {}
        for d, ctx in ours.items():
            pool = self.tracked[ctx.deployment_name]
            with contextlib.suppress(Exception):  # `decide` falls back and logs on its own
                states[d] = pool.state(ctx, queued.get(ctx.deployment_name, 0))
        decisions = {
            d: self.tracked[ctx.deployment_name].decide(ctx, states.get(d))
            for d, ctx in ours.items()
        }
        by_group: dict[str, list[Any]] = {}
        # Speculative pool first: `within_budget` gives it the ties (Serve's order is its own).
        for d, ctx in sorted(ours.items(), key=lambda item: self._role_order(item[1])):
            by_group.setdefault(self.pools[ctx.deployment_name].get("group", ""), []).append(d)
        for group, members in by_group.items():
            budget = self.budgets.get(group)
            expected = sum(1 for kw in self.pools.values() if kw.get("group", "") == group)
            if budget is None or len(members) != expected:  # a pool missing this tick: hold
                continue
            if any(d not in states for d in members):
                continue
            try:
                targets = {
                    str(d): pool_target(ours[d], self.pools[ours[d].deployment_name])
                    for d in members
                }
                models = {str(d): self.tracked[ours[d].deployment_name].model for d in members}
                shared = within_budget(
                    {str(d): decisions[d].replicas for d in members},
                    {str(d): states[d] for d in members},
                    models,
                    int(budget),
                    targets,
                )
            except Exception:
                logger.exception(f"{DECISION_LOG_PREFIX}* budget split failed for {group!r}")
                continue
            for d in members:
                if shared[str(d)] != decisions[d].replicas:
                    decisions[d] = ScalingDecision(
                        shared[str(d)],
                        f"budget {budget} of {group!r} ({decisions[d].reason})",
                        {**decisions[d].inputs, "budget": budget, "wanted": decisions[d].replicas},
                    )
        replicas, states_out = {}, {}
        for d, ctx in ours.items():
            state = dict(ctx.policy_state or {})
            state[_STATE_KEY] = _log_decision(
                ctx.deployment_name,
                ctx.current_num_replicas,
                decisions[d],
                state.get(_STATE_KEY) or {},
                self.log_interval_s,
            )
            replicas[d] = decisions[d].replicas
            states_out[d] = state
        return replicas, states_out
