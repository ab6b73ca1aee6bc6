"""From a chosen pool to the client's bytes: failover before the first token, and a clean end
after it.

Before the first output item nothing has reached the client, so a retryable failure (replica
died, pool unavailable or full, a 5xx from the engine) is retried: the chosen pool, then the
target's other pool, alternating, `max_attempts` in all, each retry traced. After the first
item a failure cannot be hidden: a stream ends with an OpenAI error event and `data: [DONE]`,
never a bare connection close. A client that goes away is not a failure: it is not counted
against the SLO, and the pool call is cancelled so the engine stops generating, also when the
client left before the body's first byte (`StreamedAnswer`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.request.admission import PoolGate, Slot
from cluster.request.errors import (
    ApiError,
    from_exception,
    from_pool_error,
    from_streamed_error,
    is_pool_error,
)

DONE = "data: [DONE]\n\n"

CLIENT_LEFT = "client_left"
"""What `sse_body` reports to `finish` when the client went away (not a failure)."""


@dataclass
class Started:
    """A pool call that produced its first item."""

    pool: str
    first: Any
    rest: Any
    """The pool's `DeploymentResponseGenerator`, positioned after `first`."""
    slot: Slot
    attempts: int
    ended: bool = False
    """The client's body (`sse_body`) ran to its end, however it ended."""


def attempt_order(chosen: str, other: str | None, max_attempts: int) -> list[str]:
    """Chosen, other, chosen, ... (the chosen pool alone when the target has one pool)."""
    cycle = [chosen, other] if other else [chosen]
    return [cycle[i % len(cycle)] for i in range(max_attempts)]


async def start(
    order: list[str],
    slot: Slot,
    gates: dict[str, PoolGate],
    call: Callable[[str], Any],
    on_retry: Callable[[str, ApiError], None],
) -> Started:
    """Run attempts in `order` until one yields a first item; `slot` is the first pool's (a
    retry takes as many places in its pool)."""
    last: ApiError | None = None
    weight = slot.weight
    for attempt, pool in enumerate(order):
        if attempt:
            slot = gates[pool].try_enter(weight)
            if slot is None:  # that pool is full or down: the failure before it stays the answer
                continue
        gate = gates[pool]
        stream = None
        try:
            stream = call(pool)  # inside: a call that raises at once must free the slot too
            first = await _first_item(stream, gate)
            error = _error_in(first)
        except BaseException as failure:
            slot.release()
            if stream is not None:
                stream.cancel()
            if isinstance(failure, asyncio.CancelledError):
                raise
            error = from_exception(
                ApiError(502, "the pool returned no output", code="pool_error", retryable=True)
                if isinstance(failure, StopAsyncIteration)
                else failure,
                gate.retry_after_s,
            )
        else:
            if error is None:
                return Started(pool, first, stream, slot, attempt + 1)
            slot.release()
            stream.cancel()
        if not error.retryable:
            raise error
        last = error
        if attempt + 1 < len(order):
            on_retry(pool, error)
    assert last is not None
    raise last


async def _first_item(stream: Any, gate: PoolGate) -> Any:
    """The pool call's first item. A cold pool's first call waits in Serve for a replica to
    start: that wait is bounded by `queue_timeout_s` (TimeoutError), the answer is not once a
    replica runs (a non-streamed answer is the first item: its whole generation)."""
    if not gate.cold:
        return await anext(stream)
    pending = asyncio.ensure_future(anext(stream))
    try:
        return await asyncio.wait_for(asyncio.shield(pending), gate.queue_timeout_s)
    except TimeoutError:
        if gate.cold:  # still no replica (the ingress refreshes the count meanwhile)
            _drop(pending)
            raise
        return await pending
    except BaseException:
        _drop(pending)
        raise


def _drop(pending: asyncio.Future) -> None:
    """Cancel a shielded first item nobody awaits any more, and read what it ends with: Serve's
    generator answers a cancel with `RequestCancelledError`, which asyncio would otherwise log
    as a task exception never retrieved."""
    pending.cancel()
    pending.add_done_callback(lambda done: done.cancelled() or done.exception())


def _error_in(item: Any) -> ApiError | None:
    first = item[0] if isinstance(item, list) and item else item
    if isinstance(first, str):
        return from_streamed_error(first)
    return from_pool_error(first) if is_pool_error(first) else None


def to_sse(item: Any) -> str:
    """One output item of a streaming pool call (a batch of chunks or one chunk) as SSE text."""
    if isinstance(item, list):
        return "".join(to_sse(part) for part in item)
    if isinstance(item, str):
        return item
    if is_pool_error(item):
        return from_pool_error(item).sse()
    if isinstance(item, dict):
        return f"data: {json.dumps(item)}\n\n"
    return f"data: {item.model_dump_json()}\n\n"


async def sse_body(
    started: Started,
    retry_after_s: int,
    observe: Callable[[str], None],
    finish: Callable[[BaseException | str | None], None],
) -> AsyncIterator[str]:
    """The stream the client reads; always ends with `data: [DONE]` unless the client left."""
    done = False
    outcome: BaseException | str | None = None
    try:
        item = started.first
        while True:
            text = to_sse(item)
            observe(text)
            done = done or text.rstrip().endswith(DONE.rstrip())
            yield text
            try:
                item = await anext(started.rest)
            except StopAsyncIteration:
                break
    except (asyncio.CancelledError, GeneratorExit):  # the client went away: not a failure
        outcome = CLIENT_LEFT
        started.rest.cancel()
        raise
    except Exception as failure:
        outcome = failure
        yield from_exception(failure, retry_after_s).sse()
    finally:
        started.ended = True
        started.slot.release()
        finish(outcome)
    if not done:
        yield DONE


class StreamedAnswer(StreamingResponse):
    """The streamed response of a started pool call. Starlette may cancel a response before it
    iterates the body (the client left while the first bytes were on their way), and a body
    generator that never started never runs its `finally`: the slot and the engine's work would
    be held for good. This lets them go however the response ends (each step is idempotent)."""

    def __init__(
        self,
        started: Started,
        retry_after_s: int,
        observe: Callable[[str], None],
        finish: Callable[[BaseException | str | None], None],
        headers: dict[str, str],
    ):
        super().__init__(
            sse_body(started, retry_after_s, observe, finish),
            media_type="text/event-stream",
            headers=headers,
        )
        self._started, self._finish = started, finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: BaseException | str = CLIENT_LEFT
        try:
            await super().__call__(scope, receive, send)
        except Exception as failure:  # sending failed for another reason than a client gone
            outcome = failure
            raise
        finally:
            if not self._started.ended:  # the body never ran (to its end): let go here
                self._started.slot.release()
                self._started.rest.cancel()
                self._finish(outcome)
