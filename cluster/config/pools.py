"""Pools: one Ray Serve deployment per pool, with its vLLM engine, speculation and
autoscaling settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cluster.config.base import Strict
from cluster.storage import check_s3_uri

MANAGED_ENGINE_ARGUMENTS = {
    **{key: f"set by targets[].{key}" for key in (
        "tensor_parallel_size", "pipeline_parallel_size", "dtype", "quantization",
        "max_model_len", "trust_remote_code", "tokenizer")},
    "model": "set by targets[].source",
    **{key: f"set by engine.{key}" for key in (
        "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_dtype",
        "enable_prefix_caching", "enforce_eager")},
    "speculative_config": "set by the pool's speculation (its drafter is validated there)",
    "disable_log_stats": "always false: the pool's stats come from vLLM's stat loggers",
}  # fmt: skip
"""vLLM engine arguments `engine.extra` may not carry, and where they are set instead: passed
through, they would override what the config validated (placement bundles, drafter checks)."""


class SpeculationConfig(Strict):
    """Speculative decoding for one pool."""

    method: Literal["eagle3", "ngram", "none"] = "none"
    """`eagle3`: an EAGLE 3 / 3.1 drafter colocated with the target; `ngram`: prompt lookup, no
    drafter; `none`: plain decoding."""

    drafter: str | None = None
    """Drafter checkpoint (local path, relative to the config file, or `s3://`); `eagle3` only."""

    _s3_drafter = field_validator("drafter")(check_s3_uri)

    trust_drafter_code: bool = False
    """Accept a drafter pulled from S3 that carries Python code (`auto_map`, `*.py`) or files
    other than safetensors/config/tokenizer. Off: such a drafter is refused before vLLM loads
    it. Turn on only for a source you control."""

    num_speculative_tokens: int | None = Field(default=None, ge=1, le=16)
    """Tokens drafted per step (draft depth), 1..16; required unless `method` is `none`."""

    prompt_lookup_min: int = Field(default=2, ge=1)
    """`ngram` only: shortest n-gram matched in the prompt."""

    prompt_lookup_max: int = Field(default=5, ge=1)
    """`ngram` only: longest n-gram matched in the prompt."""

    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    """Dynamic speculation (vLLM's schedule of the same name): `[[first, last, k], ...]`,
    inclusive running-batch-size ranges from 1 upwards, each with its draft depth `k` (0: no
    speculation at that batch size; at most `num_speculative_tokens`). Speculation pays while
    a step is memory-bound (small batches) and costs once it is compute-bound; derive the
    breakpoints from a measured depth sweep (`cluster bench schedule`, docs/benchmarks.md).
    None: always `num_speculative_tokens`. vLLM ignores it with data parallel > 1 (refused
    here)."""

    @model_validator(mode="after")
    def _consistent(self) -> SpeculationConfig:
        if self.drafter is not None and self.method != "eagle3":
            raise ValueError(f"drafter: only allowed with method eagle3 (method is {self.method})")
        if self.method == "eagle3" and self.drafter is None:
            raise ValueError("drafter: required with method eagle3")
        if self.method != "none" and self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens: required with method {self.method}")
        if self.method == "none" and self.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens: set but method is none")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min: larger than prompt_lookup_max")
        if self.num_speculative_tokens_per_batch_size is not None:
            from cluster.speculation import schedule_problem

            problem = schedule_problem(
                self.num_speculative_tokens_per_batch_size, self.num_speculative_tokens or 0
            )
            if problem:
                raise ValueError(f"num_speculative_tokens_per_batch_size: {problem}")
        return self


class EngineConfig(Strict):
    """vLLM engine settings that differ between pools (the target's settings are shared)."""

    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences batched per step; small for latency pools, large for throughput pools."""

    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Token budget per scheduler step; None = vLLM's default."""

    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of accelerator memory vLLM may use (weights, drafter, KV cache)."""

    kv_cache_dtype: str = "auto"
    """KV cache dtype (`auto`, `fp8`, ...)."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks across requests sharing a prefix (agent traces, document QA)."""

    enforce_eager: bool = False
    """Skip CUDA graphs / torch.compile: slower steps, much faster start (the CPU default)."""

    cpu_kvcache_space_gib: int = Field(default=2, ge=1)
    """CPU only: KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`)."""

    cpu_omp_threads_bind: str | None = None
    """CPU only: cores the engine's OpenMP threads bind to (`VLLM_CPU_OMP_THREADS_BIND`, e.g.
    `0` or `0-3`); None = vLLM's `auto`, which reserves a core and binds the rest. Give pools
    sharing a machine disjoint cores so their threads do not contend."""

    cpu_cores_per_replica: list[str] | None = None
    """CPU only: the cores of each replica when several share a machine, by replica rank (rank
    r binds to entry r mod the list's length; e.g. `["0", "1"]` for two one-core replicas),
    skipping entries that a running replica of the pool holds (Serve renumbers ranks after a
    scale-down). Replaces `cpu_omp_threads_bind`, which every replica of a pool shares."""

    @model_validator(mode="after")
    def _one_core_binding(self) -> EngineConfig:
        if self.cpu_cores_per_replica is not None:
            if self.cpu_omp_threads_bind is not None:
                raise ValueError("cpu_cores_per_replica: set it or cpu_omp_threads_bind, not both")
            if not self.cpu_cores_per_replica or not all(
                cores.strip() for cores in self.cpu_cores_per_replica
            ):
                raise ValueError("cpu_cores_per_replica: needs one non-empty core list per entry")
        return self

    extra: dict[str, Any] = Field(default_factory=dict)
    """Any other vLLM engine argument, passed through unchanged (not one the config sets from
    its own fields: `MANAGED_ENGINE_ARGUMENTS`)."""

    @field_validator("extra")
    @classmethod
    def _not_managed(cls, extra: dict[str, Any]) -> dict[str, Any]:
        for key in extra:
            if key in MANAGED_ENGINE_ARGUMENTS:
                raise ValueError(f"{key}: {MANAGED_ENGINE_ARGUMENTS[key]}")
        data_parallel = extra.get("data_parallel_size", 1)
        if (
            isinstance(data_parallel, bool)
            or not isinstance(data_parallel, int)
            or data_parallel < 1
        ):
            raise ValueError(
                f"data_parallel_size: must be a whole number >= 1, got {data_parallel!r}"
            )
        return extra


class AutoscalingConfig(Strict):
    """Replica counts and the Ray Serve autoscaling targets for one pool."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas; 0 allows scale to zero (cold starts of large models take many minutes)."""

    max_replicas: int = Field(default=1, ge=1)
    """Most replicas (bounded by the GPUs the cluster can get)."""

    initial_replicas: int | None = Field(default=None, ge=0)
    """Replicas at deploy time; None = `min_replicas`."""

    target_ongoing_requests: float = Field(default=8, gt=0)
    """In-flight requests per replica the autoscaler steers towards."""

    upscale_delay_s: float = Field(default=30, ge=0)
    """How long load must stay high before adding replicas."""

    downscale_delay_s: float = Field(default=600, ge=0)
    """How long load must stay low before removing replicas (GPU replicas are slow to start)."""

    policy: Literal["ray_default", "model"] = "ray_default"
    """Who decides the replica count. `ray_default`: Serve's own policy, ongoing requests per
    replica against `target_ongoing_requests`. `model`: our policy
    (`cluster.autoscale.ray_policy.PoolAutoscalingPolicy`) on the engine stats the replicas
    report (running, waiting, KV usage, acceptance), steering towards
    `target_running_per_replica`; each decision is logged with its inputs in the Serve
    controller log. Serve's bounds and `upscale_delay_s` / `downscale_delay_s` apply to both."""

    target_running_per_replica: float = Field(default=8, gt=0)
    """`model` policy without `target_per_user_tok_s`: engine requests (running + waiting) one
    replica should hold; more adds replicas, fewer removes them (after the cool-downs)."""

    target_per_user_tok_s: float | None = Field(default=None, gt=0)
    """`model` policy with `routing.profile`: the per-user decode rate (tokens/s) the pool keeps.
    The calibrated model predicts each request's rate at the pool's load spread over N replicas;
    the pool gets the fewest N that meet this rate and shrinks only when a smaller N beats it by
    20%. The model follows the pool's measured acceptance online (moving average of the engine
    counters), so a drafter that accepts less scales the pool sooner. None: steer by
    `target_running_per_replica`."""

    context_tokens: int = Field(default=1024, ge=1)
    """`model` policy with `target_per_user_tok_s`: context length (prompt + output) the
    prediction assumes for the requests in flight; longer context, slower decode."""

    target_utilization: float = Field(default=1.0, gt=0, le=1)
    """`model` policy: share of a replica's capacity (requests at the target rate, at most
    `engine.max_num_seqs`) the sizing fills; the rest takes the arrivals that come while a new
    replica starts (minutes for a large model). 1: size to full replicas."""

    demand_window_s: float = Field(default=0, ge=0)
    """`model` policy: size for the most requests the pool held over this many seconds, not
    the latest count, so a lull between bursts does not give back replicas that take minutes
    to return. 0: the latest count."""

    upscale_cooldown_s: float = Field(default=30, ge=0)
    """`model` policy: least time after a replica-count change before it adds replicas."""

    downscale_cooldown_s: float = Field(default=300, ge=0)
    """`model` policy: least time after a replica-count change before it removes replicas
    (removal drains: see `graceful_shutdown_timeout_s`)."""

    stale_stats_s: float = Field(default=35, gt=0)
    """`model` policy: a replica's stats older than this are ignored (Serve pushes them every
    10 s); with no fresh stats at all the pool holds its size."""

    @property
    def replicas_at_deploy(self) -> int:
        return self.initial_replicas if self.initial_replicas is not None else self.min_replicas

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas: larger than max_replicas")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError("initial_replicas: outside min_replicas..max_replicas")
        return self


class PoolConfig(Strict):
    """A pool: replicas of one target with one tuning, deployed as one Serve deployment."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    """Pool name (lowercase, digits, dashes); internal, shown in the `x-cluster-pool` header."""

    target: str
    """Id of the target this pool serves."""

    role: Literal["speculative", "throughput"]
    """`speculative` takes low-concurrency long-context requests; `throughput` everything else."""

    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    """Speculative decoding settings."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    """vLLM engine settings of this pool."""

    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    """Replica counts and autoscaling targets."""

    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """Ray placement strategy of a replica's bundles; STRICT_PACK keeps TP on one NVLink node."""

    cpus_per_replica: float = Field(default=1, gt=0)
    """Logical CPUs of the replica's engine (on GPU: on its first GPU bundle); the Serve
    replica actor adds one more."""

    max_ongoing_requests: int = Field(default=64, ge=1)
    """Requests one replica serves at once. The ingress admits at most this many per running
    replica into the pool; more wait in the pool's queue (`max_queued_requests`). A request
    counts once per sequence it runs (`n` for each prompt) and goes only to pools whose replica
    takes it whole; one that no pool of its target takes is refused (400)."""

    max_queued_requests: int = Field(default=64, ge=0)
    """Requests the ingress holds for this pool once its replicas are full (also Serve's
    `max_queued_requests` of the deployment, the bound for other callers). Beyond it: 429 with
    `Retry-After`."""

    queue_timeout_s: float = Field(default=30, gt=0)
    """Longest a request waits for a free slot, or for a first replica when the pool is at
    zero, before a 503 with `Retry-After`."""

    graceful_shutdown_timeout_s: float = Field(default=120, ge=0)
    """Drain: how long a replica being removed (scale-down, redeploy) lets its in-flight
    requests finish before it is killed (Serve's setting of the same name). In the KubeRay
    render each Ray pod's preStop drains its node and waits this long, and its
    `terminationGracePeriodSeconds` adds a margin, so a node drain does not cut off a stream
    that finishes within this time."""

    graceful_shutdown_wait_loop_s: float = Field(default=2, gt=0)
    """Drain: how often a draining replica checks whether its requests are done."""

    replica_router: Literal["power_of_two", "least_slowdown"] = "power_of_two"
    """How a request picks a replica inside the pool. `power_of_two`: Serve's default (two
    random replicas, the shorter queue wins). `least_slowdown`: the replica with the lowest
    predicted slowdown from its engine stats (running, waiting, KV usage;
    `cluster.deployments.replica_router`), power-of-two while any replica's stats are missing
    or stale."""

    replica_stats_period_s: float = Field(default=2, gt=0)
    """How often Serve pulls each replica's routing stats (`request_routing_stats_period_s`);
    `least_slowdown` treats stats older than 3 periods plus 5 s as stale."""

    stream_batching_interval_ms: float = Field(default=50, ge=0)
    """Ray Serve LLM coalesces a stream's chunks over this many milliseconds before sending
    them on (its `experimental_configs` knob; Ray's default is 50). Fewer, larger messages
    cost less CPU per token; 0 forwards every chunk at once (lowest TTFT)."""

    @model_validator(mode="after")
    def _role_matches_speculation(self) -> PoolConfig:
        if self.role == "speculative" and self.speculation.method == "none":
            raise ValueError("speculation.method: a speculative pool needs eagle3 or ngram")
        data_parallel = self.engine.extra.get("data_parallel_size", 1)
        if self.speculation.num_speculative_tokens_per_batch_size and data_parallel > 1:
            raise ValueError(
                "speculation.num_speculative_tokens_per_batch_size: not supported with "
                f"data parallel > 1 (engine.extra.data_parallel_size is {data_parallel}); vLLM "
                "would silently fall back to a fixed depth. Remove one of the two."
            )
        return self
