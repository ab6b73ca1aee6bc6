"""Run `cluster serve` in a child process, the way a user does, for tests and benchmarks.

`ServeProcess(config_data)` writes the config to a temporary file (on a free port unless one is
given), starts `python -m cluster serve`, waits for its ready line, and on exit sends Ctrl-C and
records the exit code, so no Ray or vLLM process outlives the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import yaml

READY_MARKER = "ready in "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_absolute_paths(config_data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """A copy of YAML data whose local target and drafter paths no longer depend on where the
    file is written (relative paths are relative to the original file's directory)."""
    from cluster.config import map_local_paths

    return map_local_paths(config_data, lambda location: str((base_dir / location).resolve()))


HARNESS_SERVE_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}
"""Defaults for servers a test or benchmark starts. Serve keeps an ingress replica alive for
30 s at shutdown so a load balancer can deregister it; a harness server has none, and every
benchmark run and e2e test paid those 30 s per server. In-flight requests are still drained."""


class ServerStartError(RuntimeError):
    """A server exited or timed out before it was ready; the message ends with its log."""


def await_ready(
    server: Any, name: str, ready: Callable[[], bool], started: float, timeout_s: float
) -> float:
    """Seconds from `started` until `ready()`. A server that exits or times out first raises
    `ServerStartError` with its log's tail; on that or an interrupt, `server.__exit__()` runs
    first, so neither its processes nor its files outlive the failed start."""
    try:
        while not ready():
            if server.process.poll() is not None or time.monotonic() - started > timeout_s:
                raise ServerStartError(f"{name} did not start:\n{server.log()[-4000:]}")
            time.sleep(1)
    except BaseException:
        server.__exit__()
        raise
    return time.monotonic() - started


class ServeProcess:
    def __init__(
        self,
        config_data: dict[str, Any],
        *,
        base_dir: Path | None = None,
        start_timeout_s: float = 600,
        env: dict[str, str] | None = None,
    ):
        """`base_dir`: the directory relative paths in `config_data` are relative to; `env`:
        variables added to the child's environment."""
        self.env = {**HARNESS_SERVE_ENV, **os.environ, **(env or {})}
        if base_dir is not None:
            config_data = with_absolute_paths(config_data, base_dir)
        self.config = {**config_data, "server": {**config_data.get("server", {})}}
        self.config["server"].setdefault("port", free_port())
        self.port = self.config["server"]["port"]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self._workdir = tempfile.TemporaryDirectory(prefix="cluster-serve-")
        self.config_path = Path(self._workdir.name) / "cluster.yaml"
        self.log_path = Path(self._workdir.name) / "serve.log"
        self.ready_s: float | None = None
        self.exit_code: int | str | None = None
        self.process: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> ServeProcess:
        self.config_path.write_text(yaml.safe_dump(self.config))
        started = time.monotonic()
        with open(self.log_path, "w") as out:
            # Its own process group, which Ray's daemons join: Ray's process reaper SIGTERMs
            # (then SIGKILLs) the whole group once `cluster serve` is gone, and that must not
            # include the caller (a benchmark between two configurations, a test session).
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cluster", "serve", str(self.config_path)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.ready_s = await_ready(
            self, "cluster serve", lambda: READY_MARKER in self.log(), started, self.start_timeout_s
        )
        return self

    def stop(self, timeout_s: float = 120) -> int | str:
        if self.process is not None and self.exit_code is None:
            self.exit_code = interrupt_and_wait(self.process, timeout_s, group=False)
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._workdir.cleanup()


def session_processes(session_id: int) -> list[int]:
    """Pids of every process in a session (Linux `/proc`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) == session_id:
                pids.append(int(entry))
    return pids


def _name_and_fields(pid: int) -> tuple[str, list[str]]:
    """A process's name and the `/proc/<pid>/stat` fields after it (the name may hold spaces
    and parentheses, so it is cut at the first "(" and the last ")")."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split("(", 1)[1].rsplit(")", 1)[0], stat.rsplit(")", 1)[1].split()


