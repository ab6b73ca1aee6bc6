"""A pool replica: Ray Serve LLM's `LLMServer` running vLLM, reporting engine signals.

The only additions to `LLMServer` are the stats hooks: the replica's running and waiting
requests, KV cache usage and speculation counters reach Serve's request router
(`record_routing_stats`) and custom autoscaling policies (`record_autoscaling_stats`).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from ray.serve.llm import LLMConfig, LLMServer
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from cluster.autoscale.signals import REPLICA_KEY, EngineStats
from cluster.deployments.replica_router import STATS_TIME_KEY
from cluster.speculation import SpecCounters

TRUST_DRAFTER_CODE_ENV = "CLUSTER_TRUST_DRAFTER_CODE"
"""Set to 1 in a pool's runtime env when its config trusts the drafter's S3 source."""
CORES_PER_REPLICA_ENV = "CLUSTER_CPU_CORES_PER_REPLICA"
"""`;`-separated core lists of a pool's replicas (`engine.cpu_cores_per_replica`)."""

logger = logging.getLogger("ray.serve")


class EngineStatsLogger(AggregateStatLoggerBase):
    """A vLLM stat logger that keeps the latest scheduler state and cumulative counters."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int]):
        self.stats = EngineStats()
        self._latest: dict[int, tuple[int, int, float]] = {}
        """Per engine (several with data parallel): running, waiting, KV cache usage."""

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            # Waiting counts the deferred requests too, as vLLM's own Prometheus gauge does.
            self._latest[engine_idx] = (
                scheduler_stats.num_running_reqs,
                scheduler_stats.num_waiting_reqs
                + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0),
                scheduler_stats.kv_cache_usage,
            )
            engines = self._latest.values()
            self.stats.running = sum(running for running, _, _ in engines)
            self.stats.waiting = sum(waiting for _, waiting, _ in engines)
            self.stats.kv_cache_usage = max(usage for _, _, usage in engines)
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None:
                self.stats.speculation += SpecCounters(
                    spec.num_drafts,
                    spec.num_draft_tokens,
                    spec.num_accepted_tokens,
                    tuple(spec.num_accepted_tokens_per_pos),
                )
        if iteration_stats is not None:
            self.stats.generation_tokens += iteration_stats.num_generation_tokens
            self.stats.finished_requests += len(iteration_stats.finished_requests)

    def log_engine_initialized(self) -> None:
        pass


class StatsVLLMEngine(VLLMEngine):
    """Ray Serve LLM's vLLM engine with an `EngineStatsLogger` attached to the AsyncLLM.

    The one adapter over private Ray Serve LLM API (`VLLMEngine._start_async_llm_engine`,
    `LLMServer._default_engine_cls`): vLLM's stat loggers are reachable no other way.
    `tests/test_ray_private.py` fails when Ray changes either."""

    stats_logger: EngineStatsLogger | None = None

    def _start_async_llm_engine(self, vllm_engine_args, vllm_engine_config, placement_group):
        client = super()._start_async_llm_engine(
            vllm_engine_args, vllm_engine_config, placement_group
        )
        if client.logger_manager is None:
            raise RuntimeError("vLLM stats are disabled; pool engines need disable_log_stats=False")
        self.stats_logger = EngineStatsLogger(vllm_engine_config, [0])
        # AsyncLLM has no add_logger (vllm#17702); its manager keeps a plain list.
        client.logger_manager.stat_loggers.append(self.stats_logger)
        return client


def stage_s3_sources(llm_config: LLMConfig) -> None:
    """Pull `s3://` target and drafter weights onto this node (resumable, hash-checked, atomic)
    and point vLLM at the local copies. Runs on the replica's node, before the engine starts."""
    from cluster import storage

    loading = llm_config.model_loading_config
    if isinstance(loading.model_source, str) and loading.model_source.startswith("s3://"):
        uri = loading.model_source
        loading.model_source = str(storage.pull(uri, storage.cached_path(uri)))
    spec = llm_config.engine_kwargs.get("speculative_config") or {}
    drafter = spec.get("model")
    if isinstance(drafter, str) and drafter.startswith("s3://"):
        trusted = os.environ.get(TRUST_DRAFTER_CODE_ENV) == "1"
        spec["model"] = str(storage.pull(drafter, storage.cached_path(drafter)))
        _refuse_invalid_drafter(spec["model"], loading.model_source, trusted)


