"""Serve really calls the deployed replica router and autoscaling policy (embedded preset:
`replica_router: least_slowdown`, `autoscaling.policy: model` with the calibrated profile on both
pools, a `replica_budget`, so the application-level policy decides for both).

A custom policy or router that is configured but never called fails silently in Ray (a wrong
import path at the wrong scope, an app-level policy shadowing it, metrics never pushed), so this
reads the proof from this cluster's own Serve logs: the controller's decision lines with the
replicas' engine stats as inputs, and the ingress's router lines with decisions made from the
pool's routing stats."""

from __future__ import annotations

import re
import time
from pathlib import Path

import openai
import pytest

from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.ray_policy import DECISION_LOG_PREFIX
from cluster.config import load_config
from cluster.deployments.replica_router import ROUTER_LOG_PREFIX
from cluster.simulate import trace
from cluster.simulate.engine import Simulation
from cluster.simulate.strategies import OURS, strategies
from cluster.slo import Slo

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def _text(logs: Path, pattern: str) -> str:
    return "".join(p.read_text(errors="replace") for p in logs.glob(pattern))


def test_serve_calls_the_deployed_policy_and_router(cluster):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name one prime number."}]
    policy_fed = re.compile(
        # Sorted keys: the calibrated model was loaded (its online acceptance correction is
        # an input) and one replica's stats reached the decision.
        re.escape(DECISION_LOG_PREFIX) + r"pool-(speculative|throughput) replicas=1->1 .*"
        r'"acceptance_scale": [0-9.]+, .*"reporting": 1'
    )
    # Whichever pool the model routes these short prompts to.
    router_by_stats = re.compile(
        re.escape(ROUTER_LOG_PREFIX)
        + r"deployment=pool-(speculative|throughput) routed_by_stats=[1-9]"
    )
    # Metrics reach the controller every 10 s and routing stats every 2 s: a minute is ample.
    deadline = time.monotonic() + 90
    while True:
        client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=4)
        controller = _text(cluster.serve_logs, "controller_*.log")
        ingress = _text(cluster.serve_logs, "replica_cluster_ingress_*.log")
        fed = {m.group(1) for m in policy_fed.finditer(controller)}
        if (fed == {"speculative", "throughput"} and router_by_stats.search(ingress)) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(2)
    # Ray's own line: it deserialized our application-level class (the preset has a replica
    # budget), which decides for both pools in place of their deployment-level policies.
    assert (
        "Using custom autoscaling policy 'cluster.autoscale.ray_policy:BudgetAutoscalingPolicy' "
        "for application 'cluster'"
    ) in controller, controller[-3000:]
    # Our policy ran and saw one reporting replica per pool (record_autoscaling_stats -> ctx).
    assert fed == {"speculative", "throughput"}, [
        line for line in controller.splitlines() if DECISION_LOG_PREFIX in line
    ][-10:]
    # Our router ran in the ingress and ranked the pool's replicas from their routing stats.
    assert router_by_stats.search(ingress), [
        line for line in ingress.splitlines() if ROUTER_LOG_PREFIX in line
    ]


def test_simulator_decides_like_the_live_ingress(cluster):
    """Same inputs, same decisions: a small seeded trace sent one request at a time (both pools
    idle, as in the simulator at the same moment); each live decision (pool and the predicted
    rates in `x-cluster-route-reason`) equals the simulator's for the prompt tokens the ingress
    counted (its route log) and the request's max_tokens."""
    config = load_config(ROOT / "configs" / "embedded.yaml")
    model = PerformanceModel.load(config.resolve_path(config.routing.profile))
    ours = next(s for s in strategies(config, model, Slo(5, 5), budget=2) if s.name == OURS)
    simulation = Simulation(ours, model.pools, Slo(5, 5))
    spec = trace.TraceSpec.model_validate({
        "seed": 3, "duration_s": 60, "peak_rate_per_s": 0.2, "trough_rate_per_s": 0.2,
        "kinds": [{"name": "chat", "share": 1, "prompt_tokens_median": 300,
                   "prompt_tokens_sigma": 1.2, "output_tokens_median": 24,
                   "output_tokens_sigma": 0.5, "max_prompt_tokens": 3000}],
    })  # fmt: skip
    requests = trace.generate(spec)
    assert len(requests) >= 5
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)
    reasons = set()
    for number, request in enumerate(requests):
        request_id = f"replay-{number}"
        raw = client.completions.with_raw_response.create(
            model=cluster.model, prompt="code " * request.prompt_tokens,
            max_tokens=request.output_tokens, extra_headers={"x-request-id": request_id},
        )  # fmt: skip
        counted = re.search(
            rf"route request={request_id} .* prompt_tokens=(\d+)",
            _text(cluster.serve_logs, "replica_cluster_ingress_*.log"),
        )
        assert counted, request_id
        replayed = trace.TraceRequest(0.0, "chat", int(counted.group(1)), request.output_tokens)
        decision = simulation.decide(replayed, now=0.0)
        assert raw.headers["x-cluster-pool"] == decision.pool, request_id
        assert raw.headers["x-cluster-route-reason"] == decision.header, request_id
        reasons.add(decision.reason.value)
    # The model decided each time (not rule v1): the comparison covered its predictions.
    assert reasons == {"predicted_faster"}
