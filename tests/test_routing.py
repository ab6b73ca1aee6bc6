"""Pool choice (pure policy): rule v1, and the model-based choice with its fallbacks."""

import pytest

from cluster.autoscale.model import PerformanceModel, PoolModel
from cluster.autoscale.profile import PoolSpeculation
from cluster.config import RoutingConfig
from cluster.routing import Decision, PoolLoad, Reason, RequestFeatures, choose_pool
from tests.test_perf_model import UNDRAFTED_PROFILE as PROFILE  # pools that differ when idle

RULE = RoutingConfig(long_context_tokens=1000, spec_max_concurrency_per_replica=4)
SPEC, THR = "speculative", "throughput"


def load(role, replicas=1, in_flight=0, **kw) -> PoolLoad:
    return PoolLoad(role, replicas, in_flight, **kw)


def loads(spec: PoolLoad | None, thr: PoolLoad | None) -> dict[str, PoolLoad]:
    return {name: value for name, value in ((SPEC, spec), (THR, thr)) if value is not None}


IDLE_S, IDLE_T = load(SPEC), load(THR)
DOWN_S, DOWN_T = load(SPEC, 0), load(THR, 0)


@pytest.mark.parametrize(
    ("tokens", "spec", "thr", "pool", "reason"),
    [
        (999, IDLE_S, IDLE_T, THR, Reason.SHORT_PROMPT),
        (1000, IDLE_S, IDLE_T, SPEC, Reason.LONG_CONTEXT),
        (5000, load(SPEC, 1, 3), IDLE_T, SPEC, Reason.LONG_CONTEXT),
        (5000, load(SPEC, 1, 4), IDLE_T, THR, Reason.SPEC_SATURATED),
        # per replica: 7 in flight over 2 replicas is 3.5 < 4
        (5000, load(SPEC, 2, 7), IDLE_T, SPEC, Reason.LONG_CONTEXT),
        (5000, load(SPEC, 2, 8), IDLE_T, THR, Reason.SPEC_SATURATED),
        (5000, DOWN_S, IDLE_T, THR, Reason.SPEC_POOL_DOWN),
        (10, IDLE_S, DOWN_T, SPEC, Reason.THROUGHPUT_POOL_DOWN),
        (10, None, IDLE_T, THR, Reason.SPEC_POOL_DOWN),
        (10, IDLE_S, None, SPEC, Reason.THROUGHPUT_POOL_DOWN),
        # both down: the normal preference, so the caller sees the pool's own answer
        (10, DOWN_S, DOWN_T, THR, Reason.SHORT_PROMPT),
    ],
)
def test_rule_v1_without_a_model(tokens, spec, thr, pool, reason):
    decision = choose_pool(RequestFeatures(tokens), loads(spec, thr), None, RULE)
    assert (decision.pool, decision.role, decision.reason) == (pool, pool, reason)
    assert decision.predicted == {} and decision.header == reason.value


def test_pool_at_zero_that_scales_from_zero_gets_its_requests_under_the_rule():
    cold_s, cold_t = load(SPEC, 0, scales_from_zero=True), load(THR, 0, scales_from_zero=True)
    assert choose_pool(RequestFeatures(5000), loads(cold_s, IDLE_T), None, RULE).pool == SPEC
    assert choose_pool(RequestFeatures(10), loads(IDLE_S, cold_t), None, RULE).pool == THR
    # once the woken pool's first replica counts, its load is per replica as usual
    busy = load(SPEC, 0, 4, scales_from_zero=True)
    assert choose_pool(RequestFeatures(5000), loads(busy, IDLE_T), None, RULE).reason == (
        Reason.SPEC_SATURATED
    )


def test_a_target_without_pools_is_an_error():
    with pytest.raises(ValueError):
        choose_pool(RequestFeatures(10), {}, None, RULE)


@pytest.fixture(scope="module")
def model() -> PerformanceModel:
    return PerformanceModel.load(PROFILE)


def expected_rates(model, request, spec: PoolLoad, thr: PoolLoad) -> dict[str, float]:
    return {
        name: model.pools[name].per_user_rate(
            pool_load.batch_with(1), request.prompt_tokens, request.max_tokens
        )
        for name, pool_load in ((SPEC, spec), (THR, thr))
    }


@pytest.mark.parametrize(
    ("tokens", "spec", "thr"),
    [
        (2048, IDLE_S, IDLE_T),
        (200, IDLE_S, IDLE_T),
        (2048, load(SPEC, 1, 3), IDLE_T),
        (2048, load(SPEC, 1, 15), IDLE_T),
        (1024, load(SPEC, 2, 30), load(THR, 1, 2)),
        (1024, IDLE_S, load(THR, 1, 20)),
    ],
)
def test_model_picks_the_pool_predicted_fastest_with_the_request_added(model, tokens, spec, thr):
    request = RequestFeatures(tokens)
    decision = choose_pool(request, loads(spec, thr), model, RULE)
    rates = expected_rates(model, request, spec, thr)
    assert decision.predicted == pytest.approx(rates)
    assert decision.pool == max(rates, key=rates.get)
    assert decision.reason == Reason.PREDICTED_FASTER


