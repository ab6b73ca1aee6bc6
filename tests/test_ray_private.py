"""The private Ray Serve LLM API our one adapter (`pool_server.StatsVLLMEngine`) relies on.
A Ray upgrade that renames or reshapes it fails here instead of silently losing engine stats."""

import inspect

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from ray.serve.llm import LLMServer


def test_engine_start_hook_keeps_its_signature():
    parameters = list(inspect.signature(VLLMEngine._start_async_llm_engine).parameters)
    assert parameters == ["self", "vllm_engine_args", "vllm_engine_config", "placement_group"]


def test_llm_server_still_takes_its_engine_class_from_default_engine_cls():
    assert hasattr(LLMServer, "_default_engine_cls")
    source = inspect.getsource(LLMServer._get_default_engine_class)
    assert "self._default_engine_cls" in source


def test_pool_server_uses_only_public_handle_methods_of_llm_server():
    # The ingress calls these by name through DeploymentHandles (cluster/request/protocol.py).
    from cluster.request.protocol import ENDPOINTS

    for method in ENDPOINTS:
        assert inspect.iscoroutinefunction(getattr(LLMServer, method)), method


# The private Ray Serve behaviour the routing and autoscaling adapters rely on
# (`cluster.deployments.replica_router`, `cluster.autoscale.ray_policy`, `PoolServer`'s stats).


def test_first_bad_autoscaling_stats_disable_the_hook_for_good():
    # PoolServer.record_autoscaling_stats returns only finite floats because of this check.
    from ray.serve._private.replica import ReplicaMetricsManager

    source = inspect.getsource(ReplicaMetricsManager._fetch_custom_autoscaling_metrics)
    assert "if not self._checked_custom_metrics" in source
    assert "isinstance(value, (int, float))" in source
    assert "self._custom_metrics_enabled = False" in source


def test_replica_metrics_are_pushed_only_with_an_autoscaling_config():
    from ray.serve._private.replica import ReplicaMetricsManager

    source = inspect.getsource(ReplicaMetricsManager.enable_custom_autoscaling_metrics)
    assert "if self._autoscaling_config:" in source


def test_class_policies_are_instantiated_once_with_policy_kwargs():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    source = inspect.getsource(_resolve_policy_callable)
    assert "raw(**policy.policy_kwargs)" in source


def test_policy_context_still_has_the_fields_the_adapter_reads():
    from ray.serve.config import AutoscalingContext

    parameters = set(inspect.signature(AutoscalingContext).parameters)
    assert {
        "current_num_replicas", "target_num_replicas", "running_replicas",
        "aggregated_metrics", "raw_metrics", "capacity_adjusted_min_replicas",
        "capacity_adjusted_max_replicas", "policy_state", "last_scale_up_time",
        "last_scale_down_time", "current_time",
    } <= parameters  # fmt: skip


def test_an_app_level_policy_silently_replaces_the_deployment_policies():
    # Only a warning: with `autoscaling_policy` in the app config our per-pool policies never
    # run, so BudgetAutoscalingPolicy decides for every pool itself.
    from ray.serve._private.autoscaling_state import ApplicationAutoscalingState

    source = inspect.getsource(ApplicationAutoscalingState.register_deployment)
    assert "The application-level policy will take precedence" in source


def test_app_level_policy_only_through_the_declarative_app_config():
    from ray import serve
    from ray.serve.schema import ServeApplicationSchema

    assert "autoscaling_policy" in ServeApplicationSchema.model_fields
    assert "autoscaling_policy" not in inspect.signature(serve.run).parameters


def test_router_hooks_the_least_slowdown_router_uses():
    from ray.serve._private.request_router.request_router import RequestRouter

    assert isinstance(RequestRouter.replica_queue_len_cache, property)
    # Without LocalityMixin the router itself must ask for backoff between full rounds.
    source = inspect.getsource(RequestRouter._choose_replicas_with_backoff)
    assert "pending_request.routing_context.should_backoff" in source
    # Within a rank Serve takes the shortest accepting queue; ranks are tried in order.
    source = inspect.getsource(RequestRouter._select_from_candidate_replicas)
    assert "queue_len < r.max_ongoing_requests" in source


def test_engine_stats_add_up_every_engine_and_the_deferred_waiting():
    from vllm.v1.metrics.stats import SchedulerStats

    from cluster.deployments.pool_server import EngineStatsLogger

    stats = EngineStatsLogger(None, [0, 1])
    stats.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.2), None)
    stats.record(
        SchedulerStats(num_running_reqs=5, num_waiting_reqs=0, num_skipped_waiting_reqs=2,
                       kv_cache_usage=0.7), None, engine_idx=1,
    )  # fmt: skip
    assert (stats.stats.running, stats.stats.waiting) == (8, 3)
    assert stats.stats.kv_cache_usage == 0.7  # the fullest engine: where new requests wait
    stats.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1), None)  # engine 0 again
    assert (stats.stats.running, stats.stats.waiting) == (6, 2)
