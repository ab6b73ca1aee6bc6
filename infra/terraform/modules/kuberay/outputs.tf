output "namespace" {
  description = "Namespace of the RayService."
  value       = kubernetes_namespace_v1.ray.metadata[0].name
}

output "rayservice_name" {
  description = "Name of the RayService."
  value       = yamldecode(var.rayservice_yaml).metadata.name
}
