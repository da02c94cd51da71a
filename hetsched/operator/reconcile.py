"""``desired = reconcile(plan, observed)``: the plan in force and what the cluster shows → the objects it should hold.

Pure: no I/O. The kopf shell lists the observed objects, calls
:func:`reconcile`, turns the result into create/patch/delete calls with
:func:`changes`, and writes the statuses it returns.

Rules, in the order they apply:

1. One Deployment per (model, pool, device, TP, role) group of the plan, pinned
   to the nodes the plan packed it on, requesting ``nvidia.com/gpu``,
   ``nvidia.com/mig-<profile>``, ``amd.com/gpu`` or ``amd.com/<partition>``. A prefill or decode group's
   engines carry the model's KV connector (:mod:`hetsched.operator.kvtransfer`) and its role's label.
2. The autoscaler seam (a :data:`ReplicaAdjuster`) may change each group's
   replicas and says why; the reasons go into the ModelDeployment's status.
3. MIG: a node whose planned mig-parted config differs from its
   ``nvidia.com/mig.config`` label is first drained of hetsched pods, then
   labelled; replicas on it are scheduled only once the MIG manager reports
   ``nvidia.com/mig.config.state=success`` (the label's stale state is removed
   with the switch, so the old config's ``success`` cannot pass for the new
   one). ``failed`` is reported and the old placement keeps serving, and so is
   no answer at all within ``PARTITION_TIMEOUT_S``. AMD partitions go the same way through the
   Device Config Manager, which needs idle GPUs: once drained, the node is
   tainted ``amd-dcm=up:NoExecute`` (evicting the GPU daemons), one pass later
   labelled ``dcm.amd.com/gpu-config-profile`` (its stale state label
   removed), and untainted once ``dcm.amd.com/gpu-config-profile-state``
   reads ``success`` or ``failure``, or when the manager has not answered
   within ``PARTITION_TIMEOUT_S`` (taken as a failure: a node must not stay
   tainted because no manager runs).
4. Make-before-break: Deployments no longer in the plan, and groups that
   shrink, keep their replicas until the model's new replicas are Ready.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hetsched.catalog import Catalog
from hetsched.catalog.types import Vendor
from hetsched.operator.inventory import NodeLabel, PoolInventory
from hetsched.operator.kvtransfer import role_parts
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.resources import API_VERSION, EngineKind, EngineSecurity, EngineTemplate, PlacementEntry
from hetsched.optimizer.plan import NodePlan, Plan
from hetsched.optimizer.spec import Role
from hetsched.partition.labels import DcmState, MigState
from hetsched.partition.naming import ALL_DISABLED, amd_mode, amd_resource, mig_resource
from hetsched.partition.render import dcm_json, mig_parted_yaml
from hetsched.specs.dtypes import DType
from hetsched.specs.durations import parse_duration_s


class Label:
    """Labels the operator puts on what it creates."""

    MODEL = "hetsched.io/model"
    ACCELERATOR = "hetsched.io/accelerator"
    ROLE = "hetsched.io/role"
    POOL = "hetsched.io/pool"
    TP = "hetsched.io/tp"
    MANAGED_BY = "app.kubernetes.io/managed-by"
    MANAGER = "hetsched"


class Annotation:
    PLAN_HASH = "hetsched.io/plan-hash"
    MODEL_NAME = "hetsched.io/served-model"


MIG_CONFIGMAP_KEY = "config.yaml"
DCM_CONFIGMAP_KEY = "config.json"
DCM_TAINT = {"key": "amd-dcm", "value": "up", "effect": "NoExecute"}
"""The taint the AMD Device Config Manager expects on a node it re-partitions (its own pods tolerate it)."""
PARTITION_TIMEOUT_S = 20 * 60
"""How long a node waits for the MIG manager's or Device Config Manager's first answer before the switch counts as
failed."""
ENGINE_HOME = "/cache"
"""The engine's HOME, an emptyDir: model downloads and compile caches go there, the root filesystem stays read-only."""
PROBE_PERIOD_S = 10


