"""`cluster render kuberay`: the manifests validate against the KubeRay CRD schema of the
operator version we deploy (committed under infra/kuberay), map every pool to the right worker
group, keep the ingress on CPU nodes spread over zones, carry PDBs, NetworkPolicies and GCS
fault tolerance, keep pod drain times consistent with Serve's graceful shutdown, and pass
checkov's Kubernetes checks (skips carry their reasons in the manifests)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.config import load_config
from cluster.kuberay import (
    GCS_REDIS_ADDRESS,
    GCS_REDIS_SECRET,
    INGRESS_GROUP,
    INGRESS_RESOURCE,
    MONITORING_NAMESPACE,
    manifests,
    serve_args_config,
)
from cluster.kuberay_pods import TERMINATION_MARGIN_S, drain_seconds
from tests.test_terraform import run_checkov

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "infra" / "kuberay" / "rayservice-v1.7.0.schema.json"
IMAGE = "ghcr.io/example/cluster:0.1.0"
PRESETS = {
    "prod": ("kimi-k2.6-nvfp4-p6-b200.yaml", {"efa_interfaces": 8}),
    "dev": ("dev-g6e.yaml", {"memory_gib_per_gpu": 24}),
}


def strict(schema):
    """The schema as kubectl's strict field validation applies it: an unknown field is an
    error instead of being pruned silently (a typo would otherwise vanish on apply)."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        open_ended = "additionalProperties" in schema or schema.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        if "properties" in schema and not open_ended:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(value) for value in schema]
    return schema


RAYSERVICE_SCHEMA = strict(json.loads(SCHEMA.read_text()))


def render(preset: str):
    config_name, options = PRESETS[preset]
    config = load_config(ROOT / "configs" / config_name)
    return config, manifests(config, image=IMAGE, **options)


def by_kind(documents: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def groups(documents: list[dict]) -> dict[str, dict]:
    service = documents[0]
    return {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def serve_app(documents: list[dict]) -> dict:
    return yaml.safe_load(documents[0]["spec"]["serveConfigV2"])["applications"][0]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rayservice_validates_against_the_kuberay_crd_schema(preset):
    _, documents = render(preset)
    assert documents[0]["kind"] == "RayService"
    jsonschema.validate(documents[0], RAYSERVICE_SCHEMA)


@pytest.mark.parametrize(
    "field,value",
    [("maxReplicas", "two"), ("minReplica", 1)],  # a wrong type, a typo
)
def test_schema_rejects_what_kuberay_would(field, value):
    _, documents = render("dev")
    broken = json.loads(json.dumps(documents[0]))
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0][field] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYSERVICE_SCHEMA)


# (preset, pool, GPUs per pod, EFA devices, minReplicas, maxReplicas)
POOL_TABLE = [
    ("prod", "speculative", 8, 8, 1, 7),
    ("prod", "throughput", 8, 8, 1, 7),
    ("dev", "speculative", 1, None, 0, 1),
    ("dev", "throughput", 1, None, 0, 2),
]


@pytest.mark.parametrize("preset,pool,gpus,efa,low,high", POOL_TABLE)
def test_every_pool_maps_to_a_worker_group(preset, pool, gpus, efa, low, high):
    config, documents = render(preset)
    group = groups(documents)[pool]
    target = config.target(next(p for p in config.pools if p.name == pool).target)
    assert gpus == target.tensor_parallel_size * target.pipeline_parallel_size
    assert (group["minReplicas"], group["maxReplicas"]) == (low, high)
    spec = group["template"]["spec"]
    container = spec["containers"][0]
    limits = container["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == gpus
    assert limits.get("vpc.amazonaws.com/efa") == efa
    assert container["resources"]["requests"] == limits  # Guaranteed QoS
    # Karpenter's NodePool of the pool labels its nodes and taints them for GPU pods only.
    assert spec["nodeSelector"] == {"cluster.ai/pool": pool}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]


