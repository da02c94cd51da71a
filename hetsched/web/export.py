"""Export a stored plan: custom resources for the operator, the MIG manager's config and the AMD Device Config
Manager's profiles.

The resources are built from the operator's own pydantic types, so what is
exported is what the operator's CRDs accept: one AcceleratorPool per pool,
one ModelDeployment per model, and one PlacementPlan holding the solved plan
(manual approval: a plan made in the planner is reviewed before it applies).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from hetsched.catalog import Catalog
from hetsched.errors import InputError
from hetsched.operator.planning import plan_hash
from hetsched.operator.resources import (
    ACCELERATOR_POOL,
    MODEL_DEPLOYMENT,
    PLACEMENT_PLAN,
    AcceleratorPoolSpec,
    Approval,
    BucketSpec,
    Disaggregation,
    EngineTemplate,
    ModelDeploymentSpec,
    PartitionPolicy,
    PlacementPlanSpec,
    QUANTIZATIONS,
    ScalingSpec,
    SLOSpec,
    WorkloadSpec,
)
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec, ModelSpec, PoolSpec
from hetsched.partition.render import dcm_json, mig_parted_config, node_config_labels
from hetsched.specs.dtypes import DType, parse_dtype
from hetsched.specs.wire import API_VERSION, Label
from hetsched.specs.workload import SLO

def resource_name(name: str) -> str:
    """A Kubernetes object name (DNS label) for a pool, model or plan name."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:63].strip("-")
    return slug or "unnamed"


def plan_resources(spec: ClusterSpec | None, plan: Plan, *, catalog: Catalog, namespace: str,
                   engine_image: str) -> list[dict[str, Any]]:
    """AcceleratorPools, ModelDeployments and the PlacementPlan that reproduce ``plan`` in a cluster.

    Without the spec (a plan stored without its input) only the PlacementPlan can be written.
    """
    placement = _document(PLACEMENT_PLAN.kind, resource_name(plan.name), None, PlacementPlanSpec(
        approval=Approval.MANUAL, approved=False, plan_hash=plan_hash(plan), plan=plan.model_dump(mode="json")))
    if spec is None:
        return [placement]
    shared = {p.accelerator for p in spec.pools if sum(q.accelerator == p.accelerator for q in spec.pools) > 1}
    documents = [_document(ACCELERATOR_POOL.kind, resource_name(p.name), None,
                           _pool_spec(p, catalog, separate=p.accelerator in shared, where=f"pools[{i}]"))
                 for i, p in enumerate(spec.pools)]
    documents += [_document(MODEL_DEPLOYMENT.kind, resource_name(m.name), namespace,
                            _model_spec(m, engine_image=engine_image, where=f"models[{i}]"))
                  for i, m in enumerate(spec.models)]
    return [*documents, placement]


def resources_yaml(documents: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(documents, sort_keys=False, allow_unicode=True)


def mig_parted_and_node_labels_yaml(plan: Plan) -> str:
    """The plan's mig-parted config, followed by a document of the node labels that select it (and the nodes' AMD
    partition profiles): the web planner's MIG export, two YAML documents where
    :func:`hetsched.partition.render.mig_parted_yaml` renders the config alone."""
    return yaml.safe_dump_all([mig_parted_config(plan.mig_configs), {"node-labels": node_config_labels(plan.nodes)}],
                              sort_keys=False)


def dcm_config_json(plan: Plan) -> str:
    """The AMD Device Config Manager's ``config.json``: one profile per partitioned node layout (the node labels
    that select them are in :func:`mig_parted_and_node_labels_yaml`)."""
    return dcm_json(plan.partition_profiles)


def _document(kind: str, name: str, namespace: str | None, spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata,
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True)}


def _pool_spec(pool: PoolSpec, catalog: Catalog, *, separate: bool, where: str) -> AcceleratorPoolSpec:
    if pool.accelerator not in catalog.accelerators:
        raise InputError(f"{pool.accelerator!r} is no catalog accelerator (an opaque type of the cluster file): the "
                         "operator schedules catalog accelerators only; name one for this pool to export it",
                         field=f"{where}.accelerator")
    accelerator = catalog.get(pool.accelerator)
    selector = {accelerator.product_label: accelerator.products[0]} if accelerator.products else {}
    if separate or not selector:
        selector[Label.POOL] = resource_name(pool.name)
    try:
        return AcceleratorPoolSpec(node_selector=selector, accelerator=accelerator.id,
                                   price_per_hour=pool.price_per_hour, max_gpus=pool.max_gpus,
                                   partitioning=PartitionPolicy.ALLOWED if pool.partition_allowed
                                   else PartitionPolicy.DISABLED)
    except ValueError as exc:
        raise InputError(f"cannot be written as an AcceleratorPool: {exc}", field=where) from exc


def _model_spec(model: ModelSpec, *, engine_image: str, where: str) -> ModelDeploymentSpec:
    load = model.workload
    if load.distribution is not None:
        raise InputError("a ModelDeployment takes mean lengths or buckets, not a length distribution",
                         field=f"{where}.workload.distribution")
    buckets = [BucketSpec(name=b.name, input_tokens=b.input_tokens, output_tokens=b.output_tokens, share=b.share)
               for b in load.buckets] if load.buckets else None
    quantization = _quantization(model.quantization, field=f"{where}.quantization") if model.quantization else None
    if model.slo is None:
        raise InputError("a ModelDeployment needs the SLO its replicas serve; this model's capacities came without one",
                         field=f"{where}.slo")
    try:
        return _model_deployment(model, model.slo, engine_image=engine_image, quantization=quantization,
                                 buckets=buckets)
    except ValueError as exc:
        raise InputError(f"cannot be written as a ModelDeployment: {exc}", field=where) from exc


def _quantization(value: str, *, field: str) -> DType:
    """The spec's weight dtype as a ModelDeployment states it; the aliases the optimizer accepts are accepted."""
    dtype = parse_dtype(value, field=field)
    if dtype not in QUANTIZATIONS:
        raise InputError(f"a ModelDeployment serves one of {[q.value for q in QUANTIZATIONS]}, got {value!r}",
                         field=field)
    return dtype


def _model_deployment(model: ModelSpec, slo: SLO, *, engine_image: str, quantization: DType | None,
                      buckets: list[BucketSpec] | None) -> ModelDeploymentSpec:
    load = model.workload
    return ModelDeploymentSpec(
        model=model.source, config=model.config, quantization=quantization,
        engine=EngineTemplate(image=engine_image),
        slo=SLOSpec(ttft=_duration_ms(slo.ttft_ms), tpot=_duration_ms(slo.tpot_ms),
                    percentile=slo.percentile, max_failure_rate=slo.max_failure_rate),
        workload=WorkloadSpec(rate_rps=load.rate_rps, input_tokens=load.input_tokens,
                              output_tokens=load.output_tokens, buckets=buckets),
        scaling=ScalingSpec(min_replicas=model.min_replicas, spread_across_nodes=model.spread_across_nodes),
        allowed_pools=[resource_name(p) for p in model.allowed_pools] if model.allowed_pools is not None else None,
        disaggregation=Disaggregation(model.disaggregation.value), max_tp=model.max_tp,
    )


def _duration_ms(ms: float) -> str:
    """``250ms``, ``12.5ms``: the Kubernetes duration the CRD's pattern accepts."""
    return f"{ms:.3f}".rstrip("0").rstrip(".") + "ms"
