variable "name" {
  description = "Name prefix for every resource of this network."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "cidr" {
  description = "IPv4 CIDR of the VPC; private subnets take the first half, public the rest."
  type        = string
  default     = "10.0.0.0/16"
  validation {
    condition     = can(cidrhost(var.cidr, 0)) && tonumber(split("/", var.cidr)[1]) <= 20
    error_message = "cidr must be a valid IPv4 CIDR of /20 or larger (GPU pods use many IPs)."
  }
}

variable "azs" {
  description = "Availability zones, at least two (EKS requires subnets in two AZs)."
  type        = list(string)
  validation {
    condition     = length(var.azs) >= 2
    error_message = "Give at least two availability zones."
  }
}

variable "single_nat_gateway" {
  description = "One NAT gateway for all AZs (cheaper) instead of one per AZ (no cross-AZ dependency)."
  type        = bool
  default     = false
}

variable "flow_log_retention_days" {
  description = "Retention of VPC flow logs in CloudWatch."
  type        = number
  default     = 365
}

variable "kms_key_arn" {
  description = "KMS key encrypting the flow log group."
  type        = string
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
