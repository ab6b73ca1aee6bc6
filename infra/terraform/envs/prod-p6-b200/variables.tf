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

variable "image" {
  description = "Container image with the cluster package, Ray and vLLM (recorded in rayservice.yaml)."
  type        = string
  default     = "ghcr.io/example/cluster:0.1.0"
}

variable "certificate_arn" {
  description = "ACM certificate of the API hostname; the ALB terminates TLS with it."
  type        = string
}

variable "api_allowed_cidrs" {
  description = "Client CIDRs the ALB admits on 443."
  type        = list(string)
}

variable "capacity_reservation_ids" {
  description = "On-Demand Capacity Reservations or Capacity Blocks for ML (cr-...) for the p6-b200 pools; used before on-demand."
  type        = list(string)
  default     = []
  validation {
    condition     = alltrue([for id in var.capacity_reservation_ids : can(regex("^cr-[0-9a-f]+$", id))])
    error_message = "capacity_reservation_ids must be cr-... IDs."
  }
}

variable "amp_enabled" {
  description = "Remote-write metrics to Amazon Managed Service for Prometheus for long-term retention."
  type        = bool
  default     = true
}
