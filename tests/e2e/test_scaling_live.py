"""Scaling on a small cluster of its own (the embedded preset, its speculative pool at zero
replicas, every pool taking one request per replica): a pool wakes for its first request, and
the requests waiting at the ingress's gates reach the application-level policy (the preset has
a replica budget, so `cluster serve` deploys declaratively with it)."""

from __future__ import annotations

import re
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml

from cluster.autoscale.ray_policy import DECISION_LOG_PREFIX
from cluster.launcher import ServeProcess

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "configs" / "embedded.yaml"


@pytest.fixture(scope="module")
def small_cluster():
    data = yaml.safe_load(EMBEDDED.read_text())
    assert data["targets"][0].get("replica_budget"), "the preset deploys with an app policy"
    speculative = next(p for p in data["pools"] if p["role"] == "speculative")
    speculative["autoscaling"] = {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0}
    speculative["queue_timeout_s"] = 600  # a CPU replica loads in about a minute
    # Rule v1's wake-up (the model path is unit-tested: a cold pool is chosen only when its
    # cold start pays off against the warm pool, which an idle cluster never does).
    data["routing"].pop("profile")
    for pool in data["pools"]:
        pool["autoscaling"].pop("target_per_user_tok_s", None)  # a rate target needs a profile
        pool["max_ongoing_requests"] = 1  # a handful of requests fill the pools
    with ServeProcess(data, base_dir=EMBEDDED.parent) as serve:
        logs = re.search(r"\(logs: (\S+)\)", serve.log())
        assert logs, serve.log()[-2000:]
        yield serve, data, Path(logs.group(1))


def test_pool_at_zero_replicas_wakes_for_its_first_request(small_cluster):
    serve, data, _ = small_cluster
    pools = requests.get(f"{serve.base_url}/readyz", timeout=30).json()["pools"]
    assert pools["speculative"]["running_replicas"] == 0
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    started = time.monotonic()
    response = requests.post(
        f"{serve.base_url}/v1/completions",
        json={"model": data["targets"][0]["id"], "prompt": source[:8000], "max_tokens": 8},
        timeout=900,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-cluster-pool"] == "speculative"
    assert response.headers["x-cluster-route-reason"] == "long_context"
    assert time.monotonic() - started > 5  # it really waited for a replica to start
    pools = requests.get(f"{serve.base_url}/readyz", timeout=30).json()["pools"]
    assert pools["speculative"]["running_replicas"] == 1


def test_the_app_policy_sees_the_requests_waiting_at_the_ingress(small_cluster):
    """More streams than the pools take at once: the rest wait at the ingress's gates, which no
    pool replica can report; the policy's decision line must show them (`"queued": N > 0`)."""
    serve, data, logs = small_cluster
    queued_seen = re.compile(re.escape(DECISION_LOG_PREFIX) + r'pool-\S+ .*"queued": [1-9]')
    body = {"model": data["targets"][0]["id"], "prompt": "Count from one to a thousand:",
            "stream": True, "max_tokens": 4000, "ignore_eos": True}  # fmt: skip
    stop, waiting = threading.Event(), []

    def hold_a_stream() -> None:
        while not stop.is_set():  # a wait that timed out (503, or our read timeout) queues again
            try:
                with requests.post(f"{serve.base_url}/v1/completions", json=body, stream=True,
                                   timeout=(10, 60)) as response:  # fmt: skip
                    for _ in response.iter_lines():
                        if stop.is_set():
                            return
            except requests.RequestException:
                continue

    def controller() -> str:
        return "".join(p.read_text(errors="replace") for p in logs.glob("controller_*.log"))

    with ThreadPoolExecutor(6) as streams:
        holders = [streams.submit(hold_a_stream) for _ in range(6)]
        try:
            # The ingress pushes its reports every 10 s; the policy logs when a queue appears.
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not queued_seen.search(controller()):
                time.sleep(2)
                pools = requests.get(f"{serve.base_url}/cluster/pools", timeout=30).json()
                waiting.append(sum(pool["queued"] for pool in pools.values()))
        finally:
            stop.set()
        for holder in holders:
            holder.result(timeout=180)
    assert max(waiting, default=0) > 0, waiting  # the streams did wait at the ingress
    assert queued_seen.search(controller()), controller()[-3000:]
