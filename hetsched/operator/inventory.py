"""Node labels → pool inventory (pure).

NVIDIA GPU Feature Discovery and the AMD node labeller describe each GPU
node with labels; the catalog maps a product label to an accelerator. A
product the catalog does not know is reported in the pool's status, never
guessed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetsched.catalog import Accelerator, Catalog
from hetsched.catalog.types import PRODUCT_LABELS, Vendor
from hetsched.operator.resources import (
    AcceleratorPoolSpec,
    AcceleratorPoolStatus,
    ConditionStatus,
    NodeInventory,
)
from hetsched.partition.labels import UNUSABLE_MIG_STRATEGIES, AmdNaming, PartitionLabel


class NodeLabel(PartitionLabel):
    """Label keys read from nodes; the partitioning ones (written too) come from :class:`PartitionLabel`."""

    NVIDIA_PRODUCT = PRODUCT_LABELS[Vendor.NVIDIA]
    NVIDIA_COUNT = "nvidia.com/gpu.count"
    NVIDIA_MEMORY = "nvidia.com/gpu.memory"
    AMD_PRODUCT = PRODUCT_LABELS[Vendor.AMD]
    AMD_VRAM = "amd.com/gpu.vram"
    HOSTNAME = "kubernetes.io/hostname"


@dataclass(frozen=True)
class PoolInventory:
    """A pool's spec with the nodes that match it, as the planner and reconciler need them."""

    name: str
    spec: AcceleratorPoolSpec
    status: AcceleratorPoolStatus
    problem: str | None
    vendor: Vendor | None = None
    split_off: str | None = None
    """Why GPUs the spec lets be split stay whole: the operator has no ConfigMap for their partitioning manager."""

    @property
    def amd_per_mode(self) -> bool:
        """Whether the AMD device plugin counts this pool's GPUs per partition mode (``mixed`` naming)."""
        return any(n.mig_strategy == AmdNaming.MIXED for n in self.usable_nodes)

    @property
    def usable_nodes(self) -> list[NodeInventory]:
        """Schedulable nodes of the pool's accelerator, sorted by name (the plan's node index order)."""
        return sorted((n for n in self.status.inventory if _whole(n, self.status.accelerator)), key=lambda n: n.name)

    @property
    def sliced_nodes(self) -> list[str]:
        """Nodes of the pool's accelerator left out because MIG ``single`` shows their slices as whole GPUs."""
        return sorted(n.name for n in self.status.inventory if n.schedulable and n.accelerator is not None
                      and n.accelerator == self.status.accelerator and mig_sliced(n))


def mig_sliced(node: NodeInventory) -> bool:
    """Whether the node runs MIG with the ``single`` strategy: GPU Feature Discovery suffixes the product
    (``-MIG-1g.10gb``) and each ``nvidia.com/gpu`` is a slice, so a pod asking for one GPU gets a slice."""
    return node.product is not None and "-MIG-" in node.product


def _whole(node: NodeInventory, accelerator: str | None) -> bool:
    """Whether the planner may count the node's GPUs as whole GPUs of the pool's accelerator."""
    return (node.schedulable and node.accelerator is not None and node.accelerator == accelerator and node.gpus > 0
            and not mig_sliced(node))


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    match = re.match(r"^\d+", value)
    return int(match.group()) if match else None


def _vram_mib(value: str | None) -> int | None:
    """AMD ``vram`` label such as ``192G`` or ``196592M`` in MiB."""
    if value is None:
        return None
    match = re.fullmatch(r"(\d+)([GMT]?)i?B?", value.strip())
    if not match:
        return None
    return int(match.group(1)) * {"": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]


