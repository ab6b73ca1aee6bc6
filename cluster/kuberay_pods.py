"""What every Ray pod of the RayService carries (`cluster.kuberay`): the security contexts,
the checkov checks that do not fit Ray pods (each exemption annotated with its reason), and the
drain on termination that gives Serve the time its replicas were promised."""

from __future__ import annotations

import math
from typing import Any

from cluster.config import PoolConfig
from cluster.kuberay_objects import SERVICE_LABEL

TERMINATION_MARGIN_S = 30  # SIGTERM to SIGKILL after the drain: Ray's own shutdown

# checkov Kubernetes checks that do not fit Ray pods, with the reason next to each.
CHECKOV_SKIPS = {
    "CKV_K8S_8": "KubeRay injects the liveness probe of every Ray container",
    "CKV_K8S_9": "KubeRay injects the readiness probe of every Ray container",
    "CKV_K8S_22": "Ray writes its session, spill and log files under /tmp/ray and $HOME",
    "CKV_K8S_43": "images are pinned by release tag in the render; digests are set by CI",
    "CKV_K8S_15": "release tags are immutable; IfNotPresent avoids a registry pull per pod",
    "CKV_K8S_40": "rayproject images run as their `ray` user, uid 1000; files in them are its",
}
HEAD_CHECKOV_SKIPS = {
    "CKV_K8S_38": "the in-tree autoscaler sidecar on the head calls the Kubernetes API",
}


def pod_metadata(name: str, skips: dict[str, str]) -> dict[str, Any]:
    return {
        "labels": {SERVICE_LABEL: name},
        "annotations": {
            f"checkov.io/skip{i}": f"{check}={reason}"
            for i, (check, reason) in enumerate(sorted(skips.items()), start=1)
        },
    }


POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,  # the `ray` user of rayproject images
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def drain_seconds(*pools: PoolConfig) -> int:
    """What a pod's preStop waits: Serve's graceful shutdown of the replicas it may hold (one
    pool's on a GPU worker, any pool's streams through the ingress)."""
    return max(
        math.ceil(p.graceful_shutdown_timeout_s + p.graceful_shutdown_wait_loop_s) for p in pools
    )


def pre_stop(seconds: int) -> dict[str, Any]:
    """Tell Ray the node is going away, then give Serve the time it was promised: it starts
    replacements elsewhere, the node's proxy fails its health checks (the load balancer stops
    sending), and replicas finish in-flight streams before SIGTERM reaches Ray."""
    drain = (
        "ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION "
        f"--reason-message 'pod terminating' --deadline-remaining-seconds {seconds}"
    )
    return {"preStop": {"exec": {"command": ["/bin/sh", "-c", f"{drain}; sleep {seconds}"]}}}
