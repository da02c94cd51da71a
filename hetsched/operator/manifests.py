"""The objects hetsched creates for a plan: one Deployment per planned group (engine container, GPU resources,
pinned to the nodes the plan packed it on), and a Service and PodDisruptionBudget per model, and the model's
InferencePool where a Gateway API gateway reaches it.

Pure: builds API objects as dicts; :mod:`hetsched.operator.reconcile` decides their replicas and nodes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetsched.catalog import Catalog
from hetsched.catalog.types import Vendor
from hetsched.operator.inventory import NodeLabel, PoolInventory
from hetsched.operator.kvtransfer import role_parts
from hetsched.operator.objects import Annotation, spec_replicas
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.resources import EngineKind, EngineSecurity, EngineTemplate
from hetsched.optimizer.spec import Role
from hetsched.partition.naming import amd_resource, mig_resource
from hetsched.partition.phases import ready_selector
from hetsched.specs.dtypes import DType
from hetsched.specs.gateway import EPP_PORT, INFERENCE_POOL_API
from hetsched.specs.durations import parse_duration_s
from hetsched.specs.wire import (API_VERSION, KV_EVENTS_PORT, KV_EVENTS_PORT_NUMBER, KV_EVENTS_REPLAY_PORT,
                                 KV_EVENTS_REPLAY_PORT_NUMBER, Label, device_label, label_value)

MIG_CONFIGMAP_KEY = "config.yaml"
DCM_CONFIGMAP_KEY = "config.json"
ENGINE_HOME = "/cache"
"""The engine's HOME, an emptyDir: model downloads and compile caches go there, the root filesystem stays read-only."""
PROBE_PERIOD_S = 10
INFERENCE_EXTENSION_MANIFESTS = ("https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
                                 "v1.0.0/manifests.yaml")
"""The inference extension's CRDs (InferencePool v1): not bundled with hetsched, the cluster installs them."""


def deployment_name(model: str, pool: str, device: str, tp: int, role: Role) -> str:
    """DNS-1123 label (≤63) naming a group's Deployment, one per pool: two pools of one accelerator must not share
    a Deployment. Where lowering, replacing characters or shortening loses anything, a digest of the group keeps
    the name unique."""
    raw = f"{model}-{pool}-{device}-tp{tp}-{role.value}"
    base = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    if base == raw and len(base) <= 63:
        return base
    digest = hashlib.sha256("\0".join((model, pool, device, str(tp), role.value)).encode()).hexdigest()[:8]
    return f"{base[:54].rstrip('-')}-{digest}"


@dataclass(frozen=True)
class DeploymentGroup:
    """One (model, pool, device, TP, role) group of the plan: one Deployment."""

    model: str
    pool: str
    accelerator: str
    profile: str | None
    device: str
    tp: int
    role: Role
    replicas: int
    cost_per_hour: float


def _owner(model: ModelDeploymentRef) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ModelDeployment", "name": model.name, "uid": model.uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(model: ModelDeploymentRef, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": model.namespace, "labels": labels, "ownerReferences": [_owner(model)]}


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
        if engine.attention_backend:
            args += ["--attention-backend", engine.attention_backend.lower()]
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


