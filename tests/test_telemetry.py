"""Span tree of one request, with OpenTelemetry's in-memory exporter."""

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.config import TelemetryConfig
from cluster.telemetry import TRACER_NAME, RequestTrace, make_tracer_provider


def _tracer():
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(TelemetryConfig(), (SimpleSpanProcessor(exporter),))
    return provider.get_tracer(TRACER_NAME), exporter


def test_span_tree_is_request_route_pool_call(monkeypatch):
    tracer, exporter = _tracer()
    clock = iter([100.0, 100.25])  # request start, first output token
    monkeypatch.setattr("cluster.telemetry.time.monotonic", lambda: next(clock))
    trace = RequestTrace(tracer, {}, "chat")
    trace.record_route("speculative", "long_context", 2048)
    trace.start_pool_call("speculative")
    trace.first_output()
    trace.output_tokens = 17
    trace.finish()
    trace.finish()  # idempotent

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"cluster.request", "cluster.route", "cluster.pool_call"}
    root = spans["cluster.request"]
    assert root.parent is None
    for child in ("cluster.route", "cluster.pool_call"):
        assert spans[child].parent.span_id == root.context.span_id
        assert spans[child].context.trace_id == root.context.trace_id
    assert spans["cluster.route"].attributes["cluster.route_reason"] == "long_context"
    assert spans["cluster.route"].attributes["cluster.prompt_tokens"] == 2048
    assert spans["cluster.pool_call"].attributes["cluster.output_tokens"] == 17
    assert spans["cluster.pool_call"].attributes["cluster.ttft_ms"] == 250.0


def test_incoming_traceparent_is_continued():
    tracer, exporter = _tracer()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    trace = RequestTrace(tracer, headers, "completions")
    assert trace.trace_id == trace_id
    trace.finish("boom")
    (root,) = exporter.get_finished_spans()
    assert root.parent.span_id == int("00f067aa0ba902b7", 16)
    assert not root.status.is_ok
