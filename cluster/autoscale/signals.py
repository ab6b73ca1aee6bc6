"""Engine signals that understand speculation: what each pool replica reports.

Plain Python (no Ray, no vLLM) so routing, autoscaling policies and a simulator share it. The
speculation counters are cumulative since the engine started, like vLLM's
`vllm:spec_decode_*` Prometheus counters; consumers take deltas between two snapshots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EngineStats:
    """Latest scheduler state plus cumulative token and speculation counters of one engine."""

    running: int = 0
    """Requests in the running batch."""
    waiting: int = 0
    """Requests queued in the engine's scheduler."""
    kv_cache_usage: float = 0.0
    """Fraction of KV cache blocks in use (0..1)."""
    generation_tokens: int = 0
    """Output tokens produced."""
    spec_drafts: int = 0
    """Speculation steps (one per request per step that drafted)."""
    spec_draft_tokens: int = 0
    """Tokens proposed by the drafter."""
    spec_accepted_tokens: int = 0
    """Drafted tokens the target accepted."""
    spec_accepted_per_position: list[int] = field(default_factory=list)
    """Accepted tokens by draft position (index 0 = first drafted token)."""

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per target forward pass: 1 + accepted / drafts (None if no drafts)."""
        if not self.spec_drafts:
            return None
        return 1 + self.spec_accepted_tokens / self.spec_drafts

    def add_speculation(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]):
        self.spec_drafts += drafts
        self.spec_draft_tokens += draft_tokens
        self.spec_accepted_tokens += accepted
        if len(self.spec_accepted_per_position) < len(per_pos):
            missing = len(per_pos) - len(self.spec_accepted_per_position)
            self.spec_accepted_per_position.extend([0] * missing)
        for position, count in enumerate(per_pos):
            self.spec_accepted_per_position[position] += count

    def as_metrics(self) -> dict[str, float]:
        """Flat numeric form for Serve's `record_autoscaling_stats` / routing stats."""
        metrics = {k: float(v) for k, v in asdict(self).items() if not isinstance(v, list)}
        for position, count in enumerate(self.spec_accepted_per_position):
            metrics[f"spec_accepted_pos_{position}"] = float(count)
        if self.mean_acceptance_length is not None:
            metrics["mean_acceptance_length"] = self.mean_acceptance_length
        return metrics
