"""Pool choice per request: pure policy, no Ray, so the simulator and unit tests use it as is.

Rule v1: speculation pays off when decoding is memory-bandwidth-bound per request, i.e. at low
concurrency; long prompts (agent traces, long-file completion, document QA) are where a drafter
that keeps its acceptance length on long context (EAGLE 3.1) wins most. So a request whose
prompt has at least `long_context_tokens` goes to the speculative pool while that pool's
in-flight requests per replica stay below `spec_max_concurrency_per_replica`; everything else
goes to the throughput pool. If one pool has no running replica, the other takes the request;
a pool at zero replicas that may scale from zero counts as up (its first request wakes it).

The ingress calls `choose_pool` with request features and pool loads only: this module is the
seam a smarter policy replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from cluster.config import RoutingConfig


class Reason(StrEnum):
    """Why a pool was chosen; the value is what `x-cluster-route-reason` carries."""

    LONG_CONTEXT = "long_context"
    """Long prompt and the speculative pool has headroom."""
    SHORT_PROMPT = "short_prompt"
    """Prompt below the long-context threshold."""
    SPEC_SATURATED = "spec_pool_saturated"
    """Long prompt, but the speculative pool is too busy for speculation to pay off."""
    SPEC_POOL_DOWN = "spec_pool_down"
    """The speculative pool has no running replica (or none is configured)."""
    THROUGHPUT_POOL_DOWN = "throughput_pool_down"
    """The throughput pool has no running replica (or none is configured)."""


@dataclass(frozen=True)
class PoolLoad:
    """What the router knows about one pool right now."""

    running_replicas: int
    in_flight: int
    scales_from_zero: bool = False
    """`min_replicas: 0`: no replica may be running, yet a request starts one."""

    @property
    def up(self) -> bool:
        return self.running_replicas > 0 or self.scales_from_zero

    @property
    def in_flight_per_replica(self) -> float:
        if not self.up:
            return float("inf")
        return self.in_flight / max(self.running_replicas, 1)


@dataclass(frozen=True)
class Decision:
    role: str
    """`speculative` or `throughput`."""
    reason: Reason


def choose_pool(
    prompt_tokens: int,
    speculative: PoolLoad | None,
    throughput: PoolLoad | None,
    rule: RoutingConfig,
) -> Decision:
    """Choose the pool role for one request. `None` means the target has no such pool.

    When both pools are down the preferred pool is returned anyway, so the caller gets the
    pool's own error (or waits for a replica that is starting) instead of a guess.
    """
    spec_up = speculative is not None and speculative.up
    thr_up = throughput is not None and throughput.up
    if speculative is None or (not spec_up and thr_up):
        return Decision("throughput", Reason.SPEC_POOL_DOWN)
    if throughput is None or (not thr_up and spec_up):
        return Decision("speculative", Reason.THROUGHPUT_POOL_DOWN)
    if prompt_tokens < rule.long_context_tokens:
        return Decision("throughput", Reason.SHORT_PROMPT)
    if speculative.in_flight_per_replica < rule.spec_max_concurrency_per_replica:
        return Decision("speculative", Reason.LONG_CONTEXT)
    return Decision("throughput", Reason.SPEC_SATURATED)
