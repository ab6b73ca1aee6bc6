variable "cluster_name" {
  description = "EKS cluster the node groups join."
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

variable "node_role_arn" {
  description = "IAM role of the nodes (from the eks module)."
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

variable "pools" {
  description = <<-EOT
    GPU node groups, one per serving pool. instance_type e.g. p6-b200.48xlarge; labels and taints
    are applied to the nodes (Ray worker pods of the pool select them); capacity_reservation_id is
    an On-Demand Capacity Reservation or a Capacity Block (market_type = "capacity-block");
    efa_interfaces overrides the per-type default (one EFA interface per network card).
  EOT
  type = list(object({
    name                    = string
    instance_type           = string
    min_size                = number
    max_size                = number
    desired_size            = optional(number)
    labels                  = optional(map(string), {})
    taints                  = optional(list(object({ key = string, value = string, effect = string })), [])
    capacity_reservation_id = optional(string)
    market_type             = optional(string, "on-demand")
    efa_interfaces          = optional(number)
    root_volume_gib         = optional(number, 500)
  }))
  validation {
    condition     = alltrue([for p in var.pools : can(regex("^[a-z][a-z0-9-]{0,30}$", p.name))])
    error_message = "Pool names must be lowercase letters, digits and dashes."
  }
  validation {
    condition     = alltrue([for p in var.pools : p.min_size >= 0 && p.min_size <= p.max_size])
    error_message = "Each pool needs 0 <= min_size <= max_size."
  }
  validation {
    condition     = alltrue([for p in var.pools : contains(["on-demand", "capacity-block"], p.market_type)])
    error_message = "market_type must be on-demand or capacity-block."
  }
  validation {
    condition     = alltrue([for p in var.pools : p.market_type != "capacity-block" || p.capacity_reservation_id != null])
    error_message = "A capacity-block pool needs its capacity_reservation_id."
  }
  validation {
    condition     = alltrue([for p in var.pools : alltrue([for t in p.taints : contains(["NO_SCHEDULE", "NO_EXECUTE", "PREFER_NO_SCHEDULE"], t.effect)])])
    error_message = "Taint effects must be NO_SCHEDULE, NO_EXECUTE or PREFER_NO_SCHEDULE."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
