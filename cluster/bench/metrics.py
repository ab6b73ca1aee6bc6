"""Per-request metrics and their aggregation (plain Python: no vLLM, no Ray).

The load generator (`vllm.benchmarks.serve`) returns per-request arrays; `requests_from_vllm`
turns them into `RequestSample`s, and `summarize` aggregates one (config, scenario) cell.

- TTFT: time to first token.
- TPOT: (latency - TTFT) / (output tokens - 1), the decode time per token a user sees. A
  response whose tokens all arrived in one piece (a starved proxy coalesces a stream) has no
  decode timing: it counts as `unstreamed` and stays out of TPOT and per-user tok/s.
- per-user tok/s: 1 / TPOT, the rate one stream decodes at (what speculation lifts);
  per-user end-to-end tok/s: output tokens / latency (prefill included).
- aggregate tok/s: all output tokens / wall time of the run (what batching lifts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PERCENTILES = (50, 90, 99)


UNSTREAMED_DECODE_S = 0.001
"""A decode span (first to last token) shorter than this was not observed but delivered in one
piece: one engine step takes longer, on any hardware."""


@dataclass(frozen=True)
class RequestSample:
    ttft_s: float
    latency_s: float
    output_tokens: int
    prompt_tokens: int
    pool: str | None = None
    """The pool the cluster's ingress routed it to (None for raw vLLM)."""
    chunks: int | None = None
    """Stream chunks that carried output (None: not recorded)."""

    @property
    def unstreamed(self) -> bool:
        """Several tokens in one chunk, or within `UNSTREAMED_DECODE_S`: the decode time was
        never observed. (An OpenAI chat stream opens with a role-only chunk, which the load
        generator takes for the first token, so a coalesced answer has two chunks.)"""
        if self.output_tokens < 2:
            return False
        return self.chunks == 1 or self.latency_s - self.ttft_s < UNSTREAMED_DECODE_S

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.unstreamed:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def per_user_tok_s(self) -> float | None:
        tpot = self.tpot_s
        return 1 / tpot if tpot else None


def requests_from_vllm(
    result: dict[str, Any], pools: Sequence[str | None] | None = None
) -> tuple[list[RequestSample], list[str]]:
    """Successful requests of a `vllm.benchmarks.serve` result, and the failed ones' errors.
    `pools`, in the same (request) order, says where each request was routed."""
    samples, errors = [], []
    for ttft, latency, out, prompt, error, itl, pool in zip(
        result["ttfts"],
        result["latencies"],
        result["output_lens"],
        result["input_lens"],
        result["errors"],
        result["itls"],  # one gap per chunk after the first
        pools or [None] * len(result["errors"]),
        strict=True,
    ):
        if error or not out:
            errors.append(error or "no output")
            continue
        samples.append(RequestSample(ttft, latency, out, prompt, pool, chunks=1 + len(itl)))
    return samples, errors


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float | None]) -> dict[str, float]:
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": math.nan} | {f"p{q}": math.nan for q in PERCENTILES}
    return {"mean": sum(present) / len(present)} | {
        f"p{q}": percentile(present, q) for q in PERCENTILES
    }


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.nan


def summarize(samples: list[RequestSample], duration_s: float, failed: int) -> dict[str, Any]:
    """One cell of one repetition. Per-user rates are token-weighted over the cell's requests
    (all decode tokens over all decode time), so a two-token answer, whose single gap is
    noise, weighs two tokens and not a whole request."""
    timed = [s for s in samples if s.tpot_s is not None]
    decode_tokens = sum(s.output_tokens - 1 for s in timed)
    decode_s = sum(s.latency_s - s.ttft_s for s in timed)
    ttfts = [s.ttft_s for s in samples]
    return {
        "completed": len(samples),
        "failed": failed,
        "unstreamed": sum(s.unstreamed for s in samples),
        "duration_s": duration_s,
        "per_user_tok_s": _rate(decode_tokens, decode_s),
        "per_user_e2e_tok_s": _rate(
            sum(s.output_tokens for s in samples), sum(s.latency_s for s in samples)
        ),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "aggregate_tok_s": _rate(sum(s.output_tokens for s in samples), duration_s),
        "output_tokens": sum(s.output_tokens for s in samples),
        "mean_output_tokens": sum(s.output_tokens for s in samples) / len(samples)
        if samples
        else math.nan,
        "mean_prompt_tokens": sum(s.prompt_tokens for s in samples) / len(samples)
        if samples
        else math.nan,
        "by_pool": {
            pool: {
                "completed": len(group),
                "per_user_tok_s": distribution(s.per_user_tok_s for s in group),
                "ttft_s": distribution(s.ttft_s for s in group),
            }
            for pool, group in _group_by_pool(samples).items()
        },
    }


def _group_by_pool(samples: list[RequestSample]) -> dict[str, list[RequestSample]]:
    groups: dict[str, list[RequestSample]] = {}
    for sample in samples:
        if sample.pool is not None:
            groups.setdefault(sample.pool, []).append(sample)
    return dict(sorted(groups.items()))
