"""Grafana dashboards: every JSON file parses; every metric the project's dashboard queries is
one that is exported (names collected from the code that defines them: ours under cluster/,
vLLM's stat loggers and Ray Serve's, as installed), so renaming a metric fails here; Ray's
dashboards in the repository are what the installed Ray generates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ray.serve
import vllm

from cluster.dashboards import DASHBOARDS_DIR, PROJECT_DASHBOARD, ray_dashboards

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _exported(kind: str, name: str) -> list[str]:
    """Prometheus names of a metric defined through Ray (ray.util / ray.serve metrics, and
    vLLM's Ray stat logger): `ray_` prefix, `:` sanitized, type suffixes."""
    base = "ray_" + re.sub(r"[^a-zA-Z0-9_{}]", "_", name)
    return [base + suffix for suffix in SUFFIXES[kind.lower()]]


def exported_metric_patterns() -> list[re.Pattern]:
    names: list[str] = []
    ours = re.compile(r'metrics\.(Counter|Gauge|Histogram)\(\s*(?:name=)?f?"([\w:{}]+)"')
    ray_serve = Path(ray.serve.__file__).parent
    for path in [*ROOT.glob("cluster/**/*.py"), *ray_serve.glob("**/*.py")]:
        for kind, name in ours.findall(path.read_text()):
            names += _exported(kind, name)
    v1 = Path(vllm.__file__).parent / "v1"
    logger = re.compile(r'_(counter|gauge|histogram)_cls\(\s*name="(vllm:\w+)"')
    for path in (v1 / "metrics" / "loggers.py", v1 / "spec_decode" / "metrics.py"):
        for kind, name in logger.findall(path.read_text()):
            names += _exported(kind, name)
    # The speculative-decoding counters are declared as (name, help) pairs for one factory call.
    spec = (v1 / "spec_decode" / "metrics.py").read_text()
    for name in re.findall(r'\("(vllm:spec_decode_\w+)",', spec):
        names += _exported("counter", name)
    # f-string names (serve_num_{protocol_name}_...) match any protocol.
    return [re.compile(re.sub(r"\\\{\w+\\\}", "[a-z]+", re.escape(n)) + "$") for n in names]


def queried_metrics(dashboard: dict) -> set[str]:
    found = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r'"[^"]*"', '""', target["expr"])  # label values and regexes
            # Label lists of aggregations and vector matching name labels, not metrics.
            expr = re.sub(
                r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr
            )
            metrics = set(re.findall(r"\b([a-zA-Z_:][\w:]*)\s*(?=[{\[)])", expr))
            assert metrics, f"{panel['title']}: no metric in {target['expr']}"
            found |= metrics
    return found


@pytest.mark.parametrize("path", sorted(DASHBOARDS_DIR.glob("*.json")), ids=lambda p: p.name)
def test_dashboard_parses(path):
    dashboard = json.loads(path.read_text())
    assert dashboard["title"] and dashboard["panels"]


def test_project_dashboard_covers_the_issue_metrics():
    dashboard = json.loads(PROJECT_DASHBOARD.read_text())
    metrics = queried_metrics(dashboard)
    for needed in (
        "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total",  # acceptance per position
        "ray_cluster_routing_decisions_total",  # routing decisions
        "ray_serve_deployment_queued_queries",  # queue depth per pool
        "ray_vllm_admission_rejections_total",  # rejections per pool
        "ray_vllm_time_to_first_token_seconds_bucket",  # TTFT per pool
        "ray_vllm_request_time_per_output_token_seconds_bucket",  # TPOT per pool
        "ray_cluster_slo_requests_total",  # SLO attainment per pool
    ):
        assert needed in metrics


def test_every_queried_metric_is_exported():
    patterns = exported_metric_patterns()
    queried = queried_metrics(json.loads(PROJECT_DASHBOARD.read_text()))
    missing = sorted(m for m in queried if not any(p.match(m) for p in patterns))
    assert not missing, f"queried but exported by no code: {missing}"


def test_a_renamed_metric_would_be_caught():
    patterns = exported_metric_patterns()
    assert any(p.match("ray_cluster_routing_decisions_total") for p in patterns)
    assert not any(p.match("ray_cluster_routing_choices_total") for p in patterns)
    assert any(p.match("ray_serve_num_http_error_requests_total") for p in patterns)


def test_ray_dashboards_are_what_the_installed_ray_generates():
    for name, content in ray_dashboards().items():
        committed = DASHBOARDS_DIR / name
        assert committed.read_text() == content, (
            f"refresh with `cluster dashboards --only-dashboards {DASHBOARDS_DIR}`"
        )


def test_local_stack_is_written(tmp_path):
    from cluster.dashboards import write_local_stack

    write_local_stack(tmp_path)
    assert (tmp_path / "dashboards" / "cluster.json").is_file()
    assert "file_sd_configs" in (tmp_path / "prometheus.yml").read_text()
    provider = json.loads((tmp_path / "provisioning/dashboards/cluster.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == str(tmp_path / "dashboards")
