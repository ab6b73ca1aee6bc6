"""Replica choice inside a pool: a Ray Serve `RequestRouter` that sends each request to the
replica with the lowest predicted slowdown (`cluster.autoscale.policy.replica_slowdown`).

Wired per pool by `request_router_config` in the pool's deployment config (`app.py`); it runs
in every process that holds a handle to the pool (our ingress). Each replica's stats are what
`PoolServer.record_routing_stats` returned last (engine running / waiting / KV usage plus
`stats_time_s`), pulled by Serve's controller every `request_routing_stats_period_s` and pushed
to the routers with the replica list. The requests at a replica are counted from Serve's
queue-length cache where it has an entry (raised as a request is sent, lowered as it finishes,
reset from the replica's own count in its replies): fresh, where the stats are up to a period
old, and a stale count piles requests onto the replica that just finished some.

`choose_replicas` returns ranks, best first; Serve tries the ranks in order and, within a rank,
takes the replica with the shortest queue that still accepts (so a full replica is skipped).
When any candidate has no stats or only stale ones (a replica just started, a stats call timing
out) it falls back to power-of-two choices: two random candidates in one rank, which is what
Serve's default router does.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.autoscale.policy import replica_slowdown

logger = logging.getLogger("ray.serve")

ROUTER_LOG_PREFIX = "replica_router "
"""Start of the router's log lines (tests and operators grep for it)."""

STATS_TIME_KEY = "stats_time_s"
"""Wall-clock time (s) a replica's routing stats were taken (`PoolServer` adds it)."""

TIE_TOLERANCE = 0.05
"""Slowdowns within 5% of a rank's best share that rank (Serve then picks by queue length)."""


def rank_by_slowdown(
    stats: Mapping[Any, Mapping[str, Any] | None],
    now_s: float,
    stale_after_s: float,
    sent: Mapping[Any, int] | None = None,
) -> list[list[Any]] | None:
    """Replica ids in ranks of (nearly) equal predicted slowdown, best first; None when any
    replica's stats are missing or older than `stale_after_s` (the caller falls back).

    `sent`: requests at each replica by Serve's queue-length cache; where present it is the
    count (split into running and waiting with the stats' waiting), the stats' KV usage kept.
    """
    scored = []
    for replica_id, replica_stats in stats.items():
        taken = (replica_stats or {}).get(STATS_TIME_KEY)
        if not isinstance(taken, int | float) or now_s - taken > stale_after_s:
            return None
        effective = dict(replica_stats)
        known = (sent or {}).get(replica_id)
        if known is not None:
            waiting = min(float(effective.get("waiting", 0.0)), float(known))
            effective |= {"running": known - waiting, "waiting": waiting}
        scored.append((replica_slowdown(effective), str(replica_id), replica_id))
    scored.sort()
    ranks: list[list[Any]] = []
    best = None
    for score, _, replica_id in scored:
        if best is None or score > best * (1 + TIE_TOLERANCE):
            ranks.append([])
            best = score
        ranks[-1].append(replica_id)
    return ranks


def power_of_two(candidates: Sequence[Any], rng: random.Random | None = None) -> list[list[Any]]:
    """Serve's default: two random candidates in one rank (Serve takes the shorter queue)."""
    if not candidates:
        return []
    return [list((rng or random).sample(list(candidates), min(2, len(candidates))))]


class LeastSlowdownRouter(FIFOMixin, RequestRouter):
    """Lowest predicted slowdown first; power-of-two when stats are missing or stale.

    `request_router_kwargs`: `stale_after_s` (default 30), `log_interval_s` (default 60: a
    summary line per interval, plus the first decision by stats and the first fallback)."""

    def initialize_state(self, stale_after_s: float = 30.0, log_interval_s: float = 60.0, **_):
        self.stale_after_s = stale_after_s
        self.log_interval_s = log_interval_s
        self.routed = {"stats": 0, "fallback": 0}
        self._last_log_s: float | None = None

    def _sent(self, replicas: Sequence[RunningReplica]) -> dict[Any, int]:
        cache = self.replica_queue_len_cache
        known = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        return {k: v for k, v in known.items() if v is not None}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without LocalityMixin nothing else sets it; unset, a pool whose replicas are all
            # full is retried in a tight loop instead of with Serve's backoff.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranks = None
        try:
            ranks = rank_by_slowdown(
                {r.replica_id: r.routing_stats for r in candidate_replicas},
                time.time(),
                self.stale_after_s,
                self._sent(candidate_replicas),
            )
        except Exception:  # a router must route: bad stats fall back, never fail a request
            logger.exception(f"{ROUTER_LOG_PREFIX}ranking failed; power-of-two fallback")
        kind = "fallback" if ranks is None else "stats"
        if ranks is None:
            ranks = power_of_two(list(by_id))
        self.routed[kind] += 1
        result = [[by_id[i] for i in rank] for rank in ranks]
        self._maybe_log(result, candidate_replicas, kind)
        return result

    def _maybe_log(self, result: list[list[RunningReplica]], candidates, kind: str) -> None:
        now = time.monotonic()
        first_of_kind = self.routed[kind] == 1
        if (
            not first_of_kind
            and self._last_log_s is not None
            and now - self._last_log_s < self.log_interval_s
        ):
            return
        self._last_log_s = now
        first = result[0][0] if result and result[0] else None
        stats = (first.routing_stats or {}) if first is not None else {}
        logger.info(
            f"{ROUTER_LOG_PREFIX}deployment={getattr(self._deployment_id, 'name', '?')} "
            f"routed_by_stats={self.routed['stats']} fallback={self.routed['fallback']} "
            f"replicas={len(candidates)} first_choice="
            f"{first.replica_id.unique_id if first is not None else None} "
            f"running={stats.get('running')} waiting={stats.get('waiting')} "
            f"kv_cache_usage={stats.get('kv_cache_usage')}"
        )
