"""What a server under test reports about a cell beyond its streams: every engine's cumulative
counters (speculation, output tokens, finished requests; a cluster's per replica, a vLLM
server's from its `/metrics` page) and, for a cluster, the pool each request was routed to."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

from cluster.autoscale.signals import REPLICA_KEY
from cluster.bench.plan import BenchConfig
from cluster.speculation import SpecCounters


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


EngineCounters = dict[str, dict[str, float]]
"""Cumulative counters by engine: replica id (a vLLM server: its config's name) -> the
`EngineStats.as_metrics()` keys it reports."""


def snapshot(config: BenchConfig, base_url: str) -> EngineCounters | None:
    """Every engine's cumulative counters (None where the server reports none)."""
    if config.kind == "vllm-serve":
        text = _get(f"{base_url}/metrics").decode()
        return {config.name: SpecCounters.from_prometheus(text).as_metrics()}
    if config.kind != "cluster":
        return None
    pools = json.loads(_get(f"{base_url}/cluster/pools"))
    return {engine[REPLICA_KEY]: engine for pool in pools.values() for engine in pool["engines"]}


def drafted_between(before: EngineCounters, after: EngineCounters) -> SpecCounters:
    """Speculation between two snapshots, summed over the engines in both (one that started
    or left in between has no baseline and is left out)."""
    total = SpecCounters()
    for engine in sorted(before.keys() & after.keys()):
        total = total + (
            SpecCounters.from_engine_metrics(after[engine])
            - SpecCounters.from_engine_metrics(before[engine])
        )
    return total


def change_by_engine(before: EngineCounters, after: EngineCounters, counter: str) -> dict[str, int]:
    """How much `counter` grew on each engine between two snapshots (engines that report it):
    how a cell's requests and tokens spread over the replicas."""
    return {
        engine: int(after[engine][counter] - before[engine][counter])
        for engine in sorted(before.keys() & after.keys())
        if counter in after[engine] and counter in before[engine]
    }


def routed_pools(base_url: str, request_id_prefix: str, requests: int) -> list[str | None]:
    """The pool of each request `i` (sent as `x-request-id: {prefix}{i}`), from the ingress's
    route log; None where the ingress has no record (the request never reached routing)."""
    query = urllib.parse.urlencode({"request_id_prefix": request_id_prefix})
    routes = json.loads(_get(f"{base_url}/cluster/routes?{query}"))
    pool_of = {route["request_id"]: route["pool"] for route in routes}
    return [pool_of.get(f"{request_id_prefix}{i}") for i in range(requests)]


def cell_engine_fields(
    before: EngineCounters | None, after: EngineCounters | None
) -> dict[str, Any]:
    """A cell record's engine fields from the snapshots around it: the speculation summary
    (None where the server reports no counters) and the requests and output tokens each
    engine (a cluster's: each replica) handled, the spread."""
    before, after = before or {}, after or {}
    return {
        "speculation": drafted_between(before, after).summary() if before else None,
        **{
            f"engine_{name}": change_by_engine(before, after, counter)
            for name, counter in (
                ("requests", "finished_requests"),
                ("tokens", "generation_tokens"),
            )
        },
    }
