"""Per-pool admission gates: bounded queue (429), bounded wait (503), slots as guards."""

import asyncio

import pytest

from cluster.request.admission import PoolGate
from cluster.request.errors import ApiError


def _gate(**kwargs) -> PoolGate:
    options = dict(per_replica=2, max_queued=1, queue_timeout_s=0.2, retry_after_s=3)
    gate = PoolGate("p", **{**options, **kwargs})
    gate.set_replicas(1)
    return gate


def test_full_queue_is_429_and_a_long_wait_is_503_both_with_retry_after():
    async def scenario():
        gate = _gate()
        slots = [await gate.enter(), await gate.enter()]  # capacity 2
        waiting = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as full:
            await gate.enter()  # queue of 1 is taken
        with pytest.raises(ApiError) as timed_out:
            await waiting
        return gate, slots, full.value, timed_out.value

    gate, slots, full, timed_out = asyncio.run(scenario())
    assert (full.status, full.headers()) == (429, {"Retry-After": "3"})
    assert (timed_out.status, timed_out.headers()) == (503, {"Retry-After": "3"})
    assert gate.in_flight == 2 and gate.queued == 0


def test_released_slot_goes_to_the_first_waiter_once():
    async def scenario():
        gate = _gate(max_queued=2, queue_timeout_s=5)
        first, _ = await gate.enter(), await gate.enter()
        waiter = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        first.release()
        first.release()  # a guard: the second release is a no-op
        await waiter
        return gate

    gate = asyncio.run(scenario())
    assert gate.in_flight == 2 and gate.queued == 0


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        gate = _gate(queue_timeout_s=5)
        await gate.enter(), await gate.enter()
        waiter = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return gate

    gate = asyncio.run(scenario())
    assert gate.queued == 0 and gate.in_flight == 2


def test_capacity_follows_replicas_and_a_pool_at_zero_that_scales_takes_one_replicas_worth():
    gate = _gate(per_replica=4)
    gate.set_replicas(3)
    assert gate.capacity == 12
    cold = PoolGate("c", per_replica=4, max_queued=0, queue_timeout_s=1, retry_after_s=1,
                    scales_from_zero=True)  # fmt: skip
    assert cold.cold and cold.capacity == 4 and cold.try_enter() is not None


def test_waiters_of_a_pool_that_goes_down_are_told_to_go_elsewhere():
    async def scenario():
        gate = _gate(queue_timeout_s=5)
        await gate.enter(), await gate.enter()
        waiter = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        gate.set_replicas(0)
        with pytest.raises(ApiError) as down:
            await waiter
        return down.value

    down = asyncio.run(scenario())
    assert down.status == 503 and down.retryable


def test_running_replicas_counts_enum_and_string_states_from_serve_status():
    from ray.serve.schema import ReplicaState

    from cluster.request.dispatch import running_replicas

    states = {ReplicaState.RUNNING: 2, ReplicaState.STARTING: 1, ReplicaState.STOPPING: 1}
    assert running_replicas(states) == 2
    # What an ingress replica actually receives: the states as plain strings.
    assert running_replicas({state.value: n for state, n in states.items()}) == 2
    assert running_replicas({}) == 0
