variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Name of the environment: VPC, EKS cluster and resource prefixes."
  type        = string
  default     = "llm-dev"
}

variable "azs" {
  description = "Availability zones; GPU nodes go to the first one (placement group + EFA)."
  type        = list(string)
  default     = ["us-east-1a", "us-east-1b"]
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
