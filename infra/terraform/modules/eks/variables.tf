variable "name" {
  description = "EKS cluster name."
  type        = string
  validation {
    condition     = can(regex("^[a-zA-Z][a-zA-Z0-9-]{0,99}$", var.name))
    error_message = "name must start with a letter and contain letters, digits and dashes (max 100)."
  }
}

variable "kubernetes_version" {
  description = "Kubernetes minor version of the control plane."
  type        = string
  default     = "1.34"
  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.34."
  }
}

variable "subnet_ids" {
  description = "Private subnets for the control plane ENIs and the system node group (two AZs or more)."
  type        = list(string)
  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "EKS needs subnets in at least two availability zones."
  }
}

variable "endpoint_public_access" {
  description = "Expose the Kubernetes API publicly (restricted to public_access_cidrs). Off by default: reach it over VPN/peering."
  type        = bool
  default     = false
}

variable "public_access_cidrs" {
  description = "CIDRs allowed to reach a public API endpoint."
  type        = list(string)
  default     = []
  validation {
    condition     = !contains(var.public_access_cidrs, "0.0.0.0/0")
    error_message = "Do not open the Kubernetes API to 0.0.0.0/0."
  }
}

variable "kms_key_arn" {
  description = "KMS key for envelope encryption of Kubernetes secrets and the control-plane log group."
  type        = string
}

variable "admin_principal_arns" {
  description = "IAM principals (roles/users) granted cluster-admin through EKS access entries."
  type        = list(string)
  default     = []
}

variable "system_node_group" {
  description = "Small CPU node group for the KubeRay operator, Ray head pods and add-ons."
  type = object({
    instance_types = list(string)
    min_size       = number
    max_size       = number
    desired_size   = number
    disk_size_gib  = number
  })
  default = {
    instance_types = ["m7i.2xlarge"]
    min_size       = 2
    max_size       = 4
    desired_size   = 2
    disk_size_gib  = 100
  }
  validation {
    condition     = var.system_node_group.min_size <= var.system_node_group.desired_size && var.system_node_group.desired_size <= var.system_node_group.max_size
    error_message = "system_node_group sizes must satisfy min <= desired <= max."
  }
}

variable "log_retention_days" {
  description = "Retention of control-plane logs."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
