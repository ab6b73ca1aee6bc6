"""Autoscaling decisions (pure): per-pool desired replicas and the budget split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.autoscale.budget import (
    capacity_at,
    fit_to_budget,
    mean_rate,
    offered_tokens_per_s,
    replica_capacity,
    share_budget,
    within_budget,
)
from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.policy import (
    MIN_DRAFTS_PER_OBSERVATION,
    DemandWindow,
    PoolScalingState,
    PoolScalingTarget,
    desired_replicas,
    fewest_replicas,
    observe_acceptance,
)
from cluster.autoscale.signals import EngineStats
from cluster.speculation import SpecCounters
from tests.test_perf_model import UNDRAFTED_PROFILE as PROFILE  # pools that differ when idle
from tests.test_ray_policy import PROFILE as EMBEDDED_PROFILE
from tests.test_ray_policy import spec_engine

MODELS = PerformanceModel.load(PROFILE).pools
SPEC, THR = MODELS["speculative"], MODELS["throughput"]
# 6 tok/s per user at 1k context: the throughput pool holds it up to ~5 requests a replica.
TARGET = PoolScalingTarget(
    min_replicas=1, max_replicas=8, target_per_user_tok_s=6.0, max_batch=16,
    upscale_cooldown_s=30, downscale_cooldown_s=300,
)  # fmt: skip


def busy(replicas: int, per_replica: int, now: float = 1000.0, **kw) -> PoolScalingState:
    stats = [{"running": float(per_replica), "waiting": 0.0}] * replicas
    return PoolScalingState(replicas, stats, now_s=now, stats_at_s=now - 1, **kw)


def test_target_rate_from_tpot_slo():
    assert PoolScalingTarget(tpot_slo_s=0.25).target_rate == 4
    assert PoolScalingTarget(target_per_user_tok_s=3, tpot_slo_s=0.25).target_rate == 3
    assert PoolScalingTarget().target_rate is None


@pytest.mark.parametrize("demand", [0, 1, 4, 9, 20, 40])
def test_fewest_replicas_is_the_smallest_count_meeting_the_target(demand):
    n = fewest_replicas(THR, demand, TARGET, TARGET.target_rate)
    assert n is not None
    batch = -(-demand // n)
    assert batch == 0 or THR.per_user_rate(batch, 1024) >= TARGET.target_rate
    if n > TARGET.min_replicas:
        fewer = -(-demand // (n - 1))
        assert THR.per_user_rate(fewer, 1024) < TARGET.target_rate


@pytest.mark.parametrize(
    ("state", "target", "replicas", "reason"),
    [
        # Load beyond what one replica holds at 6 tok/s: up to the fewest that do.
        (busy(1, 20), TARGET, fewest_replicas(THR, 20, TARGET, 6.0), "scale_up"),
        # Within the band: hold.
        (busy(2, 3), TARGET, 2, "hold"),
        # Idle for long: down to the minimum.
        (busy(4, 0), TARGET, 1, "scale_down"),
        # Stale stats: hold, whatever they say.
        (replace(busy(1, 20), stats_at_s=900.0), TARGET, 1, "stale_stats"),
        (PoolScalingState(2, [], now_s=1000.0, stats_at_s=None), TARGET, 2, "stale_stats"),
        # Pool at zero: wakes for a queued request, else stays.
        (PoolScalingState(0, queued=1, now_s=1000.0), replace(TARGET, min_replicas=0), 1, "wake"),
        (PoolScalingState(0, now_s=1000.0), replace(TARGET, min_replicas=0), 0, "idle"),
        # A target no count meets (even one request alone is slower): as many as requests.
        (busy(1, 3), replace(TARGET, target_per_user_tok_s=1000.0), 3, "slo_infeasible"),
        # No model: Ray-like ongoing-requests target (4 per replica).
        (busy(1, 10), TARGET, 3, "no_model"),
        # Scale-up within its cool-down: hold.
        (busy(1, 20, last_scale_up_s=990.0), TARGET, 1, "cooldown"),
        # Scale-down within its cool-down (counted from the last change of either kind).
        (busy(4, 0, last_scale_up_s=800.0), TARGET, 4, "cooldown"),
        (busy(4, 0, last_scale_up_s=600.0), TARGET, 1, "scale_down"),
        # The range bounds the answer.
        (busy(1, 200), replace(TARGET, max_replicas=3), 3, "slo_infeasible"),
    ],
)
def test_desired_replicas(state, target, replicas, reason):
    model = None if reason == "no_model" else THR
    decision = desired_replicas(state, model, target)
    assert (decision.replicas, decision.reason) == (replicas, reason)
    assert decision.inputs["demand"] == state.demand


def test_queued_requests_count_as_demand():
    state = busy(1, 2, queued=18)
    assert state.demand == 20
    assert desired_replicas(state, THR, TARGET).replicas == fewest_replicas(THR, 20, TARGET, 6.0)


def test_flapping_load_does_not_flap_replicas():
    """Load oscillating around a boundary: one scale-up, then holds (band + cool-downs)."""
    replicas, last_up, last_down, changes = 1, None, None, 0
    boundary = next(d for d in range(1, 100) if fewest_replicas(THR, d, TARGET, 6.0) == 2)
    for step in range(120):
        now = 1000.0 + 10 * step
        demand = boundary if step % 2 else boundary - 1
        stats = [{"running": demand / replicas, "waiting": 0.0}] * replicas
        state = PoolScalingState(replicas, stats, now, now - 1, 0, last_up, last_down)
        decision = desired_replicas(state, THR, TARGET)
        if decision.replicas != replicas:
            changes += 1
            if decision.replicas > replicas:
                last_up = now
            else:
                last_down = now
            replicas = decision.replicas
    assert changes == 1 and replicas == 2


BOTH = {"speculative": replace(TARGET, min_replicas=1), "throughput": replace(TARGET)}


def split(demand: int, previous=None, budget: int = 4) -> dict[str, int]:
    pools = {
        "speculative": busy(1, demand // 2),
        "throughput": busy(1, demand - demand // 2),
    }
    return share_budget(pools, MODELS, budget, BOTH, previous)


def test_budget_moves_to_throughput_as_concurrency_rises_and_back():
    shares = [split(d)["speculative"] for d in (1, 4, 16, 48)]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] > shares[-1]
    assert all(sum(split(d).values()) == 4 for d in (1, 4, 16, 48))


def test_budget_split_is_the_best_mean_rate():
    best = split(16)
    rate = mean_rate(MODELS, best, 16, BOTH)
    for spec in range(1, 4):
        other = {"speculative": spec, "throughput": 4 - spec}
        assert mean_rate(MODELS, other, 16, BOTH) <= rate + 1e-9


def test_budget_keeps_the_previous_split_unless_clearly_better():
    best = split(16)
    step = 1 if best["throughput"] > BOTH["throughput"].min_replicas else -1
    near = {"speculative": best["speculative"] + step, "throughput": best["throughput"] - step}
    gain = mean_rate(MODELS, best, 16, BOTH) / mean_rate(MODELS, near, 16, BOTH) - 1
    kept = split(16, previous=near)
    assert kept == (near if gain <= 0.05 else best)
    # Idle: straight back to the speculative pool.
    assert split(0, previous={"speculative": 1, "throughput": 3}) == {
        "speculative": 3, "throughput": 1,
    }  # fmt: skip


def test_budget_without_models_keeps_what_it_had():
    pools = {"speculative": busy(1, 1), "throughput": busy(1, 1)}
    models = {"speculative": SPEC, "throughput": None}
    previous = {"speculative": 2, "throughput": 2}
    assert share_budget(pools, models, 4, BOTH, previous) == previous


def test_budget_that_cannot_meet_the_minimums_is_refused():
    with pytest.raises(ValueError):
        split(4, budget=1)


@pytest.mark.parametrize(
    ("wanted", "mins", "budget", "expected"),
    [
        ({"spec": 3, "tp": 4}, {"spec": 1, "tp": 1}, 10, {"spec": 3, "tp": 4}),
        ({"spec": 3, "tp": 4}, {"spec": 1, "tp": 1}, 4, {"spec": 2, "tp": 2}),
        ({"spec": 3, "tp": 4}, {"spec": 1, "tp": 1}, 1, {"spec": 1, "tp": 1}),
        ({"spec": 0, "tp": 5}, {"spec": 0, "tp": 2}, 3, {"spec": 0, "tp": 3}),
    ],
)
def test_fit_to_budget_cuts_the_pool_furthest_above_its_minimum(wanted, mins, budget, expected):
    assert fit_to_budget(wanted, mins, budget) == expected


S_, T_ = "speculative", "throughput"

SIZED = {
    S_: PoolScalingTarget(min_replicas=1, max_replicas=6, target_per_user_tok_s=10, max_batch=16),
    T_: PoolScalingTarget(min_replicas=1, max_replicas=6, target_per_user_tok_s=5, max_batch=32),
}


def capacities() -> dict[str, float]:
    """Tokens/s one replica decodes at its pool's target rate (what within_budget sizes by)."""
    out = {}
    for name, target in SIZED.items():
        fits = capacity_at(MODELS[name], target, target.target_rate)
        out[name] = fits * MODELS[name].per_user_rate(fits, target.context_tokens)
    return out


