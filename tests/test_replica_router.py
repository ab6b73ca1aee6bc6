"""The pool's request router (`cluster.deployments.replica_router`): the pure ranking on
table-driven cases, then `LeastSlowdownRouter.choose_replicas` on Ray's own `RunningReplica`
objects (no Ray cluster: only the actor-handle lookup is replaced)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    RunningReplicaInfo,
)
from ray.serve._private.constants import DEFAULT_REQUEST_ROUTER_PATH
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RunningReplica

from cluster.autoscale.signals import EngineStats
from cluster.config import parse_config
from cluster.deployments.app import (
    LEAST_SLOWDOWN_ROUTER,
    POWER_OF_TWO_ROUTER,
    pool_llm_config_dict,
)
from cluster.deployments.pool_server import finite_metrics
from cluster.deployments.replica_router import (
    ROUTER_LOG_PREFIX,
    STATS_TIME_KEY,
    LeastSlowdownRouter,
    power_of_two,
    rank_by_slowdown,
)
from tests.serve_log import serve_log

NOW = 1_000_000.0
DEPLOYMENT = DeploymentID(name="pool-throughput", app_name="cluster")


def stats(running: int, waiting: int = 0, kv: float = 0.1, age_s: float = 1.0) -> dict:
    metrics = EngineStats(running=running, waiting=waiting, kv_cache_usage=kv).as_metrics()
    return {**metrics, STATS_TIME_KEY: NOW - age_s}


@pytest.mark.parametrize(
    ("name", "replicas", "sent", "expected"),
    [
        ("least loaded first", {"a": stats(8), "b": stats(1), "c": stats(4)}, None,
         [["b"], ["c"], ["a"]]),
        ("waiting counts against a replica", {"a": stats(2, 3), "b": stats(5)}, None,
         [["b"], ["a"]]),
        ("near-full KV cache last", {"a": stats(1, kv=0.97), "b": stats(6, kv=0.2)}, None,
         [["b"], ["a"]]),
        ("ties share a rank", {"a": stats(3), "b": stats(3), "c": stats(9)}, None,
         [["a", "b"], ["c"]]),
        ("stale stats: fall back", {"a": stats(1), "b": stats(1, age_s=60)}, None, None),
        ("missing stats: fall back", {"a": stats(1), "b": {}}, None, None),
        ("no timestamp: fall back", {"a": {"running": 1.0}}, None, None),
        ("requests sent since the stats count", {"a": stats(1), "b": stats(3)}, {"a": 6},
         [["b"], ["a"]]),
        # The stats are up to a period old: a replica that just finished requests is free.
        ("Serve's count is fresher than the stats", {"a": stats(5), "b": stats(3)},
         {"a": 0, "b": 3}, [["a"], ["b"]]),
        ("waiting counted from the stats, at most what Serve counts",
         {"a": stats(2, 2), "b": stats(3)}, {"a": 3, "b": 3}, [["b"], ["a"]]),
        # KV usage costs nothing until the cache is nearly full (two replicas 6 vs 9 apart
        # in requests when it did).
        ("KV usage below the pressure point is free", {"a": stats(6, kv=0.35), "b": stats(8)},
         None, [["a"], ["b"]]),
    ],
)  # fmt: skip
def test_rank_by_slowdown(name, replicas, sent, expected):
    assert rank_by_slowdown(replicas, NOW, 10.0, sent) == expected, name


def test_power_of_two_picks_two_distinct_candidates_in_one_rank():
    rng = random.Random(0)
    for _ in range(20):
        (rank,) = power_of_two(["a", "b", "c", "d"], rng)
        assert len(rank) == 2 and len(set(rank)) == 2
    assert power_of_two(["a"]) == [["a"]] and power_of_two([]) == []


@pytest.fixture
def running_replica(monkeypatch):
    """Ray's RunningReplica for a fake actor: the wrapper looks the actor up by name."""
    monkeypatch.setattr(RunningReplicaInfo, "get_actor_handle", lambda self: object())

    def make(name: str, routing_stats: dict) -> RunningReplica:
        info = RunningReplicaInfo(
            replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT),
            node_id="node",
            node_ip="127.0.0.1",
            availability_zone=None,
            actor_name=f"actor-{name}",
            max_ongoing_requests=64,
            routing_stats=routing_stats,
        )
        return RunningReplica(info)

    return make


def pending() -> PendingRequest:
    # Its own future, not one of a loop an earlier `asyncio.run` closed (test order).
    return PendingRequest(
        args=[],
        kwargs={},
        metadata=RequestMetadata(request_id="r", internal_request_id="i"),
        future=concurrent.futures.Future(),
    )


def route(candidates: list[RunningReplica], request: PendingRequest | None = None):
    async def run():
        router = LeastSlowdownRouter(
            deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA
        )
        router.initialize_state(stale_after_s=10.0, log_interval_s=60.0)
        router.update_replicas(candidates)
        return router, await router.choose_replicas(candidates, request)

    return asyncio.run(run())


