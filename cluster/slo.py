"""A request's service-level objectives: its first token within `ttft_s`, then at least
`per_user_tok_s` output tokens per second. One definition for the ingress (what it counts per
pool, live) and the simulator (the SLO attainment it reports), so a live cluster's attainment
and `cluster simulate`'s are the same number.

The per-user rate is output tokens over the time from the first token to the last, as the
client sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from cluster.config import RoutingConfig


class Outcome(StrEnum):
    """How a request fared against the objectives (the first one it missed)."""

    MET = "met"
    TTFT = "ttft"
    """Its first token came later than `ttft_s`."""
    TPOT = "tpot"
    """It decoded slower than `per_user_tok_s`."""


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    """Time to first token; None: no objective."""
    per_user_tok_s: float | None = None
    """Output tokens per second after the first; None: no objective."""

    @classmethod
    def from_routing(cls, routing: RoutingConfig) -> Slo | None:
        """The objectives a config sets (`routing.ttft_slo_s`, `routing.tpot_slo_s`); None when
        it sets neither."""
        if routing.ttft_slo_s is None and routing.tpot_slo_s is None:
            return None
        rate = 1 / routing.tpot_slo_s if routing.tpot_slo_s else None
        return cls(ttft_s=routing.ttft_slo_s, per_user_tok_s=rate)

    def outcome(self, ttft_s: float, output_tokens: int, decode_s: float) -> Outcome:
        """`decode_s`: from the first token to the last (0 for a single token: no rate)."""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return Outcome.TTFT
        rate = output_tokens / decode_s if decode_s > 0 else math.inf
        if self.per_user_tok_s is not None and rate < self.per_user_tok_s:
            return Outcome.TPOT
        return Outcome.MET
