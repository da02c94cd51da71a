"""Endpoint discovery: a static file, or Kubernetes pods labelled by model and accelerator.

The Kubernetes part is a pure function ``pods → endpoints`` plus a thin
watcher that feeds it. A pod is an endpoint of model M when it carries
``hetsched.io/model=M`` and ``hetsched.io/accelerator=<device>``, is Ready,
is not being deleted, and has an IP. The labels are the operator's, read as
:mod:`hetsched.specs.wire` defines them: a partition (MIG profile or AMD mode)
follows the first ``_`` of the accelerator label (``h100-sxm_3g.40gb`` for
``h100-sxm:3g.40gb``: label values cannot hold ``:``), ``hetsched.io/tp``
gives the TP degree, and ``hetsched.io/role`` (``unified``, ``prefill`` or
``decode``, as the operator labels a disaggregated model's engines) the stage
it serves. The port is the container port named ``http``, else the configured
default; a container port named ``kv-events`` (and ``kv-events-replay``) is where
the engine publishes its KV-cache events (and replays them).

With Kubernetes the watcher also reads each model's ``ModelDeployment``
(group ``hetsched.io``, named like the model's ``hetsched.io/model`` label):
its ``spec.routing.policy`` is the model's policy unless the router's own
file sets one for that model (``policies_from_deployments``), and its
``spec.objectives`` the model's request classes unless the file declares
some (``objectives_from_deployments``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hetsched.errors import BackendUnavailableError, InputError
from hetsched.router.types import Endpoint, Policy, RequestClass
from hetsched.specs.durations import parse_duration_s
from hetsched.specs.workload import SLO
from hetsched.specs.wire import (GROUP, KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, MODEL_DEPLOYMENT_PLURAL, VERSION, Label,
                                 Role, device_of_label)

log = logging.getLogger(__name__)


def _ready(pod: Any) -> bool:
    conditions = getattr(pod.status, "conditions", None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def serving(pod: Any) -> bool:
    """Whether a pod can take requests now: Ready, not being deleted, with an IP."""
    return pod.metadata.deletion_timestamp is None and bool(pod.status.pod_ip) and _ready(pod)


@dataclass(frozen=True)
class PodLabels:
    """What hetsched's labels on a pod say; None where a label is absent."""

    accelerator: str | None
    """Catalog device id, the partition decoded: ``h100-sxm:3g.40gb``."""
    tp: int | None
    role: Role
    attention_backend: str = ""


def read_pod_labels(labels: Mapping[str, str]) -> PodLabels:
    """hetsched's labels on a pod; a ``tp`` or ``role`` it cannot read is a ValueError naming the label."""
    accelerator = labels.get(Label.ACCELERATOR)
    value = labels.get(Label.TP)
    tp = int(value) if value is not None and value.isascii() and value.isdigit() else None
    if value is not None and not tp:
        raise ValueError(f"label {Label.TP}={value!r} is not a positive integer")
    try:
        role = Role(labels.get(Label.ROLE, Role.UNIFIED))
    except ValueError:
        raise ValueError(f"label {Label.ROLE}={labels[Label.ROLE]!r} is not one of {', '.join(Role)}") from None
    return PodLabels(accelerator=device_of_label(accelerator) if accelerator else None, tp=tp, role=role,
                     attention_backend=labels.get(Label.ATTENTION_BACKEND, ""))


def named_port(pod: Any, name: str) -> int | None:
    """The pod's container port called ``name``, if any."""
    for container in getattr(pod.spec, "containers", None) or []:
        for port in getattr(container, "ports", None) or []:
            if port.name == name:
                return int(port.container_port)
    return None


def kv_event_addresses(pod: Any) -> tuple[str, str]:
    """An :class:`Endpoint`'s ``kv_events`` and ``kv_events_replay`` from the pod's named ports (none: empty)."""
    ports = (named_port(pod, KV_EVENTS_PORT), named_port(pod, KV_EVENTS_REPLAY_PORT))
    events, replay = (f"tcp://{pod.status.pod_ip}:{port}" if port is not None else "" for port in ports)
    return events, replay


