variable "region" {
  description = "AWS region with p6-b200 capacity."
  type        = string
  default     = "us-east-2"
}

variable "name" {
  description = "Name of the environment: VPC, EKS cluster and resource prefixes."
  type        = string
  default     = "llm-prod"
}

variable "azs" {
  description = "Availability zones; GPU nodes go to the first one (placement group + EFA)."
  type        = list(string)
  default     = ["us-east-2a", "us-east-2b", "us-east-2c"]
}

variable "weights_bucket_name" {
  description = "Globally unique bucket for model weights and drafters."
  type        = string
}

variable "access_log_bucket" {
  description = "Existing bucket receiving S3 server access logs."
  type        = string
}

variable "admin_principal_arns" {
  description = "IAM roles granted cluster-admin on the EKS cluster."
  type        = list(string)
  default     = []
}

variable "capacity_reservation_id" {
  description = "Capacity Block or ODCR for the p6-b200 nodes (null = on-demand without reservation)."
  type        = string
  default     = null
}

variable "image" {
  description = "Container image with the cluster package, Ray and vLLM (recorded in rayservice.yaml)."
  type        = string
  default     = "ghcr.io/example/cluster:0.1.0"
}