def describe_node(node: Mapping[str, Any], catalog: Catalog) -> NodeInventory:
    """What a node's labels and capacity say about its accelerators."""
    meta = node.get("metadata", {})
    labels: dict[str, str] = meta.get("labels") or {}
    capacity: dict[str, str] = (node.get("status") or {}).get("capacity") or {}
    schedulable = not (node.get("spec") or {}).get("unschedulable", False)
    if NodeLabel.NVIDIA_PRODUCT in labels:
        product = labels[NodeLabel.NVIDIA_PRODUCT]
        accelerator = catalog.by_product(product)
        gpus = _int(labels.get(NodeLabel.NVIDIA_COUNT)) or _int(capacity.get("nvidia.com/gpu")) or 0
        return NodeInventory(
            name=meta["name"], accelerator=accelerator.id if accelerator else None, product=product, gpus=gpus,
            memory_mib=_int(labels.get(NodeLabel.NVIDIA_MEMORY)),
            mig_capable=labels.get(NodeLabel.MIG_CAPABLE, "false").lower() == "true"
            and labels.get(NodeLabel.MIG_STRATEGY) not in UNUSABLE_MIG_STRATEGIES,
            mig_strategy=labels.get(NodeLabel.MIG_STRATEGY), mig_config=labels.get(NodeLabel.MIG_CONFIG),
            mig_config_state=labels.get(NodeLabel.MIG_CONFIG_STATE), schedulable=schedulable)
    if NodeLabel.AMD_PRODUCT in labels:
        product = labels[NodeLabel.AMD_PRODUCT]
        accelerator = catalog.by_product(product)
        gpus = _amd_gpus(capacity, labels, accelerator)
        supported = [labels[k].lower() == "true" for k in NodeLabel.AMD_PARTITIONING_SUPPORTED if k in labels]
        return NodeInventory(
            name=meta["name"], accelerator=accelerator.id if accelerator else None, product=product, gpus=gpus,
            memory_mib=_vram_mib(labels.get(NodeLabel.AMD_VRAM)), partition=labels.get(NodeLabel.AMD_PARTITION),
            mig_capable=all(supported) and accelerator is not None and accelerator.amd_partitions is not None,
            mig_strategy=_amd_naming(capacity, accelerator), schedulable=schedulable)
    return NodeInventory(name=meta["name"], schedulable=schedulable)


def _amd_naming(capacity: Mapping[str, str], accelerator: Accelerator | None) -> str | None:
    """The AMD device plugin's resource naming on a node: ``mixed`` when it counts GPUs per partition mode
    (``amd.com/spx_nps1``, ``amd.com/cpx_nps1``), ``single`` when all are ``amd.com/gpu``, None when neither shows."""
    modes = set(accelerator.amd_partitions.valid_modes()) if accelerator and accelerator.amd_partitions else set()
    if any(key.removeprefix("amd.com/") in modes for key in capacity):
        return AmdNaming.MIXED
    return AmdNaming.SINGLE if "amd.com/gpu" in capacity else None


