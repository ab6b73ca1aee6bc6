"""From a `ClusterConfig` to a Ray Serve application: one `PoolServer` deployment per pool and
one ingress (`cluster.deployments.ingress`) in front of them.

`pool_llm_configs` is also what `cluster config render` prints, so operators see exactly what
will be deployed before a long GPU load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.config import ClusterConfig, PoolConfig, TargetConfig, map_local_paths
from cluster.models import local_model_path
from cluster.request.dispatch import PoolRef

INGRESS_DEPLOYMENT = "ingress"


def pool_deployment_name(pool: PoolConfig) -> str:
    return f"pool-{pool.name}"


def speculative_config(config: ClusterConfig, pool: PoolConfig) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for a pool (None = no speculation)."""
    spec = pool.speculation
    if spec.method == "none":
        return None
    vllm_spec: dict[str, Any] = {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
    }
    if spec.method == "ngram":
        vllm_spec["prompt_lookup_min"] = spec.prompt_lookup_min
        vllm_spec["prompt_lookup_max"] = spec.prompt_lookup_max
    else:
        vllm_spec["model"] = config.resolve_path(spec.drafter)
    if spec.num_speculative_tokens_per_batch_size:
        vllm_spec["num_speculative_tokens_per_batch_size"] = [
            list(r) for r in spec.num_speculative_tokens_per_batch_size
        ]
    return vllm_spec


