"""The OpenAI-compatible ingress: our own FastAPI app as a Serve deployment, wiring the
request path's modules together in the order a request meets them:

    auth -> protocol (read, parse, validate, count tokens) -> routing.choose_pool
    -> admission (the pool's gate) -> streaming.start (dispatch + failover) -> response

Clients address the target id; pools are internal. Every routed response carries
`x-cluster-pool`, `x-cluster-route-reason` and `x-cluster-trace-id`; the decision is logged
(with the caller's key name, never the key), counted, kept for `/cluster/routes` and traced.
The health and operator endpoints live in `operator_api` (a base class of the ingress).
Only public Ray APIs are used: `serve.ingress`, `DeploymentHandle` calls of `LLMServer.chat` /
`completions`, `serve.status`, `ray.serve.metrics` and `ray.serve.llm`'s request models.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from ray import serve
from ray.serve import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.signals import ingress_queue_metric
from cluster.config import RoutingConfig, ServerConfig, TelemetryConfig
from cluster.deployments.operator_api import ROUTE_LOG_SIZE, RouteRecord, operator_endpoints
from cluster.request import protocol, streaming
from cluster.request.admission import Slot
from cluster.request.auth import INFERENCE, KeyStore
from cluster.request.dispatch import PoolClient, PoolRef
from cluster.request.errors import ApiError
from cluster.routing import PoolLoad, RequestFeatures, choose_pool
from cluster.slo import Outcome, Slo
from cluster.telemetry import TRACER_NAME, RequestTrace, make_tracer_provider

logger = logging.getLogger("ray.serve")

POOL_HEADER = "x-cluster-pool"
REASON_HEADER = "x-cluster-route-reason"
TRACE_HEADER = "x-cluster-trace-id"
REQUEST_ID_HEADER = "x-request-id"
CLIENT_REQUEST_ID = re.compile(r"[!-~]{1,128}")
"""A client's `x-request-id` that is echoed and logged as is (visible ASCII, no spaces, at most
128 characters); any other gets a new id (it goes into a response header, every log line, where
a space would start a forged field, and the route log's memory)."""


def client_request_id(header: str | None) -> str:
    """The client's request id when it is a plain one (`CLIENT_REQUEST_ID`), else a new one."""
    if header is not None and CLIENT_REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


@dataclass(frozen=True)
class TargetRef:
    """What the ingress knows about a target from the config."""

    id: str
    tokenizer: str | None
    """Local tokenizer directory; None: prompt tokens are estimated as chars / 4."""
    max_model_len: int | None
    content_part_types: list[str] = field(default_factory=lambda: ["text"])


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # a remote or tokenizer-less source: estimate instead
        logger.warning("no tokenizer at %s (%s); estimating prompt tokens as chars/4", path, error)
        return None


INLINE_PARSE_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (a thread hop costs more than they do);
larger ones in a thread, so one large request does not stall every stream of the replica."""


def make_app(server: ServerConfig) -> FastAPI:
    """The FastAPI app: no CORS unless origins are listed; every error in OpenAI's shape."""
    app = FastAPI(title="cluster", docs_url=None, redoc_url=None, openapi_url=None)
    if server.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=server.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", REQUEST_ID_HEADER],
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception) -> JSONResponse:
        logger.exception("ingress error on %s", request.url.path)
        return ApiError(500, "internal error in the ingress").response()

    return app


