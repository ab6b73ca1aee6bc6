output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "Base64 CA certificate of the API endpoint."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "cluster_security_group_id" {
  description = "Security group EKS created for the control plane and managed nodes."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "oidc_provider_arn" {
  description = "OIDC provider for IRSA."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "node_role_name" {
  description = "Name of the node role (Karpenter's EC2NodeClass spec.role)."
  value       = aws_iam_role.node.name
}

output "node_role_arn" {
  description = "IAM role of the node groups."
  value       = aws_iam_role.node.arn
}
