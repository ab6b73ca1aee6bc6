output "primary_endpoint" {
  description = "Primary endpoint host (TLS, port 6379): the RayService's redisAddress host."
  value       = aws_elasticache_replication_group.this.primary_endpoint_address
}

output "auth_token_secret_arn" {
  description = "Secrets Manager secret holding the AUTH token."
  value       = aws_secretsmanager_secret.auth.arn
}

output "security_group_id" {
  description = "Security group of the replication group."
  value       = aws_security_group.this.id
}