class MigPhase(StrEnum):
    """Where one node is on its way to the planned MIG layout or AMD partition profile."""

    DRAINING = "draining"
    CONFIGURING = "configuring"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Observed:
    """What the cluster shows: raw objects as the API returns them (only hetsched's, except nodes)."""

    nodes: Sequence[Mapping[str, Any]] = ()
    deployments: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    disruption_budgets: Sequence[Mapping[str, Any]] = ()
    pods: Sequence[Mapping[str, Any]] = ()
    mig_configmap: Mapping[str, Any] | None = None
    dcm_configmap: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ReplicaTarget:
    """One Deployment's replica count as the plan has it: what the autoscaler may adjust."""

    deployment: str
    pool: str
    device: str
    tp: int
    role: Role
    planned: int


@dataclass(frozen=True)
class ScalingDecision:
    """Replicas by Deployment name (missing = as planned) and the reasons, recorded in status and events, with what
    the autoscaler saw of the model's live traffic (None: nothing seen)."""

    replicas: Mapping[str, int] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    observed_rps: float | None = None
    slo_attainment: float | None = None


ReplicaAdjuster = Callable[[ModelDeploymentRef, Sequence[ReplicaTarget]], ScalingDecision]
"""The autoscaler seam: given a model and its planned groups, the replicas to run and why."""


def keep_planned(model: ModelDeploymentRef, targets: Sequence[ReplicaTarget]) -> ScalingDecision:
    """The default adjuster: run what the plan says."""
    return ScalingDecision()


@dataclass(frozen=True)
class MigNode:
    node: str
    config: str
    phase: MigPhase
    message: str


@dataclass(frozen=True)
class ModelOutcome:
    """What reconcile concluded for one ModelDeployment; the shell writes it to status."""

    planned_replicas: int
    desired_replicas: int
    ready_replicas: int
    cost_per_hour: float
    placement: list[PlacementEntry]
    scaling_reasons: list[str]
    retiring: list[str]
    waiting_mig: list[str]
    failed_mig: list[str]
    observed_rps: float | None = None
    slo_attainment: float | None = None

    @property
    def summary(self) -> str:
        return ", ".join(f"{p.replicas}×{p.accelerator}{':' + p.profile if p.profile else ''}"
                         f"{'/tp' + str(p.tp) if p.tp > 1 else ''}{'/' + p.role if p.role != Role.UNIFIED else ''}"
                         for p in self.placement)


@dataclass(frozen=True)
class Desired:
    """The objects the cluster should hold, node label and taint changes, and per-model outcomes."""

    deployments: list[dict[str, Any]]
    services: list[dict[str, Any]]
    disruption_budgets: list[dict[str, Any]]
    node_labels: dict[str, dict[str, str | None]]
    """Per node, labels to set (None: remove)."""
    mig_configmap: dict[str, Any] | None
    mig_nodes: list[MigNode]
    models: dict[str, ModelOutcome]
    dcm_configmap: dict[str, Any] | None = None
    node_taints: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per node, its whole taint list where it must change."""


class Action(StrEnum):
    CREATE = "create"
    PATCH = "patch"
    """A merge patch."""
    DELETE = "delete"

    @property
    def past(self) -> str:
        """The verb of the event that reports it: Created, Updated, Deleted."""
        return {Action.CREATE: "Created", Action.PATCH: "Updated", Action.DELETE: "Deleted"}[self]


@dataclass(frozen=True)
class Change:
    """One API call: create, patch (merge) or delete an object."""

    action: Action
    kind: str
    namespace: str | None
    name: str
    body: dict[str, Any] | None = None


# --- names and labels ------------------------------------------------------------------------------------------


def label_value(text: str) -> str:
    """A valid label value (≤63, alphanumerics, '-', '_', '.') for an accelerator or device id."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:63].strip("_.-")
    return value