def test_speculation_wins_idle_and_loses_when_its_pool_is_loaded(model):
    request = RequestFeatures(2048)
    assert choose_pool(request, loads(IDLE_S, IDLE_T), model, RULE).pool == SPEC
    loaded = choose_pool(request, loads(load(SPEC, 1, 12), load(THR, 1, 2)), model, RULE)
    assert loaded.pool == THR


def test_header_carries_reason_and_predictions():
    decision = Decision(SPEC, SPEC, Reason.PREDICTED_FASTER, {THR: 9.84, SPEC: 12.31})
    assert decision.header == "predicted_faster; speculative=12.3 throughput=9.8"


def test_stale_stats_fall_back_to_the_rule(model):
    stale = load(SPEC, stats_age_s=RULE.max_stats_age_s + 1)
    decision = choose_pool(RequestFeatures(5000), loads(stale, IDLE_T), model, RULE)
    assert (decision.pool, decision.reason, decision.predicted) == (SPEC, Reason.STALE_STATS, {})
    short = choose_pool(RequestFeatures(10), loads(stale, IDLE_T), model, RULE)
    assert (short.pool, short.reason) == (THR, Reason.STALE_STATS)


def test_a_model_without_one_of_the_pools_falls_back_to_the_rule(model):
    partial = PerformanceModel({SPEC: model.pools[SPEC]})
    decision = choose_pool(RequestFeatures(5000), loads(IDLE_S, IDLE_T), partial, RULE)
    assert (decision.pool, decision.reason) == (SPEC, Reason.NO_MODEL)


@pytest.mark.parametrize(
    ("spec", "thr", "pool", "reason"),
    [
        (DOWN_S, IDLE_T, THR, Reason.SPEC_POOL_DOWN),
        (IDLE_S, DOWN_T, SPEC, Reason.THROUGHPUT_POOL_DOWN),
        (IDLE_S, None, SPEC, Reason.THROUGHPUT_POOL_DOWN),
    ],
)
def test_pool_down_with_a_model(model, spec, thr, pool, reason):
    decision = choose_pool(RequestFeatures(10), loads(spec, thr), model, RULE)
    assert (decision.pool, decision.reason) == (pool, reason)


def test_cold_pool_is_a_candidate_with_its_cold_start(model):
    cold = load(SPEC, 0, scales_from_zero=True)
    request = RequestFeatures(2048, max_tokens=100)
    instant = RoutingConfig(cold_start_s=0)
    assert choose_pool(request, loads(cold, IDLE_T), model, instant).pool == SPEC
    slow = RoutingConfig(cold_start_s=60)
    decision = choose_pool(request, loads(cold, IDLE_T), model, slow)
    warm_rate = model.pools[SPEC].per_user_rate(1, 2048, 100)
    assert decision.predicted[SPEC] == pytest.approx(100 / (60 + 100 / warm_rate))
    assert decision.pool == THR


def test_full_pool_carries_the_wait_for_a_slot(model):
    request = RequestFeatures(2048, max_tokens=100)
    # Both pools at 2 running per replica of 2 slots: the speculative pool is faster...
    spec, thr = load(SPEC, 1, 1, max_batch=2), load(THR, 1, 1, max_batch=2)
    assert choose_pool(request, loads(spec, thr), model, RULE).pool == SPEC
    # ...until 6 more wait for its slots: the request would start only after 3 rounds of
    # requests end, so the throughput pool with a free slot is predicted faster.
    queued = load(SPEC, 1, 8, max_batch=2)
    decision = choose_pool(request, loads(queued, load(THR, 1, 1, max_batch=4)), model, RULE)
    assert decision.pool == THR
    pool = model.pools[SPEC]
    running_rate = pool.per_user_rate(2, 2048, 100)
    wait_s = 7 * pool.typical_output_tokens / running_rate / 2
    assert decision.predicted[SPEC] == pytest.approx(100 / (wait_s + 100 / running_rate))


def test_slo_excludes_the_faster_pool(model):
    request = RequestFeatures(2048)
    spec_ttft = model.pools[SPEC].ttft_s(1, 2048)
    thr_ttft = model.pools[THR].ttft_s(1, 2048)
    assert spec_ttft != thr_ttft
    # An SLO between the two TTFTs leaves only the pool that starts sooner.
    between = RoutingConfig(ttft_slo_s=(spec_ttft + thr_ttft) / 2, slo_headroom=None)
    decision = choose_pool(request, loads(IDLE_S, IDLE_T), model, between)
    sooner = SPEC if spec_ttft < thr_ttft else THR
    assert decision.pool == sooner
    free = choose_pool(request, loads(IDLE_S, IDLE_T), model, RULE)
    assert decision.reason == (Reason.PREDICTED_FASTER if free.pool == sooner else Reason.SLO)