def session_cpu_seconds(session_id: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by a session's live processes, by process
    name: vLLM's engine processes are named `VLLM::...`, Ray's workers `ray::...`."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for pid in session_processes(session_id):
        with contextlib.suppress(OSError, IndexError):
            name, fields = _name_and_fields(pid)
            used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return used


SETTLE_IDLE_CORES = 0.5
"""A server is settled when its processes use less than this many cores over a second."""
SETTLE_TIMEOUT_S = 15.0
"""Longest wait for a server to settle before a cell (the cell then runs anyway)."""


def settle(session_id: int, timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[float, float]:
    """Wait until a server's processes are near idle, at most `timeout_s`: after a thaw (and
    after a cell's last stream) Ray's and Serve's loops catch up on timers and reports, and a
    cell that starts at once shares the cores with them. Returns (seconds waited, cores the
    server used over the last second)."""
    start = time.monotonic()
    before = sum(session_cpu_seconds(session_id).values())
    while True:
        time.sleep(1.0)
        after = sum(session_cpu_seconds(session_id).values())
        cores, before = after - before, after
        waited = time.monotonic() - start
        if cores < SETTLE_IDLE_CORES or waited >= timeout_s:
            return waited, cores


def engine_cores(session_id: int) -> list[list[int]]:
    """The cores each vLLM worker process of a session may run on (the union over its threads,
    which OpenMP binds one core each), sorted: what the engines actually got."""
    cores = []
    for pid in session_processes(session_id):
        with contextlib.suppress(OSError, IndexError):
            if not _name_and_fields(pid)[0].startswith("VLLM::Worker"):
                continue
            allowed: set[int] = set()
            for thread in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    allowed |= os.sched_getaffinity(int(thread))
            cores.append(sorted(allowed))
    return sorted(cores)


def signal_session(session_id: int, sig: signal.Signals) -> int:
    """Send `sig` to every process of a session; how many got it."""
    sent = 0
    for pid in session_processes(session_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            sent += 1
    return sent


def interrupt_and_wait(process: subprocess.Popen, timeout_s: float, *, group: bool) -> int | str:
    """SIGINT a process (`group`: its whole process group) and return its exit code, or SIGKILL
    the group after `timeout_s` (children run in their own session, so the group is theirs).

    A server frozen by a benchmark is thawed first, so it can act on the signal at once; which
    of its threads the kernel hands the signal to is chance, which `cluster serve` copes with
    (`idle_until_interrupted`; before that, a thawed server ran into the 120 s kill)."""
    signal_session(process.pid, signal.SIGCONT)
    if group:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"killed after {timeout_s:.0f}s"


def vllm_server_command(llm_config: dict[str, Any], port: int) -> tuple[list[str], dict[str, str]]:
    """`vllm.entrypoints.openai.api_server` with a pool's own model and engine settings
    (`pool_llm_config_dict` data) and the environment the pool's replicas get."""
    loading = llm_config["model_loading_config"]
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", loading["model_source"],
        "--served-model-name", loading["model_id"],
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    from vllm.engine.arg_utils import AsyncEngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(AsyncEngineArgs)}
    for key, value in llm_config["engine_kwargs"].items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) and defaults.get(key) is value:
            continue  # vLLM's default; plain store_true switches have no --no- form
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append(f"--no-{flag[2:]}")
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    env = {**os.environ, **llm_config.get("runtime_env", {}).get("env_vars", {})}
    return argv, env


class ChildServer:
    """A server in a child process of its own session (its engine processes go down with it),
    ready once `_ready()` says so (by default: it printed `READY_MARKER`)."""

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

    def _ready(self) -> bool:
        return READY_MARKER in self.log()

    def __enter__(self) -> Self:
        started = time.monotonic()
        self.process = self._popen()
        self.ready_s = await_ready(self, self.name, self._ready, started, self.start_timeout_s)
        return self

    def stop(self, timeout_s: float = 60) -> None:
        if self.process is not None and self.process.poll() is None:
            interrupt_and_wait(self.process, timeout_s, group=True)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self._log.name).unlink(missing_ok=True)


class VLLMServerProcess(ChildServer):
    """vLLM's own OpenAI server in a child process (the serving-overhead baseline)."""

    name = "vllm-server"

    def __init__(self, llm_config: dict[str, Any], *, start_timeout_s: float = 600):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        super().__init__(*vllm_server_command(llm_config, self.port), start_timeout_s)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False
