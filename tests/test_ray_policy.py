"""The autoscaling adapters (`cluster.autoscale.ray_policy`) on Ray's own context objects, run
through Ray's own wrapper (`_apply_autoscaling_config`, the one the controller applies), plus the
pure decisions they call (`cluster.autoscale.policy`) on table-driven cases."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import (
    _apply_autoscaling_config,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.policy import (
    replica_slowdown,
)
from cluster.autoscale.ray_policy import (
    DECISION_LOG_PREFIX,
    PoolAutoscalingPolicy,
    pool_state,
)
from cluster.autoscale.signals import EngineStats
from cluster.config import ConfigError, parse_config
from cluster.deployments.app import POOL_POLICY, pool_llm_config_dict
from cluster.speculation import SpecCounters
from tests.serve_log import serve_log

NOW = 1_000_000.0
APP = "cluster"


def replica(name: str, deployment: str = "pool-throughput") -> ReplicaID:
    return ReplicaID(unique_id=name, deployment_id=DeploymentID(name=deployment, app_name=APP))


def context(
    stats: dict[ReplicaID, dict[str, float]],
    *,
    deployment: str = "pool-throughput",
    current: int | None = None,
    age_s: dict[ReplicaID, float] | None = None,
    last_change_s: float | None = None,
    min_replicas: int = 1,
    max_replicas: int = 4,
    total_num_requests: float = 0.0,
    policy_state: dict | None = None,
) -> AutoscalingContext:
    """Ray's context as the controller builds it: aggregated values and raw series per metric."""
    replicas = list(stats)
    age_s = age_s or {}
    aggregated: dict[str, dict[ReplicaID, float]] = {}
    raw: dict[str, dict[ReplicaID, list[TimeStampedValue]]] = {}
    for rid, values in stats.items():
        taken = NOW - age_s.get(rid, 1.0)
        for name, value in values.items():
            aggregated.setdefault(name, {})[rid] = value
            raw.setdefault(name, {})[rid] = [
                TimeStampedValue(taken - 5, value),
                TimeStampedValue(taken, value),
            ]
    config = AutoscalingConfig(
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        upscale_delay_s=0,
        downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function=POOL_POLICY),
    )
    n = len(replicas) if current is None else current
    return AutoscalingContext(
        deployment_id=DeploymentID(name=deployment, app_name=APP),
        deployment_name=deployment,
        app_name=APP,
        current_num_replicas=n,
        target_num_replicas=n,
        running_replicas=replicas,
        total_num_requests=total_num_requests,
        total_queued_requests=0.0,
        aggregated_metrics=lambda: aggregated,  # lazy, as the controller passes them
        raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {},
        last_scale_up_time=last_change_s,
        last_scale_down_time=None,
        current_time=NOW,
        config=config,
    )


def engine(running: int, waiting: int = 0, kv: float = 0.1) -> dict[str, float]:
    return EngineStats(running=running, waiting=waiting, kv_cache_usage=kv).as_metrics()


def ray_wrapped(kwargs: dict) -> tuple:
    """Our policy exactly as Serve's controller holds it: deserialized from the
    `AutoscalingPolicy`, instantiated once with `policy_kwargs`, wrapped for bounds and delays."""
    policy = AutoscalingPolicy(policy_function=POOL_POLICY, policy_kwargs=kwargs)
    instance = _resolve_policy_callable(policy)
    return instance, _apply_autoscaling_config(instance)


KWARGS = {"target_running_per_replica": 8, "upscale_cooldown_s": 30, "downscale_cooldown_s": 300}
R1, R2, R3 = replica("r1"), replica("r2"), replica("r3")


@pytest.mark.parametrize(
    ("name", "stats", "extra", "expected"),
    [
        ("load over target adds replicas", {R1: engine(14, 6), R2: engine(10)}, {}, 4),
        ("within target holds", {R1: engine(6), R2: engine(7)}, {}, 2),
        ("light load shrinks", {R1: engine(1), R2: engine(2)}, {}, 1),
        ("stale stats are ignored: hold", {R1: engine(30)}, {"age_s": {R1: 120.0}}, 1),
        ("one stale replica counts at its last known load", {R1: engine(0), R2: engine(30)},
         {"age_s": {R2: 120.0}}, 4),
        ("bounded by max", {R1: engine(64), R2: engine(64)}, {}, 4),
        ("cooldown after a change blocks a scale-up", {R1: engine(30)},
         {"last_change_s": NOW - 5}, 1),
        ("cooldown over", {R1: engine(30)}, {"last_change_s": NOW - 60}, 4),
        ("downscale cooldown", {R1: engine(0), R2: engine(0)}, {"last_change_s": NOW - 60}, 2),
    ],
)  # fmt: skip
def test_pool_policy_through_rays_wrapper(name, stats, extra, expected):
    _, policy = ray_wrapped(KWARGS)
    replicas, state = policy(context(stats, **extra))
    assert replicas == expected, name
    assert "cluster" in state  # our memo survives Ray's merge of its own keys