@pytest.mark.parametrize("preset,replicas", [("prod", 3), ("dev", 2)])
def test_ingress_runs_on_a_cpu_group_spread_over_zones(preset, replicas):
    _, documents = render(preset)
    group = groups(documents)[INGRESS_GROUP]
    assert group["minReplicas"] == group["maxReplicas"] == replicas >= 2
    assert group["resources"] == {INGRESS_RESOURCE: "1"}
    spec = group["template"]["spec"]
    limits = spec["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and float(limits["cpu"]) >= 1
    assert "tolerations" not in spec  # never on GPU nodes
    spread = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert "kubernetes.io/hostname" in spread
    # The ingress deployment: one replica per ingress pod, pinned by the custom resource.
    ingress = next(d for d in serve_app(documents)["deployments"] if d["name"] == "ingress")
    # A fixed count; beside an app-level policy as a min = max autoscaling config, so Serve
    # pushes the ingress's gate queues to the policy (and refuses num_replicas beside it).
    scaling = ingress.get("autoscaling_config")
    if "autoscaling_policy" in serve_app(documents):
        assert scaling["min_replicas"] == scaling["max_replicas"] == replicas
        assert "num_replicas" not in ingress
    else:
        assert ingress["num_replicas"] == replicas and scaling is None
    assert ingress["ray_actor_options"]["resources"] == {INGRESS_RESOURCE: 1}
    # The head runs no workloads, so the ingress has nowhere else to go.
    head = documents[0]["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    service = by_kind(documents, "Service")["cluster-ingress"]
    assert service["spec"]["selector"]["ray.io/group"] == INGRESS_GROUP


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gcs_fault_tolerance_uses_tls_redis_with_a_secret_token(preset):
    _, documents = render(preset)
    cluster = documents[0]["spec"]["rayClusterConfig"]
    options = cluster["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == GCS_REDIS_ADDRESS
    assert options["redisAddress"].startswith("rediss://")  # TLS
    ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": GCS_REDIS_SECRET, "key": "auth-token"}
    env = {
        e["name"]: e["value"]
        for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["RAY_REDIS_CA_CERT"]
    assert env["RAY_PROMETHEUS_HOST"].startswith("http://")
    assert env["RAY_GRAFANA_HOST"].startswith("http://")
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_worker_group_has_a_pdb(preset):
    _, documents = render(preset)
    pdbs = by_kind(documents, "PodDisruptionBudget")
    for name, group in groups(documents).items():
        pdb = pdbs[f"cluster-{name}"]
        assert pdb["spec"]["maxUnavailable"] == 1
        selector = pdb["spec"]["selector"]["matchLabels"]
        labels = group["template"]["metadata"]["labels"]
        assert selector["ray.io/group"] == name
        assert all(labels[k] == v for k, v in selector.items() if k != "ray.io/group")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_network_policies_deny_by_default_and_allow_explicitly(preset):
    _, documents = render(preset)
    policies = by_kind(documents, "NetworkPolicy")
    deny = policies["cluster-default-deny"]["spec"]
    assert deny["podSelector"] == {} and "ingress" not in deny
    assert deny["policyTypes"] == ["Ingress"]
    lb = policies["cluster-load-balancer"]["spec"]
    assert lb["podSelector"]["matchLabels"]["ray.io/group"] == INGRESS_GROUP
    assert [p["port"] for p in lb["ingress"][0]["ports"]] == [8000]
    prometheus = policies["cluster-prometheus"]["spec"]["ingress"][0]
    assert prometheus["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": MONITORING_NAMESPACE
    }
    assert 8080 in [p["port"] for p in prometheus["ports"]]
    # Nothing outside the Ray pods and the KubeRay operator reaches the dashboard or client port.
    for name, policy in policies.items():
        for rule in policy["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            if {8265, 10001} & ports:
                sources = rule["from"]
                assert all("namespaceSelector" in s or "podSelector" in s for s in sources), name


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_drain_times_match_serve_graceful_shutdown(preset):
    config, documents = render(preset)
    (ingress,) = serve_app(documents)["deployments"]
    longest = max(p.graceful_shutdown_timeout_s for p in config.pools)
    assert ingress["name"] == "ingress" and ingress["graceful_shutdown_timeout_s"] == longest
    pools = {p.name: p for p in config.pools}
    for name, group in groups(documents).items():
        drained = [pools[name]] if name in pools else config.pools
        seconds = drain_seconds(*drained)
        assert seconds >= max(p.graceful_shutdown_timeout_s for p in drained)
        spec = group["template"]["spec"]
        command = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "ray drain-node" in command
        assert f"sleep {seconds}" in command
        assert spec["terminationGracePeriodSeconds"] == seconds + TERMINATION_MARGIN_S


def test_only_the_ingress_pods_read_the_api_keys_from_the_mounted_secret():
    config, documents = render("prod")
    assert config.server.auth.required and config.server.auth.keys_file is None
    keys_file = serve_app(documents)["args"]["config"]["server"]["auth"]["keys_file"]
    for name, group in groups(documents).items():
        spec = group["template"]["spec"]
        secrets = [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        if name == "ingress":
            assert secrets == ["cluster-api-keys"]
            assert mounts["api-keys"]["readOnly"]
            assert keys_file == mounts["api-keys"]["mountPath"] + "/keys.json"
        else:
            assert not secrets and "api-keys" not in mounts


def test_a_pool_may_not_take_the_ingress_group_name():
    config = load_config(ROOT / "configs" / "dev-g6e.yaml")
    data = config.model_dump(mode="json", exclude_none=True)
    data["pools"][0]["name"] = INGRESS_GROUP
    from cluster.config import parse_config

    with pytest.raises(ValueError, match="ingress"):
        manifests(parse_config(data, base_dir=ROOT / "configs"), image=IMAGE)


def _as_checkov_input(documents: list[dict], namespace: str) -> list[dict]:
    """checkov knows no RayService: each Ray pod template becomes the Pod KubeRay creates from
    it (annotations, with the skip reasons, included); the other kinds go in as they are."""
    service, rest = documents[0], documents[1:]
    cluster = service["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates |= {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**template["metadata"], "name": f"ray-{name}", "namespace": namespace},
            "spec": template["spec"],
        }
        for name, template in templates.items()
    ]
    return pods + [{**d, "metadata": {**d["metadata"], "namespace": namespace}} for d in rest]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_checkov_kubernetes_checks_pass(preset, tmp_path):
    _, documents = render(preset)
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(_as_checkov_input(documents, "ray")))
    summary = run_checkov("-f", str(path), "--framework", "kubernetes")
    assert summary["passed"] > 50


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_serve_config_is_valid_for_serve_and_carries_the_budget_policy(preset):
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingPolicy
    from ray.serve.schema import ServeDeploySchema

    from cluster.autoscale.ray_policy import BudgetAutoscalingPolicy

    config, documents = render(preset)
    ServeDeploySchema.model_validate(yaml.safe_load(documents[0]["spec"]["serveConfigV2"]))
    policy = serve_app(documents).get("autoscaling_policy")
    if all(t.replica_budget is None for t in config.targets):
        assert policy is None
        return
    # What Serve's controller does with the app config's `autoscaling_policy`.
    instance = _resolve_policy_callable(AutoscalingPolicy(**policy))
    assert isinstance(instance, BudgetAutoscalingPolicy)
    assert instance.budgets == {t.id: t.replica_budget for t in config.targets}
    assert set(instance.pools) == {f"pool-{p.name}" for p in config.pools}
    # The ingress the policy reads its queues from is deployed under that name.
    assert any(d["name"] == instance.ingress for d in serve_app(documents)["deployments"])


def test_an_absolute_path_reaches_the_image_as_is_unless_it_is_in_the_checkout():
    from cluster.config import parse_config

    data = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    data["server"]["auth"] = {"required": True, "keys_file": "/etc/cluster/keys.json"}
    data["routing"]["profile"] = str(ROOT / "configs" / "profiles" / "embedded.yaml")
    args = serve_args_config(parse_config(data, base_dir=ROOT / "configs"))
    assert args["server"]["auth"]["keys_file"] == "/etc/cluster/keys.json"  # mounted in the pod
    assert args["routing"]["profile"] == "configs/profiles/embedded.yaml"  # from the image's root


@pytest.mark.parametrize("where", ["kuberay", "local"])
def test_the_app_builder_gets_the_config_as_written(where, monkeypatch):
    """What `app_builder` parses (KubeRay's serveConfigV2 args, `cluster serve`'s declarative
    deploy) is the config itself: an explicit null stays null, local paths still resolve."""
    from cluster.config import parse_config
    from cluster.serve import local_args_config

    data = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    data["routing"]["slo_headroom"] = None  # the default is 1.25
    data["server"]["auth"] = {"required": True, "keys_file": "keys.json"}  # beside the config
    config = parse_config(data, base_dir=ROOT / "configs")
    if where == "kuberay":
        args = serve_args_config(config)
        monkeypatch.chdir(ROOT)  # the image's working directory: the project root
    else:
        args = local_args_config(config)
        monkeypatch.chdir("/")  # Serve builds the app elsewhere
    built = parse_config(args, "args.config")
    assert built.routing.slo_headroom is None
    assert built.resolve_path(built.routing.profile) == config.resolve_path(config.routing.profile)
    drafter = built.pools[0].speculation.drafter
    assert built.resolve_path(drafter) == config.resolve_path(config.pools[0].speculation.drafter)
    assert built.resolve_path(built.server.auth.keys_file) == str(ROOT / "configs" / "keys.json")
