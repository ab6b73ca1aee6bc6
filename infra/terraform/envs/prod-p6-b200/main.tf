# Production: Kimi K2.6 NVFP4 on p6-b200.48xlarge (8x B200, 8 EFA network cards) with a
# speculative pool (EAGLE 3.1) and a throughput pool. rayservice.yaml is rendered from
# configs/kimi-k2.6-nvfp4-p6-b200.yaml:
#   cluster render kuberay configs/kimi-k2.6-nvfp4-p6-b200.yaml --efa-interfaces 8 \
#     > infra/terraform/envs/prod-p6-b200/rayservice.yaml

provider "aws" {
  region = var.region
  default_tags {
    tags = local.tags
  }
}

locals {
  tags = { environment = "prod", stack = "llm-inference", managed-by = "terraform" }
  # Pool names match the cluster YAML's pools: node groups, worker groups and node labels line up.
  gpu_pools = [
    {
      name                    = "speculative"
      instance_type           = "p6-b200.48xlarge"
      min_size                = 1
      max_size                = 4
      taints                  = [{ key = "nvidia.com/gpu", value = "true", effect = "NO_SCHEDULE" }]
      capacity_reservation_id = var.capacity_reservation_id
    },
    {
      name                    = "throughput"
      instance_type           = "p6-b200.48xlarge"
      min_size                = 1
      max_size                = 8
      taints                  = [{ key = "nvidia.com/gpu", value = "true", effect = "NO_SCHEDULE" }]
      capacity_reservation_id = var.capacity_reservation_id
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

module "gpu_nodes" {
  source                    = "../../modules/gpu_nodes"
  cluster_name              = module.eks.cluster_name
  vpc_id                    = module.network.vpc_id
  subnet_id                 = module.network.private_subnet_ids[0]
  node_role_arn             = module.eks.node_role_arn
  cluster_security_group_id = module.eks.cluster_security_group_id
  kms_key_arn               = aws_kms_key.platform.arn
  pools                     = local.gpu_pools
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
  source          = "../../modules/kuberay"
  namespace       = "ray"
  service_account = "ray-weights-reader"
  rayservice_yaml = file("${path.module}/rayservice.yaml")
  depends_on      = [module.gpu_nodes, module.weights_bucket]
}
