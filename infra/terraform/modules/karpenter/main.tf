# Karpenter: adds nodes when pods are Pending (Ray worker pods that KubeRay's autoscaler
# created for new Serve replicas) and removes them once empty, so GPU pools scale to zero.
# The controller runs on the system node group and gets AWS access through Pod Identity; EC2
# interruption, rebalance and state-change events reach it through an SQS queue so it can
# drain a node before AWS takes it (Capacity Block ends, scheduled maintenance). Nodes use the
# eks module's node role, whose access entry EKS created with the system node group. The CPU
# NodePool for the Serve ingress lives here; GPU NodePools per serving pool are in gpu_nodes.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  account   = data.aws_caller_identity.current.account_id
  partition = data.aws_partition.current.partition
  region    = data.aws_region.current.region
  ec2_arn   = "arn:${local.partition}:ec2:${local.region}"
  owned     = "kubernetes.io/cluster/${var.cluster_name}"
  # What a launch creates, all tagged with the cluster and the NodePool.
  launched = [for kind in ["fleet", "instance", "volume", "network-interface", "launch-template", "spot-instances-request"] :
    "${local.ec2_arn}:*:${kind}/*"
  ]
}

# -- interruption queue ----------------------------------------------------------------------

resource "aws_sqs_queue" "interruption" {
  name                      = "${var.cluster_name}-karpenter"
  message_retention_seconds = 300
  # SSE-SQS: EventBridge may publish to it without a grant in a customer key's policy.
  sqs_managed_sse_enabled = true
  tags                    = var.tags
}

data "aws_iam_policy_document" "interruption" {
  statement {
    sid       = "EventBridgeWrites"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.interruption.arn]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com", "sqs.amazonaws.com"]
    }
  }
  statement {
    sid       = "DenyHTTP"
    effect    = "Deny"
    actions   = ["sqs:*"]
    resources = [aws_sqs_queue.interruption.arn]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_sqs_queue_policy" "interruption" {
  queue_url = aws_sqs_queue.interruption.url
  policy    = data.aws_iam_policy_document.interruption.json
}

locals {
  interruption_events = {
    health_scheduled_change = { source = ["aws.health"], detail-type = ["AWS Health Event"] }
    spot_interruption       = { source = ["aws.ec2"], detail-type = ["EC2 Spot Instance Interruption Warning"] }
    rebalance               = { source = ["aws.ec2"], detail-type = ["EC2 Instance Rebalance Recommendation"] }
    state_change            = { source = ["aws.ec2"], detail-type = ["EC2 Instance State-change Notification"] }
    capacity_reservation    = { source = ["aws.ec2"], detail-type = ["EC2 Capacity Reservation Instance Interruption Warning"] }
  }
}

resource "aws_cloudwatch_event_rule" "interruption" {
  for_each      = local.interruption_events
  name          = "${var.cluster_name}-karpenter-${replace(each.key, "_", "-")}"
  event_pattern = jsonencode(each.value)
  tags          = var.tags
}

resource "aws_cloudwatch_event_target" "interruption" {
  for_each = local.interruption_events
  rule     = aws_cloudwatch_event_rule.interruption[each.key].name
  arn      = aws_sqs_queue.interruption.arn
}

# -- controller (IAM through Pod Identity, Helm) ------------------------------------------

# Karpenter v1's controller policy: launches and deletes only what carries this cluster's tags.
data "aws_iam_policy_document" "controller" {
  statement {
    sid     = "LaunchFromSharedResources"
    actions = ["ec2:RunInstances", "ec2:CreateFleet"]
    resources = [
      "${local.ec2_arn}::image/*",
      "${local.ec2_arn}::snapshot/*",
      "${local.ec2_arn}:*:security-group/*",
      "${local.ec2_arn}:*:subnet/*",
      "${local.ec2_arn}:*:capacity-reservation/*",
      "${local.ec2_arn}:*:placement-group/*",
    ]
  }
  statement {
    sid       = "LaunchFromOwnTemplates"
    actions   = ["ec2:RunInstances", "ec2:CreateFleet"]
    resources = ["${local.ec2_arn}:*:launch-template/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.owned}"
      values   = ["owned"]
    }
    condition {
      test     = "StringLike"
      variable = "aws:ResourceTag/karpenter.sh/nodepool"
      values   = ["*"]
    }
  }
  statement {
    sid       = "CreateTaggedResources"
    actions   = ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"]
    resources = local.launched
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/${local.owned}"
      values   = ["owned"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/eks:eks-cluster-name"
      values   = [var.cluster_name]
    }
    condition {
      test     = "StringLike"
      variable = "aws:RequestTag/karpenter.sh/nodepool"
      values   = ["*"]
    }
  }
  statement {
    sid       = "TagOnCreate"
    actions   = ["ec2:CreateTags"]
    resources = local.launched
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/${local.owned}"
      values   = ["owned"]
    }
    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["RunInstances", "CreateFleet", "CreateLaunchTemplate"]
    }
  }
  statement {
    sid       = "TagOwnInstances"
    actions   = ["ec2:CreateTags"]
    resources = ["${local.ec2_arn}:*:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.owned}"
      values   = ["owned"]
    }
    condition {
      test     = "ForAllValues:StringEquals"
      variable = "aws:TagKeys"
      values   = ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]
    }
  }
  statement {
    sid       = "DeleteOwnResources"
    actions   = ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"]
    resources = ["${local.ec2_arn}:*:instance/*", "${local.ec2_arn}:*:launch-template/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.owned}"
      values   = ["owned"]
    }
    condition {
      test     = "StringLike"
      variable = "aws:ResourceTag/karpenter.sh/nodepool"
      values   = ["*"]
    }
  }
  statement {
    sid = "RegionalReads"
    actions = [
      "ec2:DescribeAvailabilityZones",
      "ec2:DescribeCapacityReservations",
      "ec2:DescribeImages",
      "ec2:DescribeInstances",
      "ec2:DescribeInstanceTypeOfferings",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplates",
      "ec2:DescribePlacementGroups",
      "ec2:DescribeSecurityGroups",
      "ec2:DescribeSpotPriceHistory",
      "ec2:DescribeSubnets",
    ]
    resources = ["*"] # Describe* cannot be scoped to resources
    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [local.region]
    }
  }
  statement {
    sid       = "AmiParameters"
    actions   = ["ssm:GetParameter"]
    resources = ["arn:${local.partition}:ssm:${local.region}::parameter/aws/service/*"]
  }
  statement {
    sid       = "Pricing"
    actions   = ["pricing:GetProducts"]
    resources = ["*"] # pricing has no resource-level permissions
  }
  statement {
    sid       = "InterruptionQueue"
    actions   = ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"]
    resources = [aws_sqs_queue.interruption.arn]
  }
  statement {
    sid       = "PassNodeRole"
    actions   = ["iam:PassRole"]
    resources = [var.node_role_arn]
    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ec2.amazonaws.com"]
    }
  }
  statement {
    sid = "OwnInstanceProfiles"
    actions = [
      "iam:CreateInstanceProfile",
      "iam:TagInstanceProfile",
      "iam:AddRoleToInstanceProfile",
      "iam:RemoveRoleFromInstanceProfile",
      "iam:DeleteInstanceProfile",
      "iam:GetInstanceProfile",
    ]
    resources = ["arn:${local.partition}:iam::${local.account}:instance-profile/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/${local.owned}"
      values   = ["owned"]
    }
  }
  statement {
    sid       = "ListInstanceProfiles"
    actions   = ["iam:ListInstanceProfiles"]
    resources = ["*"] # list actions cannot be scoped to resources
  }
  statement {
    sid       = "ClusterEndpoint"
    actions   = ["eks:DescribeCluster"]
    resources = ["arn:${local.partition}:eks:${local.region}:${local.account}:cluster/${var.cluster_name}"]
  }
  statement {
    sid       = "EncryptedNodeVolumes"
    actions   = ["kms:CreateGrant", "kms:Decrypt", "kms:GenerateDataKeyWithoutPlaintext", "kms:DescribeKey"]
    resources = [var.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["ec2.${local.region}.amazonaws.com"]
    }
  }
}

