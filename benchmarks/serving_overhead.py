"""Serving overhead: one request's output tokens/s through our HTTP endpoint vs the same model
in vLLM in-process, measured side by side in one run, plus time from `cluster serve` to ready.

    .venv/bin/python benchmarks/serving_overhead.py [--requests 5] [--max-tokens 128]

Prints a table and writes benchmarks/results/serving_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import requests
import yaml
from tqdm import tqdm

from cluster.launcher import ServeProcess

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function that parses an ISO 8601 date string and explain each step."


def measure_cluster(config_path: Path, n: int, max_tokens: int) -> dict:
    config = yaml.safe_load(config_path.read_text())
    config["server"].pop("port", None)  # a free port
    with ServeProcess(config, base_dir=config_path.parent) as serve:
        url = f"{serve.base_url}/v1/completions"
        body = {
            "model": config["targets"][0]["id"],
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        requests.post(url, json={**body, "max_tokens": 4}, timeout=300)  # warm-up
        rates, pools = [], set()
        for _ in tqdm(range(n), desc="HTTP (our cluster)"):
            t0 = time.perf_counter()
            response = requests.post(url, json=body, timeout=300)
            elapsed = time.perf_counter() - t0
            response.raise_for_status()
            rates.append(response.json()["usage"]["completion_tokens"] / elapsed)
            pools.add(response.headers["x-cluster-pool"])
    return {"ready_s": serve.ready_s, "tokens_per_s": rates, "pools": sorted(pools)}


def measure_in_process(model_path: str, llm_config: dict, n: int, max_tokens: int) -> dict:
    # The engine arguments and environment the pool's engine gets: only the serving path differs.
    os.environ.update(llm_config["runtime_env"].get("env_vars", {}))
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, **llm_config["engine_kwargs"])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates = []
    for _ in tqdm(range(n), desc="vLLM in-process"):
        t0 = time.perf_counter()
        out = llm.generate([PROMPT], params, use_tqdm=False)
        rates.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t0))
    return {"tokens_per_s": rates}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "embedded.yaml")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per side")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving_overhead.json"
    )
    args = parser.parse_args()

    from cluster.config import load_config
    from cluster.deployments.app import pool_llm_config_dict
    from cluster.models import local_model_path, prepare_config_models

    config = load_config(args.config)
    prepare_config_models(config)
    throughput = next(p for p in config.pools if p.role == "throughput")
    model_path = local_model_path(config, config.target(throughput.target))

    cluster = measure_cluster(args.config, args.requests, args.max_tokens)
    llm_config = pool_llm_config_dict(config, throughput)
    raw = measure_in_process(model_path, llm_config, args.requests, args.max_tokens)
    http_median = statistics.median(cluster["tokens_per_s"])
    raw_median = statistics.median(raw["tokens_per_s"])
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": str(args.config.relative_to(ROOT))
        if args.config.is_relative_to(ROOT)
        else str(args.config),
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "cluster_ready_s": round(cluster["ready_s"], 1),
        "http_pools": cluster["pools"],
        "http_tokens_per_s": cluster["tokens_per_s"],
        "in_process_tokens_per_s": raw["tokens_per_s"],
        "http_median_tokens_per_s": round(http_median, 2),
        "in_process_median_tokens_per_s": round(raw_median, 2),
        "http_over_in_process": round(http_median / raw_median, 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ncluster serve -> ready:         {result['cluster_ready_s']:.1f} s")
    pools = ", ".join(cluster["pools"])
    print(f"single stream, HTTP (ours):     {http_median:7.1f} tok/s  (pool {pools})")
    print(f"single stream, vLLM in-process: {raw_median:7.1f} tok/s")
    print(f"ratio HTTP / in-process:        {result['http_over_in_process']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
