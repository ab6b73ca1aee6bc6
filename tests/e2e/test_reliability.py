"""`cluster reliability` at small numbers (one replica kill, c=4, 4x overload of capacity 2 per
replica): the same targets as the full run but the timed one, on a cluster of its own with API
keys on."""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path

import pytest
import requests
import yaml

from cluster.launcher import ServeProcess
from cluster.reliability import LATENCY_TARGET, run, targets_missed

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "configs" / "embedded.yaml"


def test_reliability_targets_hold_at_small_numbers():
    result = run(EMBEDDED, capacity=2, factor=4, kills=1, concurrency=4, unloaded_n=4)
    assert result["faults"]["replica_kills"] == 1 and result["faults"]["requests"] > 0
    assert result["bad_inputs"]["cases"] >= 25 and result["auth"]["cases"] >= 10
    assert result["overload"]["429"] > 0, result  # 4x capacity must be refused, not queued
    # The latency ratio is a speed target: measured by the full `cluster reliability` run
    # (benchmarks/results/reliability.json, 1.95x there); at these small numbers on 2 shared
    # cores it lands on either side of 2x by chance. Here it must only be measured.
    assert result["overload"]["p99_admitted_s"] > 0 and result["overload"]["p99_unloaded_s"] > 0
    assert targets_missed(result, timed=False) == [], result


def test_only_the_latency_target_is_left_out_of_the_untimed_check():
    result = {
        "faults": {"lost_before_first_token": 1, "mid_stream_silent_closes": 0},
        "overload": {"other_5xx": 0, "retry_after_missing": 0, "p99_admitted_s": 5.0,
                     "p99_unloaded_s": 1.0},
        "bad_inputs": {"cases": 30, "4xx_with_openai_body": 30, "server_healthy_after": True},
        "auth": {"cases": 13, "correct": 13},
    }  # fmt: skip
    assert targets_missed(result) == ["faults.lost_before_first_token == 0", LATENCY_TARGET]
    assert targets_missed(result, timed=False) == ["faults.lost_before_first_token == 0"]


def test_pool_at_zero_replicas_wakes_for_its_first_request():
    data = yaml.safe_load(EMBEDDED.read_text())
    speculative = next(p for p in data["pools"] if p["role"] == "speculative")
    speculative["autoscaling"] = {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0}
    speculative["queue_timeout_s"] = 600  # a CPU replica loads in about a minute
    # Rule v1's wake-up (the model path is unit-tested: a cold pool is chosen only when its
    # cold start pays off against the warm pool, which an idle cluster never does).
    data["routing"].pop("profile")
    for pool in data["pools"]:  # a rate target needs the profile's model
        pool["autoscaling"].pop("target_per_user_tok_s", None)
    with ServeProcess(data, base_dir=EMBEDDED.parent) as serve:
        pools = requests.get(f"{serve.base_url}/readyz", timeout=30).json()["pools"]
        assert pools["speculative"]["running_replicas"] == 0
        source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
        started = time.monotonic()
        response = requests.post(
            f"{serve.base_url}/v1/completions",
            json={"model": data["targets"][0]["id"], "prompt": source[:8000], "max_tokens": 8},
            timeout=900,
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-cluster-pool"] == "speculative"
        assert response.headers["x-cluster-route-reason"] == "long_context"
        assert time.monotonic() - started > 5  # it really waited for a replica to start
        pools = requests.get(f"{serve.base_url}/readyz", timeout=30).json()["pools"]
        assert pools["speculative"]["running_replicas"] == 1
