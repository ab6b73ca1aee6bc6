# The KubeRay operator and one RayService. The RayService (head, one worker group per pool,
# Serve config) is rendered by `cluster render kuberay` from our own cluster YAML, so what runs
# on EKS is what ran locally. Its services are ClusterIP only: the dashboard (8265), Prometheus
# metrics (8080) and the API (8000) are reachable inside the VPC, never from the internet.

resource "kubernetes_namespace_v1" "ray" {
  metadata {
    name = var.namespace
  }
}

resource "kubernetes_service_account_v1" "ray" {
  metadata {
    name      = var.service_account
    namespace = kubernetes_namespace_v1.ray.metadata[0].name
  }
}

resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = var.operator_version
  namespace        = "kuberay-system"
  create_namespace = true
}

resource "kubernetes_manifest" "rayservice" {
  manifest = merge(yamldecode(var.rayservice_yaml), {
    metadata = merge(yamldecode(var.rayservice_yaml).metadata, {
      namespace = kubernetes_namespace_v1.ray.metadata[0].name
    })
  })
  depends_on = [helm_release.kuberay_operator, kubernetes_service_account_v1.ray]
}
