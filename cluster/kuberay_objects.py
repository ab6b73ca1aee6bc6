"""The Kubernetes objects beside the RayService (`cluster.kuberay`) that keep it safe to run:
the ingress pods' Service, a PodDisruptionBudget per worker group and the NetworkPolicies
(default deny, then explicit allows), with the names and ports they share with it."""

from __future__ import annotations

from typing import Any

INGRESS_GROUP = "ingress"
"""The CPU worker group of the Serve ingress (a pool may not take this name)."""
SERVE_PORT = 8000
METRICS_PORT = 8080
# Ray's own metrics endpoints on the head (autoscaler, dashboard) that Prometheus scrapes too.
HEAD_METRICS_PORTS = (44217, 44227)
DASHBOARD_AGENT_PORT = 52365
KUBERAY_NAMESPACE = "kuberay-system"
MONITORING_NAMESPACE = "monitoring"
SERVICE_LABEL = "cluster.ai/rayservice"


def labels(name: str, group: str) -> dict[str, str]:
    """The labels that select one worker group's pods of a RayService."""
    return {SERVICE_LABEL: name, "ray.io/group": group}


def ingress_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-ingress", "labels": {SERVICE_LABEL: name}},
        "spec": {
            "type": "ClusterIP",
            "selector": labels(name, INGRESS_GROUP),
            "ports": [{"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT}],
        },
    }


def pod_disruption_budget(name: str, group: str) -> dict[str, Any]:
    """At most one pod of a group down at a time from voluntary disruptions (node drains,
    Karpenter consolidation, upgrades): a pool never loses every replica at once, and a group
    of one can still be drained (its replica restarts elsewhere)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"{name}-{group}"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(name, group)}},
    }


def _network_policy(name: str, suffix: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-{suffix}"},
        "spec": {"policyTypes": ["Ingress"], **spec},
    }


def _namespace(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


def _ports(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def network_policies(name: str) -> list[dict[str, Any]]:
    """Default deny for every pod of the namespace, then only: Ray pods among themselves (GCS,
    object transfer, workers: many dynamic ports), the load balancer to the ingress pods' Serve
    port, the KubeRay operator to the dashboard / agent / proxy health endpoints, Prometheus to
    the metrics ports. The dashboard (8265) and client (10001) ports are reachable from nothing
    else: operators use `kubectl port-forward`."""
    ray_pods = {"matchLabels": {SERVICE_LABEL: name}}
    return [
        _network_policy(name, "default-deny", {"podSelector": {}}),
        _network_policy(
            name,
            "intra-ray",
            {"podSelector": ray_pods, "ingress": [{"from": [{"podSelector": ray_pods}]}]},
        ),
        # The ALB (target type ip) connects from its own ENIs; its security group, managed by
        # the AWS Load Balancer Controller, admits only 443 from the allowed CIDRs.
        _network_policy(
            name,
            "load-balancer",
            {
                "podSelector": {"matchLabels": labels(name, INGRESS_GROUP)},
                "ingress": [{"ports": _ports(SERVE_PORT)}],
            },
        ),
        _network_policy(
            name,
            "kuberay-operator",
            {
                "podSelector": ray_pods,
                "ingress": [
                    {
                        "from": [_namespace(KUBERAY_NAMESPACE)],
                        "ports": _ports(8265, DASHBOARD_AGENT_PORT, SERVE_PORT),
                    }
                ],
            },
        ),
        _network_policy(
            name,
            "prometheus",
            {
                "podSelector": ray_pods,
                "ingress": [
                    {
                        "from": [_namespace(MONITORING_NAMESPACE)],
                        "ports": _ports(METRICS_PORT, *HEAD_METRICS_PORTS),
                    }
                ],
            },
        ),
    ]
