"""OpenTelemetry tracing of the request path.

Each request gets a `cluster.request` span (continuing the caller's W3C `traceparent` when there
is one) with two children: `cluster.route` (the pool choice) and `cluster.pool_call` (the call
into the pool, ended when the last token has been streamed). A retry on another pool before the
first token is a `cluster.failover` event on the request span. Spans are exported over OTLP/HTTP
when `telemetry.otlp_endpoint` is set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cluster.config import TelemetryConfig
from cluster.slo import Outcome, Slo

TRACER_NAME = "cluster.ingress"
_propagator = TraceContextTextMapPropagator()


def make_tracer_provider(
    config: TelemetryConfig, extra_processors: tuple[SpanProcessor, ...] = ()
) -> TracerProvider:
    """A provider exporting to `config.otlp_endpoint` (if set) plus any extra processors."""
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    if config.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=config.export_delay_ms)
        )
    for processor in extra_processors:
        provider.add_span_processor(processor)
    return provider


class RequestTrace:
    """The spans of one request. `finish` is idempotent: streaming, non-streaming and error
    paths all end the spans exactly once, wherever they end."""

    def __init__(self, tracer: trace.Tracer, headers: Mapping[str, str], endpoint: str):
        parent = _propagator.extract(carrier=dict(headers))
        self.root: Span = tracer.start_span(
            "cluster.request",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"cluster.endpoint": endpoint},
        )
        self._tracer = tracer
        self._context = trace.set_span_in_context(self.root, parent)
        self._pool_call: Span | None = None
        self._started = time.monotonic()
        self._first_token_at: float | None = None
        self._finished_at: float | None = None
        self.output_tokens = 0
        self.finished = False

    @property
    def trace_id(self) -> str:
        return format(self.root.get_span_context().trace_id, "032x")

    def child(self, name: str, **attributes) -> Span:
        return self._tracer.start_span(name, context=self._context, attributes=attributes)

    def record_route(self, pool: str, reason: str, prompt_tokens: int) -> None:
        attributes = {
            "cluster.pool": pool,
            "cluster.route_reason": reason,
            "cluster.prompt_tokens": prompt_tokens,
        }
        self.root.set_attributes(attributes)
        span = self.child("cluster.route", **attributes)
        span.end()

    def start_pool_call(self, pool: str) -> None:
        self._pool_call = self.child("cluster.pool_call", **{"cluster.pool": pool})

    def failover(self, pool: str, error: str) -> None:
        self.root.add_event("cluster.failover", {"cluster.pool": pool, "cluster.error": error})

    def first_output(self) -> None:
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()

    def observe_sse(self, text: str) -> None:
        """Count output tokens in streamed SSE text: the usage block when present, else one per
        content chunk (a lower bound when speculation emits several tokens in one step)."""
        self.first_output()
        for event in text.split("\n\n"):
            payload = event.strip().removeprefix("data: ")
            if not payload.startswith("{"):
                continue
            data = json.loads(payload)
            usage = data.get("usage")
            if usage and usage.get("completion_tokens"):
                self.output_tokens = usage["completion_tokens"]
            elif any(
                c.get("text") or (c.get("delta") or {}).get("content")
                for c in data.get("choices", [])
            ):
                self.output_tokens += 1

    @property
    def ttft_s(self) -> float | None:
        """From the request's arrival to its first output (None: no output yet)."""
        if self._first_token_at is None:
            return None
        return self._first_token_at - self._started

    @property
    def decode_s(self) -> float | None:
        """From the first output to the end (None: not finished or no output)."""
        if self._first_token_at is None or self._finished_at is None:
            return None
        return self._finished_at - self._first_token_at

    def finish(
        self, error: BaseException | str | None = None, slo: Slo | None = None
    ) -> Outcome | None:
        """End the spans; with `slo` (a streamed request that ended without error), how it
        fared against it (also the `cluster.slo` attribute). None: not counted, or finished
        already."""
        if self.finished:
            return None
        self.finished = True
        self._finished_at = time.monotonic()
        attributes: dict[str, float | int | str] = {"cluster.output_tokens": self.output_tokens}
        outcome = None
        if self.ttft_s is not None:
            attributes["cluster.ttft_ms"] = self.ttft_s * 1000
            if slo is not None and error is None:
                outcome = slo.outcome(self.ttft_s, self.output_tokens, self.decode_s or 0.0)
                attributes["cluster.slo"] = outcome.value
        for span in (self._pool_call, self.root):
            if span is None:
                continue
            span.set_attributes(attributes)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, str(error)))
                if isinstance(error, BaseException):
                    span.record_exception(error)
            span.end()
        return outcome
