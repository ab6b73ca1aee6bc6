"""`cluster drafters eval`: acceptance and speed of speculation methods, side by side.

Every method (no speculation, n-gram, each drafter) runs the same held-out workload (`eval`
split code-long prompts in context-length buckets) single stream, greedy, in its own vLLM
engine (one subprocess per method, so memory and threads are clean). Responses stop where the
target stops, as in production: with `ignore_eos` (fixed output length, what load benchmarks
do) the tokens after the target's end-of-turn are text no drafter was trained on, and the
target answers about one code prompt in four with just the closing fence of a code block (two
tokens), so short-context buckets were mostly that text. The target is greedy, so every method
decodes the same text; `stopped_by_target` counts the responses that ended before the limit.
Per bucket it records output tok/s (whole requests, and decode alone: after the first token,
from vLLM's per-request timestamps, since speculation does not speed up prefill) and the
deltas of vLLM's `vllm:spec_decode_*` counters: mean acceptance length and per-position
acceptance. Writes JSON and a PNG.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import platform
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cluster import workloads
from cluster.speculation import SpecCounters

BUCKETS: tuple[tuple[str, int], ...] = (("<512", 384), ("512-2k", 1536), ("2k-6k", 4096))
"""Context-length buckets: label and the prompt's code tokens."""


# Whole request (prefill included), then decode only (after the first token).
_RATES = (
    ("output_tokens_per_s", "speedup_vs_none"),
    ("decode_tokens_per_s", "decode_speedup_vs_none"),
)


@dataclass(frozen=True)
class Method:
    name: str
    """Label in tables and plots."""
    speculative_config: dict[str, Any] | None
    """vLLM's `speculative_config` (None: no speculation)."""


def methods(drafters: dict[str, Path], k: int, ngram: bool = True) -> list[Method]:
    """No speculation, then n-gram, then each drafter, all with `k` speculative tokens."""
    chosen = [Method("none", None)]
    if ngram:
        chosen.append(
            Method(
                "ngram",
                {
                    "method": "ngram",
                    "num_speculative_tokens": k,
                    "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5,
                },
            )
        )
    for name, path in drafters.items():
        chosen.append(
            Method(name, {"method": "eagle3", "model": str(path), "num_speculative_tokens": k})
        )
    return chosen


def _run_method(
    target: str,
    method: Method,
    buckets: dict[str, list[dict]],
    cores: str,
    dtype: str,
    ignore_eos: bool,
    result_path: str,
) -> None:
    """Child process: one engine, every bucket, single stream; writes JSON to result_path."""
    os.setsid()  # own process group: the parent can stop vLLM's engine processes with it
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    longest = max(p["context_tokens"] for ps in buckets.values() for p in ps)
    output_tokens = max(p["output_tokens"] for ps in buckets.values() for p in ps)
    llm = LLM(
        model=target,
        dtype=dtype,
        max_model_len=longest + output_tokens + 256,
        max_num_seqs=4,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=method.speculative_config,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=ignore_eos)
    warmup = next(iter(buckets.values()))[0]["prompt"]
    llm.chat([{"role": "user", "content": warmup}], params, use_tqdm=False)
    result: dict[str, Any] = {}
    for label, prompts in buckets.items():
        before = SpecCounters.from_vllm_metrics(llm.get_metrics())
        tokens, elapsed, stopped = 0, 0.0, 0
        decode_tokens, decode_seconds = 0, 0.0
        for prompt in prompts:
            started = time.perf_counter()
            output = llm.chat(
                [{"role": "user", "content": prompt["prompt"]}], params, use_tqdm=False
            )[0]
            elapsed += time.perf_counter() - started
            generated = len(output.outputs[0].token_ids)
            tokens += generated
            stopped += output.outputs[0].finish_reason == "stop"
            # After the first token (prefill): what speculation speeds up. Engine timestamps.
            stats = output.metrics
            if stats is not None and generated > 1 and stats.last_token_ts > stats.first_token_ts:
                decode_tokens += generated - 1
                decode_seconds += stats.last_token_ts - stats.first_token_ts
        counters = SpecCounters.from_vllm_metrics(llm.get_metrics()) - before
        result[label] = {
            "requests": len(prompts),
            "output_tokens": tokens,
            "stopped_by_target": stopped,
            "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed,
            **({"decode_tokens_per_s": decode_tokens / decode_seconds} if decode_seconds else {}),
            **counters.summary(),
        }
    Path(result_path).write_text(json.dumps(result))


