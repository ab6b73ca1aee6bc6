"""Per-pool admission gates: bounded queue (429), bounded wait (503), slots as guards."""

import asyncio
import time

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


def test_a_gate_says_when_its_replica_count_matters_and_calls_on_wait_per_waiting_request():
    waits = []

    async def scenario():
        gate = _gate(queue_timeout_s=5, on_wait=lambda: waits.append(1))
        slots = [await gate.enter(), await gate.enter()]  # admitted at once: no call
        settled = gate.changing
        waiter = asyncio.create_task(gate.enter())
        await asyncio.sleep(0)
        queued = gate.changing
        slots[0].release()
        await waiter
        return settled, queued, gate.changing

    settled, queued, served = asyncio.run(scenario())
    assert (settled, queued, served) == (False, True, False) and waits == [1]
    cold = PoolGate("c", per_replica=4, max_queued=0, queue_timeout_s=1, retry_after_s=1,
                    scales_from_zero=True, on_wait=lambda: waits.append("cold"))  # fmt: skip
    assert not cold.changing  # at zero and idle: nothing to wait for
    cold.try_enter()
    assert cold.changing  # let in while no replica runs: it waits in Serve for one
    assert waits == [1, "cold"]


def test_replica_counts_refresh_fast_while_they_change_and_slowly_once_settled(monkeypatch):
    """The cadence of `serve.status()` calls. Serve's answer is replaced by a recorded
    sequence (a replica starting, then running) so the test controls when counts change."""
    from types import SimpleNamespace

    from ray import serve

    from cluster.request.dispatch import PoolClient, PoolRef

    calls = []

    def status():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise RuntimeError("controller busy")  # counts unknown: keep refreshing fast
        states = {"STARTING": 1} if len(calls) <= 2 else {"RUNNING": 1}
        deployment = SimpleNamespace(replica_states=states)
        return SimpleNamespace(applications={"app": SimpleNamespace(deployments={"d": deployment})})

    monkeypatch.setattr(serve, "status", status)
    pool = PoolRef("p", "m", "throughput", "d", 1, 4, 5.0, False, 16)

    async def scenario():
        handles = {"p": SimpleNamespace(options=lambda **_: None)}
        client = PoolClient(handles, [pool], 1, "app", refresh_s=0.02, idle_refresh_s=1.0)
        await client.ready()
        await asyncio.sleep(0.3)  # 2 STARTING, 1 failed, 1 settled: then the slow cadence
        settled_calls = len(calls)
        gate = client.gates["p"]
        slot = gate.try_enter()
        waiter = asyncio.create_task(gate.enter())  # a request waits: refreshed at once
        await asyncio.sleep(0.3)
        after_wait = len(calls)
        waiter.cancel()
        slot.release()
        client._status_task.cancel()
        return settled_calls, after_wait, gate.running_replicas

    settled_calls, after_wait, running = asyncio.run(scenario())
    assert settled_calls == 4 and running == 1
    assert settled_calls + 1 <= after_wait <= settled_calls + 20  # 1 s cadence, not a spin


def test_a_request_holds_one_place_per_sequence_and_waiters_keep_their_turn():
    async def scenario():
        gate = _gate(per_replica=4, max_queued=2, queue_timeout_s=5)
        three = await gate.enter(3)  # n = 3
        assert gate.try_enter(2) is None  # 3 + 2 > 4
        heavy = asyncio.create_task(gate.enter(2))
        await asyncio.sleep(0)
        light = asyncio.create_task(gate.enter(1))  # would fit now, but the heavy one is first
        await asyncio.sleep(0)
        held_back = (gate.in_flight, gate.queued)
        three.release()
        slots = [await heavy, await light]
        return gate, held_back, slots

    gate, held_back, slots = asyncio.run(scenario())
    assert held_back == (3, 2)
    assert (gate.in_flight, gate.queued) == (3, 0)
    for slot in slots:
        slot.release()
    assert gate.in_flight == 0


def test_a_heavy_head_is_not_overtaken_by_lighter_waiters_that_would_fit():
    async def scenario():
        gate = _gate(per_replica=4, max_queued=2, queue_timeout_s=5)
        three = await gate.enter(3)
        heavy = asyncio.create_task(gate.enter(2))
        await asyncio.sleep(0)
        light = asyncio.create_task(gate.enter(1))
        await asyncio.sleep(0)
        gate.set_replicas(1)  # a refresh wakes the queue: 3 + 1 would fit, 3 + 2 not
        await asyncio.sleep(0)
        queued = (gate.in_flight, gate.queued, gate.queued_weight, light.done())
        three.release()
        await heavy, await light
        return queued

    assert asyncio.run(scenario()) == (3, 2, 3, False)


def test_a_heavy_waiter_that_gives_up_lets_the_lighter_ones_behind_it_in():
    async def scenario():
        gate = _gate(per_replica=4, max_queued=2, queue_timeout_s=5)
        await gate.enter(3)
        heavy = asyncio.create_task(gate.enter(4))
        await asyncio.sleep(0)
        light = asyncio.create_task(gate.enter(1))
        await asyncio.sleep(0)
        heavy.cancel()
        return gate, await asyncio.wait_for(light, 1)

    gate, light = asyncio.run(scenario())
    assert light.weight == 1 and (gate.in_flight, gate.queued) == (4, 0)


def test_a_request_goes_only_to_pools_whose_replica_takes_it_whole():
    from cluster.request.dispatch import PoolClient, PoolRef

    def ref(name, role, per_replica):
        return PoolRef(name, "t", role, name, per_replica, 4, 1.0, False, per_replica)

    pools = PoolClient({}, [ref("spec", "speculative", 4), ref("thr", "throughput", 32)],
                       2, "app", 1.0, 5.0)  # fmt: skip
    assert pools.most_sequences("t") == 32
    assert [pools.takes(p, 4) for p in ("spec", "thr")] == [True, True]
    assert [pools.takes(p, 5) for p in ("spec", "thr")] == [False, True]
