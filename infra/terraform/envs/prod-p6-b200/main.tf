# Production: Kimi K2.6 NVFP4 on p6-b200.48xlarge (8x B200, 8 EFA network cards) with a
# speculative pool (EAGLE 3.1) and a throughput pool, GPU nodes from Karpenter (reservations
# first), head HA on ElastiCache, HTTPS ALB, Prometheus + AMP. kuberay.yaml is rendered from
# configs/kimi-k2.6-nvfp4-p6-b200.yaml:
#   cluster render kuberay configs/kimi-k2.6-nvfp4-p6-b200.yaml --efa-interfaces 8 \
#     > infra/terraform/envs/prod-p6-b200/kuberay.yaml
# Apply in three steps (docs/infrastructure.md): AWS resources, then the charts that bring
# CRDs (Karpenter, KubeRay, kube-prometheus-stack), then everything.

provider "aws" {
  region = var.region
  default_tags {
    tags = local.tags
  }
}

locals {
  tags = { environment = "prod", stack = "llm-inference", managed-by = "terraform" }
  # Pool names match the cluster YAML's pools: node groups, worker groups and node labels line up.
  # Reservations first (ODCR or Capacity Blocks for ML), on-demand when none is left.
  capacity_types = length(var.capacity_reservation_ids) > 0 ? ["reserved", "on-demand"] : ["on-demand"]
  # max_nodes = the pool's max_replicas (one replica = one 8-GPU node); the target's replica_budget
  # (8) keeps both pools together within 8 nodes.
  gpu_pools = [
    {
      name                     = "speculative"
      instance_types           = ["p6-b200.48xlarge"]
      max_nodes                = 7
      capacity_types           = local.capacity_types
      capacity_reservation_ids = var.capacity_reservation_ids
    },
    {
      name                     = "throughput"
      instance_types           = ["p6-b200.48xlarge"]
      max_nodes                = 7
      capacity_types           = local.capacity_types
      capacity_reservation_ids = var.capacity_reservation_ids
    },
  ]
}

data "aws_caller_identity" "current" {}

data "aws_iam_policy_document" "kms" {
  # A key policy's "*" resource is the key itself; the account root statement is AWS's default.
  # checkov:skip=CKV_AWS_111:Key policy: resource "*" means this key only.
  # checkov:skip=CKV_AWS_356:Key policy: resource "*" means this key only.
  # checkov:skip=CKV_AWS_109:Key policy: account root administers its own key (AWS default policy).
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:aws:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
  statement {
    sid       = "CloudWatchLogsEncrypt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_kms_key" "platform" {
  description             = "${var.name}: EKS secrets, logs, node volumes, weights bucket"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
}

module "network" {
  source      = "../../modules/network"
  name        = var.name
  azs         = var.azs
  kms_key_arn = aws_kms_key.platform.arn
  tags        = local.tags
}

module "eks" {
  source               = "../../modules/eks"
  name                 = var.name
  subnet_ids           = module.network.private_subnet_ids
  kms_key_arn          = aws_kms_key.platform.arn
  admin_principal_arns = var.admin_principal_arns
  tags                 = local.tags
}

module "karpenter" {
  source                    = "../../modules/karpenter"
  cluster_name              = module.eks.cluster_name
  node_role_name            = module.eks.node_role_name
  node_role_arn             = module.eks.node_role_arn
  kms_key_arn               = aws_kms_key.platform.arn
  subnet_ids                = module.network.private_subnet_ids
  cluster_security_group_id = module.eks.cluster_security_group_id
  tags                      = local.tags
}

module "gpu_nodes" {
  source                    = "../../modules/gpu_nodes"
  cluster_name              = module.eks.cluster_name
  vpc_id                    = module.network.vpc_id
  subnet_id                 = module.network.private_subnet_ids[0]
  node_role_name            = module.eks.node_role_name
  cluster_security_group_id = module.eks.cluster_security_group_id
  kms_key_arn               = aws_kms_key.platform.arn
  pools                     = local.gpu_pools
  tags                      = local.tags
  depends_on                = [module.karpenter]
}

module "gcs_redis" {
  source                    = "../../modules/gcs_redis"
  name                      = var.name
  vpc_id                    = module.network.vpc_id
  subnet_ids                = module.network.private_subnet_ids
  client_security_group_ids = [module.eks.cluster_security_group_id]
  kms_key_arn               = aws_kms_key.platform.arn
  tags                      = local.tags
}

module "weights_bucket" {
  source            = "../../modules/weights_bucket"
  bucket_name       = var.weights_bucket_name
  kms_key_arn       = aws_kms_key.platform.arn
  access_log_bucket = var.access_log_bucket
  cluster_name      = module.eks.cluster_name
  namespace         = "ray"
  service_account   = "ray-weights-reader"
  tags              = local.tags
}

provider "kubernetes" {
  host                   = module.eks.cluster_endpoint
  cluster_ca_certificate = base64decode(module.eks.cluster_ca_certificate)
  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.eks.cluster_name, "--region", var.region]
  }
}

provider "helm" {
  kubernetes = {
    host                   = module.eks.cluster_endpoint
    cluster_ca_certificate = base64decode(module.eks.cluster_ca_certificate)
    exec = {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", module.eks.cluster_name, "--region", var.region]
    }
  }
}

module "kuberay" {
  source                    = "../../modules/kuberay"
  namespace                 = "ray"
  service_account           = "ray-weights-reader"
  manifests_yaml            = file("${path.module}/kuberay.yaml")
  gcs_redis_endpoint        = module.gcs_redis.primary_endpoint
  gcs_redis_auth_secret_arn = module.gcs_redis.auth_token_secret_arn
  depends_on                = [module.gpu_nodes, module.weights_bucket, module.observability]
}

module "load_balancer" {
  source          = "../../modules/load_balancer"
  cluster_name    = module.eks.cluster_name
  vpc_id          = module.network.vpc_id
  region          = var.region
  namespace       = module.kuberay.namespace
  backend_service = module.kuberay.ingress_service
  certificate_arn = var.certificate_arn
  allowed_cidrs   = var.api_allowed_cidrs
  tags            = local.tags
}

module "observability" {
  source         = "../../modules/observability"
  name           = var.name
  cluster_name   = module.eks.cluster_name
  dashboards_dir = "${path.module}/../../../grafana/dashboards"
  amp_enabled    = var.amp_enabled
  kms_key_arn    = aws_kms_key.platform.arn
  tags           = local.tags
}