def engine_kwargs(config: ClusterConfig, target: TargetConfig, pool: PoolConfig) -> dict[str, Any]:
    engine = pool.engine
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": target.tensor_parallel_size,
        "pipeline_parallel_size": target.pipeline_parallel_size,
        "dtype": target.dtype,
        "max_num_seqs": engine.max_num_seqs,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "enforce_eager": engine.enforce_eager,
        "trust_remote_code": target.trust_remote_code,
        # PoolServer's stats hooks read vLLM's stat loggers, which exist only with stats on.
        "disable_log_stats": False,
    }
    optional = {
        "max_model_len": target.max_model_len,
        "quantization": target.quantization,
        "tokenizer": config.resolve_path(target.tokenizer) if target.tokenizer else None,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "speculative_config": speculative_config(config, pool),
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if target.accelerator_type is not None:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    kwargs.update(engine.extra)
    return kwargs


def _placement(target: TargetConfig, pool: PoolConfig) -> dict[str, Any]:
    if target.accelerator_type is None:
        bundles = [{"CPU": pool.cpus_per_replica}]
    else:
        # The engine's host-side CPUs ride on the first GPU bundle (the driver worker's).
        bundles = [{"GPU": 1, "CPU": pool.cpus_per_replica}]
        bundles += [{"GPU": 1} for _ in range(target.accelerators_per_replica - 1)]
    return {"bundles": bundles, "strategy": pool.placement_strategy}


def _runtime_env(target: TargetConfig, pool: PoolConfig) -> dict[str, Any]:
    env = {}
    if target.accelerator_type is None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(pool.engine.cpu_kvcache_space_gib)
        if pool.engine.cpu_omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = pool.engine.cpu_omp_threads_bind
        if pool.engine.cpu_cores_per_replica is not None:
            # Serve gives every replica the same environment; pool_server.bind_replica_cores
            # picks the replica's entry.
            env["CLUSTER_CPU_CORES_PER_REPLICA"] = ";".join(pool.engine.cpu_cores_per_replica)
    if target.is_embedded or "://" not in target.source:
        env["HF_HUB_OFFLINE"] = "1"  # local weights: never reach for a hub
    if pool.speculation.trust_drafter_code:
        env["CLUSTER_TRUST_DRAFTER_CODE"] = "1"  # read by pool_server.stage_s3_sources
    return {"env_vars": env} if env else {}


POOL_POLICY = "cluster.autoscale.ray_policy:PoolAutoscalingPolicy"
LEAST_SLOWDOWN_ROUTER = "cluster.deployments.replica_router:LeastSlowdownRouter"
POWER_OF_TWO_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
"""Serve's default router, spelled as Serve's `DEFAULT_REQUEST_ROUTER_PATH` (so Serve still
treats it as its default) and named so a render shows it."""


def pool_policy_kwargs(config: ClusterConfig, pool: PoolConfig) -> dict[str, Any]:
    """`policy_kwargs` of a pool's `model` autoscaling policy (plain JSON)."""
    scaling = pool.autoscaling
    kwargs: dict[str, Any] = {
        "target_running_per_replica": scaling.target_running_per_replica,
        "upscale_cooldown_s": scaling.upscale_cooldown_s,
        "downscale_cooldown_s": scaling.downscale_cooldown_s,
        "stale_after_s": scaling.stale_stats_s,
        "utilization": scaling.target_utilization,
        "demand_window_s": scaling.demand_window_s,
    }
    if scaling.target_per_user_tok_s is not None and config.routing.profile:
        kwargs |= {
            "profile": config.resolve_path(config.routing.profile),
            "pool": pool.name,
            "target_per_user_tok_s": scaling.target_per_user_tok_s,
            "context_tokens": scaling.context_tokens,
            "max_batch": pool.engine.max_num_seqs,
        }
    return kwargs


BUDGET_POLICY = "cluster.autoscale.ray_policy:BudgetAutoscalingPolicy"


def app_autoscaling_policy(config: ClusterConfig) -> dict[str, Any] | None:
    """Serve's application-level `autoscaling_policy` (plain data) when a target has a
    `replica_budget`; it decides for every pool, so each pool gets the `model` policy's
    kwargs whatever its own `autoscaling.policy` says."""
    budgets = {t.id: t.replica_budget for t in config.targets if t.replica_budget is not None}
    if not budgets:
        return None
    pools = {
        pool_deployment_name(p): {
            "group": p.target,
            "role": p.role,
            **pool_policy_kwargs(config, p),
        }
        for p in config.pools
    }
    return {
        "policy_function": BUDGET_POLICY,
        "policy_kwargs": {"pools": pools, "budgets": budgets, "ingress": INGRESS_DEPLOYMENT},
    }


def fixed_ingress_scaling(replicas: int) -> dict[str, Any]:
    """The ingress's `autoscaling_config` under an application-level policy: a fixed count
    (min = max). It scales nothing; Serve pushes a deployment's `record_autoscaling_stats`
    only when it has one, and the policy needs the ingress's gate queues."""
    return {"min_replicas": replicas, "max_replicas": replicas, "initial_replicas": replicas}


def request_router_config(pool: PoolConfig) -> dict[str, Any]:
    """Serve's `RequestRouterConfig` of a pool (its replica choice), as plain data."""
    if pool.replica_router == "power_of_two":
        return {
            "request_router_class": POWER_OF_TWO_ROUTER,
            "request_routing_stats_period_s": pool.replica_stats_period_s,
        }
    return {
        "request_router_class": LEAST_SLOWDOWN_ROUTER,
        "request_router_kwargs": {"stale_after_s": 3 * pool.replica_stats_period_s + 5},
        "request_routing_stats_period_s": pool.replica_stats_period_s,
    }


def pool_llm_config_dict(config: ClusterConfig, pool: PoolConfig) -> dict[str, Any]:
    """The `LLMConfig` of a pool as plain data (what `config render` prints)."""
    target = config.target(pool.target)
    scaling = pool.autoscaling
    autoscaling_config = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": scaling.replicas_at_deploy,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
    }
    if scaling.policy == "model":
        autoscaling_config["policy"] = {
            "policy_function": POOL_POLICY,
            "policy_kwargs": pool_policy_kwargs(config, pool),
        }
    llm_config = {
        "model_loading_config": {
            # Every pool of a target serves it under the target id, so requests pass through
            # unchanged and responses name the model the client asked for.
            "model_id": target.id,
            "model_source": local_model_path(config, target),
        },
        "engine_kwargs": engine_kwargs(config, target, pool),
        "placement_group_config": _placement(target, pool),
        "deployment_config": {
            "autoscaling_config": autoscaling_config,
            "max_ongoing_requests": pool.max_ongoing_requests,
            # The ingress's gate queues for the pool; Serve's bound only has to hold what the
            # gate lets through to a pool at zero (one replica's worth) plus its queue.
            "max_queued_requests": pool.max_ongoing_requests + pool.max_queued_requests,
            "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": pool.graceful_shutdown_wait_loop_s,
            "request_router_config": request_router_config(pool),
        },
        "runtime_env": _runtime_env(target, pool),
        "experimental_configs": {"stream_batching_interval_ms": pool.stream_batching_interval_ms},
        # Engine metrics (incl. vllm:spec_decode_*) go to Ray's Prometheus / dashboard.
        "log_engine_metrics": True,
    }
    if target.accelerator_type is not None:
        llm_config["accelerator_type"] = target.accelerator_type
    return llm_config


def ingress_options(config: ClusterConfig) -> dict[str, Any]:
    # Every request a pool gate holds (in flight or queued) is an ongoing ingress request.
    held = sum(
        p.max_ongoing_requests * max(p.autoscaling.max_replicas, 1) + p.max_queued_requests
        for p in config.pools
    )
    return {
        "name": INGRESS_DEPLOYMENT,
        # The ingress only parses, tokenizes and forwards: a fraction of a CPU.
        "ray_actor_options": {"num_cpus": 0.5},
        # Headroom over `held` for requests being read and rejected with a 4xx/429.
        "max_ongoing_requests": 2 * held + 100,
        # A draining ingress lets its streams finish like the pools it calls do.
        "graceful_shutdown_timeout_s": max(p.graceful_shutdown_timeout_s for p in config.pools),
    }


