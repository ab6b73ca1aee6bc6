output "bucket_name" {
  description = "Name of the weights bucket."
  value       = aws_s3_bucket.this.bucket
}

output "bucket_arn" {
  description = "ARN of the weights bucket."
  value       = aws_s3_bucket.this.arn
}

output "reader_role_arn" {
  description = "Read-only role the Ray pods assume through Pod Identity."
  value       = aws_iam_role.reader.arn
}

output "service_account" {
  description = "Namespace/name of the Kubernetes service account bound to the reader role."
  value       = "${var.namespace}/${var.service_account}"
}
