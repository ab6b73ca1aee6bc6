"""What a simulation records per request and reports per strategy."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.simulate.trace import TraceRequest
from cluster.slo import Outcome, Slo


@dataclass
class SimulatedRequest:
    """One trace request as the simulated cluster served it."""

    trace: TraceRequest
    pool: str = ""
    first_token_s: float | None = None
    finished_s: float | None = None
    rejected: bool = False


@dataclass
class SimulationResult:
    strategy: str
    requests: int
    completed: int
    rejected: int
    gpu_hours: float
    slo_attainment: float
    """Share of all requests (rejected ones included) that met both SLOs."""
    per_user_tok_s: dict[str, float]
    """p10 / p50 / p90 of completed requests' decode rate (output tokens / decode time)."""
    ttft_s: dict[str, float]
    """p50 / p90 / p99 of completed requests."""
    routed: dict[str, int]
    replicas: list[dict[str, Any]]
    """Per control interval: the time and each pool's replicas (running or starting)."""
    description: str = ""

    @classmethod
    def of(
        cls,
        strategy: str,
        description: str,
        done: Sequence[SimulatedRequest],
        gpu_seconds: float,
        slo: Slo,
        timeline: list[dict[str, Any]],
        warmup_s: float = 0.0,
    ) -> SimulationResult:
        """The result of a run whose finished and rejected requests are `done` (those that
        arrived during the first `warmup_s` are not counted)."""
        counted = [r for r in done if r.trace.arrival_s >= warmup_s]
        total = len(counted)
        completed = [r for r in counted if not r.rejected and r.finished_s is not None]
        rates, ttfts, met = [], [], 0
        for request in completed:
            ttft = request.first_token_s - request.trace.arrival_s
            decode_s = request.finished_s - request.first_token_s
            rate = request.trace.output_tokens / decode_s if decode_s > 0 else math.inf
            rates.append(rate)
            ttfts.append(ttft)
            met += slo.outcome(ttft, request.trace.output_tokens, decode_s) is Outcome.MET
        return cls(
            strategy=strategy,
            description=description,
            requests=total,
            completed=len(completed),
            rejected=sum(r.rejected for r in counted),
            gpu_hours=round(gpu_seconds / 3600, 3),
            slo_attainment=round(met / total, 4) if total else math.nan,
            per_user_tok_s=_percentiles(rates, {"p10": 0.1, "p50": 0.5, "p90": 0.9}),
            ttft_s=_percentiles(ttfts, {"p50": 0.5, "p90": 0.9, "p99": 0.99}),
            routed=dict(Counter(r.pool for r in counted)),
            replicas=timeline,
        )

    def summary(self) -> dict[str, Any]:
        """Everything but the timeline."""
        return {k: v for k, v in self.__dict__.items() if k != "replicas"}


def _percentiles(values: Sequence[float], points: dict[str, float]) -> dict[str, float]:
    if not values:
        return {name: math.nan for name in points}
    ordered = sorted(values)
    return {
        name: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
        for name, q in points.items()
    }
