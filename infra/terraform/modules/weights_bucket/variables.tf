variable "bucket_name" {
  description = "Globally unique name of the weights bucket."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-63 lowercase letters, digits, dots or dashes."
  }
}

variable "kms_key_arn" {
  description = "KMS key for SSE-KMS of every object."
  type        = string
}

variable "access_log_bucket" {
  description = "Existing bucket receiving S3 server access logs."
  type        = string
}

variable "cluster_name" {
  description = "EKS cluster whose Ray pods read the bucket (Pod Identity association)."
  type        = string
}

variable "namespace" {
  description = "Kubernetes namespace of the Ray pods."
  type        = string
  default     = "ray"
}

variable "service_account" {
  description = "Kubernetes service account of the Ray pods."
  type        = string
  default     = "ray-weights-reader"
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete multipart uploads (interrupted pushes) are removed."
  type        = number
  default     = 3
  validation {
    condition     = var.abort_incomplete_multipart_days >= 1
    error_message = "abort_incomplete_multipart_days must be at least 1."
  }
}

variable "noncurrent_version_days" {
  description = "Days old versions of overwritten checkpoints are kept."
  type        = number
  default     = 30
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