@pytest.mark.parametrize("slo", ["ttft", "tpot"])
def test_slo_infeasible_takes_the_closest_pool(model, slo):
    request = RequestFeatures(2048)
    config = RoutingConfig(**{f"{slo}_slo_s": 1e-4})
    decision = choose_pool(request, loads(IDLE_S, IDLE_T), model, config)
    assert decision.reason == Reason.SLO_INFEASIBLE
    if slo == "tpot":  # the closest to a TPOT SLO is the fastest decoder
        assert decision.pool == max(decision.predicted, key=decision.predicted.get)
    else:
        ttfts = {n: model.pools[n].ttft_s(1, 2048) for n in (SPEC, THR)}
        assert decision.pool == min(ttfts, key=ttfts.get)


def test_ties_go_to_the_throughput_pool():
    same = PoolModel(
        step_coefficients=(0.05, 0, 0, 0, 0, 0),
        ttft_coefficients=(0, 1, 0),
        speculation=PoolSpeculation(),
    )
    model = PerformanceModel({SPEC: same, THR: same})
    decision = choose_pool(RequestFeatures(5000), loads(IDLE_S, IDLE_T), model, RULE)
    assert decision.pool == THR


def test_batch_counts_the_request_and_is_capped_per_replica():
    assert load(SPEC, 2, 6).batch_with(1) == 4
    assert load(SPEC, 1, 40, max_batch=16).batch_with(1) == 16
    assert load(SPEC, 0, 0, scales_from_zero=True).batch_with(1) == 1


def slo_of_rate(rate: float, **kw) -> RoutingConfig:
    return RoutingConfig(long_context_tokens=1000, tpot_slo_s=1 / rate, **kw)


def test_with_slos_a_request_stays_on_its_kinds_pool_while_it_has_headroom(model):
    short, long = RequestFeatures(200), RequestFeatures(2048)
    thr_idle = model.pools[THR].per_user_rate(1, 200)
    assert model.pools[SPEC].per_user_rate(1, 200) > 1.5 * thr_idle  # speculation is faster
    config = slo_of_rate(thr_idle / 1.5)  # the throughput pool has 1.5x the rate to spare
    decision = choose_pool(short, loads(IDLE_S, IDLE_T), model, config)
    assert (decision.pool, decision.reason) == (THR, Reason.HOME_POOL)
    assert decision.predicted == pytest.approx(expected_rates(model, short, IDLE_S, IDLE_T))
    assert decision.header.startswith("home_pool; speculative=")
    assert choose_pool(long, loads(IDLE_S, IDLE_T), model, config).pool == SPEC
    # Without headroom (or without any SLO) the fastest pool, as for the live embedded preset.
    for free in (slo_of_rate(thr_idle / 1.5, slo_headroom=None), RULE):
        fastest = choose_pool(short, loads(IDLE_S, IDLE_T), model, free)
        assert (fastest.pool, fastest.reason) == (SPEC, Reason.PREDICTED_FASTER)


def test_with_slos_a_home_pool_short_of_headroom_gives_way_to_the_fastest_that_meets_them(model):
    short = RequestFeatures(200)
    slo_rate = model.pools[THR].per_user_rate(1, 200) / 1.5
    busy_thr = load(THR, 1, 3)
    home_rate = model.pools[THR].per_user_rate(4, 200)
    assert slo_rate <= home_rate < 1.25 * slo_rate  # meets the SLO, not with 25% to spare
    decision = choose_pool(short, loads(IDLE_S, busy_thr), model, slo_of_rate(slo_rate))
    assert (decision.pool, decision.reason) == (SPEC, Reason.PREDICTED_FASTER)
    # A smaller headroom keeps it home (just under what it has: not a float-rounding tie).
    modest = slo_of_rate(slo_rate, slo_headroom=0.99 * home_rate / slo_rate)
    assert choose_pool(short, loads(IDLE_S, busy_thr), model, modest).pool == THR


def test_an_output_limit_past_a_float_is_routed_not_a_500(model):
    """Any `int` validates as `max_tokens`; the prediction divides by it."""
    from cluster.request import protocol
    from cluster.request.protocol import ROUTED_OUTPUT_TOKENS_CAP, routed_max_tokens

    huge = protocol.validate({"model": "m", "prompt": "hi", "max_tokens": 10**400}, "completions")
    with pytest.raises(OverflowError):  # what the prediction did with it
        choose_pool(RequestFeatures(5, huge.max_tokens), loads(IDLE_S, IDLE_T), model, RULE)
    assert routed_max_tokens(huge) == ROUTED_OUTPUT_TOKENS_CAP
    decision = choose_pool(RequestFeatures(5, routed_max_tokens(huge)), loads(IDLE_S, IDLE_T),
                           model, RULE)  # fmt: skip
    assert decision.reason == Reason.PREDICTED_FASTER