def spread(replicas: int, running: int, now: float = 1000.0) -> PoolScalingState:
    """`running` requests spread over `replicas` as evenly as they go (none lost to rounding)."""
    per_replica = [running // replicas + (i < running % replicas) for i in range(replicas)]
    stats = [{"running": float(n), "waiting": 0.0} for n in per_replica]
    return PoolScalingState(replicas, stats, now_s=now, stats_at_s=now - 1)


def sized(spec_running: int, thr_running: int, replicas=(1, 1), budget=6, **kw):
    pools = {S_: spread(replicas[0], spec_running), T_: spread(replicas[1], thr_running)}
    wanted = {S_: replicas[0], T_: replicas[1]}
    return within_budget(wanted, pools, MODELS, budget, SIZED, **kw), pools


def test_capacity_at_is_the_largest_batch_meeting_the_rate():
    target = SIZED[S_]
    fits = capacity_at(MODELS[S_], target, 10)
    assert 1 <= fits < 16
    assert MODELS[S_].per_user_rate(fits, 1024) >= 10 > MODELS[S_].per_user_rate(fits + 1, 1024)
    assert capacity_at(MODELS[S_], target, 1000) == 0


def test_within_budget_grows_the_total_with_the_load():
    light, pools = sized(2, 0)
    assert light == {S_: 1, T_: 1}
    heavy, pools = sized(8, 8, replicas=(1, 1))  # growing: no margin needed
    load = sum(offered_tokens_per_s(pools[n], replica_capacity(MODELS[n], SIZED[n])) for n in pools)
    cap = capacities()
    assert sum(heavy.values()) > 2
    assert heavy[S_] * cap[S_] + heavy[T_] * cap[T_] >= load
    # the fewest: one replica less cannot cover the load
    fewer = sum(heavy.values()) - 1
    assert max(a * cap[S_] + (fewer - a) * cap[T_] for a in range(1, fewer)) < load


def test_within_budget_shrinks_only_with_spare_capacity():
    # A load that one replica of each pool covers, but not with the 20% margin: from 2 replicas
    # it stays at 2; from 3 it does not shrink to 2.
    cap = capacities()
    two = cap[S_] + cap[T_]
    for running in range(1, 200):
        pools = {S_: busy(1, running), T_: busy(0, 0)}
        load = offered_tokens_per_s(pools[S_], replica_capacity(MODELS[S_], SIZED[S_]))
        if two / 1.2 < load <= two:
            break
    else:
        raise AssertionError("no load between the two bounds")
    grown, _ = sized(running, 0, replicas=(1, 1))
    kept, _ = sized(running, 0, replicas=(2, 1))
    assert sum(grown.values()) == 2 and sum(kept.values()) == 3


def test_within_budget_moves_the_split_to_less_capacity_only_with_spare():
    # Found live (load step, budget 3): a load near a boundary flipped the split between 2 + 1
    # and 1 + 2 within a minute, and each flip starts a replica (minutes) and drains another.
    targets = {S_: SIZED[S_], T_: replace(SIZED[T_], target_per_user_tok_s=3)}
    cap = {n: replica_capacity(MODELS[n], targets[n]).tokens_per_s for n in targets}
    assert cap[T_] > cap[S_]  # a throughput replica holds more at its target
    spec_heavy = 2 * cap[S_] + cap[T_]
    for running in range(1, 400):
        load = offered_tokens_per_s(spread(1, running), replica_capacity(MODELS[T_], targets[T_]))
        if spec_heavy / 1.2 < load <= spec_heavy:
            break
    else:
        raise AssertionError("no load between the two bounds")

    def split_from(spec: int, thr: int) -> dict[str, int]:
        pools = {S_: spread(spec, 0), T_: spread(thr, running)}
        return within_budget({S_: spec, T_: thr}, pools, MODELS, 3, targets)

    # 2 + 1 covers the load, but not with the margin: from 1 + 2 (more capacity) it stays...
    assert split_from(1, 2) == {S_: 1, T_: 2}
    # ...and from 2 + 1 too (it covers the load; the most speculative replicas that do).
    assert split_from(2, 1) == {S_: 2, T_: 1}
    # Overloaded even at the budget, both splits within 5% of the most capacity: each holds
    # (else a load around the budget's capacity flips between this choice and the one above).
    assert 2 * cap[S_] + cap[T_] >= 0.95 * (cap[S_] + 2 * cap[T_])
    running = next(
        n for n in range(running, 800)
        if offered_tokens_per_s(spread(1, n), replica_capacity(MODELS[T_], targets[T_]))
        > cap[S_] + 2 * cap[T_]
    )  # fmt: skip
    assert split_from(1, 2) == {S_: 1, T_: 2} and split_from(2, 1) == {S_: 2, T_: 1}


def test_within_budget_load_does_not_grow_with_the_replicas():
    # The same requests on more replicas decode faster, but need no more capacity: the pool
    # shrinks back to what they need at the target.
    few, _ = sized(3, 0, replicas=(1, 1))
    many, _ = sized(3, 0, replicas=(3, 1))
    assert few == many and sum(many.values()) < 4


def test_within_budget_holds_while_a_pool_is_stale():
    pools = {S_: busy(3, 4), T_: busy(2, 0, now=1000.0)}
    pools[T_] = PoolScalingState(2, pools[T_].stats, now_s=1000.0, stats_at_s=900.0)
    assert within_budget({S_: 1, T_: 1}, pools, MODELS, 6, SIZED) == {S_: 3, T_: 2}


def test_within_budget_at_the_budget_grows_only_into_free_replicas():
    # Overloaded: the budget, but the pool that grows waits for the other to drain.
    split, _ = sized(200, 200, replicas=(5, 1), budget=6)
    assert sum(split.values()) <= 6 and split[T_] == 1


def test_within_budget_without_models_cuts_each_want_to_fit():
    pools = {S_: busy(2, 4), T_: busy(3, 4)}
    split = within_budget({S_: 4, T_: 5}, pools, {S_: None, T_: None}, 6, SIZED)
    assert split == fit_to_budget({S_: 4, T_: 5}, {S_: 1, T_: 1}, 6)
    assert within_budget({S_: 2, T_: 3}, pools, {S_: None, T_: None}, 6, SIZED) == {
        S_: 2, T_: 3,
    }  # fmt: skip


def test_demand_window_keeps_the_peak_of_its_window():
    window = DemandWindow(300)
    peaks = [window.observe(t, d) for t, d in [(0, 5), (100, 20), (200, 3), (350, 4), (401, 2)]]
    # 20 seen at t=100 holds until it is older than 300 s; then the largest left (4 at 350).
    assert peaks == [5, 20, 20, 20, 4]
    assert DemandWindow(0).observe(10, 7) == 7


def test_a_lull_between_bursts_keeps_the_replicas_of_the_window():
    target = replace(TARGET, demand_window_s=600)
    burst = desired_replicas(busy(4, 4, now=1000.0), SPEC, target)
    lull = busy(4, 1, now=1500.0, last_scale_up_s=0.0)
    assert desired_replicas(lull, SPEC, target).replicas < burst.replicas  # latest count alone
    remembered = replace(lull, peak_demand=16)
    assert desired_replicas(remembered, SPEC, target).replicas == burst.replicas


def test_utilization_leaves_room_in_every_replica():
    full, _ = sized(40, 0, replicas=(1, 1))
    cap = capacity_at(MODELS[S_], SIZED[S_], 10)
    headroom = {n: replace(t, utilization=0.5) for n, t in SIZED.items()}
    assert capacity_at(MODELS[S_], headroom[S_], 10) == max(1, cap // 2)
    pools = {S_: busy(1, 40), T_: busy(1, 0)}
    roomy = within_budget({S_: 1, T_: 1}, pools, MODELS, 12, headroom)
    assert sum(roomy.values()) > sum(full.values())
    # desired_replicas: a replica is full at utilization x max_batch requests.
    target = replace(TARGET, target_per_user_tok_s=0.1, utilization=0.5)
    assert desired_replicas(busy(1, 16), SPEC, target).replicas == 2
    assert desired_replicas(busy(1, 16), SPEC, replace(target, utilization=1.0)).replicas == 1


def test_observe_acceptance_counts_each_replicas_own_change():
    model = PerformanceModel.load(EMBEDDED_PROFILE).pools["speculative"]
    seen = observe_acceptance(model, None, [spec_engine(1, 100, 50)], ["a"])
    assert model.acceptance_scale == 1.0  # the first look has nothing to compare with
    seen = observe_acceptance(model, seen, [spec_engine(1, 10, 0)], ["a"])  # restarted
    assert model.acceptance_scale == 1.0 and seen["a"]["spec_drafts"] == 10
    # Replica b joins with a long history, c leaves: neither moves the estimate; a's own
    # 100 drafts with nothing accepted do.
    veteran = spec_engine(1, 5000, 9000)
    seen = observe_acceptance(
        model, seen | {"c": seen["a"]}, [spec_engine(1, 10, 0), veteran], ["a", "b"]
    )
    assert model.acceptance_scale == 1.0
    observe_acceptance(model, seen, [spec_engine(1, 110, 0), veteran], ["a", "b"])
    assert model.acceptance_scale < 1.0


def test_a_few_drafts_wait_for_more_before_they_move_the_acceptance():
    model = PerformanceModel.load(EMBEDDED_PROFILE).pools["speculative"]
    few = MIN_DRAFTS_PER_OBSERVATION // 3
    seen = observe_acceptance(model, None, [spec_engine(1, 1000, 2000)], ["a"])
    # A burst's tail: a handful of drafts with nothing accepted, twice over.
    for n in range(1, 3):
        seen = observe_acceptance(model, seen, [spec_engine(1, 1000 + n * few, 2000)], ["a"])
        assert model.acceptance_scale == 1.0 and seen["a"]["spec_drafts"] == 1000
    # Enough of them together: judged as one observation.
    observe_acceptance(model, seen, [spec_engine(1, 1000 + 3 * few + 3, 2000)], ["a"])
    assert model.acceptance_scale < 1.0


def test_observed_acceptance_is_judged_at_the_depth_drafted():
    model = PerformanceModel.load(EMBEDDED_PROFILE).pools["speculative"]
    first = model.acceptance_per_position[0]

    def engine_at(depth: int, drafts: int) -> dict[str, float]:
        # The calibrated acceptance of a one-token draft, drafted at `depth`.
        counters = SpecCounters(drafts=drafts, draft_tokens=depth * drafts,
                                accepted=round(first * drafts))  # fmt: skip
        return EngineStats(running=8, speculation=counters).as_metrics()

    # A dynamic schedule drafting one token at this batch: the drafter is as calibrated.
    seen = observe_acceptance(model, None, [engine_at(1, 1000)], ["a"])
    observe_acceptance(model, seen, [engine_at(1, 11000)], ["a"])
    assert model.acceptance_scale == pytest.approx(1.0, abs=0.01)
    # The same acceptance at full depth: the later positions accepted nothing, a worse drafter.
    depth = model.depth_at(1)
    assert depth > 1
    seen = observe_acceptance(model, None, [engine_at(depth, 1000)], ["a"])
    observe_acceptance(model, seen, [engine_at(depth, 11000)], ["a"])
    assert model.acceptance_scale < 0.99
