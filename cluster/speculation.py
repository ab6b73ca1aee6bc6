"""vLLM's speculative-decoding counters and what they mean, as plain Python.

vLLM counts, cumulatively per engine: drafts (one per request per step that drafted), drafted
tokens, accepted tokens, and accepted tokens by draft position. A measurement takes a snapshot
before and after (`after - before`), then reads:
- mean acceptance length = 1 + accepted / drafts: tokens emitted per target forward pass;
- per-position acceptance = accepted at position i / drafts: how often the i-th drafted token
  survives (it can only be accepted if all before it were).

Snapshots come from an in-process engine (`LLM.get_metrics()`), from a Prometheus `/metrics`
page (a vLLM OpenAI server), or from our pools' `EngineStats`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_PREFIX = "vllm:spec_decode_"
_PROMETHEUS_LINE = re.compile(r"^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


@dataclass(frozen=True)
class SpecCounters:
    drafts: int = 0
    """Speculation steps summed over requests."""
    draft_tokens: int = 0
    """Tokens proposed."""
    accepted: int = 0
    """Proposed tokens the target accepted."""
    accepted_per_position: tuple[int, ...] = field(default_factory=tuple)
    """Accepted tokens by draft position (0 = first drafted token)."""

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        after_pos = _padded(self.accepted_per_position, width)
        before_pos = _padded(before.accepted_per_position, width)
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            accepted_per_position=tuple(a - b for a, b in zip(after_pos, before_pos, strict=True)),
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        return SpecCounters(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted=self.accepted + other.accepted,
            accepted_per_position=tuple(
                a + b
                for a, b in zip(
                    _padded(self.accepted_per_position, width),
                    _padded(other.accepted_per_position, width),
                    strict=True,
                )
            ),
        )

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts; None when nothing was drafted."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position_acceptance(self) -> list[float]:
        if not self.drafts:
            return []
        return [count / self.drafts for count in self.accepted_per_position]

    def summary(self) -> dict[str, Any]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }

    def as_metrics(self) -> dict[str, float]:
        """Flat numeric form (`spec_*` keys; read back with `from_engine_metrics`)."""
        metrics = {
            "spec_drafts": float(self.drafts),
            "spec_draft_tokens": float(self.draft_tokens),
            "spec_accepted_tokens": float(self.accepted),
        }
        for position, count in enumerate(self.accepted_per_position):
            metrics[f"spec_accepted_pos_{position}"] = float(count)
        if self.mean_acceptance_length is not None:
            metrics["mean_acceptance_length"] = self.mean_acceptance_length
        return metrics

    @classmethod
    def from_vllm_metrics(cls, metrics: Iterable[Any]) -> SpecCounters:
        """From `vllm.LLM.get_metrics()` (Counter objects with `.value`, Vector with
        `.values`); several engines' series are summed."""
        totals: dict[str, int] = {}
        per_position: tuple[int, ...] = ()
        for metric in metrics:
            name = getattr(metric, "name", "")
            if not name.startswith(_PREFIX):
                continue
            if name == f"{_PREFIX}num_accepted_tokens_per_pos":
                per_position = (
                    cls(accepted_per_position=per_position)
                    + cls(accepted_per_position=tuple(metric.values))
                ).accepted_per_position
            else:
                totals[name] = totals.get(name, 0) + int(metric.value)
        return cls(
            drafts=totals.get(f"{_PREFIX}num_drafts", 0),
            draft_tokens=totals.get(f"{_PREFIX}num_draft_tokens", 0),
            accepted=totals.get(f"{_PREFIX}num_accepted_tokens", 0),
            accepted_per_position=per_position,
        )

    @classmethod
    def from_engine_metrics(cls, metrics: dict[str, float]) -> SpecCounters:
        """From `as_metrics()` / a pool replica's `EngineStats.as_metrics()` (what
        `/cluster/pools` reports per replica)."""
        positions = sorted(
            (int(key.rsplit("_", 1)[1]), int(value))
            for key, value in metrics.items()
            if key.startswith("spec_accepted_pos_")
        )
        return cls(
            drafts=int(metrics.get("spec_drafts", 0)),
            draft_tokens=int(metrics.get("spec_draft_tokens", 0)),
            accepted=int(metrics.get("spec_accepted_tokens", 0)),
            accepted_per_position=tuple(value for _, value in positions),
        )

    @classmethod
    def from_prometheus(cls, text: str) -> SpecCounters:
        """From a Prometheus exposition page (`GET /metrics` of a vLLM OpenAI server)."""
        totals: dict[str, float] = {}
        positions: dict[int, float] = {}
        for line in text.splitlines():
            match = _PROMETHEUS_LINE.match(line)
            if not match or not match["name"].startswith(_PREFIX):
                continue
            name = match["name"].removesuffix("_total").removesuffix("_created")
            if match["name"].endswith("_created"):
                continue
            value = float(match["value"])
            if name == f"{_PREFIX}num_accepted_tokens_per_pos":
                position = int(re.search(r'position="(\d+)"', match["labels"] or "")[1])
                positions[position] = positions.get(position, 0) + value
            else:
                totals[name] = totals.get(name, 0) + value
        return cls(
            drafts=int(totals.get(f"{_PREFIX}num_drafts", 0)),
            draft_tokens=int(totals.get(f"{_PREFIX}num_draft_tokens", 0)),
            accepted=int(totals.get(f"{_PREFIX}num_accepted_tokens", 0)),
            accepted_per_position=tuple(
                int(positions.get(i, 0)) for i in range(max(positions, default=-1) + 1)
            ),
        )


