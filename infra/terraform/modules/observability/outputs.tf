output "prometheus_url" {
  description = "In-cluster Prometheus (the head's RAY_PROMETHEUS_HOST)."
  value       = "http://${local.prometheus_fullname}-prometheus.${var.namespace}.svc:9090"
}

output "grafana_service" {
  description = "Grafana service (kubectl port-forward svc/grafana 3000:80 -n monitoring)."
  value       = "${var.namespace}/grafana"
}

output "amp_workspace_endpoint" {
  description = "AMP workspace Prometheus endpoint (null when amp_enabled is false)."
  value       = var.amp_enabled ? aws_prometheus_workspace.this[0].prometheus_endpoint : null
}