def fresh(running: int, waiting: int = 0) -> dict:
    return {**stats(running, waiting), STATS_TIME_KEY: time.time()}


def test_router_ranks_rays_replicas_by_their_routing_stats(running_replica):
    a, b, c = (
        running_replica("a", fresh(9)),
        running_replica("b", fresh(0)),
        running_replica("c", fresh(2, 2)),
    )
    request = pending()
    with serve_log() as records:
        router, ranks = route([a, b, c], request)
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"], ["c"], ["a"]]
    assert router.routed == {"stats": 1, "fallback": 0}
    # Nothing else sets it without LocalityMixin; unset, full pools spin without backoff.
    assert request.routing_context.should_backoff is True
    (line,) = [r.getMessage() for r in records if ROUTER_LOG_PREFIX in r.getMessage()]
    assert "deployment=pool-throughput routed_by_stats=1 fallback=0" in line
    assert "first_choice=b" in line


def test_router_falls_back_to_power_of_two_without_stats(running_replica):
    candidates = [running_replica(n, {}) for n in "abc"]
    router, ranks = route(candidates)
    assert len(ranks) == 1 and len(ranks[0]) == 2
    assert router.routed == {"stats": 0, "fallback": 1}


def test_router_logs_the_first_decision_of_each_kind_then_once_per_interval(running_replica):
    stale, fresh_ones = [running_replica("a", {})], [running_replica("b", fresh(1))]

    async def run():
        router = LeastSlowdownRouter(
            deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA
        )
        router.initialize_state(stale_after_s=10.0, log_interval_s=60.0)
        router.update_replicas(stale + fresh_ones)
        for candidates in (stale, stale, fresh_ones, fresh_ones, stale):
            await router.choose_replicas(candidates, None)

    with serve_log() as records:
        asyncio.run(run())
    lines = [r.getMessage() for r in records if ROUTER_LOG_PREFIX in r.getMessage()]
    assert len(lines) == 2, lines
    assert "routed_by_stats=0 fallback=1" in lines[0]
    assert "routed_by_stats=1 fallback=2" in lines[1]


def test_router_reads_garbage_stats_as_zero(running_replica):
    candidates = [running_replica("a", {STATS_TIME_KEY: time.time(), "running": "many"})]
    router, ranks = route(candidates)
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["a"]]
    assert router.routed == {"stats": 1, "fallback": 0}


def test_a_failing_ranking_falls_back_instead_of_failing_the_request(running_replica, monkeypatch):
    import cluster.deployments.replica_router as module

    def broken(*args, **kwargs):
        raise ZeroDivisionError

    monkeypatch.setattr(module, "rank_by_slowdown", broken)
    router, ranks = route([running_replica(n, fresh(1)) for n in "ab"])
    assert len(ranks) == 1 and len(ranks[0]) == 2
    assert router.routed == {"stats": 0, "fallback": 1}


def config_with(router: str):
    return parse_config(
        {
            "targets": [{"id": "m", "source": "/models/m"}],
            "pools": [
                {"name": "tp", "target": "m", "role": "throughput", "replica_router": router,
                 "replica_stats_period_s": 1.5},
            ],
        }
    )  # fmt: skip


def test_router_config_reaches_serve():
    deployment = pool_llm_config_dict(*_pool("least_slowdown"))["deployment_config"]
    config = RequestRouterConfig(**deployment["request_router_config"])
    assert config.request_router_class == LEAST_SLOWDOWN_ROUTER
    assert config.get_request_router_class().__name__ == "LeastSlowdownRouter"
    assert config.request_router_kwargs == {"stale_after_s": 3 * 1.5 + 5}
    assert config.request_routing_stats_period_s == 1.5


def _pool(router: str):
    config = config_with(router)
    return config, config.pools[0]


def test_power_of_two_is_serves_own_default():
    deployment = pool_llm_config_dict(*_pool("power_of_two"))["deployment_config"]
    config = RequestRouterConfig(**deployment["request_router_config"])
    assert POWER_OF_TWO_ROUTER == DEFAULT_REQUEST_ROUTER_PATH
    assert config.is_default_request_router()


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({"running": 2, "kv": 0.5}, {"running": 2.0, "kv": 0.5}),
        ({"nan": float("nan"), "inf": float("inf"), "none": None}, {}),
        ({"flag": True, "text": "x", "ok": 1}, {"ok": 1.0}),
    ],
)
def test_autoscaling_stats_are_always_a_dict_of_finite_floats(metrics, expected):
    # Serve disables record_autoscaling_stats for good if its first result is anything else.
    result = finite_metrics(metrics)
    assert result == expected
    assert all(type(v) is float for v in result.values())
