# The way in: the AWS Load Balancer Controller (Pod Identity) and one Ingress that it turns
# into an ALB: HTTPS only (ACM certificate, TLS 1.3 policy), targets = the Serve ingress pods'
# IPs (the `<rayservice>-ingress` Service), health-checked on /readyz, which answers 200 only
# while every model has a running replica. The deregistration delay stays below the pods'
# preStop drain, so the ALB stops sending before Serve stops. The Ray dashboard is not exposed.

data "aws_partition" "current" {}

locals {
  partition = data.aws_partition.current.partition
  elb_owned = { test = "Null", variable = "aws:ResourceTag/elbv2.k8s.aws/cluster", values = ["false"] }
}

# What the controller needs for ALBs of this cluster; writes are limited to resources it
# tagged (elbv2.k8s.aws/cluster), reads cannot be scoped.
data "aws_iam_policy_document" "controller" {
  # checkov:skip=CKV_AWS_356:Describe/Get/List and Create* of new load balancers, target groups and security groups have no resource ARN before creation.
  # checkov:skip=CKV_AWS_111:Create* of new load balancers and security groups has no resource ARN before creation; the tag condition scopes them.
  statement {
    sid = "Read"
    actions = [
      "ec2:DescribeAccountAttributes", "ec2:DescribeAddresses", "ec2:DescribeAvailabilityZones",
      "ec2:DescribeInternetGateways", "ec2:DescribeVpcs", "ec2:DescribeSubnets",
      "ec2:DescribeSecurityGroups", "ec2:DescribeInstances", "ec2:DescribeNetworkInterfaces",
      "ec2:DescribeTags", "ec2:DescribeRouteTables", "ec2:GetSecurityGroupsForVpc",
      "elasticloadbalancing:Describe*", "acm:ListCertificates", "acm:DescribeCertificate",
      "wafv2:GetWebACL", "wafv2:GetWebACLForResource", "shield:GetSubscriptionState",
    ]
    resources = ["*"]
  }
  statement {
    sid       = "ServiceLinkedRole"
    actions   = ["iam:CreateServiceLinkedRole"]
    resources = ["arn:${local.partition}:iam::*:role/aws-service-role/elasticloadbalancing.amazonaws.com/*"]
    condition {
      test     = "StringEquals"
      variable = "iam:AWSServiceName"
      values   = ["elasticloadbalancing.amazonaws.com"]
    }
  }
  statement {
    sid       = "CreateTagged"
    actions   = ["ec2:CreateSecurityGroup", "elasticloadbalancing:CreateLoadBalancer", "elasticloadbalancing:CreateTargetGroup"]
    resources = ["*"]
    condition {
      test     = "Null"
      variable = "aws:RequestTag/elbv2.k8s.aws/cluster"
      values   = ["false"]
    }
  }
  statement {
    sid       = "TagOnCreate"
    actions   = ["ec2:CreateTags", "elasticloadbalancing:AddTags"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["CreateSecurityGroup"]
    }
  }
  statement {
    sid = "ManageOwned"
    actions = [
      "ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress", "ec2:DeleteSecurityGroup",
      "ec2:CreateTags", "ec2:DeleteTags",
      "elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags",
      "elasticloadbalancing:ModifyLoadBalancerAttributes", "elasticloadbalancing:SetIpAddressType",
      "elasticloadbalancing:SetSecurityGroups", "elasticloadbalancing:SetSubnets",
      "elasticloadbalancing:DeleteLoadBalancer", "elasticloadbalancing:ModifyTargetGroup",
      "elasticloadbalancing:ModifyTargetGroupAttributes", "elasticloadbalancing:DeleteTargetGroup",
      "elasticloadbalancing:RegisterTargets", "elasticloadbalancing:DeregisterTargets",
      "elasticloadbalancing:CreateListener", "elasticloadbalancing:DeleteListener",
      "elasticloadbalancing:ModifyListener", "elasticloadbalancing:ModifyListenerAttributes",
      "elasticloadbalancing:CreateRule", "elasticloadbalancing:DeleteRule", "elasticloadbalancing:ModifyRule",
      "elasticloadbalancing:AddListenerCertificates", "elasticloadbalancing:RemoveListenerCertificates",
      "elasticloadbalancing:SetWebAcl", "wafv2:AssociateWebACL", "wafv2:DisassociateWebACL",
    ]
    resources = ["*"]
    condition {
      test     = local.elb_owned.test
      variable = local.elb_owned.variable
      values   = local.elb_owned.values
    }
  }
}

