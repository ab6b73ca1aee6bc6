"""Failover before the first item, error events after it, and the error table.

The pool calls here are scripted async iterators with the `cancel()` of Serve's
`DeploymentResponseGenerator`; the e2e reliability test kills real replicas."""

import asyncio
import gc
import json

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.llm.openai_api_models import ErrorResponse

from cluster.request import streaming
from cluster.request.admission import PoolGate
from cluster.request.errors import ApiError, from_exception

CHUNK = 'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


class Scripted:
    """A pool call: yields `items`; an exception in them is raised at that point."""

    def __init__(self, items):
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def _gates():
    gates = {n: PoolGate(n, per_replica=4, max_queued=0, queue_timeout_s=1, retry_after_s=2)
             for n in ("spec", "thr")}  # fmt: skip
    for gate in gates.values():
        gate.set_replicas(1)
    return gates


def _run(scripts: dict[str, list], order, weight: int = 1):
    gates, calls, retries = _gates(), [], []

    def call(pool):
        stream = Scripted(scripts[pool].pop(0))
        calls.append((pool, stream))
        return stream

    async def go():
        slot = gates[order[0]].try_enter(weight)
        return await streaming.start(order, slot, gates, call, lambda p, e: retries.append(p))

    return asyncio.run(go()), gates, calls, retries


def test_attempt_order_alternates_pools():
    assert streaming.attempt_order("thr", "spec", 3) == ["thr", "spec", "thr"]
    assert streaming.attempt_order("thr", None, 2) == ["thr", "thr"]


def test_replica_death_before_first_item_fails_over_to_the_other_pool():
    died = ActorDiedError()
    started, gates, calls, retries = _run(
        {"thr": [[died]], "spec": [[[CHUNK], ["data: [DONE]\n\n"]]]}, ["thr", "spec", "thr"]
    )
    assert started.pool == "spec" and started.attempts == 2 and retries == ["thr"]
    assert calls[0][1].cancelled
    assert gates["thr"].in_flight == 0 and gates["spec"].in_flight == 1


def test_a_failover_takes_as_many_places_as_the_first_attempt():
    started, gates, _, _ = _run(
        {"thr": [[ActorDiedError()]], "spec": [[[CHUNK]]]}, ["thr", "spec"], weight=3
    )
    assert (gates["thr"].in_flight, gates["spec"].in_flight) == (0, 3)
    started.slot.release()
    assert gates["spec"].in_flight == 0


def test_engine_5xx_is_retried_but_a_4xx_is_the_answer():
    error_5xx = ErrorResponse(error={"message": "engine dead", "type": "x", "code": 500})
    started, *_ = _run({"thr": [[error_5xx], [[CHUNK]]], "spec": []}, ["thr", "thr"])
    assert started.attempts == 2

    error_4xx = ErrorResponse(error={"message": "too long", "type": "x", "code": 400})
    with pytest.raises(ApiError) as caught:
        _run({"thr": [[error_4xx]], "spec": []}, ["thr", "spec"])
    assert caught.value.status == 400 and caught.value.message == "too long"


def test_an_engine_error_event_before_the_first_token_is_a_failure_not_a_stream():
    # vLLM reports an engine failure inside a stream as an SSE error event, then [DONE].
    def event(code):
        error = {"message": f"engine said {code}", "type": "x", "param": None, "code": code}
        return [f"data: {json.dumps({'error': error})}\n\n", "data: [DONE]\n\n"]

    started, gates, calls, retries = _run(
        {"thr": [[event(500)]], "spec": [[[CHUNK]]]}, ["thr", "spec"]
    )
    assert started.pool == "spec" and retries == ["thr"] and calls[0][1].cancelled
    assert gates["thr"].in_flight == 0
    with pytest.raises(ApiError) as caught:  # the client's own error: its status, not a 200
        _run({"thr": [[event(400)]], "spec": []}, ["thr", "spec"])
    assert caught.value.status == 400 and caught.value.message == "engine said 400"
    assert streaming._error_in([CHUNK]) is None
    quoted = {"choices": [{"delta": {"content": '{"error": 1}'}}]}  # text, not an error
    assert streaming._error_in([f"data: {json.dumps(quoted)}\n\n"]) is None


def test_a_full_other_pool_does_not_hide_the_failure_before_it():
    gates, retries = _gates(), []
    gates["spec"].set_replicas(0)  # down: no slot to fail over to

    async def go():
        slot = gates["thr"].try_enter()
        return await streaming.start(["thr", "spec"], slot, gates,
                                     lambda pool: Scripted([ActorDiedError()]),
                                     lambda p, e: retries.append(p))  # fmt: skip

    with pytest.raises(ApiError) as caught:
        asyncio.run(go())
    assert caught.value.status == 502 and caught.value.retryable
    assert gates["thr"].in_flight == 0 and gates["spec"].in_flight == 0


def test_a_call_that_raises_at_once_frees_its_slot_and_fails_over():
    gates, tried = _gates(), []

    def call(pool):
        tried.append(pool)
        if pool == "thr":
            raise DeploymentUnavailableError("thr")  # raised by `.remote()`, not the stream
        return Scripted([CHUNK])

    async def go():
        slot = gates["thr"].try_enter()
        return await streaming.start(["thr", "spec"], slot, gates, call, lambda p, e: None)

    started = asyncio.run(go())
    assert tried == ["thr", "spec"] and started.pool == "spec"
    assert gates["thr"].in_flight == 0 and gates["spec"].in_flight == 1


def test_every_attempt_failing_gives_the_last_error():
    with pytest.raises(ApiError) as caught:
        _run({"thr": [[ActorDiedError()]], "spec": [[DeploymentUnavailableError("x")]]},
             ["thr", "spec"])  # fmt: skip
    assert caught.value.status == 503 and caught.value.headers() == {"Retry-After": "2"}


