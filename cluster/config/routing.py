"""Pool choice per request."""

from __future__ import annotations

from pydantic import Field, model_validator

from cluster.config.base import Strict


class RoutingConfig(Strict):
    """Pool choice per request (`cluster/routing.py`): by the performance model when `profile`
    is set, else rule v1 (prompt length and the speculative pool's load)."""

    profile: str | None = None
    """Calibration profile (`cluster calibrate`), relative to the config file: with it, each
    request goes to the pool with the highest predicted per-user rate under current load.
    None: rule v1."""

    ttft_slo_s: float | None = Field(default=None, gt=0)
    """With a profile: only pools predicted to start the response within this many seconds are
    candidates (the closest is taken when none is). None: no TTFT objective."""

    tpot_slo_s: float | None = Field(default=None, gt=0)
    """With a profile: only pools predicted to decode at least one token per this many seconds
    per user are candidates. None: no TPOT objective."""

    slo_headroom: float | None = Field(default=1.25, ge=1)
    """With a profile and an SLO: a request stays on the pool of its kind (rule v1's by length:
    prompts of `long_context_tokens` or more to the speculative pool, the rest to the
    throughput pool) while that pool is predicted to meet every SLO with this factor to spare
    (rate >= SLO rate x headroom, TTFT <= SLO / headroom); past that, the fastest pool that
    meets them. It keeps short requests, which meet the SLO anywhere, from filling the
    speculative pool that long contexts need under load (`cluster simulate`, docs/routing.md).
    None: always the fastest pool that meets the SLOs."""

    max_stats_age_s: float = Field(default=10, gt=0)
    """Pool load older than this is stale: rule v1 decides instead of the model."""

    cold_start_s: float = Field(default=60, ge=0)
    """With a profile: the wait for a first replica of a pool at zero, added to its predicted
    TTFT and spread over the request's output in its predicted rate."""

    long_context_tokens: int = Field(default=1024, ge=1)
    """Rule v1: prompts with at least this many tokens are candidates for the speculative
    pool. Also the request kind that `slo_headroom` keeps on its pool."""

    spec_max_concurrency_per_replica: float = Field(default=4, gt=0)
    """Rule v1: the speculative pool takes long prompts while its in-flight requests per
    replica stay below this (speculation stops paying off once the batch is compute-bound)."""

    pool_status_refresh_s: float = Field(default=1.0, gt=0)
    """How often the ingress refreshes the pools' running replica counts while they may be
    changing: requests wait at a gate, a pool at zero has requests, or a replica is starting,
    recovering or stopping."""

    pool_status_idle_refresh_s: float = Field(default=5.0, gt=0)
    """How often it refreshes them while every pool is settled. Each refresh is a
    `serve.status()` call: at 1 s it cost an idle embedded cluster 5% of a core (the ingress
    and Serve's controller), time taken from the engines on a small machine. A request that
    starts waiting refreshes at once. At most half of `max_stats_age_s`, or routing falls back
    to rule v1 between refreshes."""

    @model_validator(mode="after")
    def _refresh_within_stats_age(self) -> RoutingConfig:
        if self.pool_status_idle_refresh_s > self.max_stats_age_s / 2:
            raise ValueError(
                f"pool_status_idle_refresh_s: {self.pool_status_idle_refresh_s:g} s is more than "
                f"half of max_stats_age_s ({self.max_stats_age_s:g} s): pools would look stale "
                "between refreshes"
            )
        if self.pool_status_refresh_s > self.pool_status_idle_refresh_s:
            raise ValueError(
                "pool_status_refresh_s: larger than pool_status_idle_refresh_s (the refresh "
                "while pools change must be the faster one)"
            )
        return self
