"""Performance model: predicted per-user decode rate and TTFT of a pool replica.

Plain Python + numpy (no Ray, no vLLM) so routing, autoscaling and the simulator share it.

Physical form (coefficients fitted on calibration points):

- A decode *step* of a replica with `B` requests in flight, each holding `x` thousand context
  tokens and drafting `k` tokens, verifies `V = B*(1+k)` tokens and takes
  `a + b*V + q*V^2 + c*V*x + p*(B-1)*x*tps/out + d*k` seconds: fixed overhead; the target's
  cost per verified token; `q*V^2`, a smooth stand-in for the roofline knee (a step costs
  little more per token while memory-bound, then grows once it is compute-bound: 1 -> 4
  requests add ~15% here, 4 -> 16 add ~3x); attention over the context; the prefills of the
  other `B-1` requests that land between this request's steps (each restarts every `out/tps`
  steps, `out` output tokens per request); and the drafter's `k` sequential passes.
- Tokens a request gains per step: `tps = 1 + sum(acceptance[:k])`, with `k` the depth in
  effect at batch `B` (fixed, or the pool's dynamic schedule) and `acceptance[i]` the measured
  rate at which the i-th drafted token survives.
- Per-user decode rate = `tps / step`.
- TTFT = `e^t0 * x^t1 * B^t2`: prefill grows a little faster than the context (attention) and
  queueing behind the other requests' prefills and steps grows with the batch.

The step time is the target's on its hardware, so `PerformanceModel.from_profile` fits it on
every pool's points (pools differ in speculation only, which enters through `k` and `tps`; the
speculative pool alone has too few points for six coefficients); acceptance, TTFT and output
length are per pool. Coefficients are fitted by least squares kept non-negative (a negative
cost has no physical meaning and extrapolates badly). Online, `PoolModel.observe` corrects the
acceptance and the step time from the engines' counters with an exponential moving average.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.autoscale.profile import (
    DEFAULT_OUTPUT_TOKENS,
    CalibrationPoint,
    CalibrationProfile,
    PoolSpeculation,
)

EMA_WINDOW = 20
"""Online correction: observations an exponential moving average effectively spans."""
EMA_ALPHA = 2 / (EMA_WINDOW + 1)
"""Weight of the newest observation (the usual `2 / (N + 1)` for an N-sample window)."""

MIN_CONTEXT_TOKENS = 16
"""Contexts shorter than this are predicted as this long (the TTFT power law has no floor)."""

STEP_FEATURES = ("overhead", "verify", "compute_knee", "attention", "others_prefill", "draft")
"""Names of the step-time coefficients, in order (the profile of a fitted model lists them)."""


def _step_features(
    batch: float, context_tokens: float, depth: int, tokens_per_step: float, output_tokens: float
) -> list[float]:
    x = max(context_tokens, MIN_CONTEXT_TOKENS) / 1000
    verified = batch * (1 + depth)
    others = (batch - 1) * x * tokens_per_step / max(output_tokens, 1)
    return [1.0, verified, verified**2, verified * x, others, float(depth)]


def _ttft_features(batch: float, context_tokens: float) -> list[float]:
    x = max(context_tokens, MIN_CONTEXT_TOKENS) / 1000
    return [1.0, math.log(x), math.log(max(batch, 1))]


def nonnegative_least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (active set: drop the most negative
    coefficient and refit until none is left); columns that are all zero get 0."""
    x, y = np.asarray(rows, float), np.asarray(targets, float)
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    while active:
        solution = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        worst = int(np.argmin(solution))
        if solution[worst] >= 0:
            break
        active.pop(worst)
    coefficients = [0.0] * x.shape[1]
    for j, value in zip(active, solution if active else [], strict=True):
        coefficients[j] = float(value)
    return coefficients