module "controller_identity" {
  source          = "../pod_identity"
  cluster_name    = var.cluster_name
  role_name       = "${var.cluster_name}-aws-load-balancer-controller"
  namespace       = "kube-system"
  service_account = "aws-load-balancer-controller"
  policy_json     = data.aws_iam_policy_document.controller.json
  tags            = var.tags
}

resource "helm_release" "controller" {
  name       = "aws-load-balancer-controller"
  repository = "https://aws.github.io/eks-charts"
  chart      = "aws-load-balancer-controller"
  version    = var.chart_version
  namespace  = "kube-system"
  values = [yamlencode({
    clusterName    = var.cluster_name
    vpcId          = var.vpc_id
    region         = var.region
    serviceAccount = { name = "aws-load-balancer-controller" }
    nodeSelector   = { "cluster.ai/role" = "system" }
    # Every load balancer it creates carries elbv2.k8s.aws/cluster, which the policy requires.
    defaultTags = var.tags
  })]
  depends_on = [module.controller_identity]
}

resource "kubernetes_ingress_v1" "serve" {
  metadata {
    name      = "serve"
    namespace = var.namespace
    annotations = merge(
      {
        "alb.ingress.kubernetes.io/scheme"                       = var.internal ? "internal" : "internet-facing"
        "alb.ingress.kubernetes.io/target-type"                  = "ip"
        "alb.ingress.kubernetes.io/listen-ports"                 = jsonencode([{ HTTPS = 443 }])
        "alb.ingress.kubernetes.io/certificate-arn"              = var.certificate_arn
        "alb.ingress.kubernetes.io/ssl-policy"                   = "ELBSecurityPolicy-TLS13-1-2-2021-06"
        "alb.ingress.kubernetes.io/inbound-cidrs"                = join(",", var.allowed_cidrs)
        "alb.ingress.kubernetes.io/healthcheck-path"             = "/readyz"
        "alb.ingress.kubernetes.io/healthcheck-port"             = "traffic-port"
        "alb.ingress.kubernetes.io/success-codes"                = "200"
        "alb.ingress.kubernetes.io/healthy-threshold-count"      = "2"
        "alb.ingress.kubernetes.io/unhealthy-threshold-count"    = "2"
        "alb.ingress.kubernetes.io/healthcheck-interval-seconds" = "10"
        "alb.ingress.kubernetes.io/target-group-attributes"      = "deregistration_delay.timeout_seconds=${var.deregistration_delay_s}"
        # Streams idle between tokens for at most this long (long prefills of agent traces).
        "alb.ingress.kubernetes.io/load-balancer-attributes" = join(",", compact([
          "idle_timeout.timeout_seconds=${var.idle_timeout_s}",
          "routing.http.drop_invalid_header_fields.enabled=true",
          "deletion_protection.enabled=${var.deletion_protection}",
          var.access_logs_bucket == null ? "" : "access_logs.s3.enabled=true",
          var.access_logs_bucket == null ? "" : "access_logs.s3.bucket=${var.access_logs_bucket}",
        ]))
      },
      var.waf_acl_arn == null ? {} : { "alb.ingress.kubernetes.io/wafv2-acl-arn" = var.waf_acl_arn }
    )
  }
  spec {
    ingress_class_name = "alb"
    default_backend {
      service {
        name = var.backend_service
        port {
          number = 8000
        }
      }
    }
  }
  depends_on = [helm_release.controller]
}
