"""Routing rule v1 (pure policy)."""

import pytest

from cluster.config import RoutingConfig
from cluster.routing import PoolLoad, Reason, choose_pool

RULE = RoutingConfig(long_context_tokens=1000, spec_max_concurrency_per_replica=4)
IDLE = PoolLoad(running_replicas=1, in_flight=0)
DOWN = PoolLoad(running_replicas=0, in_flight=0)


@pytest.mark.parametrize(
    ("tokens", "spec", "thr", "role", "reason"),
    [
        (999, IDLE, IDLE, "throughput", Reason.SHORT_PROMPT),
        (1000, IDLE, IDLE, "speculative", Reason.LONG_CONTEXT),
        (5000, PoolLoad(1, 3), IDLE, "speculative", Reason.LONG_CONTEXT),
        (5000, PoolLoad(1, 4), IDLE, "throughput", Reason.SPEC_SATURATED),
        # per replica: 7 in flight over 2 replicas is 3.5 < 4
        (5000, PoolLoad(2, 7), IDLE, "speculative", Reason.LONG_CONTEXT),
        (5000, PoolLoad(2, 8), IDLE, "throughput", Reason.SPEC_SATURATED),
        (5000, DOWN, IDLE, "throughput", Reason.SPEC_POOL_DOWN),
        (10, IDLE, DOWN, "speculative", Reason.THROUGHPUT_POOL_DOWN),
        (10, None, IDLE, "throughput", Reason.SPEC_POOL_DOWN),
        (10, IDLE, None, "speculative", Reason.THROUGHPUT_POOL_DOWN),
        # both down: the normal preference, so the caller sees the pool's own answer
        (10, DOWN, DOWN, "throughput", Reason.SHORT_PROMPT),
    ],
)
def test_choose_pool(tokens, spec, thr, role, reason):
    decision = choose_pool(tokens, spec, thr, RULE)
    assert (decision.role, decision.reason) == (role, reason)


def test_saturated_spec_pool_with_busy_throughput_pool_still_offloads():
    decision = choose_pool(5000, PoolLoad(1, 10), PoolLoad(1, 100), RULE)
    assert decision.role == "throughput"


def test_pool_at_zero_that_scales_from_zero_gets_its_requests():
    cold = PoolLoad(running_replicas=0, in_flight=0, scales_from_zero=True)
    assert choose_pool(5000, cold, IDLE, RULE).role == "speculative"
    assert choose_pool(10, IDLE, cold, RULE).role == "throughput"
    # once the woken pool's first replica counts, its load is per replica as usual
    assert choose_pool(5000, PoolLoad(0, 4, scales_from_zero=True), IDLE, RULE).reason == (
        Reason.SPEC_SATURATED
    )