def _amd_gpus(capacity: Mapping[str, str], labels: Mapping[str, str], accelerator: Accelerator | None) -> int:
    """Physical GPUs of an AMD node. The device plugin counts partitions as devices: per mode (``amd.com/cpx_nps1``,
    whole GPUs as ``amd.com/spx_nps1``: naming ``mixed``, which never uses ``amd.com/gpu``, so a count there is
    stale) or all as ``amd.com/gpu`` (naming ``single``, where the node labeller names the mode of a uniformly
    partitioned node); each is divided back by its partitions per GPU."""
    partitions = accelerator.amd_partitions if accelerator else None
    devices = _int(capacity.get("amd.com/gpu")) or _int(labels.get("amd.com/gpu.count")) or 0
    if partitions is None:
        return devices

    def per_gpu(mode: str) -> int:
        return partitions.compute_modes.get(mode.split("_")[0], 1)

    modes = set(partitions.valid_modes())
    by_mode = {key.removeprefix("amd.com/"): _int(value) or 0 for key, value in capacity.items()
               if key.removeprefix("amd.com/") in modes}
    if by_mode:
        return sum(count // per_gpu(mode) for mode, count in by_mode.items())
    mode = labels.get(NodeLabel.AMD_PARTITION)
    return devices // per_gpu(mode) if mode is not None and mode in modes else devices


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


SPLIT_OFF = {Vendor.NVIDIA: "MIG stays off: the operator runs without --mig-configmap",
             Vendor.AMD: "partitions stay off: the operator runs without --dcm-configmap (chart: dcmConfigMap.enabled)"}


def pool_inventory(name: str, spec: AcceleratorPoolSpec, nodes: Sequence[Mapping[str, Any]], catalog: Catalog,
                   *, generation: int | None = None, splitting: Collection[Vendor] = (Vendor.NVIDIA, Vendor.AMD)
                   ) -> PoolInventory:
    """The inventory of one pool: matching nodes, their accelerator, GPUs, MIG state, unknown products. GPUs of a
    vendor not in ``splitting`` are never split (no manager would apply the layout)."""
    members = [describe_node(n, catalog) for n in nodes
               if matches((n.get("metadata") or {}).get("labels") or {}, spec.node_selector)]
    members.sort(key=lambda n: n.name)
    unknown = sorted({n.product for n in members if n.product and n.accelerator is None})
    detected = Counter(n.accelerator for n in members if n.accelerator)
    problem: str | None = None
    accelerator = spec.accelerator
    if accelerator is None:
        if len(detected) == 1:
            accelerator = next(iter(detected))
        elif len(detected) > 1:
            problem = (f"nodes carry several accelerator types {sorted(detected)}; "
                       "set spec.accelerator or narrow spec.nodeSelector")
        elif unknown:
            problem = f"no known accelerator: products {unknown} are not in the catalog; set spec.accelerator"
        else:
            problem = "no node with GPU labels matches spec.nodeSelector"
    elif accelerator not in catalog.accelerators:
        problem = f"spec.accelerator {accelerator!r} is not in the catalog"
    used = [n for n in members if _whole(n, accelerator)]
    memory = [n.memory_mib for n in used if n.memory_mib]
    vendor = catalog.accelerators[accelerator].vendor if accelerator in catalog.accelerators else None
    off = vendor in SPLIT_OFF and vendor not in splitting
    status = AcceleratorPoolStatus(
        accelerator=accelerator, nodes=len(used), gpus=sum(n.gpus for n in used),
        memory_gb=round(min(memory) / 1024, 1) if memory else None,
        mig_capable=bool(used) and all(n.mig_capable for n in used) and not off,
        unknown_products=unknown, inventory=members, observed_generation=generation)
    return PoolInventory(name=name, spec=spec, status=status, problem=problem, vendor=vendor,
                         split_off=SPLIT_OFF[vendor] if off and vendor is not None and spec.may_partition
                         else None)


def pool_condition(pool: PoolInventory) -> tuple[ConditionStatus, str, str]:
    """The pool's ``Ready`` condition: status, reason, message; the message also names each spec field written
    under a name that is going away, whatever the status."""
    status, reason, message = _inventory_condition(pool)
    return status, reason, "; ".join([message, *pool.spec.deprecations])


def _inventory_condition(pool: PoolInventory) -> tuple[ConditionStatus, str, str]:
    if pool.problem:
        return ConditionStatus.FALSE, "InventoryProblem", pool.problem
    sliced = pool.sliced_nodes
    left_out = (f"left out {', '.join(sliced)}: MIG runs there with the single strategy, so each nvidia.com/gpu is "
                "a slice, not a whole GPU (set migStrategy: mixed in the GPU operator, or disable MIG on them)"
                if sliced else "")
    if not pool.usable_nodes:
        return ConditionStatus.FALSE, "NoNodes", (f"no schedulable {pool.status.accelerator} node matches the selector"
                                                  + (f"; {left_out}" if left_out else ""))
    message = f"{pool.status.nodes} nodes, {pool.status.gpus} GPUs of {pool.status.accelerator}"
    if left_out:
        message += f"; {left_out}"
    if pool.status.unknown_products:
        message += f"; ignored unknown products {pool.status.unknown_products}"
    if pool.split_off:
        message += f"; {pool.split_off}"
    blocking = sorted(n.name for n in pool.usable_nodes if n.mig_strategy in UNUSABLE_MIG_STRATEGIES)
    if pool.spec.may_partition and pool.vendor is Vendor.NVIDIA and blocking and not pool.split_off:
        message += (f"; MIG stays off: nvidia.com/mig.strategy on {', '.join(blocking)} is not mixed, "
                    "which MIG plans need (set migStrategy: mixed in the GPU operator)")
    return ConditionStatus.TRUE, "InventoryDiscovered", message
