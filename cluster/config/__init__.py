"""Cluster configuration: pydantic models loaded from YAML.

One YAML file describes the whole application: the target models, the pools of replicas that
serve them (each pool is one Ray Serve deployment with its own vLLM settings), how requests are
routed between pools, telemetry, the local Ray sizing and the HTTP server. Unknown keys are
rejected, and every error names the file and the field path on one line.

The models live one concern per module (`targets`, `pools`, `routing`, `server`, the whole
`application`), loading in `loading`; this package exports the public names.
"""

from cluster.config.application import ClusterConfig, is_local_path, map_local_paths
from cluster.config.base import ConfigError, load_yaml_model
from cluster.config.loading import (
    DEFAULT_CONFIG,
    drafter_problems,
    load_config,
    parse_config,
    profile_problems,
)
from cluster.config.pools import AutoscalingConfig, EngineConfig, PoolConfig, SpeculationConfig
from cluster.config.routing import RoutingConfig
from cluster.config.server import (
    ApiKey,
    AuthConfig,
    KubernetesConfig,
    RayConfig,
    ServerConfig,
    TelemetryConfig,
)
from cluster.config.targets import TargetConfig

__all__ = [
    "DEFAULT_CONFIG",
    "ApiKey",
    "AuthConfig",
    "AutoscalingConfig",
    "ClusterConfig",
    "ConfigError",
    "EngineConfig",
    "KubernetesConfig",
    "PoolConfig",
    "RayConfig",
    "RoutingConfig",
    "ServerConfig",
    "SpeculationConfig",
    "TargetConfig",
    "TelemetryConfig",
    "drafter_problems",
    "is_local_path",
    "load_config",
    "load_yaml_model",
    "map_local_paths",
    "parse_config",
    "profile_problems",
]
