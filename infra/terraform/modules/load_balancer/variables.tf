variable "cluster_name" {
  description = "EKS cluster the controller manages load balancers for."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the cluster."
  type        = string
}

variable "region" {
  description = "AWS region of the cluster."
  type        = string
}

variable "chart_version" {
  description = "aws-load-balancer-controller Helm chart version."
  type        = string
  default     = "1.14.0"
}

variable "namespace" {
  description = "Namespace of the RayService and its ingress Service."
  type        = string
}

variable "backend_service" {
  description = "Service in front of the Serve ingress pods (kuberay module output ingress_service)."
  type        = string
}

variable "certificate_arn" {
  description = "ACM certificate of the API's hostname (TLS terminates at the ALB)."
  type        = string
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:acm:", var.certificate_arn))
    error_message = "certificate_arn must be an ACM certificate ARN."
  }
}

variable "internal" {
  description = "Internal ALB (VPC only) instead of internet-facing."
  type        = bool
  default     = false
}

variable "allowed_cidrs" {
  description = "Client CIDRs the ALB admits on 443."
  type        = list(string)
  validation {
    condition     = length(var.allowed_cidrs) > 0
    error_message = "Name the client CIDRs (0.0.0.0/0 only deliberately, for a public API behind auth)."
  }
}

variable "deregistration_delay_s" {
  description = "Seconds the ALB keeps draining a deregistered pod; keep it below the pods' preStop drain (the pools' graceful_shutdown_timeout_s)."
  type        = number
  default     = 60
}

variable "idle_timeout_s" {
  description = "ALB idle timeout: the longest silence of a connection (a long prefill before the first token)."
  type        = number
  default     = 600
  validation {
    condition     = var.idle_timeout_s >= 60 && var.idle_timeout_s <= 4000
    error_message = "idle_timeout_s must be 60..4000."
  }
}

variable "deletion_protection" {
  description = "Protect the ALB from deletion."
  type        = bool
  default     = true
}

variable "access_logs_bucket" {
  description = "Bucket for ALB access logs (null = off)."
  type        = string
  default     = null
}

variable "waf_acl_arn" {
  description = "WAFv2 web ACL to attach (null = none)."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags of the load balancer and the controller's IAM resources."
  type        = map(string)
  default     = {}
}
