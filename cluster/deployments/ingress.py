"""The OpenAI-compatible ingress: parse, validate, choose a pool, call it, stream back.

`ClusterIngress` is Ray Serve LLM's `OpenAiIngress` with one change in the request path:
instead of one deployment per model id, each target has up to two pools, and every chat or
completion request is routed to one of them by `cluster.routing.choose_pool`. Clients address
the target id; pools are internal. Every routed response carries `x-cluster-pool` and
`x-cluster-route-reason`, the decision is logged, counted and kept for `/cluster/routes`
(by request id), and the request is traced.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import HTTPException, Request
from ray import serve
from ray.llm._internal.common.utils.lora_utils import get_base_model_id
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    ErrorResponse,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.ingress.ingress import (
    DEFAULT_ENDPOINTS,
    OpenAiIngress,
    init,
    make_fastapi_ingress,
)
from ray.llm._internal.serve.core.ingress.middleware import get_request_id
from ray.llm._internal.serve.core.ingress.utils import NON_STREAMING_RESPONSE_TYPES
from ray.serve import metrics
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse, Response

from cluster.config import RoutingConfig, TelemetryConfig
from cluster.routing import Decision, PoolLoad, choose_pool
from cluster.telemetry import TRACER_NAME, RequestTrace, make_tracer_provider

logger = logging.getLogger("ray.serve")

POOL_HEADER = "x-cluster-pool"
REASON_HEADER = "x-cluster-route-reason"
TRACE_HEADER = "x-cluster-trace-id"
ROUTE_LOG_SIZE = 10_000
"""Routing decisions each ingress replica keeps for `/cluster/routes` (oldest dropped first)."""


@dataclass(frozen=True)
class PoolRef:
    """What the ingress knows about a pool from the config."""

    name: str
    target: str
    role: str
    deployment: str


@dataclass(frozen=True)
class RouteRecord:
    """One routing decision, as `/cluster/routes` reports it."""

    request_id: str | None
    target: str
    pool: str
    reason: str
    prompt_tokens: int


class _PoolCall:
    """One request's stay in a pool: counted in flight until `finish`, traced throughout."""

    def __init__(self, in_flight: Counter, pool: PoolRef, decision: Decision, trace: RequestTrace):
        self.pool, self.decision, self.trace = pool, decision, trace
        self._in_flight = in_flight
        in_flight[pool.name] += 1

    @property
    def headers(self) -> dict[str, str]:
        return {
            POOL_HEADER: self.pool.name,
            REASON_HEADER: self.decision.reason.value,
            TRACE_HEADER: self.trace.trace_id,
        }

    def observe(self, item: Any) -> None:
        """Account one item of the pool's output stream (a response, an error or SSE chunks)."""
        if isinstance(item, ErrorResponse):
            self.finish(item.error.message)
            return
        self.trace.first_output()
        if isinstance(item, NON_STREAMING_RESPONSE_TYPES):
            usage = getattr(item, "usage", None)
            self.trace.output_tokens = getattr(usage, "completion_tokens", 0) or 0
            self.finish()
            return
        for chunk in item if isinstance(item, list) else [item]:
            self.trace.output_tokens = _stream_tokens(chunk, self.trace.output_tokens)

    def finish(self, error: BaseException | str | None = None) -> None:
        if not self.trace.finished:
            self._in_flight[self.pool.name] -= 1
            self.trace.finish(error)


def _stream_tokens(chunk: Any, counted: int) -> int:
    """Output tokens after one SSE chunk: the usage block when present, else one per content
    chunk (a lower bound when speculation emits several tokens in one step)."""
    text = chunk if isinstance(chunk, str) else chunk.model_dump_json()
    payload = text.strip().removeprefix("data: ")
    if not payload.startswith("{"):
        return counted
    data = json.loads(payload)
    usage = data.get("usage")
    if usage and usage.get("completion_tokens"):
        return usage["completion_tokens"]
    has_output = any(
        c.get("text") or (c.get("delta") or {}).get("content") for c in data.get("choices", [])
    )
    return counted + 1 if has_output else counted


