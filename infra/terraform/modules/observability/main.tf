# Metrics: kube-prometheus-stack (Prometheus + Grafana) in the cluster, scraping every Ray pod's
# metrics port (Ray, Serve and vLLM metrics, ours included) and the head's autoscaler and
# dashboard endpoints; Grafana loads the dashboards in infra/grafana/dashboards (Ray's defaults
# and the project's) and allows embedding, so the Ray dashboard shows its panels (the head has
# RAY_PROMETHEUS_HOST / RAY_GRAFANA_HOST pointing here, see cluster/kuberay.py). Optionally
# Amazon Managed Service for Prometheus keeps the long-term copy: Prometheus remote-writes to
# a KMS-encrypted workspace with SigV4 (Pod Identity). Both UIs stay ClusterIP.

data "aws_region" "current" {}

locals {
  # Service names the RayService's head expects (cluster.kuberay.PROMETHEUS_HOST/GRAFANA_HOST).
  prometheus_fullname = "kps"
  dashboards          = fileset(var.dashboards_dir, "*.json")
  ray_scrape = {
    job_name              = "ray"
    kubernetes_sd_configs = [{ role = "pod", namespaces = { names = [var.ray_namespace] } }]
    relabel_configs = [
      { source_labels = ["__meta_kubernetes_pod_label_ray_io_is_ray_node"], regex = "yes", action = "keep" },
      # KubeRay names the metrics port of every Ray container "metrics" (8080); the head also
      # serves the autoscaler (44217) and dashboard (44227) metrics.
      { source_labels = ["__meta_kubernetes_pod_container_port_number"], regex = "8080|44217|44227", action = "keep" },
      { source_labels = ["__meta_kubernetes_pod_label_ray_io_group"], target_label = "ray_group" },
      { source_labels = ["__meta_kubernetes_pod_name"], target_label = "pod" },
    ]
  }
}

resource "kubernetes_namespace_v1" "monitoring" {
  metadata {
    name = var.namespace # cluster.kuberay_objects.MONITORING_NAMESPACE (NetworkPolicy allows it)
  }
}

resource "kubernetes_config_map_v1" "dashboards" {
  for_each = local.dashboards
  metadata {
    name      = "dashboard-${trimsuffix(each.value, ".json")}"
    namespace = kubernetes_namespace_v1.monitoring.metadata[0].name
    labels    = { grafana_dashboard = "1" } # picked up by Grafana's dashboard sidecar
  }
  data = { (each.value) = file("${var.dashboards_dir}/${each.value}") }
}

resource "aws_cloudwatch_log_group" "amp" {
  count             = var.amp_enabled ? 1 : 0
  name              = "/aws/prometheus/${var.name}"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
  tags              = var.tags
}

resource "aws_prometheus_workspace" "this" {
  count       = var.amp_enabled ? 1 : 0
  alias       = var.name
  kms_key_arn = var.kms_key_arn
  logging_configuration {
    log_group_arn = "${aws_cloudwatch_log_group.amp[0].arn}:*"
  }
  tags = var.tags
}

data "aws_iam_policy_document" "remote_write" {
  count = var.amp_enabled ? 1 : 0
  statement {
    actions   = ["aps:RemoteWrite"]
    resources = [aws_prometheus_workspace.this[0].arn]
  }
}

module "prometheus_identity" {
  count           = var.amp_enabled ? 1 : 0
  source          = "../pod_identity"
  cluster_name    = var.cluster_name
  role_name       = "${var.name}-prometheus-remote-write"
  namespace       = kubernetes_namespace_v1.monitoring.metadata[0].name
  service_account = "${local.prometheus_fullname}-prometheus"
  policy_json     = data.aws_iam_policy_document.remote_write[0].json
  tags            = var.tags
}

resource "helm_release" "kube_prometheus_stack" {
  name       = "kube-prometheus-stack"
  repository = "https://prometheus-community.github.io/helm-charts"
  chart      = "kube-prometheus-stack"
  version    = var.chart_version
  namespace  = kubernetes_namespace_v1.monitoring.metadata[0].name
  values = [yamlencode({
    fullnameOverride = local.prometheus_fullname
    prometheus = {
      prometheusSpec = {
        retention               = var.retention
        nodeSelector            = { "cluster.ai/role" = "system" }
        additionalScrapeConfigs = [local.ray_scrape]
        remoteWrite = var.amp_enabled ? [{
          url   = "${aws_prometheus_workspace.this[0].prometheus_endpoint}api/v1/remote_write"
          sigv4 = { region = data.aws_region.current.region }
        }] : []
      }
    }
    grafana = {
      fullnameOverride = "grafana"
      nodeSelector     = { "cluster.ai/role" = "system" }
      sidecar          = { dashboards = { enabled = true, label = "grafana_dashboard", searchNamespace = "ALL" } }
      # The Ray dashboard embeds Grafana panels in iframes; Grafana is reachable only by
      # port-forward, so read-only anonymous access does not widen who can see it.
      "grafana.ini" = {
        security         = { allow_embedding = true }
        "auth.anonymous" = { enabled = true, org_role = "Viewer" }
      }
    }
  })]
  depends_on = [module.prometheus_identity]
}