def _body(items_after_first):
    gate = _gates()["thr"]
    started = streaming.Started("thr", [CHUNK], Scripted(items_after_first), gate.try_enter(), 1)
    ended = []

    async def read():
        return [t async for t in streaming.sse_body(started, 2, lambda t: None, ended.append)]

    return "".join(asyncio.run(read())), gate, ended


def test_failure_after_the_first_item_is_an_error_event_then_done():
    text, gate, ended = _body([[CHUNK], ActorDiedError()])
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_failed"
    assert gate.in_flight == 0 and isinstance(ended[0], ActorDiedError)


def test_clean_stream_gets_one_done():
    text, gate, ended = _body([["data: [DONE]\n\n"]])
    assert text.count("[DONE]") == 1 and ended == [None] and gate.in_flight == 0
    text, *_ = _body([])  # a pool stream that ends without its own [DONE]
    assert text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (BackPressureError(num_queued_requests=5, max_queued_requests=5), 429, True),
        (DeploymentUnavailableError("pool-x"), 503, True),
        (TimeoutError(), 503, True),
        (ActorDiedError(), 502, False),
        (RuntimeError("boom"), 502, False),
    ],
)
def test_error_table_never_answers_overload_with_500(error, status, retry_after):
    api = from_exception(error, 2)
    assert api.status == status and ("Retry-After" in api.headers()) == retry_after


def test_a_client_gone_before_the_first_byte_frees_the_slot_and_stops_the_engine():
    """Starlette cancels a response whose client disconnected, possibly before it iterates the
    body: the body generator's own `finally` never runs, the answer's must."""
    gate = _gates()["thr"]
    rest = Scripted([[CHUNK]])
    started = streaming.Started("thr", [CHUNK], rest, gate.try_enter(), 1)
    ended = []
    answer = streaming.StreamedAnswer(started, 2, lambda t: None, ended.append, {})

    async def gone():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0.05)  # the client's socket is slow; it has left meanwhile

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}  # uvicorn's, as Serve runs it
    asyncio.run(answer(scope, gone, send))
    assert gate.in_flight == 0 and rest.cancelled
    assert ended == [streaming.CLIENT_LEFT]  # not counted against the SLO


def test_a_client_gone_mid_stream_is_not_a_failure():
    gate = _gates()["thr"]
    started = streaming.Started("thr", [CHUNK], Scripted([[CHUNK]] * 5), gate.try_enter(), 1)
    ended = []

    async def read_one():
        body = streaming.sse_body(started, 2, lambda t: None, ended.append)
        await anext(body)
        await body.aclose()

    asyncio.run(read_one())
    assert gate.in_flight == 0 and started.rest.cancelled and ended == [streaming.CLIENT_LEFT]


def test_a_stream_that_ran_to_its_end_is_not_cancelled_again():
    gate = _gates()["thr"]
    rest = Scripted([[CHUNK], ["data: [DONE]\n\n"]])
    started = streaming.Started("thr", [CHUNK], rest, gate.try_enter(), 1)
    ended, sent = [], []
    answer = streaming.StreamedAnswer(started, 2, lambda t: None, ended.append, {})

    async def waiting():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(answer({"type": "http", "asgi": {"spec_version": "2.4"}}, waiting, send))
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert gate.in_flight == 0 and not rest.cancelled and ended == [None]


class Slow(Scripted):
    """A pool call whose first item takes `delay_s` (a cold start, or a whole answer)."""

    def __init__(self, items, delay_s):
        super().__init__(items)
        self.delay_s = delay_s

    async def __anext__(self):
        await asyncio.sleep(self.delay_s)
        return await super().__anext__()


class CancelledAsError(Slow):
    """Like Serve's generator: a cancel while waiting comes back as an error of its own."""

    async def __anext__(self):
        try:
            return await super().__anext__()
        except asyncio.CancelledError:
            raise RuntimeError("request cancelled") from None


def _cold_start(wakes_after_s: float | None, kind=Slow):
    """A pool at zero (queue timeout 0.1 s) whose first item comes after 0.3 s; its replica
    is counted running after `wakes_after_s` (None: never)."""
    gate = PoolGate("thr", per_replica=4, max_queued=0, queue_timeout_s=0.1, retry_after_s=2,
                    scales_from_zero=True)  # fmt: skip
    gate.set_replicas(0)
    stream = kind([[CHUNK]], 0.3)

    async def go():
        if wakes_after_s is not None:
            asyncio.get_running_loop().call_later(wakes_after_s, gate.set_replicas, 1)
        slot = gate.try_enter()
        return await streaming.start(["thr"], slot, {"thr": gate}, lambda p: stream,
                                     lambda p, e: None)  # fmt: skip

    return go, gate, stream


def test_a_pool_that_never_wakes_is_a_503_after_the_queue_timeout():
    go, gate, stream = _cold_start(None)
    with pytest.raises(ApiError) as caught:
        asyncio.run(go())
    assert caught.value.status == 503 and gate.in_flight == 0 and stream.cancelled


def test_a_pool_that_woke_is_waited_for_past_the_queue_timeout():
    """Once a replica runs, the wait is for the answer (a non-streamed one is all of it)."""
    go, gate, stream = _cold_start(0.05)
    started = asyncio.run(go())
    assert started.first == [CHUNK] and gate.in_flight == 1 and not stream.cancelled


def test_a_cold_wait_given_up_leaves_no_error_unread(caplog):
    go, _, _ = _cold_start(None, CancelledAsError)
    with pytest.raises(ApiError):
        asyncio.run(go())
    gc.collect()  # an unread task exception is reported when the task is collected
    assert "never retrieved" not in caplog.text
