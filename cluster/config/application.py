"""The whole application (`ClusterConfig`), its cross-field checks, and the local paths in it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from cluster.config.base import Strict
from cluster.config.pools import PoolConfig
from cluster.config.routing import RoutingConfig
from cluster.config.server import KubernetesConfig, RayConfig, ServerConfig, TelemetryConfig
from cluster.config.targets import TargetConfig
from cluster.models import EMBEDDED_SOURCE_PREFIX, absolute_keeping_link


class ClusterConfig(Strict):
    """The whole application."""

    targets: list[TargetConfig] = Field(min_length=1)
    """Target models."""

    pools: list[PoolConfig] = Field(min_length=1)
    """Pools of replicas; at most one speculative and one throughput pool per target."""

    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """Pool choice per request."""

    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    """Tracing."""

    ray: RayConfig = Field(default_factory=RayConfig)
    """Local Ray sizing."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP endpoint."""

    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    """Layout on Kubernetes (`cluster render kuberay`)."""

    # Directory relative paths resolve against: the config file's (set by the loader).
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    # Where the config came from, for error messages after loading.
    _source: str = PrivateAttr(default="<config>")

    @model_validator(mode="after")
    def _cross_references(self) -> ClusterConfig:
        _unique([t.id for t in self.targets], "targets", "id")
        _unique([p.name for p in self.pools], "pools", "name")
        targets = {t.id: t for t in self.targets}
        roles: set[tuple[str, str]] = set()
        for i, pool in enumerate(self.pools):
            if pool.target not in targets:
                raise ValueError(
                    f"pools[{i}].target: unknown target {pool.target!r} "
                    f"(known: {', '.join(targets)})"
                )
            if (pool.target, pool.role) in roles:
                raise ValueError(f"pools[{i}].role: a second {pool.role} pool for {pool.target!r}")
            roles.add((pool.target, pool.role))
        for i, target in enumerate(self.targets):
            if not any(p.target == target.id for p in self.pools):
                raise ValueError(f"targets[{i}].id: no pool serves target {target.id!r}")
            _check_parallelism(i, target, [p for p in self.pools if p.target == target.id])
            floor = sum(p.autoscaling.min_replicas for p in self.pools if p.target == target.id)
            if target.replica_budget is not None and target.replica_budget < floor:
                raise ValueError(
                    f"targets[{i}].replica_budget: {target.replica_budget} is below the "
                    f"pools' min_replicas together ({floor})"
                )
        for i, pool in enumerate(self.pools):
            if pool.autoscaling.target_per_user_tok_s is not None and not self.routing.profile:
                raise ValueError(
                    f"pools[{i}].autoscaling.target_per_user_tok_s: needs routing.profile (the "
                    "calibrated model that predicts the rate)"
                )
        return self

    def target(self, target_id: str) -> TargetConfig:
        return next(t for t in self.targets if t.id == target_id)

    def resolve_path(self, location: str) -> str:
        """A local path relative to the config file becomes absolute (`absolute_keeping_link`: a
        pulled model directory stays the link, not the version it names now); URIs stay as
        they are."""
        if not is_local_path(location):
            return location
        return str(absolute_keeping_link(self._base_dir / location))


def is_local_path(location: str) -> bool:
    """Whether a target source or drafter location is a path on disk (not a URI, not embedded)."""
    return "://" not in location and not location.startswith(EMBEDDED_SOURCE_PREFIX)


def map_local_paths(config_data: dict[str, Any], convert: Callable[[str], str]) -> dict[str, Any]:
    """A copy of config data (the YAML mapping) with each local target source and tokenizer,
    drafter path, routing profile and API keys file passed through `convert`; URIs and
    embedded sources stay as they are."""
    data = copy.deepcopy(config_data)
    holders = [
        *data.get("targets", []),
        *(p.get("speculation") or {} for p in data.get("pools", [])),
        data.get("routing") or {},
        (data.get("server") or {}).get("auth") or {},
    ]
    for holder in holders:
        for key in ("source", "tokenizer", "drafter", "profile", "keys_file"):
            if isinstance(holder.get(key), str) and is_local_path(holder[key]):
                holder[key] = convert(holder[key])
    return data


def _unique(values: list[str], field: str, key: str) -> None:
    seen: set[str] = set()
    for i, value in enumerate(values):
        if value in seen:
            raise ValueError(f"{field}[{i}].{key}: duplicate {value!r}")
        seen.add(value)


def _check_parallelism(index: int, target: TargetConfig, pools: list[PoolConfig]) -> None:
    where = f"targets[{index}]"
    n = target.accelerators_per_replica
    if target.accelerator_type is None and n != 1:
        raise ValueError(
            f"{where}.tensor_parallel_size: TP x PP = {n} needs accelerators; "
            "set accelerator_type or use 1 on CPU"
        )
    if target.accelerator_type is not None and n > target.accelerators_per_node:
        # A replica is one pod (KubeRay) and stages its weights on its own node only.
        names = ", ".join(p.name for p in pools)
        strict = any(p.placement_strategy == "STRICT_PACK" for p in pools)
        raise ValueError(
            f"{where}.tensor_parallel_size: TP x PP = {n} accelerators do not fit a node of "
            f"{target.accelerators_per_node}"
            + (f" (pools {names}: STRICT_PACK cannot place them)" if strict else "")
            + "; a replica spanning nodes is not supported"
        )
