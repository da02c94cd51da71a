"""ModelDeployments + pool inventories → ``ClusterSpec`` → ``Plan`` on real node names (pure, solver injected).

A ModelDeployment that cannot be planned (malformed, unknown model) is left
out with a message for its ``Planned`` condition; the others still plan.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from hetsched.catalog.types import Vendor
from hetsched.errors import HetschedError
from hetsched.operator.inventory import PoolInventory
from hetsched.operator.kvtransfer import runs_on, transfer_problem, vendor_problem
from hetsched.operator.resources import SERVICE_NAME_PATTERN, ModelDeploymentSpec
from hetsched.optimizer.plan import NodePlan, Plan
from hetsched.optimizer.spec import (SLO, BucketSpec, ClusterSpec, Disaggregation, ModelSpec, PoolSpec, Role,
                                    WorkloadSpec)
from hetsched.optimizer.spec import ObjectiveSpec as PlannedObjective
from hetsched.specs.durations import parse_duration_s
from hetsched.specs.hf import parse_hf_config
from hetsched.specs.registry import load_model
from hetsched.specs.wire import DEFAULT_OBJECTIVE

Solver = Callable[[ClusterSpec, Plan | None], Plan]
"""Solves a cluster spec, given the plan in force (for the churn penalty)."""


@dataclass(frozen=True)
class ModelDeploymentRef:
    """A parsed ModelDeployment with what the reconciler needs from its metadata."""

    namespace: str
    name: str
    uid: str
    generation: int | None
    spec: ModelDeploymentSpec

    @property
    def key(self) -> str:
        """The model's name in the ClusterSpec and the Plan: ``<namespace>/<name>``."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Rejected:
    """A ModelDeployment left out of planning, and why."""

    namespace: str
    name: str
    generation: int | None
    reason: str
    message: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PlanningInput:
    spec: ClusterSpec | None
    models: dict[str, ModelDeploymentRef]
    rejected: list[Rejected] = field(default_factory=list)
    problem: str | None = None


def spec_problems(exc: ValidationError) -> str:
    """Every problem pydantic found in a custom resource's spec, each with its path (``spec.slo.ttft: ...``)."""
    return "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())


def _name_problem(name: str) -> str:
    """Why ``name`` cannot name the model's Service (an RFC 1035 label), and a name that can."""
    fixed = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    fixed = (fixed if fixed[:1].isalpha() else f"m-{fixed}")[:63].rstrip("-")
    return (f"metadata.name {name!r} cannot name the model's Service: use at most 63 lowercase letters, digits and "
            f"'-', starting with a letter, without dots (e.g. {fixed!r})")


def parse_model_deployment(obj: Mapping[str, Any]) -> ModelDeploymentRef | Rejected:
    """Parse and check one ModelDeployment; a problem becomes a ``Rejected`` with a message naming the field."""
    meta = obj.get("metadata") or {}
    namespace, name, generation = meta.get("namespace", "default"), meta.get("name", ""), meta.get("generation")
    if not re.fullmatch(SERVICE_NAME_PATTERN, name):
        return Rejected(namespace, name, generation, "InvalidName", _name_problem(name))
    try:
        spec = ModelDeploymentSpec.model_validate(obj.get("spec") or {})
    except ValidationError as exc:
        return Rejected(namespace, name, generation, "InvalidSpec", spec_problems(exc))
    problem = transfer_problem(spec)
    if problem is not None:
        return Rejected(namespace, name, generation, "InvalidSpec", problem)
    try:
        for where, duration in (("spec.slo.ttft", spec.slo.ttft), ("spec.slo.tpot", spec.slo.tpot)):
            parse_duration_s(duration, field=where)
    except HetschedError as exc:
        return Rejected(namespace, name, generation, "InvalidSpec", str(exc))
    try:
        if spec.config is not None:
            parse_hf_config(spec.config, name=spec.model, source="spec.config")
        else:
            load_model(spec.model)
        _workload(spec)
    except HetschedError as exc:
        field_name = "spec.config" if spec.config is not None else "spec.model"
        hint = "" if spec.config is not None else "; give the Hugging Face config inline in spec.config"
        return Rejected(namespace, name, generation, "UnknownModel", f"{field_name}: {exc}{hint}")
    except ValueError as exc:
        return Rejected(namespace, name, generation, "InvalidSpec", f"spec.workload: {exc}")
    return ModelDeploymentRef(namespace, name, meta.get("uid", ""), generation, spec)