def ingress_class(server: ServerConfig) -> type:
    """The Serve ingress class over `make_app(server)` (built per config: CORS is app-level)."""
    app = make_app(server)

    @serve.ingress(app)
    class ClusterIngress(operator_endpoints(app)):
        """OpenAI API over pools."""

        def __init__(
            self,
            pool_handles: dict[str, Any],
            pools: list[PoolRef],
            targets: list[TargetRef],
            server: ServerConfig,
            keys_file: str | None,
            routing: RoutingConfig,
            telemetry: TelemetryConfig,
            app_name: str,
            profile: str | None = None,
        ):
            self._server, self._routing = server, routing
            self._keys = KeyStore.load(server.auth, keys_file)
            if not self._keys.required:
                logger.warning("API keys are off: anyone who can reach %s can call the API",
                               server.host)  # fmt: skip
            self._pools = PoolClient(
                pool_handles,
                pools,
                server.retry_after_s,
                app_name,
                routing.pool_status_refresh_s,
                routing.pool_status_idle_refresh_s,
            )
            self._targets = {t.id: t for t in targets}
            self._encoders = {t.id: _load_tokenizer(t.tokenizer) for t in targets}
            self._pool_of_role = {(p.target, p.role): p.name for p in pools}
            # The calibrated model (absolute path from the app builder); None: rule v1.
            self._model = PerformanceModel.load(profile) if profile else None
            self._tracer = make_tracer_provider(telemetry).get_tracer(TRACER_NAME)
            self._created = int(time.time())
            self._routed: Counter = Counter()  # requests this ingress replica sent to each pool
            self._route_log: deque[RouteRecord] = deque(maxlen=ROUTE_LOG_SIZE)
            self._decisions = metrics.Counter(
                "cluster_routing_decisions",
                description="Requests routed, by target, pool and reason.",
                tag_keys=("target", "pool", "reason"),
            )
            self._rejections = metrics.Counter(
                "cluster_rejections",
                description="Requests answered with an error, by HTTP status.",
                tag_keys=("status",),
            )
            self._failovers = metrics.Counter(
                "cluster_failovers",
                description="Retries on another attempt before the first token, by failed pool.",
                tag_keys=("pool",),
            )
            # Streamed requests against the config's objectives, as the client saw them.
            self._slo = Slo.from_routing(routing)
            self._slo_outcomes: dict[str, Counter] = {name: Counter() for name in self._pools.pools}
            self._slo_requests = metrics.Counter(
                "cluster_slo_requests",
                description="Streamed requests by target, pool and outcome against the SLO "
                "(met, ttft, tpot: the first objective missed).",
                tag_keys=("target", "pool", "outcome"),
            )

        # -- the OpenAI API --------------------------------------------------------------------

        @app.post("/v1/chat/completions")
        async def chat(self, request: Request) -> Response:
            return await self._generate(request, "chat")

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            return await self._generate(request, "completions")

        @app.get("/v1/models")
        async def models(self, request: Request) -> Response:
            return await self._guarded(request, INFERENCE, lambda: {
                "object": "list", "data": [self._card(t) for t in self._targets],
            })  # fmt: skip

        @app.get("/v1/models/{model_id:path}")
        async def model(self, model_id: str, request: Request) -> Response:
            return await self._guarded(request, INFERENCE, lambda: self._card(
                self._target(model_id).id
            ))  # fmt: skip

        async def _generate(self, request: Request, kind: str) -> Response:
            request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
            headers = {REQUEST_ID_HEADER: request_id}
            try:
                key_name = self._keys.authorize(request.headers.get("authorization"), INFERENCE)
                body, target, prompt_tokens, weight = await self._read(request, kind)
            except ApiError as error:
                return self._reject(error, headers)
            trace = RequestTrace(self._tracer, request.headers, kind)
            pool, reason, explained = await self._route(target.id, body, prompt_tokens, weight)
            trace.record_route(pool, explained, prompt_tokens)
            headers.update({POOL_HEADER: pool, REASON_HEADER: explained,
                            TRACE_HEADER: trace.trace_id})  # fmt: skip
            self._record(request_id, target.id, pool, reason, prompt_tokens, key_name, trace)
            other = self._other_pool(pool, weight)
            try:
                pool, slot = await self._admit(pool, other, weight)
                headers[POOL_HEADER] = pool  # a spill: errors from here on are that pool's
                trace.start_pool_call(pool)
                started = await streaming.start(
                    streaming.attempt_order(
                        pool, self._other_pool(pool, weight), self._server.max_attempts
                    ),
                    slot,
                    self._pools.gates,
                    lambda name: self._pools.call(name, kind, body),
                    lambda name, error: self._failover(trace, request_id, name, error),
                )
            except ApiError as error:
                trace.finish(error.message)
                return self._reject(error, headers)
            headers[POOL_HEADER] = started.pool  # the pool that answered, after any failover
            if not getattr(body, "stream", False):
                started.slot.release()
                usage = getattr(started.first, "usage", None)
                trace.output_tokens = getattr(usage, "completion_tokens", 0) or 0
                trace.first_output()
                trace.finish()
                return JSONResponse(started.first.model_dump(), headers=headers)
            return streaming.StreamedAnswer(
                started,
                self._server.retry_after_s,
                trace.observe_sse,
                lambda error: self._finished(trace, target.id, started.pool, error),
                headers,
            )

        async def record_autoscaling_stats(self) -> dict[str, float]:
            """Sequences waiting at this replica's gates (`n` for each prompt of a request,
            as the engines count them), per pool deployment, for the
            application-level autoscaling policy: the queue a pool's own replicas cannot report.
            Serve pushes it only where the ingress has an autoscaling config (`app.
            ingress_options`, with an app policy) and disables it for good after one result
            that is not a dict of numbers: plain counts cannot be anything else."""
            return {
                ingress_queue_metric(ref.deployment): float(self._pools.gates[name].queued_weight)
                for name, ref in self._pools.pools.items()
            }

        def _finished(self, trace: RequestTrace, target: str, pool: str, error) -> None:
            """End a streamed request's trace and count it against the SLO, if one is set (not
            when the client left)."""
            if error == streaming.CLIENT_LEFT:
                trace.finish()
                return
            outcome: Outcome | None = trace.finish(error, self._slo)
            if outcome is not None:
                self._slo_outcomes[pool][outcome.value] += 1
                self._slo_requests.inc(tags={"target": target, "pool": pool,
                                             "outcome": outcome.value})  # fmt: skip

        def _other_pool(self, pool: str, weight: int) -> str | None:
            """The target's other pool, if its replicas take a request of `weight`."""
            ref = self._pools.pools[pool]
            other_role = "throughput" if ref.role == "speculative" else "speculative"
            other = self._pool_of_role.get((ref.target, other_role))
            return other if other and self._pools.takes(other, weight) else None

        async def _admit(self, pool: str, other: str | None, weight: int) -> tuple[str, Slot]:
            """A slot of `weight` places (the request's sequences) in the chosen pool; when it
            is full (or goes down while we wait), one in the target's other pool; else the
            chosen pool's answer (429/503)."""
            gates = self._pools.gates
            slot = gates[pool].try_enter(weight)
            if slot is None and other is not None and self._load(other).up:
                spill = gates[other].try_enter(weight)
                if spill is not None:
                    return other, spill
            if slot is not None:
                return pool, slot
            try:
                return pool, await gates[pool].enter(weight)
            except ApiError as error:
                if not error.retryable or other is None:
                    raise
                return other, await gates[other].enter(weight)

        async def _read(self, request: Request, kind: str):
            """Body -> (request model, target, prompt tokens, sequences); any problem is an
            ApiError."""
            raw = await protocol.read_body(
                request.stream(), request.headers.get("content-length"),
                self._server.max_body_bytes,
            )  # fmt: skip
            parse = (raw, request.headers.get("content-type"), kind, self._server.max_json_depth)
            if len(raw) > INLINE_PARSE_BYTES:  # the depth scan takes ~30 ms a MiB: off the loop
                data = await asyncio.to_thread(protocol.parse, *parse)
            else:
                data = protocol.parse(*parse)
            target = self._target(data.get("model"))
            data["model"] = target.id
            protocol.check_fields(data, kind, target.content_part_types)
            body = protocol.validate(data, kind)
            encoder = self._encoders[target.id]
            encode = (
                (lambda text: encoder.encode(text, add_special_tokens=False)) if encoder else None
            )
            prompt_tokens = await asyncio.to_thread(
                protocol.count_tokens, protocol.prompt_text(body), encode
            )
            protocol.check_context(prompt_tokens, target.max_model_len)
            weight = protocol.check_sequences(body, self._pools.most_sequences(target.id))
            return body, target, prompt_tokens, weight

        def _target(self, model: Any) -> TargetRef:
            if model is None and len(self._targets) == 1:
                return next(iter(self._targets.values()))
            if not isinstance(model, str):
                raise ApiError(400, "model: must be a string", param="model")
            if model not in self._targets:
                raise ApiError(
                    404, f"The model {model!r} does not exist (available: "
                    f"{', '.join(self._targets)})", param="model", code="model_not_found",
                )  # fmt: skip
            return self._targets[model]

        async def _route(
            self, target: str, body: Any, prompt_tokens: int, weight: int
        ) -> tuple[str, str, str]:
            """(pool, reason, reason with the predicted rates for the header and trace), among
            the target's pools whose replicas take the request's `weight`."""
            await self._pools.ready()
            loads = {name: self._load(name) for (t, _), name in self._pool_of_role.items()
                     if t == target and self._pools.takes(name, weight)}  # fmt: skip
            request = RequestFeatures(prompt_tokens, protocol.routed_max_tokens(body))
            decision = choose_pool(request, loads, self._model, self._routing)
            self._routed[decision.pool] += 1
            return decision.pool, decision.reason.value, decision.header

        def _load(self, pool: str) -> PoolLoad:
            gate, ref = self._pools.gates[pool], self._pools.pools[pool]
            return PoolLoad(
                ref.role, gate.running_replicas, gate.in_flight + gate.queued_weight,
                gate.scales_from_zero,
                stats_age_s=gate.status_age_s,
                max_batch=min(gate.per_replica, ref.max_num_seqs),
            )  # fmt: skip

        def _record(self, request_id, target, pool, reason, prompt_tokens, key_name, trace):
            self._decisions.inc(tags={"target": target, "pool": pool, "reason": reason})
            self._route_log.append(RouteRecord(request_id, target, pool, reason, prompt_tokens))
            logger.info(
                "route request=%s key=%s target=%s pool=%s reason=%s prompt_tokens=%d trace=%s",
                request_id, key_name, target, pool, reason, prompt_tokens, trace.trace_id,
            )  # fmt: skip

        def _failover(self, trace: RequestTrace, request_id: str, pool: str, error: ApiError):
            self._failovers.inc(tags={"pool": pool})
            self._pools.refresh_soon()  # a replica may be gone: its gate's capacity with it
            trace.failover(pool, error.message)
            logger.warning("failover request=%s pool=%s error=%s", request_id, pool, error.message)

        def _reject(self, error: ApiError, headers: dict[str, str]) -> JSONResponse:
            self._rejections.inc(tags={"status": str(error.status)})
            return error.response(headers)

        def _card(self, target: str) -> dict[str, Any]:
            return {
                "id": target, "object": "model", "created": self._created, "owned_by": "cluster",
                "max_model_len": self._targets[target].max_model_len,
            }  # fmt: skip

        async def _guarded(self, request: Request, scope: str, answer) -> JSONResponse:
            try:
                self._keys.authorize(request.headers.get("authorization"), scope)
                return JSONResponse(answer())
            except ApiError as error:
                return self._reject(error, {})

    return ClusterIngress
