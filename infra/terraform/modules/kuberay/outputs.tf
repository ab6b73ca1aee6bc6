output "namespace" {
  description = "Namespace of the RayService."
  value       = kubernetes_namespace_v1.ray.metadata[0].name
}

output "rayservice_name" {
  description = "Name of the RayService."
  value       = local.rayservice.metadata.name
}

output "ingress_service" {
  description = "Service in front of the Serve ingress pods (the ALB's backend)."
  value       = "${local.rayservice.metadata.name}-ingress"
}
