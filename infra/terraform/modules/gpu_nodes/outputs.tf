output "node_pool_names" {
  description = "Karpenter NodePool per serving pool (nodes labelled cluster.ai/pool=<name>)."
  value       = { for name, pool in kubernetes_manifest.node_pool : name => pool.manifest.metadata.name }
}

output "efa_security_group_id" {
  description = "Security group that lets GPU nodes exchange EFA traffic."
  value       = aws_security_group.efa.id
}

output "placement_group_names" {
  description = "Cluster placement group per EFA pool."
  value       = { for name, group in aws_placement_group.pool : name => group.name }
}

output "efa_interfaces" {
  description = "EFA interfaces attached per node, by pool."
  value       = { for name, p in local.pools : name => p.efa_count }
}
