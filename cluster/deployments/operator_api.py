"""The ingress's health and operator endpoints, apart from the OpenAI API they observe:

- `/healthz` (liveness) and `/readyz` (every target has a pool that is up), keyless for probes;
- `/cluster/pools` and `/cluster/routes` (admin key): each pool's load, engine signals and SLO
  outcomes, and this ingress replica's recent routing decisions.

`operator_endpoints(app)` is a base class of the ingress: `serve.ingress` mounts the routes
of every class in the ingress's MRO. It reads the ingress's state (pools, route log, keys).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from cluster.request.auth import ADMIN
from cluster.request.errors import ApiError
from cluster.slo import Outcome

ROUTE_LOG_SIZE = 10_000
"""Routing decisions each ingress replica keeps for `/cluster/routes` (oldest dropped first)."""


@dataclass(frozen=True)
class RouteRecord:
    """One routing decision, as `/cluster/routes` reports it."""

    request_id: str | None
    target: str
    pool: str
    reason: str
    prompt_tokens: int


def operator_endpoints(app: FastAPI) -> type:
    """The endpoints' class, its routes on `app` (the ingress's own FastAPI app)."""

    class OperatorEndpoints:
        @app.get("/healthz")
        async def healthz(self) -> JSONResponse:
            """Liveness: the ingress answers (no key: probes have none)."""
            return JSONResponse({"status": "ok"})

        @app.get("/readyz")
        async def readyz(self) -> JSONResponse:
            """Readiness: every target has a pool that is up (or wakes on demand)."""
            await self._pools.ready()
            ready = all(
                any(
                    self._load(name).up
                    for (t, _), name in self._pool_of_role.items()
                    if t == target
                )
                for target in self._targets
            )
            pools = {name: self._pool_state(name) for name in self._pools.pools}
            return JSONResponse({"ready": ready, "pools": pools}, status_code=200 if ready else 503)

        def _pool_state(self, name: str) -> dict[str, Any]:
            gate = self._pools.gates[name]
            return {
                "running_replicas": gate.running_replicas, "in_flight": gate.in_flight,
                "queued": gate.queued, "capacity": gate.capacity,
            }  # fmt: skip

        @app.get("/cluster/pools")
        async def pools(self, request: Request) -> JSONResponse:
            """Operators and benchmarks (admin): per pool, its load, the requests this ingress
            replica routed to it, every replica's engine signals (`engines`: cumulative counters
            and the replica's id, one entry per replica that answered) and, with
            an SLO set, this ingress replica's streamed requests by outcome."""
            try:
                self._keys.authorize(request.headers.get("authorization"), ADMIN)
            except ApiError as error:
                return self._reject(error, {})
            await self._pools.ready()
            names = list(self._pools.pools)
            per_pool = await asyncio.gather(*(self._pools.stats(name) for name in names))
            return JSONResponse({
                name: {
                    "role": self._pools.pools[name].role, **self._pool_state(name),
                    "routed": self._routed[name], "engines": engines,
                    **({"slo": {o.value: self._slo_outcomes[name][o.value] for o in Outcome}}
                       if self._slo else {}),
                }
                for name, engines in zip(names, per_pool, strict=True)
            })  # fmt: skip

        @app.get("/cluster/routes")
        async def routes(self, request: Request, request_id_prefix: str = "") -> JSONResponse:
            """Benchmarks and debugging (admin): the last `ROUTE_LOG_SIZE` routing decisions
            of this ingress replica, oldest first, whose request id starts with the prefix."""
            return await self._guarded(request, ADMIN, lambda: [
                asdict(record) for record in self._route_log
                if (record.request_id or "").startswith(request_id_prefix)
            ])  # fmt: skip

    return OperatorEndpoints