def deployment(model: ModelDeploymentRef, group: DeploymentGroup, name: str, replicas: int, nodes: list[str],
                pool: PoolInventory, catalog: Catalog, *, gated: bool, preferred: Sequence[str] = ()) -> dict[str, Any]:
    """The engine Deployment of one group, its pods allowed on ``nodes`` and, when some of those are extra room
    for replicas beyond the plan, steered to the ``preferred`` (planned) ones first."""
    engine = model.spec.engine
    role = role_parts(model.spec, group.role)
    labels = {Label.MODEL: model.name, Label.ACCELERATOR: device_label(group.device), Label.ROLE: group.role.value,
              Label.POOL: label_value(group.pool), Label.MANAGED_BY: Label.MANAGER}
    gpu = accelerator_resources(catalog, group.accelerator, group.profile, group.tp, amd_per_mode=pool.amd_per_mode)
    requests = {"cpu": engine.resources.cpu, "memory": engine.resources.memory, **gpu}
    selector = dict(pool.spec.node_selector)
    if gated and group.profile is not None:
        selector.update(ready_selector(catalog.get(group.accelerator).vendor))
    container: dict[str, Any] = {
        "name": "engine", "image": engine.image,
        "args": [*engine_args(model, tp=group.tp), *role.args, *_kv_event_args(model)],
        "env": [{"name": "HOME", "value": ENGINE_HOME}, {"name": "USER", "value": "engine"},
                *(e.manifest() for e in engine.env),
                {"name": "HETSCHED_ROLE", "value": group.role.value},
                {"name": "HETSCHED_DEVICE", "value": group.device}, *_backend_env(engine), *role.env],
        "ports": [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}, *role.ports,
                  *_kv_event_ports(model)],
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
    affinity: dict[str, Any] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": NodeLabel.HOSTNAME, "operator": "In", "values": sorted(nodes)}]}]}}}
    if preferred and set(preferred) != set(nodes):
        affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] = [{"weight": 100, "preference": {
            "matchExpressions": [{"key": NodeLabel.HOSTNAME, "operator": "In", "values": sorted(preferred)}]}}]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {**_meta(model, name, labels), "annotations": {Annotation.MODEL_NAME: model.spec.model}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {Label.MODEL: model.name, Label.ACCELERATOR: labels[Label.ACCELERATOR],
                                         Label.ROLE: group.role.value, Label.POOL: labels[Label.POOL]}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {**labels, Label.TP: str(group.tp), **(
                    {Label.ATTENTION_BACKEND: engine.attention_backend} if engine.attention_backend else {})}},
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


def _kv_event_args(model: ModelDeploymentRef) -> list[str]:
    """With ``routing.kvEvents``, vLLM publishes its KV-cache events on every interface (a ``*`` endpoint binds;
    a host name would make it connect) and answers replays, at the ports :func:`_kv_event_ports` names."""
    if not model.spec.routing.kv_events:
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
              "endpoint": f"tcp://*:{KV_EVENTS_PORT_NUMBER}", "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT_NUMBER}"}
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def _kv_event_ports(model: ModelDeploymentRef) -> list[dict[str, Any]]:
    """The named ports discovery reads a pod's KV-event addresses from."""
    if not model.spec.routing.kv_events:
        return []
    return [{"name": KV_EVENTS_PORT, "containerPort": KV_EVENTS_PORT_NUMBER, "protocol": "TCP"},
            {"name": KV_EVENTS_REPLAY_PORT, "containerPort": KV_EVENTS_REPLAY_PORT_NUMBER, "protocol": "TCP"}]


def _backend_env(engine: EngineTemplate) -> list[dict[str, str]]:
    """vLLM picks its attention backend from the environment; SGLang takes a flag (:func:`engine_args`)."""
    if engine.attention_backend and engine.kind is EngineKind.VLLM:
        return [{"name": "VLLM_ATTENTION_BACKEND", "value": engine.attention_backend}]
    return []


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


def service(model: ModelDeploymentRef) -> dict[str, Any]:
    labels = {Label.MODEL: model.name, Label.MANAGED_BY: Label.MANAGER}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(model, model.name, labels),
            "spec": {"selector": {Label.MODEL: model.name},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}


def disruption_budget(model: ModelDeploymentRef) -> dict[str, Any]:
    labels = {Label.MODEL: model.name, Label.MANAGED_BY: Label.MANAGER}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(model, model.name, labels),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {Label.MODEL: model.name}}}}


def inference_pool(model: ModelDeploymentRef, *, epp_service: str) -> dict[str, Any]:
    """The model's InferencePool: every engine pod of the model, whatever its accelerator, pool or role (the
    Service's selector), picked among by the ``epp_service`` Endpoint Picker; requests fail while it is down."""
    labels = {Label.MODEL: model.name, Label.MANAGED_BY: Label.MANAGER}
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool", "metadata": _meta(model, model.name, labels),
            "spec": {"selector": {"matchLabels": {Label.MODEL: model.name}},
                     "targetPorts": [{"number": model.spec.engine.port}],
                     "endpointPickerRef": {"name": epp_service, "kind": "Service", "port": {"number": EPP_PORT},
                                           "failureMode": "FailClose"}}}


def retiring_deployment(deployment: Mapping[str, Any], draining: list[str]) -> dict[str, Any]:
    """A Deployment no longer in the plan, kept serving; moved off nodes that are being re-partitioned."""
    meta = deployment.get("metadata") or {}
    body: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                                         "labels": dict(meta.get("labels") or {})},
                            "spec": {"replicas": spec_replicas(deployment)}}
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
