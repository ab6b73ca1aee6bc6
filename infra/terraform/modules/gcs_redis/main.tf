# External store for Ray's GCS fault tolerance: the head writes cluster metadata (actors,
# placement groups, Serve's controller checkpoint) here, so a restarted head picks it up and
# Serve keeps answering while the head comes back. ElastiCache (Redis OSS), a primary and a
# replica in different zones with automatic failover, TLS in transit, KMS at rest, an AUTH
# token kept in Secrets Manager; only the cluster's nodes can reach 6379.

resource "random_password" "auth" {
  length  = 64
  special = false # ElastiCache AUTH tokens allow only some symbols; alphanumerics always work
}

resource "aws_secretsmanager_secret" "auth" {
  name        = "${var.name}/ray-gcs-redis-auth"
  description = "AUTH token of the Ray GCS ElastiCache replication group"
  kms_key_id  = var.kms_key_arn
  # checkov:skip=CKV2_AWS_57:ElastiCache cannot rotate an AUTH token from Secrets Manager; rotate with auth_token_update_strategy (docs/infrastructure.md).
  tags = var.tags
}

resource "aws_secretsmanager_secret_version" "auth" {
  secret_id     = aws_secretsmanager_secret.auth.id
  secret_string = random_password.auth.result
}

resource "aws_elasticache_subnet_group" "this" {
  name       = "${var.name}-ray-gcs"
  subnet_ids = var.subnet_ids
  tags       = var.tags
}

resource "aws_security_group" "this" {
  name        = "${var.name}-ray-gcs-redis"
  description = "Ray GCS Redis: 6379 from the cluster's nodes only"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-ray-gcs-redis" })
}

resource "aws_vpc_security_group_ingress_rule" "nodes" {
  for_each                     = toset(var.client_security_group_ids)
  security_group_id            = aws_security_group.this.id
  description                  = "Redis (TLS) from Ray pods on cluster nodes"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = each.value
}

resource "aws_cloudwatch_log_group" "slow_log" {
  name              = "/elasticache/${var.name}-ray-gcs/slow-log"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
  tags              = var.tags
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id       = "${var.name}-ray-gcs"
  description                = "Ray GCS fault tolerance for ${var.name}"
  engine                     = "redis"
  engine_version             = var.engine_version
  node_type                  = var.node_type
  num_cache_clusters         = var.replicas + 1
  port                       = 6379
  automatic_failover_enabled = true
  multi_az_enabled           = true
  subnet_group_name          = aws_elasticache_subnet_group.this.name
  security_group_ids         = [aws_security_group.this.id]
  transit_encryption_enabled = true
  transit_encryption_mode    = "required"
  at_rest_encryption_enabled = true
  kms_key_id                 = var.kms_key_arn
  auth_token                 = random_password.auth.result
  auth_token_update_strategy = var.auth_token_update_strategy
  auto_minor_version_upgrade = true
  snapshot_retention_limit   = var.snapshot_retention_days
  apply_immediately          = false

  log_delivery_configuration {
    destination      = aws_cloudwatch_log_group.slow_log.name
    destination_type = "cloudwatch-logs"
    log_format       = "json"
    log_type         = "slow-log"
  }

  tags = var.tags
}
