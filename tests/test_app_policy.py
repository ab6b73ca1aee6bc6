"""The application-level autoscaling adapter (`BudgetAutoscalingPolicy`) on Ray's own context
objects, through Ray's own app-level wrapper: the pools of a target under a replica budget, a
pool whose replicas start, and the requests waiting at the ingress's gates."""

from __future__ import annotations

from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
from ray.serve.config import AutoscalingPolicy

from cluster.autoscale.ray_policy import BudgetAutoscalingPolicy
from tests.serve_log import serve_log
from tests.test_ray_policy import APP, KWARGS, R1, R2, context, engine, replica


def test_budget_policy_through_rays_app_level_wrapper():
    policy = AutoscalingPolicy(
        policy_function="cluster.autoscale.ray_policy:BudgetAutoscalingPolicy",
        policy_kwargs={
            "pools": {
                "pool-speculative": {"group": "t", "target_running_per_replica": 4},
                "pool-throughput": {"group": "t", "target_running_per_replica": 8},
            },
            "budgets": {"t": 4},
        },
    )
    instance = _resolve_policy_callable(policy)
    assert isinstance(instance, BudgetAutoscalingPolicy)
    wrapped = _apply_app_level_autoscaling_config(instance)
    spec = replica("s1", "pool-speculative")
    contexts = {
        DeploymentID(name="pool-speculative", app_name=APP): context(
            {spec: engine(12)}, deployment="pool-speculative"
        ),
        DeploymentID(name="pool-throughput", app_name=APP): context({R1: engine(40)}),
        DeploymentID(name="ingress", app_name=APP): context({}, deployment="ingress", current=1),
    }
    decisions, states = wrapped(contexts)
    by_name = {d.name: n for d, n in decisions.items()}
    # No models: wanted 3 + 4 = 7 > budget 4, cut from the pool furthest above its minimum.
    assert by_name == {"pool-speculative": 2, "pool-throughput": 2}
    assert set(states) == set(contexts)
    # Light load, and the ingress (a fixed count: no decision, its state passed through)
    # reports 40 requests waiting for the speculative pool: 44 want 11 of its replicas, which
    # the budget holds to 3 beside the throughput pool's 1 (without the queue: 1 and 1).
    reporting = replica("i1", "ingress")
    queue = context({reporting: {"queued:pool-speculative": 40.0}}, deployment="ingress")
    light = {
        DeploymentID(name="pool-speculative", app_name=APP): context(
            {spec: engine(4)}, deployment="pool-speculative"
        ),
        DeploymentID(name="pool-throughput", app_name=APP): context({R1: engine(4)}),
        queue.deployment_id: queue,
    }
    instance.ingress = "ingress"
    decisions, states = wrapped(light)
    assert queue.deployment_id not in decisions and set(states) == set(light)
    assert {d.name: n for d, n in decisions.items()} == {
        "pool-speculative": 3, "pool-throughput": 1,
    }  # fmt: skip


def test_a_pool_whose_replica_starts_does_not_freeze_its_budget_group():
    instance = BudgetAutoscalingPolicy(
        pools={"pool-speculative": {"group": "t", "role": "speculative", **KWARGS},
               "pool-throughput": {"group": "t", "role": "throughput", **KWARGS}},
        budgets={"t": 6},
    )  # fmt: skip
    starting = context({}, deployment="pool-speculative", current=1)  # none running yet
    busy = context({R1: engine(40)})
    decisions, _ = instance({starting.deployment_id: starting, busy.deployment_id: busy})
    by_name = {d.name: n for d, n in decisions.items()}
    # The starting pool holds its replica; the busy one grows within what the budget leaves.
    assert by_name == {"pool-speculative": 1, "pool-throughput": 4}
    # A running replica that has not reported is unknown load: then the group holds.
    silent = context({R2: engine(0)}, deployment="pool-speculative", age_s={R2: 120.0})
    decisions, _ = instance({silent.deployment_id: silent, busy.deployment_id: busy})
    assert {d.name: n for d, n in decisions.items()}["pool-throughput"] == 1


def test_budget_policy_adds_the_requests_queued_at_the_ingress_to_each_pool():
    kwargs = {"upscale_cooldown_s": 0, "downscale_cooldown_s": 0}
    instance = BudgetAutoscalingPolicy(
        pools={"pool-speculative": {"group": "t", "role": "speculative",
                                    "target_running_per_replica": 4, **kwargs},
               "pool-throughput": {"group": "t", "role": "throughput",
                                   "target_running_per_replica": 8, **kwargs}},
        budgets={"t": 6},
        ingress="ingress",
    )  # fmt: skip
    spec = replica("s1", "pool-speculative")
    i1, i2, i3 = (replica(n, "ingress") for n in ("i1", "i2", "i3"))
    queues = {
        i1: {"queued:pool-throughput": 20.0, "queued:pool-speculative": 0.0},
        i2: {"queued:pool-throughput": 4.0, "queued:pool-speculative": 0.0},
        i3: {"queued:pool-throughput": 90.0},  # gone quiet: its queue is not counted
    }
    ingress = context(queues, deployment="ingress", age_s={i3: 120.0})
    pools = [context({spec: engine(4)}, deployment="pool-speculative"), context({R1: engine(8)})]
    contexts = {c.deployment_id: c for c in (*pools, ingress)}
    with serve_log() as records:
        decisions, _ = instance(contexts)
    # The throughput pool holds 8 and 20 + 4 wait for it at the ingress: 32 / 8 = 4 replicas.
    assert {d.name: n for d, n in decisions.items()} == {
        "pool-speculative": 1, "pool-throughput": 4,
    }  # fmt: skip
    line = next(r.getMessage() for r in records if "pool=pool-throughput" in r.getMessage())
    assert '"queued": 24' in line and '"demand": 32' in line
    # Without the ingress's reports the pool sees only what its replicas hold.
    del contexts[ingress.deployment_id]
    decisions, _ = instance(contexts)
    assert {d.name: n for d, n in decisions.items()}["pool-throughput"] == 1
