"""Calls into pools through public Serve APIs only: one cached `DeploymentHandle` per pool
(`options(stream=True)` for `LLMServer.chat` / `completions`, `broadcast` for
`PoolServer.stats`), and `serve.status()` for each pool's running replica count, which sizes
its admission gate."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from cluster.request.admission import PoolGate

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class PoolRef:
    """What the ingress knows about a pool from the config."""

    name: str
    target: str
    role: str
    deployment: str
    max_ongoing_requests: int
    max_queued_requests: int
    queue_timeout_s: float
    scales_from_zero: bool
    max_num_seqs: int
    """Requests one replica's engine runs at once (more wait inside it): the batch the routing
    model caps a prediction at, and beyond which it counts the wait for a slot."""


def running_replicas(replica_states: dict[Any, int]) -> int:
    """RUNNING replicas in `serve.status()`'s `replica_states`. Its keys are `ReplicaState`
    members (a `str` enum) or, once the status has been through serialization, their plain
    string values; `== "RUNNING"` holds for both."""
    return sum(n for state, n in replica_states.items() if state == "RUNNING")


class PoolClient:
    """Handles to every pool, and the gates their replica counts size."""

    def __init__(
        self,
        handles: dict[str, Any],
        pools: list[PoolRef],
        retry_after_s: int,
        app_name: str,
        refresh_s: float,
        idle_refresh_s: float,
    ):
        """`refresh_s`, `idle_refresh_s`: the replica count refresh cadence while counts may
        change and once they are settled (`routing.pool_status_*refresh_s`)."""
        self.pools = {pool.name: pool for pool in pools}
        self._app_name, self._refresh_s, self._idle_refresh_s = app_name, refresh_s, idle_refresh_s
        self._status_wanted = asyncio.Event()  # `refresh_soon` was called: refresh now
        self._handles = handles
        self._streams = {name: handle.options(stream=True) for name, handle in handles.items()}
        self.gates = {
            pool.name: PoolGate(
                pool.name,
                per_replica=pool.max_ongoing_requests,
                max_queued=pool.max_queued_requests,
                queue_timeout_s=pool.queue_timeout_s,
                retry_after_s=retry_after_s,
                scales_from_zero=pool.scales_from_zero,
                on_wait=self.refresh_soon,
            )
            for pool in pools
        }
        self._status_task: asyncio.Task | None = None
        self._status_ready = asyncio.Event()

    def takes(self, pool: str, weight: int) -> bool:
        """A replica of `pool` takes a request of `weight` sequences whole."""
        return weight <= self.pools[pool].max_ongoing_requests

    def most_sequences(self, target: str) -> int:
        """The heaviest request (in sequences) a pool of `target` takes."""
        return max(p.max_ongoing_requests for p in self.pools.values() if p.target == target)

    def call(self, pool: str, method: str, request: Any):
        """`LLMServer.<method>(request)` on one of the pool's replicas, chosen by Serve: a
        `DeploymentResponseGenerator` (async iterator, `.cancel()`)."""
        return getattr(self._streams[pool], method).remote(request)

    async def stats(self, pool: str, timeout_s: float = 10) -> list[dict[str, Any]]:
        """Every running replica's engine signals (`PoolServer.stats`; Serve's broadcast,
        meant for such control-plane calls); a replica that does not answer is left out."""
        if self.gates[pool].cold:
            return []
        try:
            answers = (
                await self._handles[pool]
                .broadcast("stats")
                .results_async(timeout_s=timeout_s, return_exceptions=True)
            )
        except Exception as error:  # replicas starting or gone: report, not fail
            logger.warning("stats of pool %s unavailable: %s", pool, error)
            return []
        for error in (a for a in answers if isinstance(a, BaseException)):
            logger.warning("a replica of pool %s gave no stats: %s", pool, error)
        return [a for a in answers if isinstance(a, dict)]

    async def ready(self) -> None:
        """Replica counts are known (starts the refresh loop on first use)."""
        if self._status_task is None:
            self._status_task = asyncio.create_task(self._refresh())
        await self._status_ready.wait()

    def refresh_soon(self) -> None:
        """The counts may be stale (a request waits, a pool failed a request): refresh them
        now rather than at the idle cadence."""
        self._status_wanted.set()

    async def _refresh(self) -> None:
        """Every `refresh_s` while counts may be changing, else every `idle_refresh_s` or as
        soon as `refresh_soon` is called, never twice within `refresh_s` (`serve.status()` is
        not free: a core's 5% at 1 s on an idle embedded cluster)."""
        from ray import serve

        loop = asyncio.get_running_loop()
        while True:
            self._status_wanted.clear()  # before the call: a wish made during it still counts
            called_at, settled = loop.time(), True
            try:
                status = await asyncio.to_thread(serve.status)
                app = status.applications.get(self._app_name)
                for pool in self.pools.values():
                    deployment = app.deployments.get(pool.deployment) if app else None
                    states = deployment.replica_states if deployment else {}
                    self.gates[pool.name].set_replicas(running_replicas(states))
                    settled = settled and all(state == "RUNNING" for state in states)
            except Exception:
                settled = False
                logger.exception("refreshing pool status failed; keeping the last known counts")
            self._status_ready.set()
            if settled and not any(gate.changing for gate in self.gates.values()):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._status_wanted.wait(), self._idle_refresh_s)
            await asyncio.sleep(max(0.0, called_at + self._refresh_s - loop.time()))
