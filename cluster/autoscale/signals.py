"""Engine signals that understand speculation: what each pool replica reports.

Plain Python (no Ray, no vLLM) so routing, autoscaling policies and a simulator share it. The
speculation counters are `cluster.speculation.SpecCounters` (the one type for vLLM's
`vllm:spec_decode_*` counters), cumulative since the engine started; consumers take deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.speculation import SpecCounters

LOAD_GAUGES = frozenset({"running", "waiting", "kv_cache_usage"})
"""The metrics of `EngineStats.as_metrics()` that are the load at an instant (a policy may
average them over time). Every other one is a cumulative counter, or derived from them, and is
read at its latest value: an average of a cumulative counter is no count of anything."""

REPLICA_KEY = "replica"
"""Key of the replica's id beside its `EngineStats.as_metrics()` in `PoolServer.stats()`."""


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
    finished_requests: int = 0
    """Requests finished (any reason)."""
    speculation: SpecCounters = field(default_factory=SpecCounters)
    """Drafts, drafted and accepted tokens (also by draft position)."""

    def as_metrics(self) -> dict[str, float]:
        """Flat numeric form for Serve's `record_autoscaling_stats` / routing stats (read back
        with `SpecCounters.from_engine_metrics`)."""
        return {
            "running": float(self.running),
            "waiting": float(self.waiting),
            "kv_cache_usage": float(self.kv_cache_usage),
            "generation_tokens": float(self.generation_tokens),
            "finished_requests": float(self.finished_requests),
            **self.speculation.as_metrics(),
        }


INGRESS_QUEUE_PREFIX = "queued:"
"""Start of the ingress's autoscaling metrics: `queued:<pool deployment>` is how many requests
wait at one ingress replica's gate for that pool (read by the application-level policy)."""


def ingress_queue_metric(deployment: str) -> str:
    """The ingress's metric name for requests waiting for the pool deployed as `deployment`."""
    return f"{INGRESS_QUEUE_PREFIX}{deployment}"
