# The KubeRay operator and the manifests of `cluster render kuberay`: one RayService (head,
# ingress CPU group, one worker group per pool, Serve config), the ingress Service, a
# PodDisruptionBudget per worker group and NetworkPolicies. They are rendered from our own
# cluster YAML, so what runs on EKS is what ran locally. The head keeps its GCS state in the
# gcs_redis module's ElastiCache: its endpoint replaces GCS_REDIS_ENDPOINT in the render and
# its AUTH token (from Secrets Manager) becomes the Secret the RayService references. Every
# service is ClusterIP: the dashboard (8265) and metrics (8080) stay inside the cluster; the
# load_balancer module's ALB is the only way in, to the Serve port of the ingress pods.

locals {
  documents = [
    for doc in split("\n---\n", replace(var.manifests_yaml, "GCS_REDIS_ENDPOINT", var.gcs_redis_endpoint)) :
    yamldecode(doc)
  ]
  rayservice = one([for doc in local.documents : doc if doc.kind == "RayService"])
}

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

data "aws_secretsmanager_secret_version" "gcs_redis" {
  secret_id = var.gcs_redis_auth_secret_arn
}

resource "kubernetes_secret_v1" "gcs_redis" {
  metadata {
    name      = "ray-gcs-redis" # cluster.kuberay.GCS_REDIS_SECRET
    namespace = kubernetes_namespace_v1.ray.metadata[0].name
  }
  data = { "auth-token" = data.aws_secretsmanager_secret_version.gcs_redis.secret_string }
}

resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = var.operator_version
  namespace        = "kuberay-system" # cluster.kuberay_objects.KUBERAY_NAMESPACE (NetworkPolicy)
  create_namespace = true
}

resource "kubernetes_manifest" "this" {
  for_each = { for doc in local.documents : "${doc.kind}/${doc.metadata.name}" => doc }
  manifest = merge(each.value, {
    metadata = merge(each.value.metadata, { namespace = kubernetes_namespace_v1.ray.metadata[0].name })
  })
  depends_on = [helm_release.kuberay_operator, kubernetes_service_account_v1.ray, kubernetes_secret_v1.gcs_redis]
}
