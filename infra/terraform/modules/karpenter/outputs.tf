output "interruption_queue" {
  description = "SQS queue of EC2 interruption, rebalance and state-change events."
  value       = aws_sqs_queue.interruption.name
}

output "controller_role_arn" {
  description = "IAM role of the Karpenter controller (Pod Identity)."
  value       = module.controller_identity.role_arn
}
