"""`cluster render kuberay`: a KubeRay `RayService` from the same cluster YAML that runs locally.

The Serve config points at `cluster.deployments.app:app_builder` with the cluster config inline,
so the application on EKS is built by the same code as `cluster serve`. One worker group per
pool, sized by the pool's autoscaling bounds (one Ray worker pod = one replica's accelerators),
with the Ray autoscaler on, so Serve autoscaling becomes pods and pending pods become GPU nodes
(the gpu_nodes Terraform module labels each node group `cluster.ai/pool=<pool>`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, PoolConfig, map_local_paths

MODEL_CACHE = "/mnt/cluster-cache"
NODE_MODEL_CACHE = "/mnt/k8s-disks/0"  # nodeadm's RAID0 of the instance-store NVMe drives
# The image's working directory: the project checkout, so shipped drafters/ are found there.
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _worker_group(
    config: ClusterConfig,
    pool: PoolConfig,
    image: str,
    service_account: str,
    efa: int,
    memory_gib_per_gpu: int,
) -> dict:
    target = config.target(pool.target)
    scaling = pool.autoscaling
    cpus = f"{pool.cpus_per_replica + 1:g}"  # engine bundle + the Serve replica actor
    limits: dict[str, Any] = {"cpu": cpus, "memory": "8Gi"}
    pod: dict[str, Any] = {}
    if target.accelerator_type is not None:
        gpus = target.accelerators_per_replica
        limits.update(memory=f"{memory_gib_per_gpu * gpus}Gi", **{"nvidia.com/gpu": gpus})
        if efa:
            limits["vpc.amazonaws.com/efa"] = efa
        pod["nodeSelector"] = {"cluster.ai/pool": pool.name}
        pod["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    pod["containers"] = [
        {
            "name": "ray-worker",
            "image": image,
            "resources": {"limits": limits, "requests": limits},
            "env": [{"name": "CLUSTER_CACHE", "value": MODEL_CACHE}, *api_keys_env(config)],
            "volumeMounts": [
                {"name": "model-cache", "mountPath": MODEL_CACHE},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        }
    ]
    pod["serviceAccountName"] = service_account
    pod["terminationGracePeriodSeconds"] = termination_grace_s(pool)
    pod["volumes"] = [
        {
            "name": "model-cache",
            "hostPath": {"path": NODE_MODEL_CACHE, "type": "DirectoryOrCreate"},
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    return {
        "groupName": pool.name,
        "replicas": scaling.replicas_at_deploy,
        "minReplicas": scaling.min_replicas,
        "maxReplicas": scaling.max_replicas,
        "rayStartParams": {},
        "template": {"spec": pod},
    }


def rayservice(
    config: ClusterConfig,
    *,
    image: str,
    name: str = "cluster",
    service_account: str = "ray-weights-reader",
    efa_interfaces: int = 0,
    memory_gib_per_gpu: int = 200,
) -> dict[str, Any]:
    """The RayService manifest (namespace is set by the Terraform kuberay module)."""
    import ray

    serve_config = {
        "http_options": {"host": "0.0.0.0", "port": config.server.port},
        "applications": [
            {
                "name": config.server.app_name,
                "route_prefix": "/",
                "import_path": "cluster.deployments.app:app_builder",
                "args": {"config": serve_args_config(config)},
            }
        ],
    }
    head = {
        "rayStartParams": {
            "dashboard-host": "0.0.0.0",
            "num-cpus": "0",
            "metrics-export-port": "8080",
        },
        # ClusterIP only: dashboard, metrics and API stay inside the VPC.
        "serviceType": "ClusterIP",
        "template": {
            "spec": {
                "serviceAccountName": service_account,
                "nodeSelector": {"cluster.ai/role": "system"},
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "resources": {
                            "limits": {"cpu": "4", "memory": "16Gi"},
                            "requests": {"cpu": "4", "memory": "16Gi"},
                        },
                        "ports": [
                            {"containerPort": 6379, "name": "gcs"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": 8000, "name": "serve"},
                            {"containerPort": 8080, "name": "metrics"},
                        ],
                    }
                ],
            }
        },
    }
    groups = [
        _worker_group(config, pool, image, service_account, efa_interfaces, memory_gib_per_gpu)
        for pool in config.pools
    ]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": dump_yaml(serve_config),
            "rayClusterConfig": {
                "rayVersion": ray.__version__,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"idleTimeoutSeconds": 600},
                "headGroupSpec": head,
                "workerGroupSpecs": groups,
            },
        },
    }


def api_keys_env(config: ClusterConfig) -> list[dict[str, Any]]:
    """The ingress may run on any worker: each pod gets the API keys (hashes) from the secret
    `cluster-api-keys` (key `keys.json`) as `server.auth.keys_env`, when auth is required."""
    auth = config.server.auth
    if not auth.required or not auth.keys_env:
        return []
    secret = {"name": "cluster-api-keys", "key": "keys.json"}
    return [{"name": auth.keys_env, "valueFrom": {"secretKeyRef": secret}}]


def termination_grace_s(pool: PoolConfig) -> int:
    """Pod termination grace that covers the pool's Serve drain (`graceful_shutdown_timeout_s`)
    plus time for Ray to stop after it."""
    return math.ceil(pool.graceful_shutdown_timeout_s) + 30


def serve_args_config(config: ClusterConfig) -> dict[str, Any]:
    """The config as `app_builder` receives it. Local paths, relative to the config file here,
    become relative to the project root, which the app resolves against (its working directory
    in the image); S3 URIs, what production configs use, pass through unchanged."""
    return map_local_paths(
        config.model_dump(mode="json", exclude_none=True),
        lambda location: os.path.relpath(config.resolve_path(location), PROJECT_ROOT),
    )


def dump_yaml(data: Any) -> str:
    """YAML with multi-line strings as literal blocks (readable `serveConfigV2`)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors in manifests
            return True

    def _str(dumper: yaml.SafeDumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)
