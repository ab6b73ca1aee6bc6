# GPU capacity, one Karpenter NodePool + EC2NodeClass per serving pool. Karpenter launches a
# node when a Ray worker pod of the pool is Pending and removes it once empty, so a pool with
# no replicas costs no GPU node (scale to zero). Multi-node tensor/pipeline parallelism and KV
# transfer need EFA: one EFA interface per network card, a security group that allows all
# traffic to and from itself, and a cluster placement group. The instance-store NVMe drives
# become one RAID0 volume for the model cache, so weights load from local disk. Capacity
# Reservations (On-Demand or Capacity Blocks for ML) are selected per pool and used first.

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
  gpus_by_type = {
    "p6-b200.48xlarge" = 8
    "p6-b300.48xlarge" = 8
    "p5en.48xlarge"    = 8
    "p5.48xlarge"      = 8
    "p4d.24xlarge"     = 8
    "g6e.xlarge"       = 1
    "g6e.2xlarge"      = 1
    "g6.xlarge"        = 1
  }
  pools = {
    for p in var.pools : p.name => merge(p, {
      efa_count = coalesce(p.efa_interfaces, lookup(local.efa_interfaces_by_type, p.instance_types[0], 0))
      gpus      = coalesce(p.gpus_per_node, lookup(local.gpus_by_type, p.instance_types[0], 8))
    })
  }
  efa_pools = { for name, p in local.pools : name => p if p.efa_count > 0 }
}

resource "aws_security_group" "efa" {
  # checkov:skip=CKV2_AWS_5:Attached by Karpenter: the EC2NodeClass below selects it by id for every EFA interface, which checkov cannot see through the Kubernetes manifest.
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

resource "kubernetes_manifest" "node_class" {
  for_each = local.pools
  manifest = {
    apiVersion = "karpenter.k8s.aws/v1"
    kind       = "EC2NodeClass"
    metadata   = { name = each.key }
    spec = merge(
      {
        role = var.node_role_name
        # Karpenter picks the NVIDIA variant of AL2023 for GPU instance types.
        amiSelectorTerms    = [{ alias = var.ami_alias }]
        subnetSelectorTerms = [{ id = var.subnet_id }]
        securityGroupSelectorTerms = concat(
          [{ id = var.cluster_security_group_id }],
          each.value.efa_count > 0 ? [{ id = aws_security_group.efa.id }] : []
        )
        metadataOptions = {
          httpEndpoint            = "enabled"
          httpTokens              = "required" # IMDSv2 only
          httpPutResponseHopLimit = 1          # pods use Pod Identity, never the node role
        }
        blockDeviceMappings = [{
          deviceName = "/dev/xvda"
          ebs = {
            volumeSize          = "${each.value.root_volume_gib}Gi"
            volumeType          = "gp3"
            encrypted           = true
            kmsKeyID            = var.kms_key_arn
            deleteOnTermination = true
          }
        }]
        # Instance-store NVMe as one RAID0 volume at /mnt/k8s-disks/0: the model cache.
        instanceStorePolicy = "RAID0"
        tags                = merge(var.tags, { Name = "${var.cluster_name}-${each.key}" })
      },
      # Card 0 carries the primary ENA interface plus an EFA-only device; the other cards are
      # EFA-only.
      each.value.efa_count == 0 ? {} : {
        networkInterfaces = concat(
          [
            { networkCardIndex = 0, deviceIndex = 0, interfaceType = "interface" },
            { networkCardIndex = 0, deviceIndex = 1, interfaceType = "efa-only" },
          ],
          [for card in range(1, each.value.efa_count) : { networkCardIndex = card, deviceIndex = 0, interfaceType = "efa-only" }]
        )
        placementGroupSelector = { name = aws_placement_group.pool[each.key].name }
      },
      length(each.value.capacity_reservation_ids) == 0 ? {} : {
        capacityReservationSelectorTerms = [for id in each.value.capacity_reservation_ids : { id = id }]
      }
    )
  }
}

resource "kubernetes_manifest" "node_pool" {
  for_each = local.pools
  manifest = {
    apiVersion = "karpenter.sh/v1"
    kind       = "NodePool"
    metadata   = { name = each.key }
    spec = {
      template = {
        # The pool's Ray worker pods select this label and tolerate these taints.
        metadata = { labels = merge(each.value.labels, { "cluster.ai/pool" = each.key }) }
        spec = {
          nodeClassRef = { group = "karpenter.k8s.aws", kind = "EC2NodeClass", name = each.key }
          requirements = [
            { key = "node.kubernetes.io/instance-type", operator = "In", values = each.value.instance_types },
            # "reserved" first: Karpenter prefers reservations (ODCR, Capacity Blocks) when listed.
            { key = "karpenter.sh/capacity-type", operator = "In", values = each.value.capacity_types },
          ]
          taints = each.value.taints
          # A GPU node with a loaded model is never recycled on a timer.
          expireAfter = "Never"
        }
      }
      # Only empty nodes go (never a running replica for bin-packing): scale to zero when the
      # pool has no replicas, one node at a time.
      disruption = {
        consolidationPolicy = "WhenEmpty"
        consolidateAfter    = each.value.consolidate_after
        budgets             = [{ nodes = "1" }]
      }
      limits = { "nvidia.com/gpu" = tostring(each.value.max_nodes * each.value.gpus) }
    }
  }
  depends_on = [kubernetes_manifest.node_class]
}

# The AL2023 NVIDIA AMI has the driver; pods see GPUs and EFA devices through these plugins.
resource "helm_release" "nvidia_device_plugin" {
  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = var.nvidia_device_plugin_version
  namespace  = "kube-system"
  values = [yamlencode({
    tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
    affinity = { nodeAffinity = { requiredDuringSchedulingIgnoredDuringExecution = { nodeSelectorTerms = [
      { matchExpressions = [{ key = "cluster.ai/pool", operator = "In", values = keys(local.pools) }] }
    ] } } }
  })]
}

resource "helm_release" "efa_device_plugin" {
  count      = length(local.efa_pools) > 0 ? 1 : 0
  name       = "aws-efa-k8s-device-plugin"
  repository = "https://aws.github.io/eks-charts"
  chart      = "aws-efa-k8s-device-plugin"
  version    = var.efa_device_plugin_version
  namespace  = "kube-system"
  values = [yamlencode({
    tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
    affinity = { nodeAffinity = { requiredDuringSchedulingIgnoredDuringExecution = { nodeSelectorTerms = [
      { matchExpressions = [{ key = "cluster.ai/pool", operator = "In", values = keys(local.efa_pools) }] }
    ] } } }
  })]
}
