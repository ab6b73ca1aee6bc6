"""What a benchmark run measures: workloads, scenarios (load shapes) and configurations.

Plain data, no servers: `runner.py` executes a `Plan`.

Workloads (JSONL in the run directory, replayable by any client, `eval` split files only so
the shipped drafters are measured on code they never saw):
- `code-long-<N>`: a stdlib file cut at N tokens, continue it (fixed output, EOS ignored);
- `chat-short`: an instruction about one real function;
- `mixed`: both kinds interleaved, replayed open loop (Poisson arrivals) for routing.

Configurations, deployed one after another with the same model and workload:
`none`, `ngram`, `eagle3`, `eagle3.1` (single pool each, all cores), `routed` (the embedded
preset's two pools), `vllm` (vLLM's own OpenAI server, no speculation: serving overhead).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_NAMES = ("none", "ngram", "eagle3", "eagle3.1", "routed", "vllm")
SINGLE_POOL_ENGINE = {
    "max_num_seqs": 16,
    "enforce_eager": True,
    "cpu_kvcache_space_gib": 2,
    "cpu_omp_threads_bind": "0-1",
}
"""Engine of the single-pool configurations: the whole machine, room for 16 streams."""


@dataclass(frozen=True)
class Scenario:
    """One load shape over one workload."""

    workload: str
    """Workload name (`code-long-1024`, `chat-short`, `mixed`)."""
    requests: int
    """Requests sent."""
    concurrency: int | None = None
    """Closed loop: requests in flight at once (None: open loop)."""
    rate: float | None = None
    """Open loop: Poisson arrivals per second."""

    @property
    def name(self) -> str:
        load = f"c{self.concurrency}" if self.concurrency else f"rate{self.rate:g}"
        return f"{self.workload}@{load}"


@dataclass(frozen=True)
class Plan:
    code_long_contexts: tuple[int, ...]
    """Context lengths (tokens of code) of the code-long workloads."""
    concurrencies: tuple[int, ...]
    """Closed-loop sweep."""
    rates: tuple[float, ...]
    """Open-loop arrival rates of the mixed workload."""
    output_tokens: int
    """Output tokens of code-long requests (fixed; EOS ignored)."""
    chat_output_tokens: int
    """Output tokens of chat-short requests."""
    min_requests: int = 4
    """Closed loop sends max(min_requests, waves x concurrency) requests."""
    waves: int = 1
    """Closed loop: how many times every slot is filled (1: all requests of c=16 run at once,
    which is what per-user tok/s at c=16 means; more averages over staggered starts)."""
    mixed_requests: int = 12
    """Requests of each open-loop run."""
    max_context_in_flight: int | None = None
    """Skip code-long levels whose concurrency x context tokens exceed this (None or 0: run all).
    On a CPU, prefilling 16 x 2k tokens alone takes about a minute per configuration."""
    chat_short: bool = True
    """Include the chat-short closed-loop sweep (chat prompts are part of `mixed` either way)."""
    seed: int = 0
    """Seed of workload sampling and arrivals."""

    def scenarios(self) -> list[Scenario]:
        def closed(workload: str, context: int = 0) -> list[Scenario]:
            budget = self.max_context_in_flight
            return [
                Scenario(workload, max(self.min_requests, self.waves * c), concurrency=c)
                for c in self.concurrencies
                if not budget or c * context <= budget
            ]

        scenarios = [s for n in self.code_long_contexts for s in closed(f"code-long-{n}", n)]
        if self.chat_short:
            scenarios += closed("chat-short")
        scenarios += [Scenario("mixed", self.mixed_requests, rate=r) for r in self.rates]
        return scenarios

    def requests_of(self, workload: str) -> int:
        return max(s.requests for s in self.scenarios() if s.workload == workload)


# Budgets on 2 cores, where starting a configuration's server takes 60-100 s: the quick plan
# compares no speculation with the EAGLE 3.1 drafter in about 5 minutes; the default plan runs
# all six configurations in about 30 (code-long 2k runs at c = 1, 4 only).
QUICK = Plan(
    code_long_contexts=(1024,),
    concurrencies=(1, 4),
    rates=(),
    output_tokens=64,
    chat_output_tokens=48,
    min_requests=3,
    chat_short=False,
)
QUICK_CONFIGS = ("none", "eagle3.1")
DEFAULT = Plan(
    code_long_contexts=(1024, 2048),
    concurrencies=(1, 4, 16),
    rates=(1.0,),
    output_tokens=64,
    chat_output_tokens=48,
    min_requests=3,
    mixed_requests=8,
    max_context_in_flight=16 * 1024,
    chat_short=False,
)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    kind: str
    """`cluster` (deployed with `cluster serve`) or `vllm` (vLLM's own server)."""
    config_data: dict[str, Any] | None = None
    """Cluster YAML data (for `vllm`: the cluster whose single pool it mirrors)."""
    skip_reason: str | None = None
    """Why it cannot run here (shown, and recorded in the result)."""


def _single_pool(preset: dict[str, Any], speculation: dict[str, Any] | None) -> dict[str, Any]:
    data = copy.deepcopy(preset)
    target = data["targets"][0]["id"]
    data["pools"] = [
        {
            "name": "main",
            "target": target,
            "role": "speculative" if speculation else "throughput",
            "speculation": speculation or {"method": "none"},
            "engine": dict(SINGLE_POOL_ENGINE),
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        }
    ]
    return data


def configurations(
    preset: dict[str, Any],
    names: tuple[str, ...],
    drafters: dict[str, Path],
    num_speculative_tokens: int,
) -> list[BenchConfig]:
    """The configurations to compare, in order; drafters that do not exist are skipped."""
    k = num_speculative_tokens
    chosen = []
    for name in names:
        if name == "none":
            chosen.append(BenchConfig(name, "cluster", _single_pool(preset, None)))
        elif name == "ngram":
            ngram = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": 5,
            }
            chosen.append(BenchConfig(name, "cluster", _single_pool(preset, ngram)))
        elif name in ("eagle3", "eagle3.1"):
            drafter = drafters.get(name)
            if drafter is None or not drafter.is_dir():
                chosen.append(
                    BenchConfig(name, "cluster", skip_reason=f"no {name} drafter at {drafter}")
                )
                continue
            spec = {"method": "eagle3", "drafter": str(drafter), "num_speculative_tokens": k}
            chosen.append(BenchConfig(name, "cluster", _single_pool(preset, spec)))
        elif name == "routed":
            chosen.append(BenchConfig(name, "cluster", copy.deepcopy(preset)))
        elif name == "vllm":
            chosen.append(BenchConfig(name, "vllm", _single_pool(preset, None)))
        else:
            raise ValueError(f"unknown configuration {name!r} (known: {', '.join(CONFIG_NAMES)})")
    return chosen
