output "load_balancer_hostname" {
  description = "DNS name of the ALB (point the certificate's hostname at it)."
  value       = try(kubernetes_ingress_v1.serve.status[0].load_balancer[0].ingress[0].hostname, null)
}

output "controller_role_arn" {
  description = "IAM role of the AWS Load Balancer Controller (Pod Identity)."
  value       = module.controller_identity.role_arn
}