def deployment_name(model: str, device: str, tp: int, role: Role) -> str:
    """DNS-1123 name of a group's Deployment, ≤63 characters (a digest keeps long names unique)."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"{model}-{device}-tp{tp}-{role.value}".lower()).strip("-")
    if len(base) <= 63:
        return base
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    return f"{base[:54].rstrip('-')}-{digest}"


def _owner(model: ModelDeploymentRef) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ModelDeployment", "name": model.name, "uid": model.uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(model: ModelDeploymentRef, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": model.namespace, "labels": labels, "ownerReferences": [_owner(model)]}


# --- engine container ------------------------------------------------------------------------------------------


def engine_args(model: ModelDeploymentRef, *, tp: int) -> list[str]:
    """The template's args followed by those the plan implies, in the engine's own flag names (a disaggregated
    role's come after, from :func:`~hetsched.operator.kvtransfer.role_parts`).

    The engine serves the model under the ModelDeployment's name, the same name the pods carry in
    ``hetsched.io/model``, so clients and the router address it by that name.
    """
    engine = model.spec.engine
    served = model.spec.model
    if engine.kind is EngineKind.SGLANG:
        args = ["--model-path", served, "--served-model-name", model.name, "--tp-size", str(tp), "--mem-fraction-static",
                str(engine.gpu_memory_utilization), "--port", str(engine.port), "--host", "0.0.0.0"]
        if engine.max_num_seqs:
            args += ["--max-running-requests", str(engine.max_num_seqs)]
    else:
        args = ["--model", served, "--served-model-name", model.name, "--tensor-parallel-size", str(tp),
                "--gpu-memory-utilization",
                str(engine.gpu_memory_utilization), "--port", str(engine.port)]
        if engine.max_num_seqs:
            args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if model.spec.quantization is DType.FP8:
        args += ["--quantization", "fp8"]
    return [*engine.args, *args]


def accelerator_resources(catalog: Catalog, accelerator: str, profile: str | None, tp: int, *,
                          amd_per_mode: bool = False) -> dict[str, str]:
    """Extended resources one replica requests: whole GPUs, one MIG instance, or one AMD partition.

    The AMD device plugin names them one of two ways: ``single`` counts every GPU and partition as
    ``amd.com/gpu``; ``mixed`` (``amd_per_mode``) counts each under its mode, whole GPUs too (``amd.com/spx_nps1``).
    """
    acc = catalog.get(accelerator)
    if acc.vendor is Vendor.CPU:
        return {}
    if acc.vendor is Vendor.AMD:
        mode = profile or (acc.amd_partitions.unpartitioned_mode() if acc.amd_partitions else None)
        return {amd_resource(mode): str(tp)} if amd_per_mode and mode else {acc.resource_name: str(tp)}
    if profile is None:
        return {acc.resource_name: str(tp)}
    return {mig_resource(profile): str(tp)}


def _tolerations(pool: PoolInventory, vendor: Vendor) -> list[dict[str, Any]]:
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in pool.spec.tolerations]
    gpu_taint = {Vendor.NVIDIA: "nvidia.com/gpu", Vendor.AMD: "amd.com/gpu"}.get(vendor)
    if gpu_taint and not any(t.get("key") == gpu_taint for t in tolerations):
        tolerations.append({"key": gpu_taint, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


@dataclass(frozen=True)
class _Group:
    model: str
    pool: str
    accelerator: str
    profile: str | None
    device: str
    tp: int
    role: Role
    replicas: int
    cost_per_hour: float


def _deployment(model: ModelDeploymentRef, group: _Group, name: str, replicas: int, nodes: list[str],
                pool: PoolInventory, catalog: Catalog, *, gated: bool) -> dict[str, Any]:
    engine = model.spec.engine
    role = role_parts(model.spec, group.role)
    labels = {Label.MODEL: model.name, Label.ACCELERATOR: label_value(group.device), Label.ROLE: group.role.value,
              Label.POOL: label_value(group.pool), Label.MANAGED_BY: Label.MANAGER}
    gpu = accelerator_resources(catalog, group.accelerator, group.profile, group.tp, amd_per_mode=pool.amd_per_mode)
    requests = {"cpu": engine.resources.cpu, "memory": engine.resources.memory, **gpu}
    selector = dict(pool.spec.node_selector)
    if gated and group.profile is not None:  # the instances exist once the node's partitioning succeeded
        if catalog.get(group.accelerator).vendor is Vendor.AMD:
            selector[NodeLabel.DCM_PROFILE_STATE] = DcmState.SUCCESS
        else:
            selector[NodeLabel.MIG_CONFIG_STATE] = MigState.SUCCESS
    container: dict[str, Any] = {
        "name": "engine", "image": engine.image,
        "args": [*engine_args(model, tp=group.tp), *role.args],
        "env": [{"name": "HOME", "value": ENGINE_HOME}, {"name": "USER", "value": "engine"},
                *(e.manifest() for e in engine.env),
                {"name": "HETSCHED_ROLE", "value": group.role.value},
                {"name": "HETSCHED_DEVICE", "value": group.device}, *role.env],
        "ports": [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}, *role.ports],
        "resources": {"requests": requests,
                      "limits": {"cpu": engine.resources.cpu, "memory": engine.resources.memory, **gpu}},
        **_probes(engine),
        "securityContext": _container_security(engine.security),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": ENGINE_HOME},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    if engine.env_from:
        container["envFrom"] = [e.model_dump(by_alias=True, exclude_none=True) for e in engine.env_from]
    if engine.command:
        container["command"] = list(engine.command)
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": NodeLabel.HOSTNAME, "operator": "In", "values": sorted(nodes)}]}]}}}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {**_meta(model, name, labels), "annotations": {Annotation.MODEL_NAME: model.spec.model}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {Label.MODEL: model.name, Label.ACCELERATOR: labels[Label.ACCELERATOR],
                                         Label.ROLE: group.role.value, Label.POOL: labels[Label.POOL]}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {**labels, Label.TP: str(group.tp)}},
                "spec": {
                    "nodeSelector": selector, "affinity": affinity,
                    "tolerations": _tolerations(pool, catalog.get(group.accelerator).vendor),
                    "securityContext": _pod_security(engine.security),
                    "containers": [container],
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                                {"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def _probes(engine: EngineTemplate) -> dict[str, Any]:
    """Startup (the model's download and load, up to ``startupTimeout``), then liveness and readiness on /health."""
    health = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S}
    startup_checks = max(1, -(-int(parse_duration_s(engine.startup_timeout)) // PROBE_PERIOD_S))
    return {"startupProbe": {**health, "failureThreshold": startup_checks},
            "livenessProbe": {**health, "timeoutSeconds": 5, "failureThreshold": 6},
            "readinessProbe": {**health, "failureThreshold": 3}}


def _pod_security(security: EngineSecurity) -> dict[str, Any]:
    """The restricted Pod Security Standard's pod fields: a non-root user, the runtime's seccomp profile."""
    context: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": security.run_as_user,
                               "runAsGroup": security.run_as_group, "fsGroup": security.run_as_group,
                               "seccompProfile": {"type": "RuntimeDefault"}}
    if security.supplemental_groups:
        context["supplementalGroups"] = list(security.supplemental_groups)
    return context


def _container_security(security: EngineSecurity) -> dict[str, Any]:
    """The restricted Pod Security Standard's container fields, and a read-only root filesystem."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "readOnlyRootFilesystem": security.read_only_root_filesystem}


def _service(model: ModelDeploymentRef) -> dict[str, Any]:
    labels = {Label.MODEL: model.name, Label.MANAGED_BY: Label.MANAGER}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(model, model.name, labels),
            "spec": {"selector": {Label.MODEL: model.name},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}


def _disruption_budget(model: ModelDeploymentRef) -> dict[str, Any]:
    labels = {Label.MODEL: model.name, Label.MANAGED_BY: Label.MANAGER}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(model, model.name, labels),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {Label.MODEL: model.name}}}}


# --- MIG ----------------------------------------------------------------------------------------------------------


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def mig_phase(node: Mapping[str, Any] | None, config: str, pods_on_node: int, *, now: float) -> tuple[MigPhase, str]:
    """Where a node stands on its way to ``config`` at time ``now`` (Unix seconds), from its labels and the hetsched
    pods still on it."""
    labels = _labels(node) if node else {}
    current, state = labels.get(NodeLabel.MIG_CONFIG), labels.get(NodeLabel.MIG_CONFIG_STATE)
    if current is None and config == ALL_DISABLED:
        return MigPhase.READY, "MIG is off and the MIG manager was never asked otherwise"
    if current == config:
        if state == MigState.SUCCESS:
            return MigPhase.READY, f"MIG config {config} applied"
        if state == MigState.FAILED:
            return MigPhase.FAILED, f"the MIG manager reports failed for config {config}; the old placement keeps serving"
        if state is None and _unanswered(labels, now):
            return (MigPhase.FAILED, f"no answer from the MIG manager for config {config} in "
                                     f"{PARTITION_TIMEOUT_S // 60} min (is it deployed, reading this ConfigMap?); "
                                     "the old placement keeps serving")
        return MigPhase.CONFIGURING, f"waiting for the MIG manager to apply {config} (state {state or 'unset'})"
    if pods_on_node:
        return MigPhase.DRAINING, f"draining {pods_on_node} hetsched pods before switching MIG config {current} → {config}"
    return MigPhase.CONFIGURING, f"switching MIG config {current or 'unset'} → {config}"


def partition_phase(node: Mapping[str, Any] | None, profile: str, pods_on_node: int, *, unpartitioned: bool,
                    now: float) -> tuple[MigPhase, str]:
    """Where an AMD node stands on its way to Device Config Manager ``profile`` at time ``now`` (Unix seconds); an
    ``unpartitioned`` profile (every GPU one device) holds on a node the manager was never asked about."""
    labels = _labels(node) if node else {}
    current, state = labels.get(NodeLabel.DCM_PROFILE), labels.get(NodeLabel.DCM_PROFILE_STATE)
    if current is None and unpartitioned:
        return MigPhase.READY, "no GPU is partitioned and the Device Config Manager was never asked otherwise"
    if current == profile:
        if state == DcmState.SUCCESS:
            return MigPhase.READY, f"partition profile {profile} applied"
        if state == DcmState.FAILURE:
            return (MigPhase.FAILED, f"the Device Config Manager reports failure for profile {profile}; "
                                     "the old placement keeps serving")
        if _unanswered(labels, now):
            return (MigPhase.FAILED, f"no answer from the Device Config Manager for profile {profile} in "
                                     f"{PARTITION_TIMEOUT_S // 60} min (is it deployed, reading this ConfigMap?); "
                                     "the old placement keeps serving")
        return MigPhase.CONFIGURING, f"waiting for the Device Config Manager to apply {profile} (state {state or 'unset'})"
    if pods_on_node:
        return MigPhase.DRAINING, f"draining {pods_on_node} hetsched pods before switching partition profile " \
                                  f"{current or 'unset'} → {profile}"
    return MigPhase.CONFIGURING, f"switching partition profile {current or 'unset'} → {profile}"


def _unanswered(labels: Mapping[str, str], now: float) -> bool:
    """Whether the partitioning the operator asked for (``hetsched.io/partitioning-since``) has gone unanswered
    for longer than ``PARTITION_TIMEOUT_S``."""
    since = labels.get(NodeLabel.PARTITIONING_SINCE, "")
    return since.isdigit() and now - int(since) > PARTITION_TIMEOUT_S


def _taints(node: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((node or {}).get("spec") or {}).get("taints") or [])


def _is_dcm_taint(taint: Mapping[str, Any]) -> bool:
    return taint.get("key") == DCM_TAINT["key"] and taint.get("effect") == DCM_TAINT["effect"]


# --- reconcile --------------------------------------------------------------------------------------------------


def _ready(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def _spec_replicas(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("spec") or {}).get("replicas") or 0)


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


def _groups(plan: Plan) -> dict[str, list[_Group]]:
    out: dict[str, list[_Group]] = defaultdict(list)
    for model in plan.models:
        for g in model.replicas:
            out[g.model].append(_Group(g.model, g.pool, g.accelerator, g.profile, g.device, g.tp, g.role, g.replicas,
                                       g.cost_per_hour))
    return out


def _placements(plan: Plan) -> dict[tuple[str, str, str, int, Role], dict[str, int]]:
    """Replicas per node of each (model, pool, device, tp, role) group, as the plan packed them."""
    out: dict[tuple[str, str, str, int, Role], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for node in plan.nodes:
        for r in node.replicas:
            out[(r.model, node.pool, r.device, r.tp, r.role)][node.name] += 1
    return out


def reconcile(plan: Plan | None, observed: Observed, *, models: Mapping[str, ModelDeploymentRef],
              pools: Sequence[PoolInventory], catalog: Catalog, adjust: ReplicaAdjuster = keep_planned,
              untouched: Collection[tuple[str, str]] = (), now: float = 0.0) -> Desired:
    """The objects the cluster should hold to run ``plan`` for ``models`` at time ``now`` (Unix seconds: how long
    a node has waited for its partitioning).

    ``untouched`` names ModelDeployments (namespace, name) that could not be
    planned: whatever already serves them stays as it is.
    """
    nodes_by_name = {(n.get("metadata") or {}).get("name"): n for n in observed.nodes}
    pools_by_name = {p.name: p for p in pools}
    pods_on: dict[str, int] = defaultdict(int)
    for pod in observed.pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name and Label.MODEL in _labels(pod) and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            pods_on[node_name] += 1

    mig_nodes, node_labels, node_taints = (_config_nodes(plan, nodes_by_name, pods_on, catalog, now=now)
                                           if plan is not None else ([], {}, {}))
    mig_phase_of = {m.node: m.phase for m in mig_nodes}
    draining = sorted(m.node for m in mig_nodes if m.phase is MigPhase.DRAINING)

    observed_deps = {_key(d): d for d in observed.deployments}
    groups = _groups(plan) if plan is not None else {}
    placements = _placements(plan) if plan is not None else {}
    deployments: list[dict[str, Any]] = []
    outcomes: dict[str, ModelOutcome] = {}
    kept: set[tuple[str, str]] = set()
    for key, model in sorted(models.items()):
        model_groups = groups.get(key, [])
        named = [(deployment_name(model.name, g.device, g.tp, g.role), g) for g in model_groups]
        targets = [ReplicaTarget(name, g.pool, g.device, g.tp, g.role, g.replicas) for name, g in named]
        decision = adjust(model, targets)
        planned_total = 0
        rendered: list[tuple[dict[str, Any], int]] = []
        placement: list[PlacementEntry] = []
        waiting: set[str] = set()
        failed: set[str] = set()
        for name, g in named:
            pool = pools_by_name.get(g.pool)
            if pool is None:
                continue
            wanted = max(0, decision.replicas.get(name, g.replicas))
            planned_total += wanted
            on_nodes = placements.get((g.model, g.pool, g.device, g.tp, g.role), {})
            waiting |= {n for n in on_nodes if mig_phase_of.get(n) in (MigPhase.DRAINING, MigPhase.CONFIGURING)}
            failed |= {n for n in on_nodes if mig_phase_of.get(n) is MigPhase.FAILED}
            body, runnable = _render_group(model, g, name, wanted, on_nodes, mig_phase_of, pool, catalog)
            rendered.append((body, runnable))
            placement.append(PlacementEntry(
                pool=g.pool, accelerator=g.accelerator, profile=g.profile, tp=g.tp, role=g.role.value, replicas=wanted,
                ready_replicas=min(_ready(observed_deps.get((model.namespace, name))), runnable)))
        ready_new = sum(p.ready_replicas for p in placement)
        switched = ready_new >= planned_total
        for body, runnable in rendered:
            current = observed_deps.get((model.namespace, body["metadata"]["name"]))
            if not switched and _spec_replicas(current) > runnable:
                body["spec"]["replicas"] = _spec_replicas(current)  # shrink only once the new replicas are Ready
            deployments.append(body)
            kept.add((model.namespace, body["metadata"]["name"]))
        retiring = []
        if not switched:
            for dep_key, dep in sorted(observed_deps.items()):
                if dep_key[0] == model.namespace and _labels(dep).get(Label.MODEL) == model.name and dep_key not in kept:
                    deployments.append(_retiring(dep, draining))
                    kept.add(dep_key)
                    retiring.append(dep_key[1])
        outcomes[key] = ModelOutcome(
            planned_replicas=planned_total, desired_replicas=sum(r for _, r in rendered),
            ready_replicas=sum(_ready(observed_deps.get((model.namespace, b["metadata"]["name"]))) for b, _ in rendered)
            + sum(_ready(observed_deps.get((model.namespace, n))) for n in retiring),
            cost_per_hour=round(sum(g.cost_per_hour for g in model_groups), 4), placement=placement,
            scaling_reasons=list(decision.reasons), retiring=retiring, waiting_mig=sorted(waiting),
            failed_mig=sorted(failed), observed_rps=decision.observed_rps, slo_attainment=decision.slo_attainment)

    services = [_service(m) for _, m in sorted(models.items())]
    budgets = [_disruption_budget(m) for _, m in sorted(models.items())]
    for wanted, have in ((deployments, observed.deployments), (services, observed.services),
                         (budgets, observed.disruption_budgets)):
        for obj in have:
            namespace, name = _key(obj)
            if (namespace, _labels(obj).get(Label.MODEL)) in untouched:
                wanted.append({"metadata": {"name": name, "namespace": namespace}})
    configmap = None
    if plan is not None and plan.mig_configs:
        configmap = {MIG_CONFIGMAP_KEY: mig_parted_yaml(plan.mig_configs)}
    dcm = None
    if plan is not None and plan.partition_profiles:
        dcm = {DCM_CONFIGMAP_KEY: dcm_json(plan.partition_profiles)}
    return Desired(
        deployments=deployments,
        services=services, disruption_budgets=budgets,
        node_labels=node_labels, mig_configmap=configmap, mig_nodes=mig_nodes, models=outcomes,
        dcm_configmap=dcm, node_taints=node_taints)


def _config_nodes(plan: Plan, nodes: Mapping[str, Mapping[str, Any]], pods_on: Mapping[str, int], catalog: Catalog, *,
                  now: float) -> tuple[list[MigNode], dict[str, dict[str, str | None]], dict[str, list[dict[str, Any]]]]:
    """Each planned node's re-partitioning phase, the labels that select its MIG config or partition profile, and
    the Device Config Manager taint (set while a profile is applied, gone otherwise)."""
    mig_nodes: list[MigNode] = []
    labels: dict[str, dict[str, str | None]] = {}
    taints: dict[str, list[dict[str, Any]]] = {}
    for node in plan.nodes:
        observed = nodes.get(node.name)
        pods = pods_on.get(node.name, 0)
        if node.mig_config is not None:
            phase, message = mig_phase(observed, node.mig_config, pods, now=now)
            mig_nodes.append(MigNode(node.name, node.mig_config, phase, message))
            if phase is MigPhase.CONFIGURING and _labels(observed or {}).get(NodeLabel.MIG_CONFIG) != node.mig_config:
                labels[node.name] = {NodeLabel.MIG_CONFIG: node.mig_config, NodeLabel.MIG_CONFIG_STATE: None,
                                     NodeLabel.PARTITIONING_SINCE: str(int(now))}
        elif node.partition_profile is not None:
            phase, message = partition_phase(observed, node.partition_profile, pods,
                                             unpartitioned=_unpartitioned(plan, node, observed, catalog), now=now)
            mig_nodes.append(MigNode(node.name, node.partition_profile, phase, message))
            have = _taints(observed)
            tainted = any(_is_dcm_taint(t) for t in have)
            if phase is MigPhase.CONFIGURING and not tainted:
                taints[node.name] = [*have, dict(DCM_TAINT)]
            elif phase is MigPhase.CONFIGURING and _labels(observed or {}).get(NodeLabel.DCM_PROFILE) != node.partition_profile:
                labels[node.name] = {NodeLabel.DCM_PROFILE: node.partition_profile, NodeLabel.DCM_PROFILE_STATE: None,
                                     NodeLabel.PARTITIONING_SINCE: str(int(now))}
            elif phase in (MigPhase.READY, MigPhase.FAILED) and tainted:
                taints[node.name] = [t for t in have if not _is_dcm_taint(t)]
    return mig_nodes, labels, taints


def _unpartitioned(plan: Plan, node: NodePlan, observed: Mapping[str, Any] | None, catalog: Catalog) -> bool:
    """Whether every GPU of the node's partition profile is one device, and the node labeller (when it reports
    the mode) says the GPUs are so now."""
    partitions = catalog.get(node.accelerator).amd_partitions
    whole = partitions.unpartitioned_mode() if partitions else None
    now = _labels(observed or {}).get(NodeLabel.AMD_PARTITION, whole)
    return now == whole and all(amd_mode(g.compute, g.memory) == whole
                                for g in plan.partition_profiles.get(node.partition_profile or "", []))


def _render_group(model: ModelDeploymentRef, g: _Group, name: str, wanted: int, on_nodes: Mapping[str, int],
                  mig_phase_of: Mapping[str, MigPhase], pool: PoolInventory, catalog: Catalog
                  ) -> tuple[dict[str, Any], int]:
    """A group's Deployment and how many of its ``wanted`` replicas may run now.

    Nothing goes onto a node before the MIG config the plan gives it is in
    place: the switch needs idle GPUs, and the instances must exist.
    """
    gated = any(n in mig_phase_of for n in on_nodes)
    usable = [n for n in on_nodes if mig_phase_of.get(n, MigPhase.READY) is MigPhase.READY]
    runnable = min(wanted, sum(on_nodes[n] for n in usable)) if gated else wanted
    hosts = usable or sorted(on_nodes) or [n.name for n in pool.usable_nodes]
    body = _deployment(model, g, name, runnable, hosts, pool, catalog, gated=gated)
    return body, runnable


def _retiring(deployment: Mapping[str, Any], draining: list[str]) -> dict[str, Any]:
    """A Deployment no longer in the plan, kept serving; moved off nodes that are being re-partitioned."""
    meta = deployment.get("metadata") or {}
    body: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                                         "labels": dict(meta.get("labels") or {})},
                            "spec": {"replicas": _spec_replicas(deployment)}}
    if draining:
        terms = ((((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get("affinity") or {})
        hosts = [v for t in terms.get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
                 .get("nodeSelectorTerms", []) for e in t.get("matchExpressions", [])
                 if e.get("key") == NodeLabel.HOSTNAME and e.get("operator") == "In" for v in e.get("values", [])]
        if any(h in draining for h in hosts):
            expressions = [{"key": NodeLabel.HOSTNAME, "operator": "NotIn", "values": draining}]
            body["spec"]["template"] = {"spec": {"affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": expressions}]}}}}}
    return body


# --- diff ---------------------------------------------------------------------------------------------------------


def is_subset(want: Any, have: Any) -> bool:
    """Whether ``have`` already holds everything ``want`` sets (the server may add defaults around it)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(is_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(is_subset(w, h) for w, h in zip(want, have))
    if isinstance(want, int | float) and isinstance(have, int | float) and not isinstance(want, bool):
        return float(want) == float(have)
    return bool(want == have)


def _managed(obj: Mapping[str, Any]) -> bool:
    return _labels(obj).get(Label.MANAGED_BY) == Label.MANAGER


def changes(desired: Desired, observed: Observed, *, mig_configmap: tuple[str, str] | None = None,
            dcm_configmap: tuple[str, str] | None = None) -> list[Change]:
    """The API calls that make the cluster match ``desired``; none when it already does."""
    out: list[Change] = []
    for kind, wanted, have in (("Deployment", desired.deployments, observed.deployments),
                               ("Service", desired.services, observed.services),
                               ("PodDisruptionBudget", desired.disruption_budgets, observed.disruption_budgets)):
        existing = {_key(o): o for o in have if _managed(o)}
        wanted_keys = set()
        for body in wanted:
            key = _key(body)
            wanted_keys.add(key)
            current = existing.get(key)
            if current is None:
                out.append(Change(Action.CREATE, kind, key[0], key[1], body))
            elif not is_subset(body, current):
                out.append(Change(Action.PATCH, kind, key[0], key[1], body))
        for key in sorted(set(existing) - wanted_keys):
            out.append(Change(Action.DELETE, kind, key[0], key[1]))
    nodes = {(n.get("metadata") or {}).get("name"): n for n in observed.nodes}
    for node_name, labels in sorted(desired.node_labels.items()):
        if not is_subset(labels, _labels(nodes.get(node_name) or {})):
            out.append(Change(Action.PATCH, "Node", None, node_name, {"metadata": {"labels": labels}}))
    for node_name, taints in sorted(desired.node_taints.items()):
        if _taints(nodes.get(node_name)) != taints:
            out.append(Change(Action.PATCH, "Node", None, node_name, {"spec": {"taints": taints}}))
    for data, have, where in ((desired.mig_configmap, observed.mig_configmap, mig_configmap),
                              (desired.dcm_configmap, observed.dcm_configmap, dcm_configmap)):
        if data is None or where is None:
            continue
        namespace, name = where
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, "labels": {Label.MANAGED_BY: Label.MANAGER}},
                "data": data}
        if have is None:
            out.append(Change(Action.CREATE, "ConfigMap", namespace, name, body))
        elif not is_subset(data, have.get("data")):
            out.append(Change(Action.PATCH, "ConfigMap", namespace, name, {"data": data}))
    out.sort(key=lambda c: c.kind == "Node")  # node labels last: the ConfigMap they name must exist first
    return out
