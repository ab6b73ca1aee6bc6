"""The serving levers of the ablation: `<base>:<lever>` changes one setting of a configuration
(`none`, `rayllm` or `vllm-serve`) and is paired with it in the ratios. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Lever:
    """One serving lever changed on a configuration (`<base>:<name>`): the ablation."""

    bases: tuple[str, ...]
    """The configurations it applies to (`none`; `rayllm`: Ray Serve LLM's own app)."""
    description: str
    overrides: dict[str, Any] = field(default_factory=dict)
    """YAML overrides of the cluster config (`pool`: the pool's fields)."""
    environment: dict[str, str] = field(default_factory=dict)
    """Environment variables of the server's processes."""
    beside: str | None = None
    """A configuration of the same run whose server stays up, idle, during this one's turns
    instead of frozen (the run must include it; servers kept for the run, not restarted)."""


HAPROXY = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
LEVERS: dict[str, Lever] = {
    "batch0": Lever(
        ("none",),
        "stream chunks forwarded at once (`stream_batching_interval_ms: 0`)",
        {"pool": {"stream_batching_interval_ms": 0}},
    ),
    "batch10": Lever(
        ("none",),
        "stream chunks coalesced over 10 ms",
        {"pool": {"stream_batching_interval_ms": 10}},
    ),
    "no-throughput-opt": Lever(
        ("none",),
        "without `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`",
        {"ray": {"serve_throughput_optimized": False}},
    ),
    "haproxy": Lever(
        ("none", "rayllm"),
        "Serve's HAProxy proxy (`RAY_SERVE_ENABLE_HA_PROXY=1`)",
        environment=HAPROXY,
    ),
    # Direct streaming makes the LLM server itself the HTTP ingress (`build_openai_app` only,
    # and only behind HAProxy): our ingress is the router, so the lever exists for Ray Serve
    # LLM's app, where beside `rayllm:haproxy` it says what the ingress hop costs.
    "direct-streaming": Lever(
        ("rayllm",),
        "Ray Serve LLM's direct streaming (`RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`, alpha: "
        "the LLM server is the ingress, no router hop; behind HAProxy, which it requires)",
        environment={"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", **HAPROXY},
    ),
    "status1": Lever(
        ("none",),
        "the pools' replica counts refreshed every second even when settled "
        "(`routing.pool_status_idle_refresh_s: 1`, the cadence before it existed)",
        {"routing": {"pool_status_idle_refresh_s": 1}},
    ),
    "nice0": Lever(
        ("none",),
        "Ray workers (engine, proxy, ingress) at nice 0 like Ray's daemons "
        "(`RAY_worker_niceness=0`; Ray's default 15 lets its daemons preempt the engine)",
        environment={"RAY_worker_niceness": "0"},
    ),
    # The largest share of Ray's idle CPU here: the controller's 0.1 s loop (idle `none` server
    # 23.6% -> 17.7% of a core at 0.5 s, controller 4.9% -> 1.9%); it delays what the loop
    # reacts to (replica state, autoscaling decisions) by up to the interval.
    "loop500": Lever(
        ("none",),
        "Serve's controller loop every 500 ms (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5`; Ray's "
        "default 0.1 s)",
        environment={"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"},
    ),
    # What `none/vllm-serve` owes to Ray's always-on processes taking slices of the engine's
    # two cores, measured apart from the per-request cost of Serve's hops: `vllm serve` with
    # our idle cluster running beside it, and `none` against that.
    "beside-ray": Lever(
        ("vllm-serve",),
        "our idle `none` server running beside it, not frozen (Ray's daemons and dashboard, "
        "Serve's controller and proxy, the ingress and pool replicas, an idle engine)",
        beside="none",
    ),
}
"""Levers by name; the configurations are `<base>:<name>` for each of its bases."""
LEVER_CONFIGS = tuple(f"{base}:{name}" for name, lever in LEVERS.items() for base in lever.bases)
