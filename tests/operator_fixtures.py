"""Hand-built nodes, pools, ModelDeployments and Plans shared by the operator tests."""

from __future__ import annotations

import math
from typing import Any

from hetsched.optimizer.plan import (
    Explanation,
    GpuMode,
    GpuPlan,
    ModelPlan,
    NodePlan,
    PartitionInstance,
    Plan,
    PlanStatus,
    PoolUsage,
    ReplicaGroup,
    ReplicaPlacement,
    SolverStats,
)
from hetsched.optimizer.spec import ClusterSpec, Role
from hetsched.partition.types import MigDeviceGroup


def node(name: str, product: str = "NVIDIA-H100-80GB-HBM3", gpus: int = 8, **labels: str) -> dict[str, Any]:
    base = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": "81559",
            "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed", "kubernetes.io/hostname": name}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {**base, **labels}},
            "status": {"capacity": {"nvidia.com/gpu": str(gpus)}}}


def amd_node(name: str) -> dict[str, Any]:
    labels = {"amd.com/gpu.product-name": "AMD_Instinct_MI300X", "amd.com/gpu.vram": "192G",
              "amd.com/gpu.compute-memory-partition": "spx_nps1", "kubernetes.io/hostname": name}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"capacity": {"amd.com/gpu": "8"}}}


def pool(name: str, product: str = "NVIDIA-H100-80GB-HBM3", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "hetsched.io/v1alpha1", "kind": "AcceleratorPool", "metadata": {"name": name},
            "spec": {"nodeSelector": {"nvidia.com/gpu.product": product}, **spec}}


def model_deployment(name: str, *, namespace: str = "serving", rate: float = 10.0, model: str = "llama-3.1-8b",
                     uid: str | None = None, **spec: Any) -> dict[str, Any]:
    body = {"model": model, "engine": {"image": "vllm/vllm-openai:v0.11.0", "maxNumSeqs": 128},
            "slo": {"ttft": "500ms", "tpot": "50ms"},
            "workload": {"rateRps": rate, "inputTokens": 512, "outputTokens": 128}, **spec}
    return {"apiVersion": "hetsched.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}", "generation": 1},
            "spec": body}


def _stats() -> SolverStats:
    return SolverStats(status=PlanStatus.OPTIMAL, message="ok", objective=0.0, bound=0.0, gap=0.0, time_s=0.0,
                       variables=0, integer_variables=0, constraints=0)


def make_plan(groups: list[ReplicaGroup], nodes: list[NodePlan] | None = None,
              mig_configs: dict[str, list[MigDeviceGroup]] | None = None) -> Plan:
    """A plan holding ``groups``; whole-GPU groups are packed onto ``<pool>-<k>`` nodes, 8 GPUs each."""
    by_model: dict[str, list[ReplicaGroup]] = {}
    for g in groups:
        by_model.setdefault(g.model, []).append(g)
    if nodes is None:
        nodes = []
        for pool_name in sorted({g.pool for g in groups}):
            placements = [(g, k) for g in groups if g.pool == pool_name for k in range(g.replicas)]
            per_node: list[list[ReplicaPlacement]] = [[]]
            used = 0
            for g, _ in placements:
                if used + g.tp > 8:
                    per_node.append([])
                    used = 0
                per_node[-1].append(ReplicaPlacement(model=g.model, role=g.role, device=g.device, tp=g.tp,
                                                     gpus=list(range(used, used + g.tp))))
                used += g.tp
            for k, replicas in enumerate(per_node):
                if replicas:
                    nodes.append(NodePlan(name=f"{pool_name}-{k}", pool=pool_name, accelerator=groups[0].accelerator,
                                          gpus=[GpuPlan(index=i, mode=GpuMode.WHOLE) for i in range(8)],
                                          replicas=replicas))
    cost = sum(g.cost_per_hour for g in groups)
    return Plan(name="cluster", status=PlanStatus.OPTIMAL, cost_per_hour=cost,
                models=[ModelPlan(name=m, demand_rps=1.0, replicas=gs, split=[], cost_per_hour=sum(g.cost_per_hour for g in gs),
                                  headroom=0.1) for m, gs in by_model.items()],
                nodes=nodes, pools=[PoolUsage(pool="h100", accelerator="h100-sxm", price_per_hour=2.0, gpus_total=8,
                                              gpus_used=1, gpus_mig=0, cost_per_hour=cost)],
                cost_by_model={m: sum(g.cost_per_hour for g in gs) for m, gs in by_model.items()},
                mig_configs=mig_configs or {}, solver=_stats(), explanation=Explanation())


def group(model: str, replicas: int, *, pool: str = "h100", accelerator: str = "h100-sxm", profile: str | None = None,
          tp: int = 1, role: Role = Role.UNIFIED) -> ReplicaGroup:
    device = f"{accelerator}:{profile}" if profile else accelerator
    return ReplicaGroup(model=model, pool=pool, accelerator=accelerator, profile=profile, device=device, tp=tp,
                        role=role, replicas=replicas, gpus_per_replica=tp, capacity_rps=10.0 * replicas,
                        load_rps=5.0, cost_per_hour=2.0 * tp * replicas)


def mig_plan(model: str, *, node_name: str = "h100-0", profile: str = "3g.40gb", count: int = 2) -> Plan:
    """``count`` replicas of ``model`` on MIG instances of GPU 0 of one node, layout config ``hetsched-<...>``."""
    g = group(model, count, profile=profile)
    starts = [0, 4, 0, 0][:count]
    gpu0 = GpuPlan(index=0, mode=GpuMode.MIG, instances=[PartitionInstance(profile=profile, start=s, model=model,
                                                                      role=Role.UNIFIED) for s in starts])
    node_plan = NodePlan(name=node_name, pool="h100", accelerator="h100-sxm",
                         gpus=[gpu0, *(GpuPlan(index=i, mode=GpuMode.IDLE) for i in range(1, 8))],
                         replicas=[ReplicaPlacement(model=model, role=Role.UNIFIED, device=g.device, tp=1, gpus=[0],
                                                    instance_start=s) for s in starts],
                         mig_config="hetsched-2x3g")
    configs = {"hetsched-2x3g": [MigDeviceGroup(devices=[0], mig_enabled=True, mig_devices={profile: count}),
                                 MigDeviceGroup(devices=[1, 2, 3, 4, 5, 6, 7], mig_enabled=False)]}
    return make_plan([g], nodes=[node_plan], mig_configs=configs)


def proportional_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
    """A stand-in solver: one whole GPU of the first allowed pool per 10 req/s (at least minReplicas)."""
    groups = []
    for m in spec.models:
        pools = [p for p in spec.pools if m.allowed_pools is None or p.name in m.allowed_pools]
        p = pools[0]
        replicas = max(m.min_replicas, math.ceil(m.workload.rate_rps / 10.0))
        groups.append(group(m.name, replicas, pool=p.name, accelerator=p.accelerator))
    return make_plan(groups)
