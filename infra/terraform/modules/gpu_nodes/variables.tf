variable "cluster_name" {
  description = "EKS cluster the nodes join."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the cluster (for the EFA security group)."
  type        = string
}

variable "subnet_id" {
  description = "One private subnet: a cluster placement group and EFA need every node in one AZ."
  type        = string
}

variable "node_role_name" {
  description = "IAM role of the nodes Karpenter launches (the eks module's node role)."
  type        = string
}

variable "cluster_security_group_id" {
  description = "The EKS cluster security group, attached to the primary interface of every node."
  type        = string
}

variable "kms_key_arn" {
  description = "KMS key encrypting node root volumes."
  type        = string
}

variable "ami_alias" {
  description = "EKS-optimized AMI alias of the nodes; pin a version (al2023@v20251120) in production so a new AMI is a deliberate rollout."
  type        = string
  default     = "al2023@latest"
  validation {
    condition     = can(regex("^al2023@(latest|v[0-9]{8})$", var.ami_alias))
    error_message = "ami_alias must be al2023@latest or al2023@vYYYYMMDD."
  }
}

variable "pools" {
  description = <<-EOT
    One Karpenter NodePool per serving pool; name = the pool's name in the cluster YAML (its Ray
    worker pods select cluster.ai/pool=<name> and tolerate the taints). max_nodes caps the pool
    (as a GPU limit). capacity_types are Karpenter's: "reserved" uses the listed
    capacity_reservation_ids (On-Demand Capacity Reservations or Capacity Blocks for ML, which
    Karpenter drains before the block ends), "on-demand" falls back to regular capacity.
    efa_interfaces and gpus_per_node override the per-type defaults.
  EOT
  type = list(object({
    name                     = string
    instance_types           = list(string)
    max_nodes                = number
    capacity_types           = optional(list(string), ["on-demand"])
    capacity_reservation_ids = optional(list(string), [])
    labels                   = optional(map(string), {})
    taints                   = optional(list(object({ key = string, value = string, effect = string })), [{ key = "nvidia.com/gpu", value = "true", effect = "NoSchedule" }])
    efa_interfaces           = optional(number)
    gpus_per_node            = optional(number)
    root_volume_gib          = optional(number, 500)
    consolidate_after        = optional(string, "10m")
  }))
  validation {
    condition     = alltrue([for p in var.pools : can(regex("^[a-z][a-z0-9-]{0,30}$", p.name)) && p.name != "ingress"])
    error_message = "Pool names must be lowercase letters, digits and dashes, and not ingress (the CPU worker group)."
  }
  validation {
    condition     = alltrue([for p in var.pools : length(p.instance_types) > 0 && p.max_nodes >= 1])
    error_message = "Each pool needs instance types and max_nodes >= 1."
  }
  validation {
    condition     = alltrue([for p in var.pools : length(p.capacity_types) > 0 && alltrue([for t in p.capacity_types : contains(["reserved", "on-demand", "spot"], t)])])
    error_message = "capacity_types must be reserved, on-demand or spot."
  }
  validation {
    condition     = alltrue([for p in var.pools : !contains(p.capacity_types, "reserved") || length(p.capacity_reservation_ids) > 0])
    error_message = "A pool with capacity type reserved needs capacity_reservation_ids."
  }
  validation {
    condition     = alltrue([for p in var.pools : alltrue([for t in p.taints : contains(["NoSchedule", "NoExecute", "PreferNoSchedule"], t.effect)])])
    error_message = "Taint effects must be NoSchedule, NoExecute or PreferNoSchedule."
  }
}

variable "nvidia_device_plugin_version" {
  description = "NVIDIA device plugin Helm chart version (exposes nvidia.com/gpu)."
  type        = string
  default     = "0.17.1"
}

variable "efa_device_plugin_version" {
  description = "AWS EFA device plugin Helm chart version (exposes vpc.amazonaws.com/efa)."
  type        = string
  default     = "v0.5.6"
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