def _padded(values: tuple[int, ...], width: int) -> tuple[int, ...]:
    return tuple(values) + (0,) * (width - len(values))


Schedule = list[tuple[int, int, int]]
"""vLLM's dynamic speculation schedule: inclusive batch-size ranges `(first, last, k)`."""


def schedule_problem(schedule: Schedule, max_k: int) -> str | None:
    """Why vLLM would refuse (or silently clip) `schedule`, in one line; None if it is fine.
    vLLM's own rules (ranges positive, sorted, disjoint, the first starting at 1) plus ours:
    no gaps (vLLM fills a gap with the previous depth, which nobody means to write) and no
    depth above the pool's `num_speculative_tokens` (vLLM clips it without a word)."""
    if not schedule:
        return "empty (leave it out for a fixed depth)"
    expected = 1
    for first, last, k in schedule:
        if first != expected:
            return f"range ({first}, {last}, {k}) should start at batch size {expected}"
        if last < first:
            return f"range ({first}, {last}, {k}) ends before it starts"
        if not 0 <= k <= max_k:
            return f"depth {k} of range ({first}, {last}) is outside 0..{max_k} (the pool's depth)"
        expected = last + 1
    return None


def derive_schedule(rates: dict[int, dict[int, float]], max_batch_size: int) -> Schedule:
    """The dynamic speculation schedule a measured sweep supports.

    `rates[k][c]`: per-user decode rate at draft depth `k` (0 = no speculation) and `c` requests
    in flight. For every measured `c` the fastest `k` wins (a tie keeps the shallower depth,
    which costs less compute); between measured levels a depth holds until the next measured
    level, and the last one holds above the sweep up to `max_batch_size` (the pool's
    `max_num_seqs`). Adjacent levels with the same depth merge,
    so the schedule has as few range boundaries as the data allows (vLLM issue #49548 reports
    throughput collapsing at boundaries)."""
    levels = sorted({c for by_c in rates.values() for c in by_c})
    if not levels or 0 not in rates:
        raise ValueError("the sweep needs depth 0 (no speculation) and at least one level")
    best = []
    for c in levels:
        measured = {k: by_c[c] for k, by_c in rates.items() if c in by_c}
        best.append(max(sorted(measured), key=lambda k: (measured[k], -k)))
    schedule: Schedule = []
    for i, (c, k) in enumerate(zip(levels, best, strict=True)):
        first = 1 if i == 0 else c
        last = levels[i + 1] - 1 if i + 1 < len(levels) else max(c, max_batch_size)
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], last, k)
        else:
            schedule.append((first, last, k))
    return schedule
