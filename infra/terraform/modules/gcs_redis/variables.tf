variable "name" {
  description = "Prefix of every resource (the environment name)."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the cluster."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets in at least two zones (primary and replica land in different zones)."
  type        = list(string)
  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "Multi-AZ needs subnets in at least two zones."
  }
}

variable "client_security_group_ids" {
  description = "Security groups allowed to reach 6379: the EKS cluster security group that every node carries."
  type        = list(string)
}

variable "kms_key_arn" {
  description = "KMS key for encryption at rest, the AUTH token secret and the slow log."
  type        = string
}

variable "node_type" {
  description = "Cache node type; GCS metadata is small (MBs), so a small type suffices."
  type        = string
  default     = "cache.t4g.medium"
}

variable "engine_version" {
  description = "Redis OSS engine version."
  type        = string
  default     = "7.1"
}

variable "replicas" {
  description = "Read replicas next to the primary (>= 1 for automatic failover across zones)."
  type        = number
  default     = 1
  validation {
    condition     = var.replicas >= 1 && var.replicas <= 5
    error_message = "replicas must be 1..5 (multi-AZ failover needs at least one)."
  }
}

variable "auth_token_update_strategy" {
  description = "How a new AUTH token is applied: ROTATE keeps the old one valid too (while pods still hold it), SET then drops it."
  type        = string
  default     = "ROTATE"
  validation {
    condition     = contains(["ROTATE", "SET"], var.auth_token_update_strategy)
    error_message = "auth_token_update_strategy must be ROTATE or SET."
  }
}

variable "snapshot_retention_days" {
  description = "Daily snapshots kept."
  type        = number
  default     = 7
}

variable "log_retention_days" {
  description = "Retention of the slow log."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