def test_pool_at_zero_takes_rays_cold_start_path():
    # With requests waiting for a pool at zero Serve scales up before calling any policy.
    _, policy = ray_wrapped(KWARGS)
    replicas, _ = policy(context({}, current=0, min_replicas=0, total_num_requests=3))
    assert replicas == 1


def test_pool_at_zero_without_requests_stays():
    _, policy = ray_wrapped(KWARGS)
    assert policy(context({}, current=0, min_replicas=0))[0] == 0


def test_class_policy_is_instantiated_once_with_its_kwargs():
    instance, _ = ray_wrapped({**KWARGS, "target_running_per_replica": 3})
    assert isinstance(instance, PoolAutoscalingPolicy)
    assert instance.pool.kwargs["target_running_per_replica"] == 3


def test_decisions_are_logged_with_inputs_once_per_change():
    _, policy = ray_wrapped(KWARGS)
    with serve_log() as records:
        replicas, state = policy(context({R1: engine(30)}))
        policy(context({R1: engine(30)}, policy_state=state))  # same decision: not repeated
    lines = [r.getMessage() for r in records if DECISION_LOG_PREFIX in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("autoscale pool=pool-throughput replicas=1->4 reason=no_model")
    assert '"demand": 30' in lines[0] and '"reporting": 1' in lines[0]


def test_a_failing_policy_falls_back_to_rays_default_instead_of_raising():
    _, policy = ray_wrapped(KWARGS)
    ctx = context({R1: engine(1)}, total_num_requests=40)
    ctx.running_replicas = None  # a context Ray reshaped: our code breaks on it
    with serve_log() as records:
        replicas, _ = policy(ctx)
    # Ray's default: 40 ongoing requests / target_ongoing_requests 2 = 20, within max 4.
    assert replicas == 4
    assert any("fallback to Ray's default policy" in r.getMessage() for r in records)


def test_pool_state_reads_rays_metrics_per_running_replica():
    state = pool_state(context({R1: engine(3, 1, 0.5), R2: engine(2)}, last_change_s=NOW - 9))
    assert state.replicas == 2
    assert sorted(s["running"] for s in state.stats) == [2.0, 3.0]
    assert state.last_scale_up_s == NOW - 9 and state.now_s == NOW


def test_pool_state_reads_counters_at_their_latest_report_and_load_as_serves_average():
    ctx = context({R1: spec_engine(6, 500, 400)})
    averaged = ctx.aggregated_metrics
    # Serve weights a report's last sample by the time since it came, so between two reports
    # an averaged counter moves every tick; the report itself (raw) does not.
    averaged["spec_drafts"][R1], averaged["running"][R1] = 321.5, 4.5
    stats = pool_state(ctx).stats[0]
    assert stats["spec_drafts"] == 500 and stats["spec_accepted_tokens"] == 400
    assert stats["running"] == 4.5


@pytest.mark.parametrize(
    ("stats", "better_than"),
    [
        (engine(1), engine(4)),
        (engine(4), engine(2, 2)),  # waiting requests are ahead of the new one
        (engine(4, kv=0.2), engine(2, kv=0.9)),  # near-full KV cache
        ({}, engine(1)),
    ],
)
def test_replica_slowdown_orders_replicas(stats, better_than):
    assert replica_slowdown(stats) < replica_slowdown(better_than)


def test_replica_slowdown_tolerates_bad_values():
    assert replica_slowdown({"running": float("nan"), "kv_cache_usage": 7.0}) == pytest.approx(20)


def test_model_policy_config_reaches_the_deployment():
    config = parse_config(
        {
            "targets": [{"id": "m", "source": "/models/m"}],
            "pools": [
                {"name": "tp", "target": "m", "role": "throughput",
                 "autoscaling": {"max_replicas": 3, "policy": "model",
                                 "target_running_per_replica": 5}},
            ],
        }
    )  # fmt: skip
    deployment = pool_llm_config_dict(config, config.pools[0])["deployment_config"]
    scaling = AutoscalingConfig(**deployment["autoscaling_config"])
    assert scaling.policy.policy_function == POOL_POLICY
    assert scaling.policy.policy_kwargs["target_running_per_replica"] == 5
    instance = _resolve_policy_callable(scaling.policy)
    assert isinstance(instance, PoolAutoscalingPolicy)


def test_every_pool_has_an_autoscaling_config():
    # Serve pushes replica metrics (record_autoscaling_stats included) only for deployments
    # with an autoscaling config; a fixed num_replicas would silently starve the policy.
    config = parse_config(
        {
            "targets": [{"id": "m", "source": "/models/m"}],
            "pools": [{"name": "tp", "target": "m", "role": "throughput"}],
        }
    )
    deployment = pool_llm_config_dict(config, config.pools[0])["deployment_config"]
    assert "autoscaling_config" in deployment and "num_replicas" not in deployment


PROFILE = str(Path(__file__).parent.parent / "configs" / "profiles" / "embedded.yaml")


def spec_engine(running: int, drafts: int, accepted: int) -> dict[str, float]:
    counters = SpecCounters(drafts=drafts, draft_tokens=3 * drafts, accepted=accepted)
    return EngineStats(running=running, kv_cache_usage=0.1, speculation=counters).as_metrics()


def model_kwargs(rate: float) -> dict:
    return {**KWARGS, "profile": PROFILE, "pool": "speculative", "target_per_user_tok_s": rate,
            "context_tokens": 1024, "max_batch": 16}  # fmt: skip


def test_model_policy_sizes_the_pool_for_the_target_rate():
    model = PerformanceModel.load(PROFILE).pools["speculative"]
    # The rate the model predicts for 4 requests per replica: 12 requests need 3 replicas.
    rate = model.per_user_rate(4, 1024) * 0.99
    instance, policy = ray_wrapped(model_kwargs(rate))
    assert instance.pool.model is not None
    with serve_log() as records:
        replicas, _ = policy(context({R1: engine(12)}, deployment="pool-speculative"))
    assert replicas == 3
    line = next(r.getMessage() for r in records if DECISION_LOG_PREFIX in r.getMessage())
    assert "reason=scale_up" in line and '"predicted_at_current"' in line
    # Twice the load halves nothing: 24 requests need 6 at 4 each, bounded by max 4.
    assert policy(context({R1: engine(24)}, deployment="pool-speculative"))[0] == 4


def test_model_policy_sizes_for_the_peak_of_its_demand_window():
    model = PerformanceModel.load(PROFILE).pools["speculative"]
    rate = model.per_user_rate(4, 1024) * 0.99
    spec = {"deployment": "pool-speculative"}
    for window_s, after_lull in ((0, 1), (600, 3)):
        _, policy = ray_wrapped({**model_kwargs(rate), "demand_window_s": window_s})
        assert policy(context({R1: engine(12)}, **spec))[0] == 3
        lull = context({R1: engine(1), R2: engine(0), R3: engine(0)}, **spec)
        assert policy(lull)[0] == after_lull, window_s


def test_model_policy_follows_the_measured_acceptance():
    model = PerformanceModel.load(PROFILE).pools["speculative"]
    rate = model.per_user_rate(2, 1024) * 0.99  # 2 per replica at the calibrated acceptance
    instance, policy = ray_wrapped(model_kwargs(rate))
    first = policy(context({R1: spec_engine(4, 1000, 1000)}, deployment="pool-speculative"))[0]
    # The drafter now accepts nothing: each later tick moves the model towards it.
    drafts, decisions = 1000, [first]
    for _ in range(40):
        drafts += 1000
        ctx = context({R1: spec_engine(4, drafts, 1000)}, deployment="pool-speculative")
        decisions.append(policy(ctx)[0])
    assert instance.pool.model.acceptance_scale < 0.2
    # Without speculation's lift 2 per replica miss the rate: the pool grows past 2 replicas.
    assert decisions[0] == 2 and decisions[-1] > 2


def test_model_policy_kwargs_name_the_profile_and_pool():
    config = parse_config(
        {
            "targets": [{"id": "m", "source": "/models/m"}],
            "pools": [
                {"name": "sp", "target": "m", "role": "speculative",
                 "speculation": {"method": "ngram", "num_speculative_tokens": 3},
                 "engine": {"max_num_seqs": 12},
                 "autoscaling": {"max_replicas": 3, "policy": "model",
                                 "target_per_user_tok_s": 20}},
            ],
            "routing": {"profile": PROFILE},
        }
    )  # fmt: skip
    deployment = pool_llm_config_dict(config, config.pools[0])["deployment_config"]
    kwargs = deployment["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["profile"] == PROFILE and kwargs["pool"] == "sp"
    assert kwargs["target_per_user_tok_s"] == 20 and kwargs["max_batch"] == 12
    instance = _resolve_policy_callable(
        AutoscalingPolicy(**deployment["autoscaling_config"]["policy"])
    )
    assert instance.pool.model is None  # the profile has no pool `sp`: steered by requests


def test_a_rate_target_needs_a_profile():
    with pytest.raises(ConfigError, match=r"pools\[0\]\.autoscaling\.target_per_user_tok_s"):
        parse_config(
            {
                "targets": [{"id": "m", "source": "/models/m"}],
                "pools": [{"name": "tp", "target": "m", "role": "throughput",
                           "autoscaling": {"policy": "model", "target_per_user_tok_s": 20}}],
            }
        )  # fmt: skip
