"""Span tree of one request, with OpenTelemetry's in-memory exporter, and how the request
counts against the SLO."""

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.config import RoutingConfig, TelemetryConfig
from cluster.slo import Outcome, Slo
from cluster.telemetry import TRACER_NAME, RequestTrace, make_tracer_provider


def _tracer():
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(TelemetryConfig(), (SimpleSpanProcessor(exporter),))
    return provider.get_tracer(TRACER_NAME), exporter


def test_span_tree_is_request_route_pool_call(monkeypatch):
    tracer, exporter = _tracer()
    clock = iter([100.0, 100.25, 101.0])  # request start, first output token, end
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
    assert "cluster.slo" not in spans["cluster.request"].attributes  # no SLO given


# First token 0.25 s after arrival, then 10 tokens over 0.5 s: 20 tok/s.
@pytest.mark.parametrize(
    ("slo", "expected"),
    [
        (Slo(ttft_s=0.3, per_user_tok_s=19), Outcome.MET),
        (Slo(ttft_s=0.25, per_user_tok_s=20), Outcome.MET),  # at the objective is within it
        (Slo(ttft_s=0.2, per_user_tok_s=1), Outcome.TTFT),
        (Slo(ttft_s=0.2, per_user_tok_s=100), Outcome.TTFT),  # the first objective missed
        (Slo(ttft_s=1, per_user_tok_s=21), Outcome.TPOT),
        (Slo(per_user_tok_s=21), Outcome.TPOT),
        (Slo(ttft_s=0.2), Outcome.TTFT),
    ],
)
def test_a_streamed_request_is_counted_against_the_slo(monkeypatch, slo, expected):
    tracer, exporter = _tracer()
    clock = iter([100.0, 100.25, 100.75])
    monkeypatch.setattr("cluster.telemetry.time.monotonic", lambda: next(clock))
    trace = RequestTrace(tracer, {}, "chat")
    trace.first_output()
    trace.output_tokens = 10
    assert trace.finish(None, slo) is expected
    assert trace.finish(None, slo) is None  # counted once
    (root,) = exporter.get_finished_spans()
    assert root.attributes["cluster.slo"] == expected.value


def test_a_failed_or_silent_request_is_not_counted(monkeypatch):
    tracer, _ = _tracer()
    slo = Slo(ttft_s=1, per_user_tok_s=1)
    failed = RequestTrace(tracer, {}, "chat")
    failed.first_output()
    assert failed.finish("the pool failed mid-stream", slo) is None
    assert RequestTrace(tracer, {}, "chat").finish(None, slo) is None  # no output at all


def test_the_slo_is_the_routing_config_s():
    assert Slo.from_routing(RoutingConfig()) is None
    slo = Slo.from_routing(RoutingConfig(ttft_slo_s=5, tpot_slo_s=0.05))
    assert slo.ttft_s == 5 and slo.per_user_tok_s == pytest.approx(20)
    assert Slo.from_routing(RoutingConfig(tpot_slo_s=0.1)).ttft_s is None


def test_a_single_token_has_no_rate_to_miss():
    assert Slo(ttft_s=1, per_user_tok_s=1e9).outcome(0.5, 1, 0.0) is Outcome.MET


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
