variable "name" {
  description = "Prefix of AWS resources (the environment name)."
  type        = string
}

variable "cluster_name" {
  description = "EKS cluster (for the Prometheus Pod Identity association)."
  type        = string
}

variable "namespace" {
  description = "Namespace of Prometheus and Grafana (the RayService's NetworkPolicy admits it to the metrics ports)."
  type        = string
  default     = "monitoring"
}

variable "ray_namespace" {
  description = "Namespace of the Ray pods to scrape."
  type        = string
  default     = "ray"
}

variable "chart_version" {
  description = "kube-prometheus-stack Helm chart version."
  type        = string
  default     = "79.5.0"
}

variable "retention" {
  description = "How long the in-cluster Prometheus keeps samples (AMP keeps the long-term copy)."
  type        = string
  default     = "15d"
}

variable "dashboards_dir" {
  description = "Directory of Grafana dashboard JSON files (infra/grafana/dashboards: Ray's defaults and the project's)."
  type        = string
}

variable "amp_enabled" {
  description = "Also remote-write every sample to an Amazon Managed Service for Prometheus workspace."
  type        = bool
  default     = false
}

variable "kms_key_arn" {
  description = "KMS key of the AMP workspace and its log group."
  type        = string
}

variable "log_retention_days" {
  description = "Retention of the AMP workspace's log group."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = {}
}
