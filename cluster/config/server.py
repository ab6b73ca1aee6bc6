"""Where and how the application runs: the HTTP server and its API keys, tracing, local Ray
sizing, the layout on Kubernetes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.config.base import Strict


class TelemetryConfig(Strict):
    """OpenTelemetry tracing of the request path."""

    service_name: str = "cluster"
    """`service.name` resource attribute of exported spans."""

    otlp_endpoint: str | None = None
    """OTLP/HTTP traces endpoint (e.g. `http://collector:4318/v1/traces`); None = no export."""

    export_delay_ms: int = Field(default=1000, ge=1)
    """Batch span processor delay before exporting."""


class RayConfig(Strict):
    """How `cluster serve` starts a local Ray (ignored with `--address`)."""

    num_cpus: int | None = Field(default=None, ge=1)
    """Logical CPUs declared to Ray. Scheduling tokens, not cores: a 2-core box must declare
    more than 2 or the ingress never schedules next to two engine replicas."""

    include_dashboard: bool = True
    """Start the Ray dashboard (port 8265) for operations."""

    serve_throughput_optimized: bool = True
    """Set `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` for the Serve processes this command starts
    (Ray's bundle: user code on the replica's event loop, gRPC between proxy and replicas,
    buffered request logs, GC frozen after start). With `--address`, set it on the cluster."""


class ApiKey(Strict):
    """One API key, stored as its SHA-256 (`cluster keys hash` prints it); never the key."""

    name: str = Field(min_length=1)
    """Who holds the key; logged instead of the key."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex SHA-256 of the key."""

    scopes: list[Literal["inference", "admin"]] = Field(min_length=1)
    """`inference`: the OpenAI API; `admin`: the operator endpoints under `/cluster/`."""


class AuthConfig(Strict):
    """API keys. Clients send `Authorization: Bearer <key>`."""

    required: bool = True
    """Refuse requests without a valid key. Off is allowed only on a loopback host (the
    embedded preset); the server says so at start."""

    keys: list[ApiKey] = Field(default_factory=list)
    """Keys listed in the config itself."""

    keys_env: str | None = "CLUSTER_API_KEYS"
    """Environment variable (of the ingress process) holding more keys, as a JSON list of
    `{name, sha256, scopes}`; unset or empty adds none."""

    keys_file: str | None = None
    """File (e.g. a mounted Kubernetes secret) with more keys in the same JSON form."""


class ServerConfig(Strict):
    """The HTTP endpoint."""

    host: str = "127.0.0.1"
    """Interface the Serve HTTP proxy binds."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the OpenAI-compatible API."""

    app_name: str = "cluster"
    """Ray Serve application name."""

    auth: AuthConfig = Field(default_factory=AuthConfig)
    """API keys and scopes."""

    cors_allow_origins: list[str] = Field(default_factory=list)
    """Browser origins allowed to call the API; empty (the default) sends no CORS headers."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest request body; bigger ones get a 413."""

    max_json_depth: int = Field(default=32, ge=2)
    """Deepest JSON nesting accepted in a body (arrays and objects)."""

    retry_after_s: int = Field(default=2, ge=1)
    """`Retry-After` seconds sent with 429 and 503 answers."""

    max_attempts: int = Field(default=3, ge=1, le=5)
    """Tries per request before its first token: the chosen pool, then the target's other
    pool, then the chosen pool again (a replica that failed is replaced meanwhile)."""

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> ServerConfig:
        if not self.auth.required and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"auth.required: false is only allowed on a loopback host (host is {self.host})"
            )
        return self


class KubernetesConfig(Strict):
    """How `cluster render kuberay` lays the application out on Kubernetes (unused locally)."""

    ingress_replicas: int = Field(default=2, ge=2)
    """Replicas of the ingress deployment, one per pod of the CPU worker group, spread over
    zones: the API survives losing a pod, a node or a zone."""
