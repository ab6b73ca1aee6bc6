output "role_arn" {
  description = "ARN of the role."
  value       = aws_iam_role.this.arn
}

output "association_id" {
  description = "ID of the Pod Identity association (depend on it before starting the pods)."
  value       = aws_eks_pod_identity_association.this.association_id
}
