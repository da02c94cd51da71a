"""A plan made one objective at a time, joined back into one plan per model for those who deploy it.

:func:`~hetsched.optimizer.spec.split_objectives` plans each class of a model (``model/objective``) at its own
SLO and share of the rate, so a loose-SLO class may land on cheaper, slower accelerators; the plan itself says
which class went where. The operator deploys replicas per model, not per class (the router's flow control and
``slo`` policy send each class's requests to the endpoints that meet its SLO), so it deploys the joined plan:
each class's replica groups added up per pool, device, TP degree and role.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetsched.optimizer.plan import BucketShare, GpuPlan, ModelPlan, NodePlan, Plan, ReplicaGroup
from hetsched.optimizer.spec import ClusterSpec


def objective_models(spec: ClusterSpec) -> dict[str, str]:
    """Each planned class's name (``model/objective``) → its model's, for the models ``spec`` splits."""
    return {f"{m.name}/{o.name}": m.name for m in spec.models for o in m.objectives if not o.best_effort}


def join_objectives(plan: Plan, owners: Mapping[str, str]) -> Plan:
    """``plan`` with the classes in ``owners`` (see :func:`objective_models`) joined into their models."""
    if not any(m.name in owners for m in plan.models):
        return plan
    parts: dict[str, list[ModelPlan]] = {}
    for m in plan.models:
        parts.setdefault(owners.get(m.name, m.name), []).append(m)
    return plan.model_copy(update={"models": [_joined(name, group) for name, group in parts.items()],
                                   "nodes": [_renamed(node, owners) for node in plan.nodes]})


def _joined(name: str, parts: list[ModelPlan]) -> ModelPlan:
    if len(parts) == 1 and parts[0].name == name:
        return parts[0]
    groups: dict[tuple[str, str, int, str], ReplicaGroup] = {}
    for g in (g for part in parts for g in part.replicas):
        key = (g.pool, g.device, g.tp, str(g.role))
        old = groups.get(key)
        groups[key] = g.model_copy(update={"model": name}) if old is None else old.model_copy(update={
            "replicas": old.replicas + g.replicas, "capacity_rps": old.capacity_rps + g.capacity_rps,
            "load_rps": old.load_rps + g.load_rps, "cost_per_hour": old.cost_per_hour + g.cost_per_hour})
    split: list[BucketShare] = [s.model_copy(update={"model": name}) for part in parts for s in part.split]
    loaded = [part.headroom for part in parts if part.demand_rps > 0]
    return ModelPlan(name=name, demand_rps=sum(part.demand_rps for part in parts), replicas=list(groups.values()),
                     split=split, cost_per_hour=sum(part.cost_per_hour for part in parts),
                     headroom=min(loaded) if loaded else 0.0)


def _renamed(node: NodePlan, owners: Mapping[str, str]) -> NodePlan:
    def owner(name: str | None) -> str | None:
        return None if name is None else owners.get(name, name)

    gpus: list[GpuPlan] = [gpu.model_copy(update={
        "model": owner(gpu.model),
        "instances": [i.model_copy(update={"model": owner(i.model)}) for i in gpu.instances]}) for gpu in node.gpus]
    return node.model_copy(update={"gpus": gpus,
                                   "replicas": [r.model_copy(update={"model": owner(r.model)}) for r in node.replicas]})