def endpoints_from_pods(pods: Iterable[Any], *, models: Iterable[str], default_port: int) -> dict[str, list[Endpoint]]:
    """Endpoints per configured model from pod objects (``kubernetes`` V1Pod or look-alikes)."""
    found: dict[str, list[Endpoint]] = {m: [] for m in models}
    for pod in pods:
        labels = pod.metadata.labels or {}
        model = labels.get(Label.MODEL)
        if model not in found or not serving(pod):
            continue
        try:
            told = read_pod_labels(labels)
        except ValueError as exc:
            log.warning("pod %s: %s; skipped", pod.metadata.name, exc)
            continue
        if told.accelerator is None:
            continue
        port = named_port(pod, "http") or default_port
        events, replay = kv_event_addresses(pod)
        found[model].append(Endpoint(url=f"http://{pod.status.pod_ip}:{port}", model=model,
                                     accelerator=told.accelerator, tp=told.tp or 1, role=told.role,
                                     attention_backend=told.attention_backend, kv_events=events,
                                     kv_events_replay=replay))
    for endpoints in found.values():
        endpoints.sort(key=lambda e: e.url)
    return found


def policies_from_deployments(items: Iterable[Mapping[str, Any]], *, models: Iterable[str]) -> dict[str, Policy]:
    """The routing policy each configured model's ModelDeployment asks for (``spec.routing.policy``),
    by the resource's name; one that sets none, or one the router does not know, is left out."""
    wanted = set(models)
    found: dict[str, Policy] = {}
    for item in items:
        name = (item.get("metadata") or {}).get("name")
        value = ((item.get("spec") or {}).get("routing") or {}).get("policy")
        if name not in wanted or value is None:
            continue
        try:
            found[name] = Policy(value)
        except ValueError:
            log.warning("ModelDeployment %s: routing policy %r is not one of %s; the router's own applies", name,
                        value, ", ".join(p.value for p in Policy))
    return found


def objectives_from_deployments(items: Iterable[Mapping[str, Any]], *,
                                models: Iterable[str]) -> dict[str, list[RequestClass]]:
    """The request classes each configured model's ModelDeployment declares (``spec.objectives``, each without an
    SLO taking the resource's ``spec.slo``; none when it declares none), by the resource's name; one whose
    objectives cannot be read is left out with a warning."""
    wanted = set(models)
    found: dict[str, list[RequestClass]] = {}
    for item in items:
        name = (item.get("metadata") or {}).get("name")
        spec = item.get("spec") or {}
        if name not in wanted:
            continue
        try:
            default = _slo(spec["slo"]) if spec.get("slo") else None
            found[name] = [RequestClass(o["name"], priority=int(o.get("priority", 0)),
                                        slo=_slo(o["slo"]) if o.get("slo") else default,
                                        sheddable=bool(o.get("sheddable", False)), share=o.get("share"),
                                        best_effort=bool(o.get("bestEffort", False)))
                           for o in spec.get("objectives") or ()]
        except (KeyError, TypeError, ValueError, InputError) as exc:
            log.warning("ModelDeployment %s: objectives not read (%s); the router file's classes apply", name, exc)
    return found


def _slo(raw: Mapping[str, Any]) -> SLO:
    return SLO(ttft_ms=parse_duration_s(raw["ttft"], field="ttft", positive=True) * 1e3,
               tpot_ms=parse_duration_s(raw["tpot"], field="tpot", positive=True) * 1e3)