def _workload(spec: ModelDeploymentSpec) -> WorkloadSpec:
    load = spec.workload
    if load.buckets:
        return WorkloadSpec(rate_rps=load.rate_rps, buckets=[
            BucketSpec(name=b.name, input_tokens=b.input_tokens, output_tokens=b.output_tokens, share=b.share)
            for b in load.buckets])
    if load.input_tokens is None or load.output_tokens is None:
        raise ValueError("give inputTokens and outputTokens, or buckets")
    return WorkloadSpec(rate_rps=load.rate_rps, input_tokens=load.input_tokens, output_tokens=load.output_tokens)


def allowed_pools(model: ModelDeploymentRef, vendors: Mapping[str, Vendor | None]) -> list[str] | None:
    """The pools (of ``vendors``: usable pool → its GPUs' vendor) the optimizer may place the model on; None: any.

    Those of ``spec.allowedPools`` that exist, and for a disaggregated model only those whose GPUs its KV
    connector runs on: both roles' engines must speak it. An ``auto`` model keeps them all (see
    :func:`planned_mode`).
    """
    spec = model.spec
    allowed = [p for p in spec.allowed_pools if p in vendors] if spec.allowed_pools is not None else None
    if spec.disaggregation is not Disaggregation.PREFILL_DECODE:
        return allowed
    fitting = [p for p in (vendors if allowed is None else allowed) if runs_on(spec, vendors[p])]
    return None if allowed is None and len(fitting) == len(vendors) else fitting


def planned_mode(model: ModelDeploymentRef, allowed: Sequence[str] | None,
                 vendors: Mapping[str, Vendor | None]) -> Disaggregation:
    """How the optimizer may serve the model: an ``auto`` model on a pool its KV connector does not run on is
    planned unified, since a disaggregated plan could not use every pool a unified one may."""
    spec = model.spec
    if spec.disaggregation is not Disaggregation.AUTO:
        return spec.disaggregation
    pools = vendors if allowed is None else allowed
    return spec.disaggregation if all(runs_on(spec, vendors[p]) for p in pools) else Disaggregation.UNIFIED


def as_planned(spec: ClusterSpec, plan: Plan | None) -> ClusterSpec:
    """``spec`` with each ``auto`` model served as ``plan`` chose: unified when its replica groups are, else
    disaggregated (also with no plan or no groups: such a model is left as planned, not autoscaled)."""
    chosen = {m.name: {g.role for g in m.replicas} for m in plan.models} if plan is not None else {}
    models = [m.model_copy(update={"disaggregation": Disaggregation.UNIFIED if chosen.get(m.name) == {Role.UNIFIED}
                                   else Disaggregation.PREFILL_DECODE})
              if m.disaggregation is Disaggregation.AUTO else m for m in spec.models]
    return spec.model_copy(update={"models": models})


def model_spec(model: ModelDeploymentRef, allowed: Sequence[str] | None, disaggregation: Disaggregation) -> ModelSpec:
    """The optimizer's view of one ModelDeployment, on the ``allowed`` pools (None: any), served as
    ``disaggregation`` (:func:`planned_mode`)."""
    spec = model.spec
    slo = SLO(ttft_ms=parse_duration_s(spec.slo.ttft, field="spec.slo.ttft") * 1e3,
              tpot_ms=parse_duration_s(spec.slo.tpot, field="spec.slo.tpot") * 1e3,
              percentile=spec.slo.percentile, max_failure_rate=spec.slo.max_failure_rate)
    return ModelSpec(
        name=model.key, model=spec.model, config=spec.config,
        quantization=spec.quantization.value if spec.quantization else None,
        slo=slo, objectives=_planned_objectives(spec, slo),
        workload=_workload(spec), min_replicas=spec.scaling.min_replicas,
        spread_across_nodes=spec.scaling.spread_across_nodes,
        allowed_pools=list(allowed) if allowed is not None else None,
        disaggregation=disaggregation,
        max_tp=spec.max_tp, attention_backend=spec.engine.attention_backend)


def _planned_objectives(spec: ModelDeploymentSpec, slo: SLO) -> list[PlannedObjective]:
    """The classes the plan sizes separately: those with a ``demandShare``, each at its SLO, and the default class
    at the model's with the rest of the rate; none when no objective says what share of the demand it is."""
    shared = [(i, o) for i, o in enumerate(spec.objectives) if o.demand_share is not None]
    if not shared:
        return []
    planned = []
    for i, o in shared:
        assert o.demand_share is not None
        own = slo if o.slo is None else slo.model_copy(update={
            "ttft_ms": parse_duration_s(o.slo.ttft, field=f"spec.objectives[{i}].slo.ttft") * 1e3,
            "tpot_ms": parse_duration_s(o.slo.tpot, field=f"spec.objectives[{i}].slo.tpot") * 1e3})
        planned.append(PlannedObjective(name=o.name, demand_share=o.demand_share, slo=own, best_effort=o.best_effort))
    rest = 1.0 - sum(o.demand_share for o in planned)
    if rest > 1e-9:
        planned.append(PlannedObjective(name=DEFAULT_OBJECTIVE, demand_share=rest, slo=slo))
    return planned