def _refuse_invalid_drafter(drafter: str, target: str, trusted: bool) -> None:
    """A pulled drafter is checked like a local one is at config load, before vLLM sees it;
    unless its source is trusted it may hold weights, config and tokenizer files only (no
    `auto_map`, no Python that `trust_remote_code` would run)."""
    from cluster.drafters import spec

    target_config = Path(target) / spec.CONFIG_FILE
    problems = [] if trusted else spec.untrusted_content(Path(drafter))
    problems += spec.validate(
        Path(drafter), spec.read_target_config(Path(target)) if target_config.is_file() else None
    )
    if problems:
        raise ValueError("drafter failed validation:\n" + "\n".join(problems))


def replica_cores(per_replica: str, rank: int) -> str:
    """The core list of the replica of rank `rank` from `CORES_PER_REPLICA_ENV`'s value."""
    entries = per_replica.split(";")
    return entries[rank % len(entries)]


def claim_cores(
    per_replica: str, rank: int, lock_dir: Path, namespace: str
) -> tuple[str, IO[str] | None]:
    """This replica's core list and the lock that holds it: the first entry from its rank's on
    that no live replica of the deployment holds (an flock per entry, released when the
    process ends), else its rank's (every entry held). Serve renumbers ranks after a
    scale-down to keep them contiguous, so a new replica may get the rank that a running
    replica bound its engine by: the rank alone would put two engines on one core."""
    entries = per_replica.split(";")
    for offset in range(len(entries)):
        index = (rank + offset) % len(entries)
        lock = (lock_dir / f"cluster-cores-{namespace}-{index}.lock").open("a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        return entries[index], lock
    return replica_cores(per_replica, rank), None


_HELD_CORES: list[IO[str]] = []
"""The lock on this replica's cores, held while its process lives."""


def bind_replica_cores() -> None:
    """Point vLLM's OpenMP binding at this replica's cores (before the engine starts: its
    process inherits the environment): `claim_cores` among the replicas of its deployment in
    this Ray cluster on this machine."""
    per_replica = os.environ.get(CORES_PER_REPLICA_ENV)
    if not per_replica:
        return
    import ray
    from ray import serve

    context = serve.get_replica_context()
    rank = getattr(context.rank, "local_rank", context.rank)  # ReplicaRank since Ray 2.5x
    if rank is None:
        logger.warning("Serve gave this replica no rank; binding it like rank 0")
        rank = 0
    scope = f"{ray.get_runtime_context().gcs_address}|{context.app_name}|{context.deployment}"
    namespace = hashlib.sha256(scope.encode()).hexdigest()[:16]
    cores, lock = claim_cores(per_replica, int(rank), Path(tempfile.gettempdir()), namespace)
    if lock is None:
        logger.warning("every core entry is held; binding by rank %s like another replica", rank)
    else:
        _HELD_CORES.append(lock)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    logger.info("replica of local rank %s binds its engine to cores %s", rank, cores)


def finite_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Only plain finite floats: numpy scalars, bools, None, NaN and infinities are dropped or
    converted, so Serve's type check and the controller's averages always accept them."""
    clean = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(key, str):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            clean[key] = number
    return clean


class PoolServer(LLMServer):
    """`LLMServer` plus engine signals for routing and autoscaling, and S3 weight staging."""

    _default_engine_cls = StatsVLLMEngine

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any):
        bind_replica_cores()
        await asyncio.to_thread(stage_s3_sources, llm_config)
        await super().__init__(llm_config, **kwargs)

    def engine_stats(self) -> EngineStats:
        logger = getattr(self.engine, "stats_logger", None)
        return logger.stats if logger is not None else EngineStats()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Stats for the pool's request router (`replica_router`), with the time they were taken
        so a router can tell stale ones."""
        return {
            **await super().record_routing_stats(),
            **finite_metrics(self.engine_stats().as_metrics()),
            STATS_TIME_KEY: time.time(),
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Stats for custom autoscaling policies (`cluster.autoscale.ray_policy`).

        Serve checks the first result only and, if it is not a dict of int/float, disables the
        hook for the replica's lifetime (one error log, no retry); so this never returns
        anything else, and never raises."""
        try:
            return finite_metrics(self.engine_stats().as_metrics())
        except Exception:
            logger.exception("record_autoscaling_stats failed; reporting nothing this time")
            return {}

    async def stats(self) -> dict[str, Any]:
        """Handle method for operators and benchmarks (`/cluster/pools` asks every replica):
        this replica's signals, with its id (`replica`) so counters can be paired over time."""
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        return {REPLICA_KEY: replica, **self.engine_stats().as_metrics()}
