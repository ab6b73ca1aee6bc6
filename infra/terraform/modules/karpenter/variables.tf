variable "cluster_name" {
  description = "EKS cluster Karpenter provisions nodes for."
  type        = string
}

variable "node_role_name" {
  description = "IAM role of the nodes Karpenter launches: the eks module's node role (its access entry already exists)."
  type        = string
}

variable "node_role_arn" {
  description = "ARN of that node role (Karpenter passes it to EC2)."
  type        = string
}

variable "chart_version" {
  description = "Karpenter Helm chart version (>= 1.11: EC2NodeClass networkInterfaces and placementGroupSelector, used for EFA)."
  type        = string
  default     = "1.14.1"
  validation {
    condition     = can(regex("^1\\.(1[1-9]|[2-9][0-9])\\.[0-9]+$", var.chart_version))
    error_message = "chart_version must be 1.11.0 or newer (EFA interfaces and placement groups in EC2NodeClass)."
  }
}

variable "namespace" {
  description = "Namespace of the Karpenter controller (its Pod Identity association names it)."
  type        = string
  default     = "kube-system"
}

variable "kms_key_arn" {
  description = "KMS key encrypting the interruption queue and node root volumes."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets, one per zone, for the ingress CPU nodes."
  type        = list(string)
  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "The ingress node pool spreads over at least two zones."
  }
}

variable "cluster_security_group_id" {
  description = "The EKS cluster security group, attached to every node Karpenter launches."
  type        = string
}

variable "ingress_node_pool" {
  description = "CPU nodes of the Serve ingress worker group (label cluster.ai/role=ingress): instance types and the most vCPUs the pool may hold."
  type = object({
    instance_types = list(string)
    max_cpu        = number
  })
  default = {
    instance_types = ["m7i.2xlarge", "m7i.4xlarge", "m6i.2xlarge", "m6i.4xlarge"]
    max_cpu        = 64
  }
  validation {
    condition     = length(var.ingress_node_pool.instance_types) > 0 && var.ingress_node_pool.max_cpu > 0
    error_message = "ingress_node_pool needs instance types and a positive max_cpu."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