def pool_spec(pool: PoolInventory) -> PoolSpec | None:
    """The optimizer's view of one pool, or None when it has no usable node."""
    nodes = pool.usable_nodes
    if pool.problem or not nodes or pool.status.accelerator is None:
        return None
    return PoolSpec(name=pool.name, accelerator=pool.status.accelerator, nodes=len(nodes),
                    gpus_per_node=min(n.gpus for n in nodes), price_per_hour=pool.spec.price_per_hour,
                    partition_allowed=pool.spec.may_partition and pool.status.mig_capable,
                    max_gpus=pool.spec.max_gpus)


def planning_input(deployments: Sequence[Mapping[str, Any]], pools: Sequence[PoolInventory], *,
                   name: str = "cluster", namespaces: Collection[str] = ()) -> PlanningInput:
    """Everything a solve needs, plus the ModelDeployments that were left out and why.

    With ``namespaces``, the operator may create engines in those only (its namespaced RBAC): a ModelDeployment
    elsewhere is left out with a message saying so.
    """
    parsed = [parse_model_deployment(d) for d in deployments]
    rejected = [m for m in parsed if isinstance(m, Rejected)]
    models: dict[str, ModelDeploymentRef] = {}
    for model in (m for m in parsed if isinstance(m, ModelDeploymentRef)):
        if namespaces and model.namespace not in namespaces:
            rejected.append(Rejected(model.namespace, model.name, model.generation, "NamespaceNotServed",
                                     f"this operator creates engines only in {', '.join(sorted(namespaces))} (its "
                                     f"--serve-namespace, the chart's rbac.namespaces); create the ModelDeployment "
                                     f"there, or add {model.namespace}"))
        else:
            models[model.key] = model
    pool_specs = [p for p in (pool_spec(pool) for pool in pools) if p is not None]
    if not pool_specs:
        return PlanningInput(None, models, rejected, "no AcceleratorPool has usable nodes")
    names = [p.name for p in pool_specs]
    vendors = {p.name: p.vendor for p in pools if p.name in names}
    usable: dict[str, ModelDeploymentRef] = {}
    placeable: list[ModelSpec] = []
    for key, model in sorted(models.items()):
        if model.spec.allowed_pools is not None and not any(p in names for p in model.spec.allowed_pools):
            rejected.append(Rejected(model.namespace, model.name, model.generation, "NoAllowedPool",
                                     f"spec.allowedPools {model.spec.allowed_pools} name no usable pool; "
                                     f"usable pools are {names}"))
            continue
        allowed = allowed_pools(model, vendors)
        if allowed == []:
            candidates = model.spec.allowed_pools if model.spec.allowed_pools is not None else names
            rejected.append(Rejected(model.namespace, model.name, model.generation, "ConnectorUnsupported",
                                     vendor_problem(model.spec, {p: vendors[p] for p in candidates if p in vendors})))
            continue
        usable[key] = model
        placeable.append(model_spec(model, allowed, planned_mode(model, allowed, vendors)))
    if not usable:
        return PlanningInput(None, usable, rejected, "no ModelDeployment to plan")
    spec = ClusterSpec(name=name, pools=pool_specs, models=placeable)
    return PlanningInput(spec, usable, rejected)


def bind_nodes(plan: Plan, pools: Sequence[PoolInventory]) -> Plan:
    """The plan with its node names (``<pool>-<k>``) replaced by the pool's k-th usable node."""
    real = {p.name: [n.name for n in p.usable_nodes] for p in pools}
    nodes: list[NodePlan] = []
    for node in plan.nodes:
        prefix = f"{node.pool}-"
        names = real.get(node.pool, [])
        if node.name.startswith(prefix) and node.name[len(prefix):].isdigit() and int(node.name[len(prefix):]) < len(names):
            node = node.model_copy(update={"name": names[int(node.name[len(prefix):])]})
        nodes.append(node)
    return plan.model_copy(update={"nodes": nodes})


def plan_hash(plan: Plan) -> str:
    """A digest of what the plan places where: approval of a manual plan holds for this digest only."""
    body = {"replicas": sorted([*k, v] for k, v in plan.replica_counts().items()),
            "nodes": [n.model_dump(mode="json") for n in plan.nodes],
            "mig": {k: [g.model_dump(mode="json") for g in v] for k, v in sorted(plan.mig_configs.items())},
            "partitions": {k: [g.model_dump(mode="json") for g in v] for k, v in sorted(plan.partition_profiles.items())}}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]
