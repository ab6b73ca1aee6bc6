"""`cluster serve`: start (or join) Ray, deploy the application, wait until it answers, and
shut down cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, ConfigError, drafter_problems

READY_TIMEOUT_S = 900


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")
        time.sleep(0.5)


def local_args_config(config: ClusterConfig) -> dict[str, Any]:
    """The config as `app_builder` gets it from a declarative deploy on this machine: every
    local path absolute (Serve builds the app in another process, with another working
    directory)."""
    from cluster.deployments.app import builder_args_config

    return builder_args_config(config, config.resolve_path)


def _wait_deployed(app_name: str) -> None:
    """Until Serve reports the application RUNNING (as long as it takes, as `serve.run` waits:
    a large model loads for many minutes); its deploy error if it fails."""
    from ray import serve

    while True:
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploying {app_name!r} failed: {status.message}")
        time.sleep(1)


def deploy_declaratively(config: ClusterConfig, dashboard_url: str, config_file: Path) -> None:
    """Deploy with `serve deploy` (Serve's REST API on the dashboard), the way KubeRay's
    `serveConfigV2` does: the only way to give Serve an application-level autoscaling policy
    (replica budgets), which `serve.run` does not take. It replaces every application on the
    cluster, so only for a cluster this command started. The config is kept in `config_file`."""
    from cluster.deployments.app import serve_application

    body = {
        "http_options": {"host": config.server.host, "port": config.server.port},
        "applications": [serve_application(config, local_args_config(config), ingress_replicas=1)],
    }
    config_file.write_text(json.dumps(body, indent=2))
    command = [sys.executable, "-m", "ray.serve.scripts", "deploy", str(config_file),
               "--address", f"http://{dashboard_url}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"serve deploy {config_file} failed: {done.stderr.strip()[-2000:]}")
    _wait_deployed(config.server.app_name)


def _sigterm_as_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def idle_until_interrupted() -> None:
    """Block until Ctrl-C / SIGTERM raises KeyboardInterrupt. In short sleeps: the signal can
    land on any of Ray's threads (mostly so after a benchmark froze and thawed the server), and
    Python acts on it only when the main thread wakes."""
    while True:
        time.sleep(1)


def serve_config(config: ClusterConfig, address: str | None = None) -> int:
    """Deploy `config` and block until interrupted. Returns the process exit code."""
    from cluster.models import prepare_config_models

    started = time.monotonic()
    prepare_config_models(config)
    # Drafters of embedded targets can only be checked once the target is prepared.
    problems = drafter_problems(config)
    if problems:
        raise ConfigError("\n".join(f"{config._source}: {p}" for p in problems))

    # Serve reads it at import, in this process and in every Serve process Ray starts from it.
    if config.ray.serve_throughput_optimized and not address:
        os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
        # The bundle buffers 1000 request-path log records per replica; routing decisions must
        # reach the logs as they are made (operators tail them), so write them through.
        os.environ.setdefault("RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE", "1")
    import ray
    from ray import serve

    from cluster.deployments.app import app_autoscaling_policy, build_app

    dashboard_url = None  # set: this command started Ray, with the dashboard
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # Serve gives its HTTP proxy 3 x 5 s to come up; on a small machine that is busy (a
        # drafter training in the background) importing it takes longer, and Serve kills it.
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
        started_ray = ray.init(
            # A Ray of our own, even beside a running cluster or with RAY_ADDRESS set: joining
            # one takes `--address` (a declarative deploy replaces every app on a cluster).
            address="local",
            num_cpus=config.ray.num_cpus,
            include_dashboard=config.ray.include_dashboard,
            dashboard_host="127.0.0.1",
            log_to_driver=False,
        )
        dashboard_url = started_ray.dashboard_url or None
    # After ray.init, which installs its own SIGTERM handler. Background shells start us with
    # SIGINT ignored; Ctrl-C and SIGTERM must both reach the cleanup below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    logs = ray._private.worker.global_worker.node.get_logs_dir_path()  # noqa: SLF001
    host = "127.0.0.1" if config.server.host in ("0.0.0.0", "::") else config.server.host
    base = f"http://{host}:{config.server.port}"
    try:
        serve.start(http_options={"host": config.server.host, "port": config.server.port})
        print(
            f"deploying {config.server.app_name!r}: pools "
            f"{', '.join(p.name for p in config.pools)} (logs: {logs}/serve)",
            flush=True,
        )
        budgets = app_autoscaling_policy(config) is not None
        if budgets and dashboard_url:
            deploy_declaratively(config, dashboard_url, Path(logs).parent / "serve_config.json")
        else:
            if budgets:
                print(
                    "WARNING: targets[].replica_budget needs Serve's application-level "
                    "autoscaling policy, which only a declarative deploy applies: through the "
                    "dashboard of a Ray cluster this command starts, or `cluster render "
                    "kuberay`. Here (--address, or ray.include_dashboard: false) each pool "
                    "scales on its own policy within its max_replicas.",
                    flush=True,
                )
            serve.run(build_app(config), name=config.server.app_name, route_prefix="/")
        _wait_ready(f"{base}/readyz", READY_TIMEOUT_S)
        model = config.targets[0].id
        dashboard = f" (dashboard http://{dashboard_url})" if dashboard_url else ""
        print(
            f"\nready in {time.monotonic() - started:.1f}s: {base}/v1{dashboard}\n\n"
            f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{model}", "messages": '
            f'[{{"role": "user", "content": "Say hello"}}], "max_tokens": 32}}\'\n\n'
            f"Ctrl-C to stop.",
            flush=True,
        )
        if not config.server.auth.required:
            print(
                f"WARNING: API keys are off (server.auth.required: false): anyone who can reach "
                f"{base} can use it. Production configs require keys (docs/operations.md).",
                flush=True,
            )
        idle_until_interrupted()
    except KeyboardInterrupt:
        print("\nshutting down", flush=True)
        return 0
    except Exception as error:  # deployment failures: one clear line, then clean up
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Draining can take graceful_shutdown_timeout_s: another Ctrl-C or SIGTERM then must
        # not cut it short and leave Ray behind, nor must a failing first step skip the second.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if address:
                serve.delete(config.server.app_name)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
