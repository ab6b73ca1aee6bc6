"""`cluster reliability` at small numbers (one replica kill, c=4, 4x overload of capacity 2 per
replica): the same targets as the full run but the timed one, on a cluster of its own with API
keys on."""

from __future__ import annotations

from pathlib import Path

import pytest

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