@dataclass
class PoolModel:
    """Fitted model of one pool's replicas, plus its online corrections."""

    step_coefficients: tuple[float, ...]
    """Seconds per unit of each of `STEP_FEATURES`."""
    ttft_coefficients: tuple[float, float, float]
    """`(t0, t1, t2)` of `ttft = e^t0 * (context/1000)^t1 * batch^t2`."""
    speculation: PoolSpeculation = field(default_factory=PoolSpeculation)
    acceptance_per_position: tuple[float, ...] = ()
    """Calibrated acceptance by draft position (averaged over the points that drafted it)."""
    typical_output_tokens: float = DEFAULT_OUTPUT_TOKENS
    """Output tokens per request assumed when a prediction does not say."""
    acceptance_scale: float = 1.0
    """Online: observed over calibrated (acceptance length - 1), moving average."""
    step_time_scale: float = 1.0
    """Online: observed over predicted step time, moving average."""

    @classmethod
    def fit(
        cls,
        points: Iterable[CalibrationPoint],
        speculation: PoolSpeculation | None = None,
        step_points: Iterable[CalibrationPoint] | None = None,
    ) -> PoolModel:
        """Fit on one pool's points. `speculation`: the deployed one (default: a fixed depth,
        the deepest the points drafted). `step_points`: the points the step time is fitted on
        (default: `points`; `PerformanceModel` passes every pool's points of the target)."""
        points = list(points)
        if not points:
            raise ValueError("no calibration points to fit")
        depth = max(p.depth for p in points)
        if speculation is None:
            method = "eagle3" if depth else "none"
            speculation = PoolSpeculation(method=method, num_speculative_tokens=depth)
        step_points = points if step_points is None else list(step_points)
        step = nonnegative_least_squares(
            [
                _step_features(
                    p.batch, p.context_tokens, p.depth, p.tokens_per_step, p.output_tokens
                )
                for p in step_points
            ],
            [p.tokens_per_step / p.per_user_tok_s for p in step_points],
        )
        ttft = np.linalg.lstsq(
            np.asarray([_ttft_features(p.batch, p.context_tokens) for p in points]),
            np.log([p.ttft_s for p in points]),
            rcond=None,
        )[0]
        acceptance = []
        for position in range(depth):
            drafted = [p.acceptance_per_position[position] for p in points if p.depth > position]
            acceptance.append(statistics.fmean(drafted))
        return cls(
            step_coefficients=tuple(step),
            ttft_coefficients=tuple(float(t) for t in ttft),
            speculation=speculation,
            acceptance_per_position=tuple(acceptance),
            # Output length is the workload's, not the pool's: every step point counts.
            typical_output_tokens=statistics.median(p.output_tokens for p in step_points),
        )

    def depth_at(self, batch: int) -> int:
        """Depth in effect at `batch`, capped at what calibration measured acceptance for."""
        return min(self.speculation.depth_at(batch), len(self.acceptance_per_position))

    def tokens_per_step(self, batch: int, depth: int | None = None) -> float:
        """Expected tokens a request gains per step (mean acceptance length) at `batch` (at
        `depth`, when the caller has it: `depth_at(batch)`)."""
        accepted = self.acceptance_per_position[: self.depth_at(batch) if depth is None else depth]
        return 1 + sum(min(1.0, a * self.acceptance_scale) for a in accepted)

    def per_user_rate(
        self, batch: int, context_tokens: int, output_tokens: float | None = None
    ) -> float:
        """Predicted decode tokens/s one request sees with `batch` requests in flight on its
        replica (itself included), each with `context_tokens` of context: tokens per step over
        the step time."""
        batch = max(batch, 1)
        depth = self.depth_at(batch)  # the simulator's hot path: depth and tokens once
        tokens_per_step = self.tokens_per_step(batch, depth)
        features = _step_features(
            batch,
            context_tokens,
            depth,
            tokens_per_step,
            output_tokens or self.typical_output_tokens,
        )
        step = sum(c * f for c, f in zip(self.step_coefficients, features, strict=True))
        return tokens_per_step / (max(step, 1e-6) * self.step_time_scale)

    def ttft_s(self, batch: int, context_tokens: int) -> float:
        """Predicted time to first token with `batch` requests in flight (itself included)."""
        t0, t1, t2 = self.ttft_coefficients
        _, log_x, log_b = _ttft_features(batch, context_tokens)
        return math.exp(t0 + t1 * log_x + t2 * log_b)

    def observe(
        self,
        mean_acceptance_length: float | None,
        step_time_ratio: float | None,
        depth: int | None = None,
    ) -> None:
        """Fold in one observation from the engines (None: not measured this time).

        `mean_acceptance_length`: 1 + accepted / drafts over the last period, measured at draft
        depth `depth` (default: the pool's full depth). `step_time_ratio`: observed over
        predicted step time for the same period. Each moves its correction by `EMA_ALPHA`."""
        calibrated = sum(self.acceptance_per_position[: depth or self.depth_at(1)])
        if mean_acceptance_length is not None and calibrated > 0:
            observed = max(mean_acceptance_length - 1, 0) / calibrated
            self.acceptance_scale += EMA_ALPHA * (observed - self.acceptance_scale)
        if step_time_ratio is not None and step_time_ratio > 0 and math.isfinite(step_time_ratio):
            self.step_time_scale += EMA_ALPHA * (step_time_ratio - self.step_time_scale)


@dataclass(frozen=True)
class Prediction:
    per_user_tok_s: float
    ttft_s: float


@dataclass
class PerformanceModel:
    """Every pool's model, by pool name."""

    pools: dict[str, PoolModel]

    @classmethod
    def from_profile(cls, profile: CalibrationProfile) -> PerformanceModel:
        """One model per pool of the profile; the step time is fitted on all its points (one
        target on one machine; see the module docstring)."""
        by_pool: dict[str, list[CalibrationPoint]] = {}
        for point in profile.points:
            by_pool.setdefault(point.pool, []).append(point)
        return cls(
            {
                pool: PoolModel.fit(points, profile.pools.get(pool), profile.points)
                for pool, points in sorted(by_pool.items())
            }
        )

    @classmethod
    def load(cls, path: str | Path) -> PerformanceModel:
        return cls.from_profile(CalibrationProfile.load(path))

    def predict(
        self, pool: str, batch: int, context_tokens: int, output_tokens: float | None = None
    ) -> Prediction:
        model = self.pools[pool]
        return Prediction(
            per_user_tok_s=model.per_user_rate(batch, context_tokens, output_tokens),
            ttft_s=model.ttft_s(batch, context_tokens),
        )
