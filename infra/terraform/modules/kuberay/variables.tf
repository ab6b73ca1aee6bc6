variable "operator_version" {
  description = "KubeRay operator Helm chart version."
  type        = string
  default     = "1.4.2"
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

variable "rayservice_yaml" {
  description = "RayService manifest produced by `cluster render kuberay FILE` from the same cluster YAML that runs locally."
  type        = string
  validation {
    condition     = can(yamldecode(var.rayservice_yaml).kind) && yamldecode(var.rayservice_yaml).kind == "RayService"
    error_message = "rayservice_yaml must be a RayService manifest (cluster render kuberay FILE)."
  }
}
