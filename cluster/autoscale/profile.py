"""Calibration profile: measured points per pool (`cluster calibrate` writes it as YAML that
humans read and diff) and each pool's speculation as deployed. `PerformanceModel.from_profile`
(cluster/autoscale/model.py) fits the model on it."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_OUTPUT_TOKENS = 128
"""Output tokens per request assumed where a calibration point does not say."""


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured cell: a pool at one batch size and context length (medians of a run)."""

    pool: str
    context_tokens: int
    batch: int
    """Requests in flight on the replica (the closed-loop concurrency of the cell)."""
    per_user_tok_s: float
    """Median per-user decode rate (1 / TPOT)."""
    ttft_s: float
    """Median time to first token."""
    acceptance_per_position: tuple[float, ...] = ()
    """Share of drafts whose i-th drafted token was accepted; empty without speculation."""
    depth: int = 0
    """Drafted tokens per step in effect (drafted / drafts, rounded); 0 without speculation."""
    output_tokens: float = DEFAULT_OUTPUT_TOKENS
    """Mean output tokens per request (sets how often other requests' prefills interrupt)."""
    source: str = ""
    """Where it was measured: `run/config/cell`."""

    @property
    def tokens_per_step(self) -> float:
        return 1 + sum(self.acceptance_per_position[: self.depth])


class PoolSpeculation(BaseModel):
    """How a pool speculates (what the model needs of its `speculation` config)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    method: str = "none"
    """`none`, `eagle3` or `ngram`."""
    num_speculative_tokens: int = 0
    """Draft depth (the most, with a dynamic schedule)."""
    schedule: list[tuple[int, int, int]] | None = None
    """Dynamic speculation: inclusive batch-size ranges `[first, last, k]`; None: fixed depth."""

    def depth_at(self, batch: int) -> int:
        """Depth vLLM uses with `batch` requests running (above the schedule: its last depth)."""
        if self.method == "none":
            return 0
        if not self.schedule:
            return self.num_speculative_tokens
        batch = math.ceil(batch)  # a scaled model's batch may be fractional; ranges are whole
        for first, last, k in self.schedule:
            if first <= batch <= last:
                return k
        return self.schedule[-1][2]

    @classmethod
    def from_config(cls, speculation: Any) -> PoolSpeculation:
        """From a pool's `SpeculationConfig` (or its dict form)."""
        data = speculation if isinstance(speculation, Mapping) else speculation.model_dump()
        schedule = data.get("num_speculative_tokens_per_batch_size")
        return cls(
            method=data.get("method", "none"),
            num_speculative_tokens=data.get("num_speculative_tokens") or 0,
            schedule=[tuple(r) for r in schedule] if schedule else None,
        )


class CalibrationProfile(BaseModel):
    """Calibration of one deployment's pools: YAML that a human reads and diffs.

    Written by `cluster calibrate`; read by the ingress (routing), the autoscaling policies and
    `cluster simulate` through `PerformanceModel.from_profile`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    machine: dict[str, Any] = Field(default_factory=dict)
    """Where the runs were measured (CPUs, processor, platform) and package versions."""
    sources: list[str] = Field(default_factory=list)
    """Benchmark run directories the points come from."""
    configs: dict[str, str] = Field(default_factory=dict)
    """Benchmark configuration measured for each pool (pool -> bench config name)."""
    pools: dict[str, PoolSpeculation] = Field(default_factory=dict)
    """Each pool's speculation as deployed (the model predicts with this schedule)."""
    points: list[CalibrationPoint] = Field(default_factory=list)
    """Measured cells, one per (run, configuration, workload, concurrency)."""

    def dump_yaml(self) -> str:
        data = json.loads(self.model_dump_json())  # tuples -> lists, plain types only
        return yaml.safe_dump(data, sort_keys=False, width=100, default_flow_style=None)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(_PROFILE_HEADER + self.dump_yaml())

    @classmethod
    def load(cls, path: str | Path) -> CalibrationProfile:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    @classmethod
    def from_bench_run(
        cls, path: str | Path, pool_of_config: Mapping[str, str]
    ) -> CalibrationProfile:
        """Points from a `cluster bench` run directory: per configuration in `pool_of_config`
        (bench config name -> pool name) and cell, the median per-user rate and TTFT over the
        measured repetitions, and acceptance per position from the counters summed over them.
        A configuration of N replicas (`<role>-x2`) puts concurrency / N on each (the batch)."""
        from cluster.bench import stats

        path = Path(path)
        result = json.loads((path / "result.json").read_text())
        records = stats.measured(stats.usable_records(result))
        points = []
        for config, pool in pool_of_config.items():
            replicas = _fixed_replicas((result["configs"].get(config) or {}).get("config"))
            for cell, _, concurrency in stats.cells_of(records):
                reps = list(stats.by_repetition(records, config, cell).values())
                if reps:
                    batch = math.ceil(concurrency / replicas)
                    points.append(_point(pool, batch, reps, f"{path.name}/{config}/{cell}"))
        pools = {}
        for config, pool in pool_of_config.items():
            data = (result["configs"].get(config) or {}).get("config") or {}
            if data.get("pools"):
                pools[pool] = PoolSpeculation.from_config(data["pools"][0].get("speculation") or {})
        return cls(
            machine={**result.get("machine", {}), "versions": result.get("versions", {})},
            sources=[path.name],
            configs={pool: config for config, pool in pool_of_config.items()},
            pools=pools,
            points=points,
        )

    @classmethod
    def combine(cls, profiles: Sequence[CalibrationProfile]) -> CalibrationProfile:
        """One profile from several runs' (later runs' machine and speculation win)."""
        combined = cls()
        for profile in profiles:
            combined.machine = profile.machine or combined.machine
            combined.sources += profile.sources
            combined.configs |= profile.configs
            combined.pools |= profile.pools
            combined.points += profile.points
        return combined


_PROFILE_HEADER = """\
# Calibration profile (`cluster calibrate`): measured points per pool, read by
# cluster.autoscale.model.PerformanceModel. Edit by re-running calibrate, not by hand.
"""


def _fixed_replicas(data: Mapping[str, Any] | None) -> int:
    """Replicas of a single-pool benchmark configuration (1 unless its min and max agree)."""
    pools = (data or {}).get("pools") or [{}]
    scaling = pools[0].get("autoscaling") or {}
    low, high = scaling.get("min_replicas", 1), scaling.get("max_replicas", 1)
    return max(1, low) if low == high else 1


def _point(pool: str, batch: int, reps: list[dict[str, Any]], source: str) -> CalibrationPoint:
    drafts = draft_tokens = 0
    accepted: list[float] = []
    for rep in reps:
        spec = rep.get("speculation") or {}
        n = spec.get("drafts") or 0
        drafts += n
        draft_tokens += spec.get("draft_tokens") or 0
        rates = spec.get("per_position_acceptance") or []
        accepted += [0.0] * (len(rates) - len(accepted))
        for i, rate in enumerate(rates):
            accepted[i] += rate * n
    depth = round(draft_tokens / drafts) if drafts else 0
    return CalibrationPoint(
        pool=pool,
        context_tokens=round(statistics.median(r["mean_prompt_tokens"] for r in reps)),
        batch=batch,
        per_user_tok_s=round(statistics.median(r["per_user_tok_s"] for r in reps), 3),
        ttft_s=round(statistics.median(r["ttft_p50_s"] for r in reps), 4),
        acceptance_per_position=tuple(round(a / drafts, 4) for a in accepted[:depth]),
        depth=depth,
        output_tokens=round(statistics.median(r["mean_output_tokens"] for r in reps), 1),
        source=source,
    )