def openai_error(
    status_code: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""
    error_type = "invalid_request_error" if status_code < 500 else "server_error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}
    return JSONResponse(body, status_code=status_code, headers=headers)


def _error_status_and_message(error: Exception) -> tuple[int, str]:
    if isinstance(error, OpenAIHTTPException):
        return error.status_code, error.message
    if isinstance(error, HTTPException):
        return error.status_code, str(error.detail)
    return 500, "Internal Server Error"


_CURRENT_CALL: contextvars.ContextVar[_PoolCall | None] = contextvars.ContextVar(
    "cluster_pool_call", default=None
)


def _load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # a remote or tokenizer-less source: estimate instead
        logger.warning("no tokenizer at %s (%s); estimating prompt tokens as chars/4", path, error)
        return None


def _prompt_text(body: Any) -> str | list[int]:
    if isinstance(body, ChatCompletionRequest):
        parts = []
        for message in body.messages:
            content = message.get("content") if isinstance(message, dict) else message.content
            if isinstance(content, str):
                parts.append(content)
            elif content:
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = getattr(body, "prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p if isinstance(p, str) else "" for p in prompt)
    return prompt or ""


class ClusterIngress(OpenAiIngress):
    """OpenAI API over pools: chooses a pool per request (rule v1 in `cluster.routing`)."""

    def __init__(
        self,
        pool_handles: dict[str, Any],
        pools: list[PoolRef],
        model_cards: dict[str, Any],
        tokenizers: dict[str, str],
        routing: RoutingConfig,
        telemetry: TelemetryConfig,
        app_name: str,
    ):
        self._pools = {pool.name: pool for pool in pools}
        self._pool_of_role = {(pool.target, pool.role): pool for pool in pools}
        self._pool_handles = {name: h.options(stream=True) for name, h in pool_handles.items()}
        self._stats_handles = pool_handles
        # Requests that bypass routing (embeddings, tokenize, ...) use the throughput pool.
        default_pools = {
            target: (
                self._pool_of_role.get((target, "throughput"))
                or self._pool_of_role[(target, "speculative")]
            )
            for target in model_cards
        }
        super().__init__(
            llm_deployments={t: pool_handles[p.name] for t, p in default_pools.items()},
            model_cards=model_cards,
        )
        self._routing = routing
        self._app_name = app_name
        self._tokenizers = {target: _load_tokenizer(path) for target, path in tokenizers.items()}
        self._tracer = make_tracer_provider(telemetry).get_tracer(TRACER_NAME)
        self._in_flight: Counter = Counter()
        self._routed: Counter = Counter()  # requests this ingress replica sent to each pool
        self._route_log: deque[RouteRecord] = deque(maxlen=ROUTE_LOG_SIZE)
        self._running_replicas: dict[str, int] = {name: 0 for name in self._pools}
        self._status_task: asyncio.Task | None = None
        self._status_ready = asyncio.Event()
        self._decisions = metrics.Counter(
            "cluster_routing_decisions",
            description="Requests routed, by target, pool and reason.",
            tag_keys=("target", "pool", "reason"),
        )

    # -- pool status ---------------------------------------------------------------------------

    async def _refresh_pool_status(self) -> None:
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                app = status.applications.get(self._app_name)
                for pool in self._pools.values():
                    deployment = app.deployments.get(pool.deployment) if app else None
                    states = deployment.replica_states if deployment else {}
                    self._running_replicas[pool.name] = sum(
                        n
                        for state, n in states.items()
                        if str(getattr(state, "value", state)) == "RUNNING"
                    )
            except Exception:
                logger.exception("refreshing pool status failed; keeping the last known counts")
            self._status_ready.set()
            await asyncio.sleep(self._routing.pool_status_refresh_s)

    async def _pool_loads(self) -> dict[str, PoolLoad]:
        if self._status_task is None:
            self._status_task = asyncio.create_task(self._refresh_pool_status())
        await self._status_ready.wait()
        return {
            name: PoolLoad(self._running_replicas[name], self._in_flight[name])
            for name in self._pools
        }

    # -- routing -------------------------------------------------------------------------------

    def _prompt_tokens(self, target: str, body: Any) -> int:
        text = _prompt_text(body)
        if isinstance(text, list):
            return len(text)
        tokenizer = self._tokenizers.get(target)
        if tokenizer is None:
            return len(text) // 4
        return len(tokenizer.encode(text, add_special_tokens=False))

    async def _route(self, target: str, body: Any) -> tuple[PoolRef, Decision, int]:
        prompt_tokens = self._prompt_tokens(target, body)
        loads = await self._pool_loads()
        spec = self._pool_of_role.get((target, "speculative"))
        thr = self._pool_of_role.get((target, "throughput"))
        decision = choose_pool(
            prompt_tokens,
            loads[spec.name] if spec else None,
            loads[thr.name] if thr else None,
            self._routing,
        )
        pool = self._pool_of_role[(target, decision.role)]
        self._routed[pool.name] += 1
        return pool, decision, prompt_tokens

    # -- request path --------------------------------------------------------------------------

    async def _process_llm_request(
        self, body: Any, call_method: str, raw_request: Request | None = None
    ) -> Response:
        target = get_base_model_id(await self._get_model_id(body.model))
        headers = raw_request.headers if raw_request is not None else {}
        trace = RequestTrace(self._tracer, headers, call_method)
        try:
            pool, decision, prompt_tokens = await self._route(target, body)
        except BaseException as error:
            trace.finish(error)
            raise
        trace.record_route(pool.name, decision.reason.value, prompt_tokens)
        self._decisions.inc(
            tags={"target": target, "pool": pool.name, "reason": decision.reason.value}
        )
        request_id = get_request_id(raw_request) if raw_request is not None else None
        self._route_log.append(
            RouteRecord(request_id, target, pool.name, decision.reason.value, prompt_tokens)
        )
        logger.info(
            "route request=%s target=%s pool=%s reason=%s prompt_tokens=%d trace=%s",
            request_id,
            target,
            pool.name,
            decision.reason.value,
            prompt_tokens,
            trace.trace_id,
        )
        call = _PoolCall(self._in_flight, pool, decision, trace)
        token = _CURRENT_CALL.set(call)
        try:
            response = await super()._process_llm_request(body, call_method, raw_request)
        except Exception as error:
            call.finish(error)
            status_code, message = _error_status_and_message(error)
            if status_code >= 500:
                logger.exception("pool %s failed request %s", pool.name, request_id)
            return openai_error(status_code, message, headers=call.headers)
        finally:
            _CURRENT_CALL.reset(token)
        response.headers.update(call.headers)
        return response

    def _get_configured_serve_handle(self, model_id: str):
        call = _CURRENT_CALL.get()
        if call is None:
            return super()._get_configured_serve_handle(model_id)
        return self._pool_handles[call.pool.name]

    async def _get_response(self, *, body: Any, call_method: str, raw_request: Any = None):
        call = _CURRENT_CALL.get()
        stream = super()._get_response(body=body, call_method=call_method, raw_request=raw_request)
        if call is None:
            async for item in stream:
                yield item
            return
        call.trace.start_pool_call(call.pool.name)
        try:
            async for item in stream:
                call.observe(item)
                yield item
        except BaseException as error:  # includes the client going away mid-stream
            call.finish(error)
            raise
        call.finish()

    # -- health --------------------------------------------------------------------------------

    async def healthz(self) -> JSONResponse:
        """Liveness: the ingress answers."""
        return JSONResponse({"status": "ok"})

    async def readyz(self) -> JSONResponse:
        """Readiness: every target has at least one pool with a running replica."""
        loads = await self._pool_loads()
        targets = {pool.target for pool in self._pools.values()}
        ready = all(
            any(loads[p.name].up for p in self._pools.values() if p.target == target)
            for target in targets
        )
        body = {
            "ready": ready,
            "pools": {
                name: {"running_replicas": load.running_replicas, "in_flight": load.in_flight}
                for name, load in loads.items()
            },
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def pools(self) -> JSONResponse:
        """Operators and benchmarks: per pool, its load, the requests this ingress replica
        routed to it, and one replica's engine signals (cumulative speculation counters)."""
        loads = await self._pool_loads()

        async def stats(name: str) -> dict[str, float] | None:
            if not loads[name].up:
                return None
            try:
                return await asyncio.wait_for(self._stats_handles[name].stats.remote(), 10)
            except Exception as error:  # a replica that is starting or gone: report, not fail
                logger.warning("stats of pool %s unavailable: %s", name, error)
                return None

        engine_stats = await asyncio.gather(*(stats(name) for name in self._pools))
        body = {
            name: {
                "role": pool.role,
                "running_replicas": loads[name].running_replicas,
                "in_flight": loads[name].in_flight,
                "routed": self._routed[name],
                "engine": engine,
            }
            for (name, pool), engine in zip(self._pools.items(), engine_stats, strict=True)
        }
        return JSONResponse(body)

    async def routes(self, request_id_prefix: str = "") -> JSONResponse:
        """Benchmarks and debugging: the last `ROUTE_LOG_SIZE` routing decisions of this ingress
        replica, oldest first, whose request id starts with `request_id_prefix`. The id is the
        client's `x-request-id` header when it sends one (vLLM's benchmark client does)."""
        return JSONResponse(
            [
                asdict(record)
                for record in self._route_log
                if (record.request_id or "").startswith(request_id_prefix)
            ]
        )


class _RequireJSON(BaseHTTPMiddleware):
    """POST bodies of the API must be JSON; anything else is a 415 in OpenAI's error shape."""

    async def dispatch(self, request: Request, call_next):
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            content_type = request.headers.get("content-type", "")
            if content_type.split(";")[0].strip().lower() != "application/json":
                return openai_error(
                    415, f"Content-Type must be application/json, got {content_type or 'none'!r}"
                )
        return await call_next(request)


def make_ingress_class(cls: type[ClusterIngress] = ClusterIngress) -> type:
    """The FastAPI-wrapped Serve ingress class: OpenAI routes plus /healthz and /readyz."""
    app = init()
    app.add_middleware(_RequireJSON)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        # FastAPI's default is `{"detail": ...}`; OpenAI clients expect `{"error": {...}}`.
        return openai_error(error.status_code, str(error.detail))

    endpoints = {
        **DEFAULT_ENDPOINTS,
        "healthz": lambda app: app.get("/healthz"),
        "readyz": lambda app: app.get("/readyz"),
        "pools": lambda app: app.get("/cluster/pools"),
        "routes": lambda app: app.get("/cluster/routes"),
    }
    return make_fastapi_ingress(cls, endpoint_map=endpoints, app=app)
