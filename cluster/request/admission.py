"""Bounded admission per pool: a request holds a slot while the pool serves it.

A pool's capacity is its running replicas x `max_ongoing_requests`, so the ingress never sends
a pool more than its replicas take at once, and waiting happens here, where it is bounded:
at most `max_queued_requests` wait (more: 429) for at most `queue_timeout_s` (then: 503), both
with `Retry-After`. A pool at zero replicas that may scale from zero counts as one replica: its
first requests go to Serve, whose queue is what wakes the autoscaler, and the dispatcher bounds
their wait for a replica by the same timeout. A slot is a guard: it is released exactly once,
when the response (or stream) ends, however it ends.

A request holds as many places as sequences it runs in the engine at once (`n` per prompt,
`protocol.sequences`), so `n = 8` weighs what 8 requests do; waiters are served first come,
first served (a heavy request at the head is not overtaken). The ingress sends a request only
to pools whose replica takes its weight (`per_replica`), and refuses one that no pool takes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

from cluster.request.errors import ApiError


class Slot:
    """One admitted request's places in a pool."""

    def __init__(self, gate: PoolGate, weight: int = 1):
        self._gate: PoolGate | None = gate
        self.weight = weight

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate._release(self.weight)


class PoolGate:
    def __init__(
        self,
        name: str,
        *,
        per_replica: int,
        max_queued: int,
        queue_timeout_s: float,
        retry_after_s: int,
        scales_from_zero: bool = False,
        on_wait: Callable[[], None] | None = None,
    ):
        """`on_wait`: called when a request starts waiting, here or (at zero replicas) in Serve:
        the replica count may be stale."""
        self.name = name
        self.per_replica, self.max_queued = per_replica, max_queued
        self.queue_timeout_s, self.retry_after_s = queue_timeout_s, retry_after_s
        self.scales_from_zero = scales_from_zero
        self.running_replicas = 0
        self.in_flight = 0
        self._status_at: float | None = None  # monotonic time of the last replica count
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()  # (grant, weight)
        self._on_wait = on_wait

    @property
    def capacity(self) -> int:
        replicas = self.running_replicas or (1 if self.scales_from_zero else 0)
        return replicas * self.per_replica

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def queued_weight(self) -> int:
        """Places the waiting requests will hold (their sequences)."""
        return sum(weight for waiter, weight in self._waiters if not waiter.done())

    @property
    def cold(self) -> bool:
        """No replica runs; requests let in now wait in Serve for one to start."""
        return self.running_replicas == 0

    @property
    def changing(self) -> bool:
        """Its replica count matters now: requests wait for a slot, or are let in while no
        replica runs (they wait in Serve for one to start)."""
        return bool(self._waiters) or (self.cold and self.in_flight > 0)

    @property
    def status_age_s(self) -> float:
        """Seconds since the replica count was refreshed (inf before the first refresh)."""
        return math.inf if self._status_at is None else time.monotonic() - self._status_at

    def set_replicas(self, running: int) -> None:
        self.running_replicas = running
        self._status_at = time.monotonic()
        if self.capacity == 0:  # the pool went down: waiters may find another pool
            while self._waiters:
                waiter, _ = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(
                        ApiError(
                            503,
                            f"pool {self.name!r} has no running replica; retry later",
                            code="pool_down",
                            retry_after_s=self.retry_after_s,
                            retryable=True,
                        )
                    )
        self._wake()

    def try_enter(self, weight: int = 1) -> Slot | None:
        """A slot of `weight` places now, or None (no waiting): for failover to a pool that was
        not chosen."""
        if self.in_flight + weight <= self.capacity and not self._waiters:
            self.in_flight += weight
            if self.cold and self._on_wait is not None:
                self._on_wait()  # let in to wait in Serve for a replica to start
            return Slot(self, weight)
        return None

    async def enter(self, weight: int = 1) -> Slot:
        slot = self.try_enter(weight)
        if slot is not None:
            return slot
        if len(self._waiters) >= self.max_queued:
            raise ApiError(
                429,
                f"pool {self.name!r} is at capacity ({self.in_flight} in flight, "
                f"{len(self._waiters)} queued); retry later",
                code="pool_queue_full",
                retry_after_s=self.retry_after_s,
            )
        waiter = asyncio.get_running_loop().create_future()
        entry = (waiter, weight)
        self._waiters.append(entry)
        if self._on_wait is not None:
            self._on_wait()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except ApiError:  # the pool went down while we waited
            raise
        except BaseException as error:  # the wait timed out, or the client went away
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(weight)  # granted just as we gave up: pass the places on
            elif entry in self._waiters:
                self._waiters.remove(entry)
                waiter.cancel()
                self._wake()  # a heavy request at the head may have held lighter ones back
            if not isinstance(error, TimeoutError):
                raise
            raise ApiError(
                503,
                f"pool {self.name!r} had no free replica within {self.queue_timeout_s:g}s; "
                "retry later",
                code="pool_timeout",
                retry_after_s=self.retry_after_s,
            ) from None
        return Slot(self, weight)

    def _release(self, weight: int) -> None:
        self.in_flight -= weight
        self._wake()

    def _wake(self) -> None:
        # Granting a waiter moves the places to it (in_flight stays counted); first come,
        # first served: the head waits until its weight fits.
        while self._waiters:
            waiter, weight = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.in_flight + weight > self.capacity:
                break
            self._waiters.popleft()
            self.in_flight += weight
            waiter.set_result(None)