APP_BUILDER = "cluster.deployments.app:app_builder"


def serve_application(
    config: ClusterConfig,
    args_config: dict[str, Any],
    *,
    ingress_replicas: int,
    ingress_actor_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Serve's declarative application config (`ServeApplicationSchema`): `app_builder` with
    `args_config` (the cluster YAML as the builder will read it), the ingress's replica count
    and actor options, and the application-level autoscaling policy when a target has a
    replica budget (only a declarative deploy takes one; the ingress's count is then a
    min = max autoscaling config, which reports its gate queues to the policy)."""
    policy = app_autoscaling_policy(config)
    ingress: dict[str, Any] = {"name": INGRESS_DEPLOYMENT}
    if policy is not None:
        ingress["autoscaling_config"] = fixed_ingress_scaling(ingress_replicas)
    else:
        ingress["num_replicas"] = ingress_replicas
    if ingress_actor_options is not None:
        ingress["ray_actor_options"] = ingress_actor_options
    ingress["graceful_shutdown_timeout_s"] = ingress_options(config)["graceful_shutdown_timeout_s"]
    application = {
        "name": config.server.app_name,
        "route_prefix": "/",
        "import_path": APP_BUILDER,
        "args": {"config": args_config},
        "deployments": [ingress],
    }
    if policy is not None:
        application["autoscaling_policy"] = policy
    return application


def pool_refs(config: ClusterConfig) -> list[PoolRef]:
    return [
        PoolRef(
            name=pool.name,
            target=pool.target,
            role=pool.role,
            deployment=pool_deployment_name(pool),
            max_ongoing_requests=pool.max_ongoing_requests,
            max_queued_requests=pool.max_queued_requests,
            queue_timeout_s=pool.queue_timeout_s,
            scales_from_zero=pool.autoscaling.min_replicas == 0,
            max_num_seqs=pool.engine.max_num_seqs,
        )
        for pool in config.pools
    ]


def render(config: ClusterConfig) -> dict[str, Any]:
    """Everything that will be deployed, as plain data."""
    return {
        "application": config.server.app_name,
        "http": {"host": config.server.host, "port": config.server.port},
        "ingress": {**ingress_options(config), "routing": config.routing.model_dump()},
        "autoscaling_policy": app_autoscaling_policy(config),
        "pools": {
            pool.name: {
                "target": pool.target,
                "role": pool.role,
                "deployment": pool_deployment_name(pool),
                "llm_config": pool_llm_config_dict(config, pool),
            }
            for pool in config.pools
        },
    }


def build_app(config: ClusterConfig):
    """The Serve application (imports Ray and vLLM; call on a machine that has them)."""
    from ray import serve
    from ray.serve.llm import LLMConfig, build_llm_deployment

    from cluster.deployments.ingress import TargetRef, ingress_class
    from cluster.deployments.pool_server import PoolServer

    handles = {
        pool.name: build_llm_deployment(
            LLMConfig(**pool_llm_config_dict(config, pool)),
            deployment_cls=PoolServer,
            override_serve_options={"name": pool_deployment_name(pool)},
        )
        for pool in config.pools
    }
    targets = [
        TargetRef(
            id=t.id,
            tokenizer=config.resolve_path(t.tokenizer) if t.tokenizer else _local_dir(config, t),
            max_model_len=t.max_model_len,
            content_part_types=list(t.content_part_types),
        )
        for t in config.targets
    ]
    auth = config.server.auth
    return serve.deployment(ingress_class(config.server), **ingress_options(config)).bind(
        pool_handles=handles,
        pools=pool_refs(config),
        targets=targets,
        server=config.server,
        keys_file=config.resolve_path(auth.keys_file) if auth.keys_file else None,
        routing=config.routing,
        telemetry=config.telemetry,
        app_name=config.server.app_name,
        profile=config.resolve_path(config.routing.profile) if config.routing.profile else None,
    )


def _local_dir(config: ClusterConfig, target: TargetConfig) -> str | None:
    location = local_model_path(config, target)
    return None if "://" in location else location


def builder_args_config(
    config: ClusterConfig, convert_path: Callable[[str], str]
) -> dict[str, Any]:
    """The config as `app_builder` will parse it, each local path through `convert_path`. Every
    field is written out, nulls too: left out, an explicit `null` (e.g. `routing.slo_headroom`)
    would come back as its non-null default on the other side."""
    return map_local_paths(config.model_dump(mode="json"), convert_path)


def app_builder(args: dict[str, Any]):
    """Serve application builder for `serveConfigV2` (KubeRay): `args.config` is the cluster
    YAML as a mapping, validated exactly as `cluster serve` validates a file; local paths in it
    are relative to the working directory (the project root in the image, see `kuberay`)."""
    from cluster.config import parse_config

    return build_app(parse_config(args["config"], "serveConfigV2.args.config"))
