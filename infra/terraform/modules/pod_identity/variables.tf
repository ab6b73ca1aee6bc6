variable "cluster_name" {
  description = "EKS cluster of the service account."
  type        = string
}

variable "role_name" {
  description = "Name of the IAM role."
  type        = string
  validation {
    condition     = length(var.role_name) <= 64
    error_message = "IAM role names are at most 64 characters."
  }
}

variable "namespace" {
  description = "Namespace of the service account."
  type        = string
}

variable "service_account" {
  description = "Service account whose pods assume the role."
  type        = string
}

variable "policy_json" {
  description = "Inline policy of the role (an aws_iam_policy_document's json)."
  type        = string
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
