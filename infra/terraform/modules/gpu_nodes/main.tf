# GPU node groups, one per serving pool. Multi-node tensor/pipeline parallelism and KV transfer
# need EFA: one EFA interface per network card, a security group that allows all traffic to and
# from itself, and a cluster placement group. The instance-store NVMe drives become one RAID0
# volume for the model cache (nodeadm localStorage), so weights load from local disk.

locals {
  # Network cards per instance type = EFA interfaces to attach (AWS instance specs).
  efa_interfaces_by_type = {
    "p6-b200.48xlarge" = 8
    "p6-b300.48xlarge" = 8
    "p5en.48xlarge"    = 16
    "p5.48xlarge"      = 32
    "p4d.24xlarge"     = 4
    "g6e.xlarge"       = 0
    "g6e.2xlarge"      = 0
    "g6.xlarge"        = 0
  }
  pools = {
    for p in var.pools : p.name => merge(p, {
      efa_count = coalesce(p.efa_interfaces, lookup(local.efa_interfaces_by_type, p.instance_type, 0))
    })
  }
  efa_pools = { for name, p in local.pools : name => p if p.efa_count > 0 }
}

resource "aws_security_group" "efa" {
  name        = "${var.cluster_name}-efa"
  description = "EFA: all traffic between GPU nodes of this cluster, nothing else"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.cluster_name}-efa" })
}

resource "aws_vpc_security_group_ingress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  description                  = "EFA: all traffic from members of this group"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.efa.id
}

resource "aws_vpc_security_group_egress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  description                  = "EFA: all traffic to members of this group"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.efa.id
}

resource "aws_placement_group" "pool" {
  for_each = local.efa_pools
  name     = "${var.cluster_name}-${each.key}"
  strategy = "cluster"
  tags     = var.tags
}

resource "aws_launch_template" "pool" {
  for_each    = local.pools
  name_prefix = "${var.cluster_name}-${each.key}-"

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required" # IMDSv2 only
    http_put_response_hop_limit = 1          # pods use Pod Identity, never the node role
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = each.value.root_volume_gib
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  # Card 0 carries the primary interface (EFA + IP); the other cards are EFA-only.
  dynamic "network_interfaces" {
    for_each = range(max(each.value.efa_count, 1))
    content {
      network_card_index    = network_interfaces.value
      device_index          = network_interfaces.value == 0 ? 0 : 1
      interface_type        = each.value.efa_count == 0 ? null : (network_interfaces.value == 0 ? "efa" : "efa-only")
      delete_on_termination = true
      security_groups = each.value.efa_count == 0 ? [var.cluster_security_group_id] : [
        var.cluster_security_group_id, aws_security_group.efa.id
      ]
    }
  }

  dynamic "placement" {
    for_each = each.value.efa_count > 0 ? [1] : []
    content {
      group_name = aws_placement_group.pool[each.key].name
    }
  }

  dynamic "capacity_reservation_specification" {
    for_each = each.value.capacity_reservation_id == null ? [] : [1]
    content {
      capacity_reservation_target {
        capacity_reservation_id = each.value.capacity_reservation_id
      }
    }
  }

  dynamic "instance_market_options" {
    for_each = each.value.market_type == "capacity-block" ? [1] : []
    content {
      market_type = "capacity-block"
    }
  }

  user_data = base64encode(<<-EOT
    MIME-Version: 1.0
    Content-Type: multipart/mixed; boundary="BOUNDARY"

    --BOUNDARY
    Content-Type: application/node.eks.aws

    apiVersion: node.eks.aws/v1alpha1
    kind: NodeConfig
    spec:
      instance:
        localStorage:
          strategy: RAID0
    --BOUNDARY--
  EOT
  )

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.cluster_name}-${each.key}" })
  }
  tags = var.tags
}

resource "aws_eks_node_group" "pool" {
  for_each        = local.pools
  cluster_name    = var.cluster_name
  node_group_name = each.key
  node_role_arn   = var.node_role_arn
  subnet_ids      = [var.subnet_id]
  instance_types  = [each.value.instance_type]
  ami_type        = "AL2023_x86_64_NVIDIA"
  capacity_type   = each.value.market_type == "capacity-block" ? "CAPACITY_BLOCK" : "ON_DEMAND"

  scaling_config {
    min_size     = each.value.min_size
    max_size     = each.value.max_size
    desired_size = coalesce(each.value.desired_size, each.value.min_size)
  }

  launch_template {
    id      = aws_launch_template.pool[each.key].id
    version = aws_launch_template.pool[each.key].latest_version
  }

  labels = merge(each.value.labels, { "cluster.ai/pool" = each.key })

  dynamic "taint" {
    for_each = each.value.taints
    content {
      key    = taint.value.key
      value  = taint.value.value
      effect = taint.value.effect
    }
  }

  # The Ray autoscaler and Cluster Autoscaler own the size once the group exists.
  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  tags = merge(var.tags, {
    "k8s.io/cluster-autoscaler/enabled"             = "true"
    "k8s.io/cluster-autoscaler/${var.cluster_name}" = "owned"
  })
}
