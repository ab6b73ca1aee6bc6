output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name ...)."
  value       = module.eks.cluster_name
}

output "weights_bucket" {
  description = "Bucket to push weights and drafters to (cluster models push DIR s3://BUCKET/...)."
  value       = module.weights_bucket.bucket_name
}

output "gpu_node_pools" {
  description = "Karpenter NodePool per serving pool."
  value       = module.gpu_nodes.node_pool_names
}

output "load_balancer_hostname" {
  description = "DNS name of the HTTPS load balancer (CNAME the certificate's hostname to it)."
  value       = module.load_balancer.load_balancer_hostname
}

output "rayservice" {
  description = "namespace/name of the RayService (kubectl port-forward svc/<name>-head-svc 8265 for the dashboard)."
  value       = "${module.kuberay.namespace}/${module.kuberay.rayservice_name}"
}