module "controller_identity" {
  source          = "../pod_identity"
  cluster_name    = var.cluster_name
  role_name       = "${var.cluster_name}-karpenter-controller"
  namespace       = var.namespace
  service_account = "karpenter"
  policy_json     = data.aws_iam_policy_document.controller.json
  tags            = var.tags
}

resource "helm_release" "karpenter" {
  name       = "karpenter"
  repository = "oci://public.ecr.aws/karpenter"
  chart      = "karpenter"
  version    = var.chart_version
  namespace  = var.namespace
  values = [yamlencode({
    serviceAccount = { name = "karpenter" }
    # Never on nodes it manages: the system node group runs it.
    nodeSelector = { "cluster.ai/role" = "system" }
    settings = {
      clusterName       = var.cluster_name
      interruptionQueue = aws_sqs_queue.interruption.name
      # On-Demand Capacity Reservations and Capacity Blocks as capacity type "reserved".
      featureGates = { reservedCapacity = true }
    }
  })]
  depends_on = [module.controller_identity]
}

# -- CPU capacity for the Serve ingress -------------------------------------------------------

resource "kubernetes_manifest" "ingress_node_class" {
  manifest = {
    apiVersion = "karpenter.k8s.aws/v1"
    kind       = "EC2NodeClass"
    metadata   = { name = "ingress" }
    spec = {
      role                       = var.node_role_name
      amiSelectorTerms           = [{ alias = "al2023@latest" }]
      subnetSelectorTerms        = [for id in var.subnet_ids : { id = id }]
      securityGroupSelectorTerms = [{ id = var.cluster_security_group_id }]
      metadataOptions = {
        httpEndpoint            = "enabled"
        httpTokens              = "required" # IMDSv2 only
        httpPutResponseHopLimit = 1          # pods use Pod Identity, never the node role
      }
      blockDeviceMappings = [{
        deviceName = "/dev/xvda"
        ebs        = { volumeSize = "100Gi", volumeType = "gp3", encrypted = true, kmsKeyID = var.kms_key_arn, deleteOnTermination = true }
      }]
      tags = var.tags
    }
  }
  depends_on = [helm_release.karpenter]
}

resource "kubernetes_manifest" "ingress_node_pool" {
  manifest = {
    apiVersion = "karpenter.sh/v1"
    kind       = "NodePool"
    metadata   = { name = "ingress" }
    spec = {
      template = {
        metadata = { labels = { "cluster.ai/role" = "ingress" } }
        spec = {
          nodeClassRef = { group = "karpenter.k8s.aws", kind = "EC2NodeClass", name = "ingress" }
          requirements = [
            { key = "node.kubernetes.io/instance-type", operator = "In", values = var.ingress_node_pool.instance_types },
            { key = "karpenter.sh/capacity-type", operator = "In", values = ["on-demand"] },
          ]
          expireAfter = "720h"
        }
      }
      # Replace under-used nodes, but at most one at a time (the PDB keeps one ingress pod up).
      disruption = {
        consolidationPolicy = "WhenEmptyOrUnderutilized"
        consolidateAfter    = "5m"
        budgets             = [{ nodes = "1" }]
      }
      limits = { cpu = tostring(var.ingress_node_pool.max_cpu) }
    }
  }
  depends_on = [kubernetes_manifest.ingress_node_class]
}
