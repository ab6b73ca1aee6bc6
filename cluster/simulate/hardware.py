"""A calibrated profile carried over to other hardware by stated ratios (for the simulator).

This machine's profile (`cluster calibrate`) gives the *shape* of each pool's per-user rate and
TTFT as batch and context grow. On a GPU cluster the scales differ; `HardwareScale` says by how
much, each number an assumption written down in a YAML file next to the preset (e.g.
`configs/profiles/kimi-k2.6-nvfp4-p6-b200.scale.yaml`):

- rates: the throughput pool's single-stream decode rate on the target hardware, and the
  speculative pool's lift over it at one request (the release's documented number);
- batch: one request here costs what `batch_scale` requests cost there (GPUs batch far more
  before decode turns compute-bound);
- context: `context_scale` tokens there behave like one token here;
- TTFT: the throughput pool's TTFT at one request and 1k context there.

`scaled_model` wraps each `PoolModel` with those factors; routing and autoscaling call it through
the same methods as a calibrated model (`per_user_rate`, `ttft_s`, `typical_output_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from cluster.autoscale.model import PerformanceModel, PoolModel
from cluster.config import load_yaml_model

ANCHOR_CONTEXT_TOKENS = 1000
"""Context (on the target hardware) at which the rate and TTFT anchors hold."""


class HardwareScale(BaseModel):
    """How a profile measured here maps to the target hardware (every field an assumption)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    description: str = ""
    """What the numbers stand for and where they come from."""
    profile: str | None = None
    """The calibration profile measured here that these ratios carry over (relative to this
    file): the one whose shape (where speculation stops paying as the batch grows) is closest
    to the target's. None: `cluster simulate`'s default profile."""
    single_stream_tok_s: float = Field(gt=0)
    """Throughput pool (no speculation): decode tokens/s of one request alone on a replica,
    with 1k tokens of context."""
    speculative_lift_at_1: float = Field(gt=0)
    """Speculative over throughput pool, per-user rate at one request per replica."""
    batch_scale: float = Field(default=1, gt=0)
    """Requests in a replica's batch there that cost what one costs here."""
    context_scale: float = Field(default=1, gt=0)
    """Context tokens there that cost what one costs here."""
    ttft_1k_s: float = Field(gt=0)
    """Throughput pool: time to first token of one request alone with 1k tokens of context."""
    typical_output_tokens: float | None = Field(default=None, gt=0)
    """Output tokens of a typical request on the target (what routing assumes for the requests
    queued ahead); None: the profile's (its benchmark workload's)."""
    documented_lift: dict[int, float] = Field(default_factory=dict)
    """Published per-user lift of the speculative pool by concurrency, to report beside the
    scaled model's own (not fitted: the check of the carried-over shape)."""

    @classmethod
    def load(cls, path: str | Path) -> HardwareScale:
        scale = load_yaml_model(cls, path)
        if scale.profile:
            scale.profile = str(Path(path).parent / scale.profile)
        return scale


@dataclass
class ScaledPoolModel:
    """A `PoolModel` with its batch, context, rate and TTFT axes rescaled."""

    base: PoolModel
    rate_scale: float
    ttft_scale: float
    batch_scale: float
    context_scale: float
    output_tokens: float | None = None

    @property
    def typical_output_tokens(self) -> float:
        return self.output_tokens or self.base.typical_output_tokens

    def _here(self, batch: float, context_tokens: float) -> tuple[float, float]:
        # Fractional batches here are fine: the fitted step time is smooth in the batch.
        return max(1.0, batch / self.batch_scale), context_tokens / self.context_scale

    def per_user_rate(
        self, batch: float, context_tokens: float, output_tokens: float | None = None
    ) -> float:
        here_batch, here_context = self._here(batch, context_tokens)
        return self.rate_scale * self.base.per_user_rate(here_batch, here_context, output_tokens)

    def ttft_s(self, batch: float, context_tokens: float) -> float:
        return self.ttft_scale * self.base.ttft_s(*self._here(batch, context_tokens))


def scaled_model(
    base: PerformanceModel, scale: HardwareScale, roles: dict[str, str]
) -> PerformanceModel:
    """`base` (pools by name, `roles`: pool -> `speculative`/`throughput`) on the target
    hardware: the throughput pool's rate at one request becomes `single_stream_tok_s`, the
    speculative pool's becomes `speculative_lift_at_1` times that."""
    by_role = {role: name for name, role in roles.items()}
    throughput = base.pools[by_role["throughput"]]
    here_context = ANCHOR_CONTEXT_TOKENS / scale.context_scale
    pools = {}
    for name, model in base.pools.items():
        wanted = scale.single_stream_tok_s
        if roles[name] == "speculative":
            wanted *= scale.speculative_lift_at_1
        pools[name] = ScaledPoolModel(
            base=model,
            rate_scale=wanted / model.per_user_rate(1, here_context),
            ttft_scale=scale.ttft_1k_s / throughput.ttft_s(1, here_context),
            batch_scale=scale.batch_scale,
            context_scale=scale.context_scale,
            output_tokens=scale.typical_output_tokens,
        )
    return PerformanceModel(pools)  # type: ignore[arg-type]  # same methods as PoolModel


def lift_by_concurrency(
    model: PerformanceModel, roles: dict[str, str], concurrencies: list[int], context: int
) -> dict[int, float]:
    """Speculative over throughput per-user rate at each concurrency per replica."""
    by_role = {role: name for name, role in roles.items()}
    spec, thr = model.pools[by_role["speculative"]], model.pools[by_role["throughput"]]
    return {
        c: round(spec.per_user_rate(c, context) / thr.per_user_rate(c, context), 3)
        for c in concurrencies
    }