def run_isolated(
    target: Path,
    method: Method,
    buckets: dict[str, list[dict]],
    cores: str,
    dtype: str,
    ignore_eos: bool = False,
) -> dict:
    """`_run_method` in a fresh spawned process (its own engine, threads and memory)."""
    context = multiprocessing.get_context("spawn")
    result_path = Path(f"/tmp/cluster-eval-{os.getpid()}-{method.name}.json")
    child = context.Process(
        target=_run_method,
        args=(str(target), method, buckets, cores, dtype, ignore_eos, str(result_path)),
    )
    child.start()
    while child.is_alive() and not result_path.exists():
        child.join(timeout=1)
    # vLLM's engine shutdown at interpreter exit can hang in a spawned child once the result
    # is written (seen here with vLLM-cpu 0.32), leaving its engine processes behind: give it
    # a grace period, then stop the whole process group.
    child.join(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # the child and its engine processes
    child.join()
    if not result_path.exists():
        raise RuntimeError(f"eval of {method.name} failed (exit code {child.exitcode})")
    result = json.loads(result_path.read_text())
    result_path.unlink()
    return result


def evaluate(
    target: Path,
    chosen: list[Method],
    per_bucket: int = 6,
    max_context: int | None = None,
    output_tokens: int = 128,
    seed: int = 0,
    cores: str = "0-1",
    dtype: str = "float32",
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Run every method on the same prompts; returns the report (see `write_report`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    buckets = {
        label: [
            p.__dict__
            for p in workloads.code_long(
                tokenizer, [context], per_bucket, output_tokens, "eval", seed
            )
        ]
        for label, context in BUCKETS
        if max_context is None or context <= max_context
    }
    results = {
        method.name: run_isolated(target, method, buckets, cores, dtype, ignore_eos)
        for method in tqdm(chosen, desc="eval methods", unit="method")
    }
    baseline = results.get("none")
    for per_bucket_result in results.values():
        for label, r in per_bucket_result.items():
            for rate, speedup in _RATES:
                if baseline and rate in r and rate in baseline[label]:
                    r[speedup] = r[rate] / baseline[label][rate]
    return {
        "target": str(target),
        "workload": {
            "kind": "code-long",
            "split": "eval",
            "buckets": {label: context for label, context in BUCKETS if label in buckets},
            "requests_per_bucket": per_bucket,
            "output_tokens": output_tokens,
            "seed": seed,
            "mode": "single stream, greedy, " + ("ignore_eos" if ignore_eos else "stop at eos"),
        },
        "methods": {m.name: m.speculative_config for m in chosen},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "cores": cores},
        "dtype": dtype,
        "results": results,
    }


def write_report(report: dict[str, Any], out_json: Path, out_png: Path | None) -> None:
    """JSON, the Markdown table next to it (`.md`), and the plot."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=2) + "\n")
    out_json.with_suffix(".md").write_text(markdown(report))
    if out_png is not None:
        plot(report, out_png)


def _rate_cell(r: dict[str, Any], rate: str, speedup: str, method: str) -> str:
    if rate not in r:  # reports from before decode timing was recorded
        return "-"
    ratio = f" (x{r[speedup]:.2f})" if method != "none" and speedup in r else ""
    return f"{r[rate]:.1f}{ratio}"


def markdown(report: dict[str, Any]) -> str:
    """One row per method: acceptance length per bucket, per-position acceptance in the
    longest bucket, tok/s of whole requests and of decode alone (after the first token), each
    with the speed-up over no speculation; then the EAGLE 3.1 / EAGLE 3 acceptance ratio and
    how many tokens each bucket decoded."""
    results, labels = report["results"], list(report["workload"]["buckets"])
    longest = labels[-1]
    lines = [
        "| method | "
        + " | ".join(f"AL {label}" for label in labels)
        + f" | per-position {longest} | "
        + " | ".join(f"tok/s {label}" for label in labels)
        + " | "
        + " | ".join(f"decode tok/s {label}" for label in labels)
        + " |",
        "| --- " * (3 * len(labels) + 2) + "|",
    ]
    for name, per_bucket in results.items():
        positions = per_bucket[longest].get("per_position_acceptance")
        cells = [f"{_acceptance(per_bucket[label]):.2f}" for label in labels]
        cells.append(", ".join(f"{a:.2f}" for a in positions) if positions else "-")
        for rate, speedup in _RATES:
            cells += [_rate_cell(per_bucket[label], rate, speedup, name) for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    if {"eagle3.1", "eagle3"} <= results.keys():
        ratios = (
            f"{_acceptance(results['eagle3.1'][label]) / _acceptance(results['eagle3'][label]):.2f}"
            f" ({label})"
            for label in labels
        )
        lines.append(f"EAGLE 3.1 / EAGLE 3 acceptance-length ratio: {', '.join(ratios)}.")
    first = next(iter(results.values()))  # greedy: every method decodes the same text
    decoded = (
        f"{first[label]['output_tokens']} at {label} ({first[label]['stopped_by_target']} of "
        f"{first[label]['requests']} responses ended by the target)"
        for label in labels
    )
    lines.append(f"Tokens decoded per method: {'; '.join(decoded)}.")
    return "\n".join(lines) + "\n"


def _acceptance(bucket: dict[str, Any]) -> float:
    return bucket["mean_acceptance_length"] or 1.0  # None: no speculation, one token a step


METRICS_FILE = "metrics.json"


def write_drafter_metrics(report: dict[str, Any], drafters: dict[str, Path]) -> None:
    """Each drafter's own results, with the baselines measured in the same run, into
    `DIR/metrics.json` (shipped next to the weights)."""
    baselines = {n: r for n, r in report["results"].items() if n not in drafters}
    for name, path in drafters.items():
        metrics = {key: report[key] for key in ("target", "workload", "machine", "dtype")}
        metrics |= {
            "speculative_config": report["methods"][name],
            "results": report["results"][name],
            "baselines": baselines,
        }
        (path / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    labels = list(report["workload"]["buckets"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (name, per_bucket) in enumerate(results.items()):
        color = f"C{index}"  # one colour per method in both panels
        acceptance = [per_bucket[label]["mean_acceptance_length"] for label in labels]
        if any(a is not None for a in acceptance):
            left.plot(
                labels, [a or float("nan") for a in acceptance], marker="o", label=name, color=color
            )
        right.plot(
            labels,
            [per_bucket[label]["output_tokens_per_s"] for label in labels],
            marker="o",
            label=name,
            color=color,
        )
        decode = [per_bucket[label].get("decode_tokens_per_s") for label in labels]
        if all(decode):
            right.plot(
                labels,
                decode,
                marker="x",
                linestyle="--",
                color=color,
                label=f"{name} decode",
            )
    left.set(title="Mean acceptance length", xlabel="prompt tokens", ylabel="tokens / step")
    right.set(
        title="Single-stream tok/s (dashed: decode only)", xlabel="prompt tokens", ylabel="tok/s"
    )
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
