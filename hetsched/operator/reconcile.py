"""``desired = reconcile(plan, observed)``: the plan in force and what the cluster shows → the objects it should hold.

Pure: no I/O. The kopf shell lists the observed objects, calls
:func:`reconcile`, turns the result into create/patch/delete calls with
:func:`hetsched.operator.diff.changes`, and writes the statuses it returns. The objects themselves are built in
:mod:`hetsched.operator.manifests`; the values that cross are in :mod:`hetsched.operator.objects`.

Rules, in the order they apply:

1. One Deployment per (model, pool, device, TP, role) group of the plan, named for all five, pinned
   to the nodes the plan packed it on, requesting ``nvidia.com/gpu``,
   ``nvidia.com/mig-<profile>``, ``amd.com/gpu`` or ``amd.com/<partition>``. A prefill or decode group's
   engines carry the model's KV connector (:mod:`hetsched.operator.kvtransfer`) and its role's label.
2. The autoscaler seam (a :data:`ReplicaAdjuster`) may change each group's
   replicas and says why; the reasons go into the ModelDeployment's status.
3. Partitioning: replicas on a node whose GPUs the plan re-partitions (a MIG config or an AMD partition profile)
   run only once the node's partition manager reports success; the per-node phases (drain, label, taint, wait,
   fail on no answer) are :mod:`hetsched.partition.phases`. Until then the old placement keeps serving, moved off
   the nodes being drained.
4. Make-before-break: Deployments no longer in the plan, and groups that
   shrink, keep their replicas until the model's new replicas are Ready.
5. A model whose plan names an AcceleratorPool that no longer exists keeps every Deployment it runs, as it runs,
   until a plan that serves it elsewhere is applied: its status names the missing pools.
6. A model with ``spec.gateway.inferencePool`` gets an InferencePool of all its engine pods; where the cluster has
   no InferencePool API, its status says how to install it and everything else goes on.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from hetsched.catalog import Catalog
from hetsched.operator.inventory import PoolInventory
from hetsched.operator.manifests import (DCM_CONFIGMAP_KEY, INFERENCE_EXTENSION_MANIFESTS, MIG_CONFIGMAP_KEY,
                                         DeploymentGroup, deployment, deployment_name,
                                         disruption_budget, inference_pool, retiring_deployment, service)
from hetsched.operator.objects import (Desired, ModelOutcome, Observed, PartitionNode, ReplicaAdjuster, ReplicaTarget,
                                       keep_planned, key_of, labels_of, ready_replicas, spec_replicas)
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.resources import PlacementEntry
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import Role
from hetsched.partition.phases import PartitionPhase, dcm_step, mig_step, unpartitioned
from hetsched.partition.render import dcm_json, mig_parted_yaml
from hetsched.settings.operator import EPP_SERVICE
from hetsched.specs.gateway import INFERENCE_POOL_API
from hetsched.specs.wire import Label

NO_INFERENCE_POOL_API = (f"spec.gateway.inferencePool is on, but the cluster has no InferencePool API "
                         f"({INFERENCE_POOL_API}): install the Gateway API Inference Extension CRDs with 'kubectl "
                         f"apply -f {INFERENCE_EXTENSION_MANIFESTS}'; the engines serve meanwhile")


def reconcile(plan: Plan | None, observed: Observed, *, models: Mapping[str, ModelDeploymentRef],
              pools: Sequence[PoolInventory], catalog: Catalog, adjust: ReplicaAdjuster = keep_planned,
              untouched: Collection[tuple[str, str]] = (), now: float = 0.0,
              epp_service: str = EPP_SERVICE) -> Desired:
    """The objects the cluster should hold to run ``plan`` for ``models`` at time ``now`` (Unix seconds: how long
    a node has waited for its partitioning); InferencePools name the ``epp_service`` Endpoint Picker.

    ``untouched`` names ModelDeployments (namespace, name) that could not be
    planned: whatever already serves them stays as it is.
    """
    nodes_by_name = {key_of(n)[1]: n for n in observed.nodes}
    pools_by_name = {p.name: p for p in pools}
    pods_on: dict[str, list[str]] = defaultdict(list)
    for pod in observed.pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name and Label.MODEL in labels_of(pod) and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            pods_on[node_name].append(_holder(pod))

    partition_nodes, node_labels, node_taints = (_partition_nodes(plan, nodes_by_name, pods_on, catalog, now=now)
                                           if plan is not None else ([], {}, {}))
    phase_of = {m.node: m.phase for m in partition_nodes}
    draining = sorted(m.node for m in partition_nodes if m.phase is PartitionPhase.DRAINING)
    why = {m.node: f"{m.node}: {m.message}" for m in partition_nodes}

    observed_deps = {key_of(d): d for d in observed.deployments}
    groups = _groups(plan) if plan is not None else {}
    placements = _placements(plan) if plan is not None else {}
    deployments: list[dict[str, Any]] = []
    outcomes: dict[str, ModelOutcome] = {}
    kept: set[tuple[str, str]] = set()
    pool_api = observed.inference_pools is not None
    for key, model in sorted(models.items()):
        model_groups = groups.get(key, [])
        named = [(deployment_name(model.name, g.pool, g.device, g.tp, g.role), g) for g in model_groups]
        targets = [ReplicaTarget(name, g.pool, g.device, g.tp, g.role, g.replicas) for name, g in named]
        decision = adjust(model, targets)
        planned_total = 0
        rendered: list[tuple[dict[str, Any], int]] = []
        placement: list[PlacementEntry] = []
        waiting: set[str] = set()
        failed: set[str] = set()
        missing_pools = sorted({g.pool for g in model_groups if g.pool not in pools_by_name})
        for name, g in named:
            pool = pools_by_name.get(g.pool)
            if pool is None:
                continue
            wanted = max(0, decision.replicas.get(name, g.replicas))
            planned_total += wanted
            on_nodes = placements.get((g.model, g.pool, g.device, g.tp, g.role), {})
            waiting |= {n for n in on_nodes if phase_of.get(n) in (PartitionPhase.DRAINING, PartitionPhase.CONFIGURING)}
            failed |= {n for n in on_nodes if phase_of.get(n) is PartitionPhase.FAILED}
            body, runnable = _render_group(model, g, name, wanted, on_nodes, phase_of, pool, catalog)
            rendered.append((body, runnable))
            placement.append(PlacementEntry(
                pool=g.pool, accelerator=g.accelerator, profile=g.profile, tp=g.tp, role=g.role.value, replicas=wanted,
                ready_replicas=min(ready_replicas(observed_deps.get((model.namespace, name))), runnable)))
        ready_new = sum(p.ready_replicas for p in placement)
        switched = ready_new >= planned_total and not missing_pools
        for body, runnable in rendered:
            current = observed_deps.get((model.namespace, body["metadata"]["name"]))
            if not switched and spec_replicas(current) > runnable:
                body["spec"]["replicas"] = spec_replicas(current)  # shrink only once the new replicas are Ready
            deployments.append(body)
            kept.add((model.namespace, body["metadata"]["name"]))
        retiring = []
        if not switched:
            for dep_key, dep in sorted(observed_deps.items()):
                if dep_key[0] == model.namespace and labels_of(dep).get(Label.MODEL) == model.name and dep_key not in kept:
                    deployments.append(retiring_deployment(dep, draining))
                    kept.add(dep_key)
                    retiring.append(dep_key[1])
        outcomes[key] = ModelOutcome(
            planned_replicas=planned_total, desired_replicas=sum(r for _, r in rendered),
            ready_replicas=sum(ready_replicas(observed_deps.get((model.namespace, b["metadata"]["name"]))) for b, _ in rendered)
            + sum(ready_replicas(observed_deps.get((model.namespace, n))) for n in retiring),
            cost_per_hour=round(sum(g.cost_per_hour for g in model_groups), 4), placement=placement,
            scaling_reasons=list(decision.reasons), retiring=retiring, waiting_partition=sorted(waiting),
            failed_partition=sorted(failed), waiting_reasons=[why[n] for n in sorted(waiting)],
            observed_rps=decision.observed_rps, slo_attainment=decision.slo_attainment, missing_pools=missing_pools,
            gateway_problem=None if pool_api or not model.spec.gateway.inference_pool else NO_INFERENCE_POOL_API)

    services = [service(m) for _, m in sorted(models.items())]
    budgets = [disruption_budget(m) for _, m in sorted(models.items())]
    inference_pools = [inference_pool(m, epp_service=epp_service) for _, m in sorted(models.items())
                       if pool_api and m.spec.gateway.inference_pool]
    for bodies, have in ((deployments, observed.deployments), (services, observed.services),
                         (budgets, observed.disruption_budgets), (inference_pools, observed.inference_pools or ())):
        for obj in have:
            namespace, name = key_of(obj)
            if (namespace, labels_of(obj).get(Label.MODEL)) in untouched:
                bodies.append({"metadata": {"name": name, "namespace": namespace}})
    configmap = None
    if plan is not None and plan.mig_configs:
        configmap = {MIG_CONFIGMAP_KEY: mig_parted_yaml(plan.mig_configs)}
    dcm = None
    if plan is not None and plan.partition_profiles:
        dcm = {DCM_CONFIGMAP_KEY: dcm_json(plan.partition_profiles)}
    return Desired(
        deployments=deployments,
        services=services, disruption_budgets=budgets,
        node_labels=node_labels, mig_configmap=configmap, partition_nodes=partition_nodes, models=outcomes,
        dcm_configmap=dcm, node_taints=node_taints, inference_pools=inference_pools)


def _holder(pod: Mapping[str, Any]) -> str:
    """``namespace/deployment`` a pod belongs to (its ReplicaSet's name less the template hash), else the pod."""
    meta = pod.get("metadata") or {}
    owner = next((o.get("name", "") for o in meta.get("ownerReferences") or [] if o.get("kind") == "ReplicaSet"), "")
    template_hash = labels_of(pod).get("pod-template-hash")
    if owner and template_hash:
        return f"{meta.get('namespace')}/{owner.removesuffix(f'-{template_hash}')}"
    return f"pod {meta.get('namespace')}/{meta.get('name')}"


def _blockers(holders: Sequence[str]) -> str:
    """What still runs on a draining node, so its status says what the switch waits for."""
    return ", ".join(holder + (f" ({count} pods)" if count > 1 else "") for holder, count in sorted(Counter(holders).items()))


def _partition_nodes(plan: Plan, nodes: Mapping[str, Mapping[str, Any]], pods_on: Mapping[str, Sequence[str]], catalog: Catalog,
                     *, now: float) -> tuple[list[PartitionNode], dict[str, dict[str, str | None]],
                                         dict[str, list[dict[str, Any]]]]:
    """Each planned node's re-partitioning phase, the labels that select its MIG config or partition profile, and
    the Device Config Manager taint (set while a profile is applied, gone otherwise)."""
    partition_nodes: list[PartitionNode] = []
    labels: dict[str, dict[str, str | None]] = {}
    taints: dict[str, list[dict[str, Any]]] = {}
    for node in plan.nodes:
        observed = nodes.get(node.name)
        holders = pods_on.get(node.name, [])
        pods = len(holders)
        if node.mig_config is not None:
            config, step = node.mig_config, mig_step(observed, node.mig_config, pods, now=now)
        elif node.partition_profile is not None:
            whole = unpartitioned(catalog.get(node.accelerator), plan.partition_profiles.get(node.partition_profile, []),
                                  observed)
            config, step = node.partition_profile, dcm_step(observed, node.partition_profile, pods,
                                                            unpartitioned=whole, now=now)
        else:
            continue
        message = f"{step.message}; still there: {_blockers(holders)}" if step.phase is PartitionPhase.DRAINING \
            and holders else step.message
        partition_nodes.append(PartitionNode(node.name, config, step.phase, message))
        if step.labels is not None:
            labels[node.name] = step.labels
        if step.taints is not None:
            taints[node.name] = step.taints
    return partition_nodes, labels, taints


def _render_group(model: ModelDeploymentRef, g: DeploymentGroup, name: str, wanted: int, on_nodes: Mapping[str, int],
                  phase_of: Mapping[str, PartitionPhase], pool: PoolInventory, catalog: Catalog
                  ) -> tuple[dict[str, Any], int]:
    """A group's Deployment and how many of its ``wanted`` replicas may run now.

    Nothing goes onto a node before the MIG config the plan gives it is in
    place: the switch needs idle GPUs, and the instances must exist. Replicas
    beyond the plan's count (an autoscaler's scale-up) may go on any pool node
    not being re-partitioned, the plan's nodes preferred, since the plan's
    nodes have no room for them.
    """
    gated = any(n in phase_of for n in on_nodes)
    usable = [n for n in on_nodes if phase_of.get(n, PartitionPhase.READY) is PartitionPhase.READY]
    runnable = min(wanted, sum(on_nodes[n] for n in usable)) if gated else wanted
    hosts = usable or sorted(on_nodes) or [n.name for n in pool.usable_nodes]
    preferred: list[str] = []
    if not gated and on_nodes and wanted > sum(on_nodes.values()):
        preferred = sorted(on_nodes)
        hosts = sorted({*hosts, *(n.name for n in pool.usable_nodes
                                  if phase_of.get(n.name, PartitionPhase.READY) is PartitionPhase.READY)})
    body = deployment(model, g, name, runnable, hosts, pool, catalog, gated=gated, preferred=preferred)
    return body, runnable


def _groups(plan: Plan) -> dict[str, list[DeploymentGroup]]:
    out: dict[str, list[DeploymentGroup]] = defaultdict(list)
    for model in plan.models:
        for g in model.replicas:
            out[g.model].append(DeploymentGroup(g.model, g.pool, g.accelerator, g.profile, g.device, g.tp, g.role, g.replicas,
                                       g.cost_per_hour))
    return out


def _placements(plan: Plan) -> dict[tuple[str, str, str, int, Role], dict[str, int]]:
    """Replicas per node of each (model, pool, device, tp, role) group, as the plan packed them."""
    out: dict[tuple[str, str, str, int, Role], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for node in plan.nodes:
        for r in node.replicas:
            out[(r.model, node.pool, r.device, r.tp, r.role)][node.name] += 1
    return out
