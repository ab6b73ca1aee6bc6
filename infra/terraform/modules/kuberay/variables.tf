variable "operator_version" {
  description = "KubeRay operator Helm chart version; infra/kuberay holds the RayService schema of this version, which the render is tested against."
  type        = string
  default     = "1.7.0"
}

variable "namespace" {
  description = "Namespace of the RayService, its pods and their service account."
  type        = string
  default     = "ray"
}

variable "service_account" {
  description = "Service account of the Ray pods (bound to the weights reader role by Pod Identity)."
  type        = string
  default     = "ray-weights-reader"
}

variable "manifests_yaml" {
  description = "Output of `cluster render kuberay FILE`: the RayService (first document) and its Service, PodDisruptionBudgets and NetworkPolicies, from the same cluster YAML that runs locally."
  type        = string
  validation {
    condition     = can(yamldecode(split("\n---\n", var.manifests_yaml)[0]).kind) && yamldecode(split("\n---\n", var.manifests_yaml)[0]).kind == "RayService"
    error_message = "manifests_yaml must start with a RayService (cluster render kuberay FILE)."
  }
}

variable "gcs_redis_endpoint" {
  description = "Primary endpoint host of the GCS Redis (gcs_redis module); replaces GCS_REDIS_ENDPOINT in the render."
  type        = string
}

variable "gcs_redis_auth_secret_arn" {
  description = "Secrets Manager secret with the GCS Redis AUTH token (gcs_redis module)."
  type        = string
}
