"""`cluster render kuberay`: a KubeRay `RayService` from the same cluster YAML that runs locally,
plus the objects that keep it safe to run (`cluster.kuberay_objects`): its ingress Service, a
PodDisruptionBudget per worker group and a default-deny NetworkPolicy with explicit allows;
what every pod carries (security contexts, drain on termination) is `cluster.kuberay_pods`.

The Serve config points at `cluster.deployments.app:app_builder` with the cluster config inline,
so the application on EKS is built by the same code as `cluster serve`. One worker group per
pool, sized by the pool's autoscaling bounds (one Ray worker pod = one replica's accelerators),
with the Ray autoscaler on, so Serve autoscaling becomes pods and pending pods become GPU nodes
(Karpenter's NodePool per pool, from the gpu_nodes Terraform module, labels its nodes
`cluster.ai/pool=<pool>` and taints them for GPU pods only). A CPU worker group runs the Serve
ingress, spread over zones; the load balancer reaches it through the `<name>-ingress` Service.
The head keeps its state in an external Redis (GCS fault tolerance) so a head restart does not
take the Serve application down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, PoolConfig
from cluster.kuberay_objects import (
    HEAD_METRICS_PORTS,
    INGRESS_GROUP,
    METRICS_PORT,
    MONITORING_NAMESPACE,
    SERVE_PORT,
    ingress_service,
    labels,
    network_policies,
    pod_disruption_budget,
)
from cluster.kuberay_pods import (
    CHECKOV_SKIPS,
    CONTAINER_SECURITY_CONTEXT,
    HEAD_CHECKOV_SKIPS,
    POD_SECURITY_CONTEXT,
    TERMINATION_MARGIN_S,
    drain_seconds,
    pod_metadata,
    pre_stop,
)

MODEL_CACHE = "/mnt/cluster-cache"
NODE_MODEL_CACHE = "/mnt/k8s-disks/0"  # nodeadm's RAID0 of the instance-store NVMe drives
# The image's working directory: the project checkout, so shipped drafters/ are found there.
PROJECT_ROOT = Path(__file__).resolve().parents[1]

INGRESS_RESOURCE = "cluster_ingress"
"""Custom Ray resource: one per ingress pod, one per ingress replica, so replicas land one per
pod (and the pods spread over zones) instead of on GPU nodes."""
GCS_REDIS_ADDRESS = "rediss://GCS_REDIS_ENDPOINT:6379"
"""`rediss://` = TLS. The kuberay Terraform module replaces GCS_REDIS_ENDPOINT with the
ElastiCache primary endpoint of the gcs_redis module."""
GCS_REDIS_SECRET = "ray-gcs-redis"
"""Kubernetes Secret (key `auth-token`) the kuberay module fills from Secrets Manager."""
# Amazon's ElastiCache certificates chain to public roots: the image's system CA bundle.
REDIS_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# In-cluster Prometheus and Grafana of the observability Terraform module; the Ray dashboard
# queries Prometheus server-side and embeds Grafana panels in the operator's browser, which
# reaches Grafana through `kubectl port-forward svc/grafana 3000:80 -n monitoring`.
PROMETHEUS_HOST = f"http://kps-prometheus.{MONITORING_NAMESPACE}.svc:9090"
GRAFANA_HOST = f"http://grafana.{MONITORING_NAMESPACE}.svc"
GRAFANA_IFRAME_HOST = "http://localhost:3000"
API_KEYS_SECRET, API_KEYS_SECRET_KEY = "cluster-api-keys", "keys.json"
API_KEYS_DIR = "/etc/cluster/api-keys"


def _worker_pod(
    drain_s: int,
    name: str,
    image: str,
    service_account: str,
    limits: dict[str, Any],
    container: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": pod_metadata(name, CHECKOV_SKIPS),
        "spec": {
            "serviceAccountName": service_account,
            "securityContext": POD_SECURITY_CONTEXT,
            # Workers never call the Kubernetes API; Pod Identity mounts its own token.
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": drain_s + TERMINATION_MARGIN_S,
            "containers": [
                {
                    "name": "ray-worker",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {"limits": limits, "requests": limits},
                    "securityContext": CONTAINER_SECURITY_CONTEXT,
                    "lifecycle": pre_stop(drain_s),
                    **(container or {}),
                }
            ],
        },
    }


def _worker_group(
    config: ClusterConfig,
    pool: PoolConfig,
    name: str,
    image: str,
    service_account: str,
    efa: int,
    memory_gib_per_gpu: int,
) -> dict:
    if pool.name == INGRESS_GROUP:
        raise ValueError(f"pool name {INGRESS_GROUP!r} is the ingress worker group's")
    target = config.target(pool.target)
    scaling = pool.autoscaling
    cpus = f"{pool.cpus_per_replica + 1:g}"  # engine bundle + the Serve replica actor
    limits: dict[str, Any] = {"cpu": cpus, "memory": "8Gi"}
    if target.accelerator_type is not None:
        gpus = target.accelerators_per_replica
        limits.update(memory=f"{memory_gib_per_gpu * gpus}Gi", **{"nvidia.com/gpu": gpus})
        if efa:
            limits["vpc.amazonaws.com/efa"] = efa
    pod = _worker_pod(
        drain_seconds(pool),
        name,
        image,
        service_account,
        limits,
        {
            "env": [{"name": "CLUSTER_CACHE", "value": MODEL_CACHE}],
            "volumeMounts": [
                {"name": "model-cache", "mountPath": MODEL_CACHE},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        },
    )
    if target.accelerator_type is not None:
        # Karpenter's NodePool of this pool labels and taints its nodes (gpu_nodes module).
        pod["spec"]["nodeSelector"] = {"cluster.ai/pool": pool.name}
        pod["spec"]["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    pod["spec"]["volumes"] = [
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
        "template": pod,
    }


def _ingress_group(config: ClusterConfig, name: str, image: str, service_account: str) -> dict:
    replicas = config.kubernetes.ingress_replicas
    keys = api_keys_mount(config)
    pod = _worker_pod(
        drain_seconds(*config.pools),
        name,
        image,
        service_account,
        {"cpu": "4", "memory": "16Gi"},  # the proxy, one ingress replica and its tokenizers
        {
            "ports": [{"containerPort": SERVE_PORT, "name": "serve"}],
            **({"volumeMounts": keys["volumeMounts"]} if keys else {}),
        },
    )
    if keys:
        pod["spec"]["volumes"] = keys["volumes"]
    pod["spec"]["nodeSelector"] = {"cluster.ai/role": "ingress"}
    selector = {"matchLabels": labels(name, INGRESS_GROUP)}
    pod["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": selector,
        }
        for key in ("topology.kubernetes.io/zone", "kubernetes.io/hostname")
    ]
    return {
        "groupName": INGRESS_GROUP,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {},
        "resources": {INGRESS_RESOURCE: "1"},
        "template": pod,
    }


def _head(config: ClusterConfig, name: str, image: str, service_account: str) -> dict:
    env = {
        "RAY_REDIS_CA_CERT": REDIS_CA_BUNDLE,
        "RAY_PROMETHEUS_HOST": PROMETHEUS_HOST,
        "RAY_GRAFANA_HOST": GRAFANA_HOST,
        "RAY_GRAFANA_IFRAME_HOST": GRAFANA_IFRAME_HOST,
    }
    limits = {"cpu": "4", "memory": "16Gi"}
    return {
        "rayStartParams": {
            "dashboard-host": "0.0.0.0",
            "num-cpus": "0",  # nothing but Ray's control plane on the head
            "metrics-export-port": str(METRICS_PORT),
        },
        # ClusterIP only: dashboard, metrics and API stay inside the VPC.
        "serviceType": "ClusterIP",
        "template": {
            "metadata": pod_metadata(name, CHECKOV_SKIPS | HEAD_CHECKOV_SKIPS),
            "spec": {
                "serviceAccountName": service_account,
                "securityContext": POD_SECURITY_CONTEXT,
                "nodeSelector": {"cluster.ai/role": "system"},
                "terminationGracePeriodSeconds": TERMINATION_MARGIN_S,
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "resources": {"limits": limits, "requests": limits},
                        "securityContext": CONTAINER_SECURITY_CONTEXT,
                        "env": [{"name": k, "value": v} for k, v in env.items()],
                        "ports": [
                            {"containerPort": 6379, "name": "gcs"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": SERVE_PORT, "name": "serve"},
                            {"containerPort": METRICS_PORT, "name": "metrics"},
                            {"containerPort": HEAD_METRICS_PORTS[0], "name": "as-metrics"},
                            {"containerPort": HEAD_METRICS_PORTS[1], "name": "dash-metrics"},
                        ],
                    }
                ],
            },
        },
    }


def _serve_config(config: ClusterConfig) -> dict[str, Any]:
    from cluster.deployments.app import ingress_options, serve_application

    application = serve_application(
        config,
        serve_args_config(config),
        ingress_replicas=config.kubernetes.ingress_replicas,
        ingress_actor_options={
            **ingress_options(config)["ray_actor_options"],
            "resources": {INGRESS_RESOURCE: 1},
        },
    )
    return {
        "http_options": {"host": "0.0.0.0", "port": config.server.port},
        "applications": [application],
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

    groups = [_ingress_group(config, name, image, service_account)] + [
        _worker_group(
            config, pool, name, image, service_account, efa_interfaces, memory_gib_per_gpu
        )
        for pool in config.pools
    ]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": dump_yaml(_serve_config(config)),
            # The load balancer reaches the ingress pods through `<name>-ingress`; the head
            # runs no proxy traffic.
            "excludeHeadPodFromServeSvc": True,
            "rayClusterConfig": {
                "rayVersion": ray.__version__,
                "enableInTreeAutoscaling": True,
                # v2 drains a node through the GCS before KubeRay deletes its pod.
                "autoscalerOptions": {"version": "v2", "idleTimeoutSeconds": 600},
                "gcsFaultToleranceOptions": {
                    "redisAddress": GCS_REDIS_ADDRESS,
                    "redisPassword": {
                        "valueFrom": {
                            "secretKeyRef": {"name": GCS_REDIS_SECRET, "key": "auth-token"}
                        }
                    },
                },
                "headGroupSpec": _head(config, name, image, service_account),
                "workerGroupSpecs": groups,
            },
        },
    }


def manifests(config: ClusterConfig, **options: Any) -> list[dict[str, Any]]:
    """Everything `cluster render kuberay` prints: the RayService (see `rayservice` for the
    options), the ingress Service, a PodDisruptionBudget per worker group, NetworkPolicies."""
    service = rayservice(config, **options)
    name = service["metadata"]["name"]
    groups = [g["groupName"] for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    return [
        service,
        ingress_service(name),
        *(pod_disruption_budget(name, group) for group in groups),
        *network_policies(name),
    ]


def api_keys_mount(config: ClusterConfig) -> dict[str, Any]:
    """When keys are required and the config names no keys file: the ingress pods (the only
    ones that run the ingress deployment) mount the secret `cluster-api-keys` (key `keys.json`,
    the hashes) read-only as a file, which `serve_args_config` names `server.auth.keys_file`.
    A file rather than an environment variable: it does not show in `ps`, crash dumps or the
    pod spec, and a rotated secret reaches the pod without a restart."""
    auth = config.server.auth
    if not auth.required or auth.keys_file is not None:
        return {}
    return {
        "volumeMounts": [{"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}],
        "volumes": [{"name": "api-keys", "secret": {"secretName": API_KEYS_SECRET}}],
    }


def _in_image(config: ClusterConfig, location: str) -> str:
    """A local path as the app in the image reads it: within this checkout, relative to the
    project root (the image's working directory); outside it (a file mounted into the pod),
    absolute as written."""
    path = Path(config.resolve_path(location))
    if path.is_relative_to(PROJECT_ROOT):
        return os.path.relpath(path, PROJECT_ROOT)
    return location if os.path.isabs(location) else str(path)


def serve_args_config(config: ClusterConfig) -> dict[str, Any]:
    """The config as `app_builder` receives it. Local paths within this checkout become
    relative to the project root, which the app resolves against (its working directory in the
    image), others stay absolute (`_in_image`); S3 URIs, what production configs use, pass
    through unchanged. Required API keys come from the secret the ingress pods mount
    (`api_keys_mount`)."""
    from cluster.deployments.app import builder_args_config

    data = builder_args_config(config, lambda location: _in_image(config, location))
    if api_keys_mount(config):
        data["server"]["auth"]["keys_file"] = f"{API_KEYS_DIR}/{API_KEYS_SECRET_KEY}"
    return data


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


def dump_yaml_documents(documents: list[Any]) -> str:
    """Several manifests as one multi-document YAML stream."""
    return "---\n".join(dump_yaml(document) for document in documents)
