"""The simulator (`cluster simulate`): trace generation, the simulated cluster against the
performance model, Serve's default policy and delays, the strategies, and the CLI end to end on
a small trace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

from cluster.autoscale.model import PerformanceModel
from cluster.cli import main
from cluster.config import ConfigError, load_config
from cluster.simulate import sweep as sweep_module
from cluster.simulate import trace
from cluster.simulate.engine import (
    CONTEXT_BUCKET_TOKENS,
    PoolSetup,
    Simulation,
    Strategy,
    ray_default_replicas,
)
from cluster.simulate.hardware import HardwareScale, lift_by_concurrency, scaled_model
from cluster.simulate.result import SimulationResult
from cluster.simulate.strategies import OURS, static_splits, strategies
from cluster.simulate.sweep import at_budget, ours_against_static
from cluster.slo import Slo
from tests.test_ray_policy import context as ray_context
from tests.test_ray_policy import engine as engine_stats
from tests.test_ray_policy import replica

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "configs" / "profiles" / "embedded.yaml"
KIMI = ROOT / "configs" / "kimi-k2.6-nvfp4-p6-b200.yaml"
KIMI_SCALE = ROOT / "configs" / "profiles" / "kimi-k2.6-nvfp4-p6-b200.scale.yaml"
KIMI_BASE = ROOT / "configs" / "profiles" / "embedded-two-core.yaml"
"""The profile the Kimi scale carries over (its `profile` field)."""
SLO = Slo(ttft_s=5.0, per_user_tok_s=5.0)


def spec(**overrides) -> trace.TraceSpec:
    data = {
        "seed": 7, "duration_s": 600, "peak_rate_per_s": 2.0, "trough_rate_per_s": 0.2,
        "peak_hour": 12, "kinds": [
            {"name": "chat", "share": 3, "prompt_tokens_median": 200, "output_tokens_median": 60},
            {"name": "code", "share": 1, "prompt_tokens_median": 1500, "output_tokens_median": 100},
        ],
    }  # fmt: skip
    return trace.TraceSpec.model_validate(data | overrides)


def pool(name="throughput", role="throughput", replicas=1, **overrides) -> PoolSetup:
    values = {
        "name": name, "role": role, "min_replicas": replicas, "max_replicas": replicas,
        "max_batch": 8, "max_queued": 16, "queue_timeout_s": 30.0, "gpus_per_replica": 1,
        "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "target_ongoing_requests": 4.0,
    }  # fmt: skip
    return PoolSetup(**(values | overrides))


@pytest.fixture(scope="module")
def model() -> PerformanceModel:
    return PerformanceModel.load(PROFILE)


def test_a_spec_and_its_seed_are_one_trace():
    first, again = trace.generate(spec()), trace.generate(spec())
    assert first == again and len(first) > 50
    assert trace.generate(spec(seed=8)) != first
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(first, first[1:], strict=False))
    assert {r.kind for r in first} == {"chat", "code"}


def test_rate_curve_peaks_at_its_hour_and_bursts_add():
    s = spec(bursts=[{"start_h": 0, "duration_min": 60, "extra_rate_per_s": 5}])
    assert s.rate_at(300) == pytest.approx(2.0)  # hour 12 of a 600 s day
    assert s.rate_at(0) == pytest.approx(0.2 + 5)  # the trough, plus the burst
    assert s.rate_at(100) < s.rate_at(300)


def test_jsonl_round_trip_and_bad_lines(tmp_path):
    requests = trace.generate(spec())
    trace.write(requests, tmp_path / "t.jsonl")
    assert trace.load(tmp_path / "t.jsonl") == requests
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a trace request"):
        trace.load(tmp_path / "bad.jsonl")


def test_bad_spec_names_file_and_field(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("peak_rate_per_s: -1\ntrough_rate_per_s: 0\nkinds: []\n")
    with pytest.raises(ConfigError, match=r"spec.yaml: peak_rate_per_s: "):
        trace.TraceSpec.load(path)


def test_a_lone_request_runs_at_the_models_rate(model):
    request = trace.TraceRequest(arrival_s=0.0, kind="chat", prompt_tokens=512, output_tokens=200)
    strategy = Strategy("one", (pool(),), routing=load_config(KIMI).routing, routing_model=None)
    result = Simulation(strategy, model.pools, SLO, step_s=0.1).run([request])
    throughput = model.pools["throughput"]
    rate = throughput.per_user_rate(1, round(512 / CONTEXT_BUCKET_TOKENS) * CONTEXT_BUCKET_TOKENS)
    assert result.completed == 1 and result.rejected == 0
    assert result.per_user_tok_s["p50"] == pytest.approx(rate, rel=0.02)
    assert result.ttft_s["p50"] == pytest.approx(throughput.ttft_s(1, 512), rel=0.01)


def test_every_request_is_served_or_rejected_and_overload_rejects(model):
    requests = trace.generate(spec(peak_rate_per_s=20.0, trough_rate_per_s=20.0))
    strategy = Strategy("small", (pool(max_queued=4),), load_config(KIMI).routing, None)
    result = Simulation(strategy, model.pools, SLO).run(requests)
    assert result.completed + result.rejected == result.requests == len(requests)
    assert result.rejected > 0  # 20/s on one replica of 8 slots and a queue of 4
    assert 0 <= result.slo_attainment < 1


def test_serve_delays_gate_a_scale_up(model):
    requests = [trace.TraceRequest(float(t) / 10, "chat", 200, 400) for t in range(600)]
    changes = []
    for delay in (0.0, 40.0):
        setup = pool(replicas=1, max_replicas=4, upscale_delay_s=delay)
        strategy = Strategy("scaling", (setup,), load_config(KIMI).routing, None)
        simulation = Simulation(strategy, model.pools, SLO, replica_start_s=5.0)
        simulation.on_decision = lambda now, name, before, after, d=delay: changes.append(
            (d, now, before, after)
        )
        simulation.run(requests)
    first_up = {d: min(now for dd, now, b, a in changes if dd == d and a > b) for d in (0.0, 40.0)}
    assert first_up[40.0] >= first_up[0.0] + 40


def test_ray_default_matches_rays_own_policy():
    # Ray's default policy on its own context: ongoing requests / target per replica.
    for ongoing, current in ((12.0, 1), (3.0, 2), (40.0, 4)):
        stats = {replica(f"r{i}"): engine_stats(0) for i in range(current)}
        ctx = ray_context(stats, total_num_requests=ongoing)
        ctx.config.target_ongoing_requests = 2.0
        theirs, _ = replica_queue_length_autoscaling_policy(ctx)
        assert ray_default_replicas(ongoing, 2.0) == pytest.approx(theirs)


def test_strategies_share_one_budget():
    config = load_config(KIMI)
    model = scaled_model(
        PerformanceModel.load(KIMI_BASE),
        HardwareScale.load(KIMI_SCALE),
        {"speculative": "speculative", "throughput": "throughput"},
    )
    made = strategies(config, model, Slo(5, 20), budget=4)
    names = [s.name for s in made]
    assert names == [OURS, "ray_default_static_1", "ray_default_static_2",
                     "ray_default_static_3", "all_speculative", "all_throughput"]  # fmt: skip
    for s in made[1:4]:
        assert sum(p.max_replicas for p in s.pools) == 4
    assert made[0].budget == 4 and made[0].routing_model is model
    assert all(p.gpus_per_replica == 8 for s in made for p in s.pools)


def test_scaled_model_keeps_the_anchors():
    scale = HardwareScale.load(KIMI_SCALE)
    roles = {"speculative": "speculative", "throughput": "throughput"}
    assert Path(scale.profile).resolve() == KIMI_BASE  # resolved next to the scale file
    model = scaled_model(PerformanceModel.load(scale.profile), scale, roles)
    context = 1000
    assert model.pools["throughput"].per_user_rate(1, context) == pytest.approx(
        scale.single_stream_tok_s
    )
    assert lift_by_concurrency(model, roles, [1], context)[1] == pytest.approx(
        scale.speculative_lift_at_1, rel=1e-3
    )
    # Up to batch_scale requests cost what one costs on the profile's machine.
    assert model.pools["throughput"].per_user_rate(scale.batch_scale, context) == pytest.approx(
        scale.single_stream_tok_s
    )
    assert model.pools["throughput"].ttft_s(1, context) == pytest.approx(scale.ttft_1k_s)


def test_cli_writes_results_and_the_summary_block(tmp_path):
    trace_spec = tmp_path / "trace.yaml"
    trace_spec.write_text(
        json.dumps(spec(duration_s=1200, peak_rate_per_s=6, trough_rate_per_s=1).model_dump())
    )
    summary = tmp_path / "routing_summary.json"
    summary.write_text(json.dumps({"points": [{"kept": True}]}))
    code = main([
        "simulate", str(KIMI), "--trace", str(trace_spec), "--hardware", str(KIMI_SCALE),
        "--budget", "3", "--warmup-s", "300", "--replica-start-s", "60",
        "--out", str(tmp_path / "out"), "--summary", str(summary),
        "--write-trace", str(tmp_path / "trace.jsonl"),
    ])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert [s["strategy"] for s in result["strategies"]][0] == OURS
    assert Path(result["profile"]).resolve() == KIMI_BASE  # the scale file's, not the preset's
    assert result["best_static"].startswith("ray_default_static_")
    assert (tmp_path / "out" / "replicas.png").stat().st_size > 10_000
    document = json.loads(summary.read_text())
    assert document["points"] == [{"kept": True}]  # the live part of the file survives
    block = document["simulation"]
    for key in ("gpu_hours_ours", "gpu_hours_ray_default", "slo_attainment_ours",
                "slo_attainment_ray_default"):  # fmt: skip
        assert isinstance(block[key], float) and math.isfinite(block[key])
    assert len(trace.load(tmp_path / "trace.jsonl")) == len(trace.load(trace_spec))


def test_a_scaled_spec_carries_the_traffic_of_a_larger_cluster():
    base = spec(
        duration_s=1200, bursts=[{"start_h": 12, "duration_min": 120, "extra_rate_per_s": 1}]
    )
    double = base.scaled(2)
    for t in (0, 300, 600, 900):
        assert double.rate_at(t) == pytest.approx(2 * base.rate_at(t))
    ratio = len(trace.generate(double)) / len(trace.generate(base))
    assert 1.8 < ratio < 2.2
    assert double.kinds == base.kinds and base.peak_rate_per_s == 2.0  # the original is kept


def test_static_splits_and_pools_grow_with_the_budget():
    assert static_splits(4) == [1, 2, 3] and len(static_splits(8)) == 7
    assert static_splits(64) == [8, 16, 24, 32, 40, 48, 56]
    config = at_budget(load_config(KIMI), 64)
    assert {p.autoscaling.max_replicas for p in config.pools} == {63}
    assert at_budget(load_config(KIMI), 8).pools == load_config(KIMI).pools  # the preset's own


def test_sweep_scales_trace_and_budget_together(tmp_path):
    trace_spec = tmp_path / "trace.yaml"
    trace_spec.write_text(
        json.dumps(spec(duration_s=900, peak_rate_per_s=4, trough_rate_per_s=1).model_dump())
    )
    summary = tmp_path / "routing_summary.json"
    code = main([
        "simulate", str(KIMI), "--trace", str(trace_spec), "--hardware", str(KIMI_SCALE),
        "--budget", "2", "--sweep", "2,4", "--warmup-s", "120", "--replica-start-s", "60",
        "--seeds", "2",
        "--out", str(tmp_path / "out"), "--summary", str(summary),
    ])  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "out" / "sweep.json").read_text())["rows"]
    assert [(r["budget_replicas"], r["gpus"]) for r in rows] == [(2, 16), (4, 32)]
    assert 1.6 < rows[1]["requests"] / rows[0]["requests"] < 2.4
    for row in rows:
        assert row["ray_default_split"] in row["strategies"]
        assert [t["seed"] for t in row["traces"]] == [7, 8]
        assert row["gpu_hours_ratio"] == pytest.approx(
            row["gpu_hours_ours"] / row["gpu_hours_ray_default"], abs=1e-3
        )
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
    block = json.loads(summary.read_text())["simulation_sweep"]
    assert [b["gpus"] for b in block] == [16, 32]


def test_a_baseline_sweep_gives_the_same_rows_running_ours_alone(tmp_path, capsys, monkeypatch):
    ran: list[str] = []

    class Counted(sweep_module.Simulation):  # the real simulation, each run's strategy noted
        def run(self, requests):
            ran.append(self.strategy.name)
            return super().run(requests)

    monkeypatch.setattr(sweep_module, "Simulation", Counted)
    trace_spec = tmp_path / "trace.yaml"
    trace_spec.write_text(
        json.dumps(spec(duration_s=900, peak_rate_per_s=4, trough_rate_per_s=1).model_dump())
    )
    args = [
        "simulate", str(KIMI), "--trace", str(trace_spec), "--hardware", str(KIMI_SCALE),
        "--budget", "2", "--sweep", "2,4", "--warmup-s", "120", "--replica-start-s", "60",
        "--seeds", "2", "--summary", "",
    ]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "full")]) == 0
    full = tmp_path / "full" / "sweep.json"
    assert ran.count(OURS) == 4 and len(set(ran)) > 4  # every strategy, 2 budgets x 2 traces
    ran.clear()
    assert main([*args, "--out", str(tmp_path / "reused"), "--baseline", str(full)]) == 0
    assert ran == [OURS] * 4
    reused = json.loads((tmp_path / "reused" / "sweep.json").read_text())["rows"]
    assert reused == json.loads(full.read_text())["rows"]  # the simulator is deterministic
    # Other settings, other numbers for every strategy: the baseline does not apply.
    changed = [*args, "--out", str(tmp_path / "x"), "--baseline", str(full)]
    changed[changed.index("--replica-start-s") + 1] = "90"
    assert main(changed) == 2
    assert "baseline: no row for 2 replicas" in capsys.readouterr().err


def _result(strategy: str, gpu_hours: float, slo_attainment: float) -> SimulationResult:
    return SimulationResult(strategy, 100, 100, 0, gpu_hours, slo_attainment, {}, {}, {}, [])


def test_the_baseline_fingerprint_is_canonical_data():
    from cluster.simulate.sweep import _canonical

    slo = Slo(5.0, 20.0)
    assert _canonical(slo) == _canonical(Slo(5.0 + 1e-13, 20.0))  # last-bit noise of a fit
    assert _canonical(slo) != _canonical(Slo(5.1, 20.0))
    assert _canonical({"b": (1, 2.5), "a": True}) == {"b": [1, 2.5], "a": True}
    with pytest.raises(TypeError, match="set"):
        _canonical({1, 2})  # an order-less value would give a fingerprint that wanders


def test_the_static_split_is_the_one_best_over_every_trace():
    # Split 2 is best on the first trace, split 1 on the second and on average: an operator
    # fixes one split for every day, so ours is compared with split 1 on both.
    first = [_result(OURS, 90, 0.90), _result("ray_default_static_1", 100, 0.88),
             _result("ray_default_static_2", 95, 0.89)]  # fmt: skip
    second = [_result(OURS, 110, 0.90), _result("ray_default_static_1", 100, 0.95),
              _result("ray_default_static_2", 95, 0.80)]  # fmt: skip
    comparison = ours_against_static([first, second], [7, 8])
    assert comparison["ray_default_split"] == "ray_default_static_1"
    assert [t["best_split_of_this_trace"] for t in comparison["traces"]] == [
        "ray_default_static_2", "ray_default_static_1"
    ]  # fmt: skip
    assert [t["gpu_hours_ratio"] for t in comparison["traces"]] == [0.9, 1.1]
    assert (comparison["gpu_hours_ratio_min"], comparison["gpu_hours_ratio_max"]) == (0.9, 1.1)
    assert comparison["gpu_hours_ratio"] == 1.0
    assert comparison["slo_attainment_ray_default"] == pytest.approx(0.915)
    assert comparison["traces_won"] == 1  # fewer GPU-hours at no lower attainment: the first


def test_cli_compares_over_several_traces_of_the_spec(tmp_path):
    trace_spec = tmp_path / "trace.yaml"
    trace_spec.write_text(
        json.dumps(spec(duration_s=1200, peak_rate_per_s=6, trough_rate_per_s=1).model_dump())
    )
    args = [
        "simulate", str(KIMI), "--trace", str(trace_spec), "--hardware", str(KIMI_SCALE),
        "--budget", "3", "--warmup-s", "300", "--replica-start-s", "60",
        "--out", str(tmp_path / "out"), "--summary", str(tmp_path / "summary.json"),
    ]  # fmt: skip
    assert main([*args, "--seeds", "2"]) == 0
    over = json.loads((tmp_path / "out" / "result.json").read_text())["over_traces"]
    assert [t["seed"] for t in over["traces"]] == [7, 8]
    assert over["traces"][1]["requests"] != over["traces"][0]["requests"]  # another day
    block = json.loads((tmp_path / "summary.json").read_text())["simulation"]
    assert block["gpu_hours_ours"] == pytest.approx(
        (over["traces"][0]["gpu_hours_ours"] + over["traces"][1]["gpu_hours_ours"]) / 2, abs=1e-3
    )
    assert block["gpu_hours_ratio_min"] <= block["gpu_hours_ratio"] <= block["gpu_hours_ratio_max"]
    jsonl = tmp_path / "trace.jsonl"
    trace.write(trace.load(trace_spec), jsonl)
    args[args.index(str(trace_spec))] = str(jsonl)
    assert main([*args, "--seeds", "2"]) == 2  # a JSONL trace has no seed to vary