def load_kubernetes_config() -> None:
    """Point the Kubernetes client at this pod's cluster, else at the kubeconfig; neither is one clear error."""
    try:
        from kubernetes import config
    except ImportError as exc:
        raise BackendUnavailableError(f"Kubernetes discovery needs the 'serve' extra: pip install 'hetsched[serve]' "
                                      f"({exc})") from exc
    try:
        config.load_incluster_config()
        return
    except config.ConfigException as exc:
        in_cluster = str(exc)
    try:
        config.load_kube_config()
    except Exception as exc:  # noqa: BLE001 - a missing, unreadable or malformed kubeconfig is the same answer
        raise BackendUnavailableError(f"cannot reach a Kubernetes API server: not in a cluster ({in_cluster}) and "
                                      f"no usable kubeconfig ({exc}); use discovery kind 'static' outside a "
                                      "cluster") from exc


class PodWatcher:
    """Watches labelled pods in a thread and hands each new endpoint set to ``on_change`` on the event loop;
    on every listing (at least once a minute) it also hands the models' ModelDeployment policies to
    ``on_policies`` and their objectives to ``on_objectives``."""

    def __init__(self, *, models: list[str], namespace: str | None, label_selector: str, default_port: int,
                 on_change: Callable[[dict[str, list[Endpoint]]], None],
                 on_policies: Callable[[dict[str, Policy]], None],
                 on_objectives: Callable[[dict[str, list[RequestClass]]], None]) -> None:
        self._models, self._namespace, self._selector = models, namespace, label_selector
        self._default_port, self._on_change, self._on_policies = default_port, on_change, on_policies
        self._on_objectives = on_objectives
        self._policies_readable = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client

        load_kubernetes_config()
        api = client.CoreV1Api()
        self._thread = threading.Thread(target=self._run, args=(api, client.CustomObjectsApi(), loop),
                                        name="pod-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, api: Any, custom: Any, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import watch

        pods: dict[str, Any] = {}
        while not self._stop.is_set():
            try:
                self._publish_policies(custom, loop)
                listing = (api.list_namespaced_pod(self._namespace, label_selector=self._selector)
                           if self._namespace else api.list_pod_for_all_namespaces(label_selector=self._selector))
                pods = {p.metadata.uid: p for p in listing.items}
                self._publish(pods, loop)
                stream = watch.Watch().stream(
                    api.list_namespaced_pod if self._namespace else api.list_pod_for_all_namespaces,
                    *([self._namespace] if self._namespace else []), label_selector=self._selector,
                    resource_version=listing.metadata.resource_version, timeout_seconds=60)
                for event in stream:
                    pod = event["object"]
                    if event["type"] == "DELETED":
                        pods.pop(pod.metadata.uid, None)
                    else:
                        pods[pod.metadata.uid] = pod
                    self._publish(pods, loop)
                    if self._stop.is_set():
                        return
            except Exception as exc:  # noqa: BLE001 - keep watching through API hiccups
                log.warning("pod watch failed (%s); retrying in 2 s", exc)
                self._stop.wait(2.0)

    def _publish_policies(self, custom: Any, loop: asyncio.AbstractEventLoop) -> None:
        plural = MODEL_DEPLOYMENT_PLURAL
        try:
            listing = (custom.list_namespaced_custom_object(GROUP, VERSION, self._namespace, plural)
                       if self._namespace else custom.list_cluster_custom_object(GROUP, VERSION, plural))
        except Exception as exc:  # noqa: BLE001 - no CRD or no RBAC: the router's own policies apply
            if self._policies_readable:
                log.warning("cannot read ModelDeployments (%s); the router file's policies apply", exc)
            self._policies_readable = False
            return
        self._policies_readable = True
        items = listing.get("items") or []
        loop.call_soon_threadsafe(self._on_policies, policies_from_deployments(items, models=self._models))
        loop.call_soon_threadsafe(self._on_objectives, objectives_from_deployments(items, models=self._models))

    def _publish(self, pods: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
        found = endpoints_from_pods(pods.values(), models=self._models, default_port=self._default_port)
        loop.call_soon_threadsafe(self._on_change, found)
