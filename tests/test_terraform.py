"""Terraform, statically: no terraform binary or provider registry is reachable here, so every
`.tf` is parsed with python-hcl2 and its structure asserted, checkov (offline) must report zero
failed checks, and `terraform fmt/validate` run only where a binary exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest
import yaml

from cluster import kuberay
from cluster.config import load_config
from cluster.kuberay import INGRESS_GROUP, manifests

ROOT = Path(__file__).resolve().parent.parent
TF = ROOT / "infra" / "terraform"
MODULES = sorted(p for p in (TF / "modules").iterdir() if p.is_dir())
ENVS = sorted(p for p in (TF / "envs").iterdir() if p.is_dir())
RAY_PORTS = {6379, 8265, 10001}


def _clean(value):
    """python-hcl2 keeps quotes and bookkeeping keys; strip both."""
    if isinstance(value, dict):
        return {
            _clean(k): _clean(v)
            for k, v in value.items()
            if k not in ("__is_block__", "__comments__")
        }
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def parse(path: Path) -> dict:
    with open(path) as handle:
        return _clean(hcl2.load(handle))


def blocks(directory: Path, kind: str) -> dict[str, dict]:
    """`resource`/`data` blocks of a directory as {"type.name": body}."""
    found = {}
    for tf in directory.glob("*.tf"):
        for block in parse(tf).get(kind, []):
            for rtype, named in block.items():
                for name, body in named.items():
                    found[f"{rtype}.{name}"] = body
    return found


def all_resources() -> dict[str, dict]:
    found = {}
    for directory in MODULES + ENVS:
        for key, body in blocks(directory, "resource").items():
            found[f"{directory.name}/{key}"] = body
    return found


def test_expected_modules_and_envs_exist():
    assert [m.name for m in MODULES] == [
        "eks",
        "gcs_redis",
        "gpu_nodes",
        "karpenter",
        "kuberay",
        "load_balancer",
        "network",
        "observability",
        "pod_identity",
        "weights_bucket",
    ]
    assert [e.name for e in ENVS] == ["dev", "prod-p6-b200"]


@pytest.mark.parametrize("directory", MODULES + ENVS, ids=lambda p: p.name)
def test_every_module_has_the_four_files_and_parses(directory):
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf"):
        assert (directory / name).is_file(), f"{directory.name} lacks {name}"
        parse(directory / name)
    versions = parse(directory / "versions.tf")["terraform"][0]
    assert versions["required_version"] == ">= 1.6"
    providers = versions["required_providers"][0]
    if "aws" in providers:
        assert providers["aws"]["version"] == ">= 6.0"


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_modules_have_a_readme(module):
    text = (module / "README.md").read_text()
    assert "## Inputs" in text and "## Outputs" in text
    for variable in parse(module / "variables.tf").get("variable", []):
        assert f"`{next(iter(variable))}`" in text, f"README of {module.name} misses an input"


@pytest.mark.parametrize("directory", MODULES + ENVS, ids=lambda p: p.name)
def test_every_variable_has_type_and_description(directory):
    for variable in parse(directory / "variables.tf").get("variable", []):
        for name, body in variable.items():
            assert body.get("type"), f"{directory.name}: variable {name} has no type"
            assert body.get("description"), f"{directory.name}: variable {name} has no description"
    for output in parse(directory / "outputs.tf").get("output", []):
        for name, body in output.items():
            assert body.get("description"), f"{directory.name}: output {name} has no description"


def assigns(text: str, key: str, value: str) -> bool:
    """Whether HCL `text` sets `key = value`, however `terraform fmt` aligned it."""
    return re.search(rf"{re.escape(key)}\s*=\s*{re.escape(value)}", text) is not None


def _manifests(directory: Path) -> dict[str, dict]:
    return {k: v["manifest"] for k, v in blocks(directory, "resource").items() if "manifest" in v}


def test_efa_security_group_is_self_referencing_and_placement_group_is_cluster():
    resources = blocks(TF / "modules" / "gpu_nodes", "resource")
    for direction in ("ingress", "egress"):
        rule = resources[f"aws_vpc_security_group_{direction}_rule.efa_self"]
        assert rule["ip_protocol"] == "-1"
        assert rule["referenced_security_group_id"] == rule["security_group_id"]
    assert resources["aws_placement_group.pool"]["strategy"] == "cluster"
    main = (TF / "modules" / "gpu_nodes" / "main.tf").read_text()
    assert assigns(main, '"p6-b200.48xlarge"', "8")  # one EFA interface per network card
    # Karpenter's EC2NodeClass: primary ENA interface, EFA-only on every card, placement group.
    assert assigns(main, "interfaceType", '"interface"') and assigns(
        main, "interfaceType", '"efa-only"'
    )
    assert "range(1, each.value.efa_count)" in main
    assert assigns(main, "placementGroupSelector", "{ name = aws_placement_group.pool[each.key]")
    assert assigns(main, "instanceStorePolicy", '"RAID0"')  # instance-store NVMe: model cache


def test_gpu_node_pools_scale_to_zero_and_match_worker_group_tolerations():
    node_pool = _manifests(TF / "modules" / "gpu_nodes")["kubernetes_manifest.node_pool"]
    spec = node_pool["spec"]
    assert "replicas" not in spec  # no static floor: empty pools have no nodes
    assert spec["disruption"]["consolidationPolicy"] == "WhenEmpty"  # never evicts a replica
    assert spec["template"]["spec"]["expireAfter"] == "Never"
    assert "cluster.ai/pool" in spec["template"]["metadata"]["labels"]
    assert "nvidia.com/gpu" in spec["limits"]
    variables = {
        next(iter(v)): next(iter(v.values()))
        for v in parse(TF / "modules/gpu_nodes/variables.tf")["variable"]
    }
    taints = variables["pools"]["type"]
    # The default taint is the one every GPU worker group tolerates.
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    _, documents = _render("dev")
    for group in documents[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        if group["groupName"] != INGRESS_GROUP:
            assert group["template"]["spec"]["tolerations"] == [toleration]
    assert '[{key = "nvidia.com/gpu", value = "true", effect = "NoSchedule"}]' in taints
    main = (TF / "modules" / "gpu_nodes" / "main.tf").read_text()
    # Capacity reservations (ODCR or Capacity Blocks) are selected by id per pool.
    assert assigns(
        main, "capacityReservationSelectorTerms", "[for id in each.value.capacity_reservation_ids"
    )


def test_karpenter_controller_pod_identity_interruption_queue_and_node_access():
    resources = blocks(TF / "modules" / "karpenter", "resource")
    release = resources["helm_release.karpenter"]
    assert release["repository"] == "oci://public.ecr.aws/karpenter"
    identity = _module_calls(TF / "modules" / "karpenter")["controller_identity"]
    assert identity["service_account"] == "karpenter"
    assert identity["policy_json"] == "${data.aws_iam_policy_document.controller.json}"
    main = (TF / "modules" / "karpenter" / "main.tf").read_text()
    assert assigns(main, "interruptionQueue", "aws_sqs_queue.interruption.name")
    assert resources["aws_sqs_queue.interruption"]["sqs_managed_sse_enabled"] is True
    target = resources["aws_cloudwatch_event_target.interruption"]
    assert target["arn"] == "${aws_sqs_queue.interruption.arn}"
    # Nodes share the eks module's node role: its access entry comes with the system nodes.
    assert "aws_eks_access_entry.node" not in resources
    assert assigns(main, "role", "var.node_role_name")
    assert assigns(main, "reservedCapacity", "true")
    ingress = _manifests(TF / "modules" / "karpenter")["kubernetes_manifest.ingress_node_pool"]
    assert ingress["spec"]["template"]["metadata"]["labels"] == {"cluster.ai/role": "ingress"}


def test_gcs_redis_is_encrypted_multi_az_with_a_secret_token():
    resources = blocks(TF / "modules" / "gcs_redis", "resource")
    group = resources["aws_elasticache_replication_group.this"]
    assert group["transit_encryption_enabled"] is True
    assert group["at_rest_encryption_enabled"] is True
    assert group["multi_az_enabled"] is True and group["automatic_failover_enabled"] is True
    assert group["auth_token"] == "${random_password.auth.result}"
    assert group["port"] == 6379 == int(kuberay.GCS_REDIS_ADDRESS.rsplit(":", 1)[1])
    secret = resources["aws_secretsmanager_secret_version.auth"]
    assert secret["secret_string"] == "${random_password.auth.result}"
    rule = resources["aws_vpc_security_group_ingress_rule.nodes"]
    assert "referenced_security_group_id" in rule and not _cidrs(rule)
    main = (TF / "modules" / "kuberay" / "main.tf").read_text()
    assert '"GCS_REDIS_ENDPOINT", var.gcs_redis_endpoint' in main
    assert assigns(main, "name", f'"{kuberay.GCS_REDIS_SECRET}"')


def test_load_balancer_is_https_only_and_health_checks_readyz():
    main = (TF / "modules" / "load_balancer" / "main.tf").read_text()
    annotation = '"alb.ingress.kubernetes.io/{}"'.format
    assert assigns(main, annotation("healthcheck-path"), '"/readyz"')
    assert assigns(main, annotation("listen-ports"), "jsonencode([{ HTTPS = 443 }])")
    assert assigns(main, annotation("certificate-arn"), "var.certificate_arn")
    assert assigns(main, annotation("target-type"), '"ip"')
    ingress = blocks(TF / "modules" / "load_balancer", "resource")["kubernetes_ingress_v1.serve"]
    backend = ingress["spec"][0]["default_backend"][0]["service"][0]
    assert backend["port"][0]["number"] == kuberay.SERVE_PORT
    identity = _module_calls(TF / "modules" / "load_balancer")["controller_identity"]
    assert identity["service_account"] == "aws-load-balancer-controller"


def test_observability_matches_what_the_ray_head_expects():
    main = (TF / "modules" / "observability" / "main.tf").read_text()
    assert assigns(main, "prometheus_fullname", '"kps"')
    namespace = kuberay.MONITORING_NAMESPACE
    assert kuberay.PROMETHEUS_HOST.startswith(f"http://kps-prometheus.{namespace}")
    assert kuberay.GRAFANA_HOST.startswith(f"http://grafana.{namespace}")
    assert assigns(main, "fullnameOverride", '"grafana"')
    assert assigns(main, "allow_embedding", "true")
    assert str(kuberay.METRICS_PORT) in main
    variables = {
        next(iter(v)): next(iter(v.values()))
        for v in parse(TF / "modules/observability/variables.tf")["variable"]
    }
    assert variables["namespace"]["default"] == kuberay.MONITORING_NAMESPACE
    assert variables["amp_enabled"]["type"] == "bool"
    resources = blocks(TF / "modules" / "observability", "resource")
    assert resources["aws_prometheus_workspace.this"]["kms_key_arn"] == "${var.kms_key_arn}"
    assert resources["kubernetes_config_map_v1.dashboards"]["metadata"][0]["labels"] == {
        "grafana_dashboard": "1"
    }


def test_pod_identity_role_trusts_only_the_pod_identity_agent():
    data = blocks(TF / "modules" / "pod_identity", "data")
    statement = data["aws_iam_policy_document.assume"]["statement"][0]
    assert statement["principals"][0]["identifiers"] == ["pods.eks.amazonaws.com"]
    resources = blocks(TF / "modules" / "pod_identity", "resource")
    association = resources["aws_eks_pod_identity_association.this"]
    assert association["role_arn"] == "${aws_iam_role.this.arn}"


def test_vpc_cni_enforces_network_policies():
    addon = blocks(TF / "modules" / "eks", "resource")["aws_eks_addon.vpc_cni"]
    assert "enableNetworkPolicy" in addon["configuration_values"]


def _cidrs(rule: dict) -> list[str]:
    return [
        c
        for key in ("cidr_blocks", "cidr_ipv4", "ipv6_cidr_blocks", "cidr_ipv6")
        for c in (rule.get(key) if isinstance(rule.get(key), list) else [rule.get(key)])
        if c
    ]


def _ports(rule: dict) -> set[int]:
    low, high = rule.get("from_port"), rule.get("to_port")
    if low is None or str(rule.get("ip_protocol", rule.get("protocol"))) == "-1":
        return set(range(0, 65536))
    return set(range(int(low), int(high) + 1))


def test_no_security_group_opens_ray_ports_or_ssh_to_the_world():
    for key, body in all_resources().items():
        rules = []
        if "aws_security_group." in key:
            rules = body.get("ingress", [])
        elif "security_group_ingress_rule" in key or key.endswith("aws_security_group_rule"):
            rules = [body]
        for rule in rules:
            world = {"0.0.0.0/0", "::/0"} & set(_cidrs(rule))
            if world:
                assert not (_ports(rule) & (RAY_PORTS | {22})), f"{key} opens Ray/SSH ports"


def test_every_node_requires_imdsv2_and_encrypts_volumes():
    templates = {k: v for k, v in all_resources().items() if "aws_launch_template." in k}
    assert templates
    for key, body in templates.items():
        assert body["metadata_options"][0]["http_tokens"] == "required", key
        assert body["block_device_mappings"][0]["ebs"][0]["encrypted"] is True, key
    node_classes = {
        f"{module.name}/{key}": manifest
        for module in MODULES
        for key, manifest in _manifests(module).items()
        if isinstance(manifest, dict) and manifest.get("kind") == "EC2NodeClass"
    }
    assert len(node_classes) == 2  # ingress (karpenter) and one per GPU pool (gpu_nodes)
    for key in node_classes:
        main = (TF / "modules" / key.split("/")[0] / "main.tf").read_text()
        assert assigns(main, "httpTokens", '"required"'), key
        assert assigns(main, "encrypted", "true") and assigns(main, "kmsKeyID", "var.kms_key_arn")


def test_weights_bucket_is_encrypted_private_tls_only_with_multipart_cleanup():
    resources = blocks(TF / "modules" / "weights_bucket", "resource")
    data = blocks(TF / "modules" / "weights_bucket", "data")
    sse = resources["aws_s3_bucket_server_side_encryption_configuration.this"]
    default = sse["rule"][0]["apply_server_side_encryption_by_default"][0]
    assert default["sse_algorithm"] == "aws:kms"
    block = resources["aws_s3_bucket_public_access_block.this"]
    assert all(
        block[k] is True
        for k in (
            "block_public_acls",
            "block_public_policy",
            "ignore_public_acls",
            "restrict_public_buckets",
        )
    )
    assert (
        resources["aws_s3_bucket_versioning.this"]["versioning_configuration"][0]["status"]
        == "Enabled"
    )
    deny = data["aws_iam_policy_document.tls_only"]["statement"][0]
    assert deny["effect"] == "Deny" and deny["condition"][0]["variable"] == "aws:SecureTransport"
    rule = resources["aws_s3_bucket_lifecycle_configuration.this"]["rule"][0]
    assert "abort_incomplete_multipart_upload" in rule
    reader = data["aws_iam_policy_document.read_weights"]["statement"]
    actions = {a for s in reader for a in s["actions"]}
    assert actions == {
        "s3:ListBucket",
        "s3:GetBucketLocation",
        "s3:GetObject",
        "s3:GetObjectVersion",
        "kms:Decrypt",
    }  # read-only
    assert "aws_eks_pod_identity_association.reader" in resources


def test_network_has_s3_gateway_endpoint_and_private_nodes():
    resources = blocks(TF / "modules" / "network", "resource")
    endpoint = resources["aws_vpc_endpoint.s3"]
    assert endpoint["vpc_endpoint_type"] == "Gateway"
    assert "aws_route_table.private" in endpoint["route_table_ids"]
    assert resources["aws_subnet.public"]["map_public_ip_on_launch"] is False


def test_eks_api_is_private_with_encrypted_secrets():
    cluster = blocks(TF / "modules" / "eks", "resource")["aws_eks_cluster.this"]
    assert cluster["vpc_config"][0]["endpoint_private_access"] is True
    assert cluster["encryption_config"][0]["resources"] == ["secrets"]
    variables = {
        next(iter(v)): next(iter(v.values()))
        for v in parse(TF / "modules/eks/variables.tf")["variable"]
    }
    assert variables["endpoint_public_access"]["default"] is False


def _module_calls(env: Path) -> dict[str, dict]:
    return {
        name: body for block in parse(env / "main.tf")["module"] for name, body in block.items()
    }


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_env_wires_the_modules_together_with_matching_names(env):
    calls = _module_calls(env)
    assert set(calls) == {m.name for m in MODULES} - {"pod_identity"}  # used by modules
    for name, call in calls.items():
        assert call["source"] == f"../../modules/{name}"
    assert calls["eks"]["subnet_ids"] == "${module.network.private_subnet_ids}"
    assert calls["gpu_nodes"]["cluster_name"] == "${module.eks.cluster_name}"
    assert calls["gpu_nodes"]["vpc_id"] == "${module.network.vpc_id}"
    assert calls["gpu_nodes"]["node_role_name"] == "${module.eks.node_role_name}"
    assert calls["karpenter"]["node_role_arn"] == "${module.eks.node_role_arn}"
    assert calls["kuberay"]["gcs_redis_endpoint"] == "${module.gcs_redis.primary_endpoint}"
    assert calls["load_balancer"]["backend_service"] == "${module.kuberay.ingress_service}"
    assert calls["weights_bucket"]["cluster_name"] == "${module.eks.cluster_name}"
    # The pods' service account is the one the bucket's Pod Identity association names.
    assert calls["weights_bucket"]["namespace"] == calls["kuberay"]["namespace"]
    assert calls["weights_bucket"]["service_account"] == calls["kuberay"]["service_account"]
    # GPU NodePools are named after the pools of the RayService's GPU worker groups and hold
    # their largest size.
    manifest = next(yaml.safe_load_all((env / "kuberay.yaml").read_text()))
    groups = {
        g["groupName"]: g
        for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        if g["groupName"] != INGRESS_GROUP
    }
    main = (env / "main.tf").read_text()
    node_pools = {
        name: int(nodes)
        for name, nodes in re.findall(
            r'name\s*=\s*"([a-z-]+)",?\s*instance_types\s*=\s*\[[^]]*\],?\s*max_nodes\s*=\s*(\d+)',
            main,
        )
    }
    assert set(groups) == set(node_pools)
    for name, group in groups.items():
        assert node_pools[name] >= group["maxReplicas"], name


RENDERED = {
    "prod-p6-b200": ("kimi-k2.6-nvfp4-p6-b200.yaml", {"efa_interfaces": 8}),
    "dev": ("dev-g6e.yaml", {"memory_gib_per_gpu": 24}),
}


def _render(env: str) -> tuple:
    config_name, options = RENDERED[env]
    config = load_config(ROOT / "configs" / config_name)
    return config, manifests(config, image="ghcr.io/example/cluster:0.1.0", **options)


@pytest.mark.parametrize("env", sorted(RENDERED))
def test_env_manifests_are_the_current_render_of_its_config(env):
    _, expected = _render(env)
    committed = list(yaml.safe_load_all((TF / "envs" / env / "kuberay.yaml").read_text()))
    assert committed == expected, f"re-render {env}/kuberay.yaml (see its main.tf header)"


@pytest.mark.parametrize(
    "config_name", ["kimi-k2.6-nvfp4-p6-b200.yaml", "dev-g6e.yaml", "embedded.yaml"]
)
def test_render_kuberay_matches_the_config(config_name, capsys):
    from cluster.cli import main

    assert (
        main(["render", "kuberay", str(ROOT / "configs" / config_name), "--efa-interfaces", "8"])
        == 0
    )
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    manifest = documents[0]
    assert {d["kind"] for d in documents[1:]} == {"Service", "PodDisruptionBudget", "NetworkPolicy"}
    config = load_config(ROOT / "configs" / config_name)
    assert manifest["kind"] == "RayService"
    spec = manifest["spec"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    app = serve_config["applications"][0]
    assert app["import_path"] == "cluster.deployments.app:app_builder"
    from cluster.config import map_local_paths, parse_config

    # The same configuration that runs locally; local paths now relative to the project root,
    # the image's working directory; the API keys from the secret the ingress pods mount.
    rendered = parse_config(app["args"]["config"], base_dir=ROOT)
    expected = config.model_dump()
    if config.server.auth.required:
        expected["server"]["auth"]["keys_file"] = "/etc/cluster/api-keys/keys.json"
    assert map_local_paths(rendered.model_dump(), rendered.resolve_path) == map_local_paths(
        expected, config.resolve_path
    )
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {p.name for p in config.pools} | {INGRESS_GROUP}
    for pool in config.pools:
        group, target = groups[pool.name], config.target(pool.target)
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert (group["minReplicas"], group["maxReplicas"]) == (
            pool.autoscaling.min_replicas,
            pool.autoscaling.max_replicas,
        )
        if target.accelerator_type:
            assert (
                limits["nvidia.com/gpu"]
                == target.tensor_parallel_size * target.pipeline_parallel_size
            )
            assert limits["vpc.amazonaws.com/efa"] == 8
            assert group["template"]["spec"]["nodeSelector"] == {"cluster.ai/pool": pool.name}
        else:
            assert "nvidia.com/gpu" not in limits


def _checkov() -> str | None:
    local = ROOT / ".venv-tools" / "bin" / "checkov"
    return str(local) if local.exists() else shutil.which("checkov")


def run_checkov(*args: str) -> dict:
    """checkov's JSON summary over `args`, asserting zero failed checks and a written reason
    next to every skip."""
    checkov = _checkov()
    assert checkov, "checkov missing: `make unit` puts it in .venv-tools"
    result = subprocess.run(
        [checkov, *args, "--compact", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(result.stdout)
    summary, results = report["summary"], report["results"]
    failed = [f"{c['check_id']} {c['resource']} {c['file_path']}" for c in results["failed_checks"]]
    assert summary["failed"] == 0, "\n".join(failed)
    assert summary["skipped"] == len(results["skipped_checks"])
    for skipped in results["skipped_checks"]:
        assert skipped["check_result"].get("suppress_comment"), skipped["check_id"]
    return summary


def test_checkov_reports_zero_failed_checks():
    summary = run_checkov("-d", str(TF), "--framework", "terraform")
    assert summary["passed"] > 150
    assert summary["skipped"] > 0  # the deliberate ones, each with its reason


TERRAFORM = shutil.which("terraform")


@pytest.mark.skipif(TERRAFORM is None, reason="no terraform binary on this machine")
def test_terraform_fmt():
    result = subprocess.run(
        [TERRAFORM, "fmt", "-check", "-recursive", "-diff", str(TF)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_terraform_validate(env, tmp_path):
    if TERRAFORM is None:
        pytest.skip("no terraform binary on this machine")
    data = {"TF_DATA_DIR": str(tmp_path / ".terraform"), "PATH": "/usr/bin:/bin"}
    init = subprocess.run(
        [
            TERRAFORM,
            f"-chdir={env}",
            "init",
            "-backend=false",
            "-input=false",
            "-lockfile=readonly",
        ],
        capture_output=True,
        text=True,
        env=data,
        timeout=120,
    )
    if init.returncode != 0 and "Failed to query available provider packages" in init.stderr:
        pytest.skip("provider registry unreachable from this machine; structure checked statically")
    assert init.returncode == 0, init.stderr
    result = subprocess.run(
        [TERRAFORM, f"-chdir={env}", "validate"], capture_output=True, text=True, env=data
    )
    assert result.returncode == 0, result.stderr
