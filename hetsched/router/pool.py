"""Endpoint discovery from a Gateway API Inference Extension ``InferencePool``, as the endpoint picker needs it.

An ``InferencePool`` (``inference.networking.k8s.io/v1``) selects its model servers by
``spec.selector.matchLabels`` among the pods of its own namespace; every port of ``spec.targetPorts`` on every
selected pod is an endpoint (data-parallel ranks listen on several). ``spec.appProtocol`` is ``http`` (HTTP/1.1,
the default) or ``kubernetes.io/h2c`` (HTTP/2 without TLS): cleartext either way, so endpoint URLs are ``http://``.

A pool is not only hetsched's operator's pods, so each pod's model and device come from the first that says:

1. hetsched's labels, as :mod:`hetsched.router.discovery` reads them (``hetsched.io/model``,
   ``hetsched.io/accelerator`` with its partition, ``hetsched.io/tp``, ``hetsched.io/role``);
2. the pod's node, as the vendors' labellers describe it: NVIDIA GPU Feature Discovery's ``nvidia.com/gpu.product``
   (MIG ``single`` suffixes it with the slice, ``-MIG-1g.10gb``; under ``mixed`` the pod asks for the slice,
   ``nvidia.com/mig-3g.40gb``), the AMD labeller's ``amd.com/gpu.product-name`` (or its ``beta.`` twin) with the
   partition mode the pod asks for (``amd.com/cpx_nps4``) or the node reports. Product names map to catalog ids
   through the catalog's ``products`` (data, not code); the TP degree is the count of devices the pod asks for.

A pod without a model label serves the default model; one whose device cannot be told is still an endpoint,
of accelerator :data:`UNKNOWN_ACCELERATOR` (routed by load alone), with a warning naming it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hetsched.catalog import Catalog, load_catalog
from hetsched.catalog.types import PRODUCT_LABELS, Vendor
from hetsched.errors import InputError
from hetsched.router.discovery import kv_event_addresses, load_kubernetes_config, read_pod_labels, serving
from hetsched.router.types import Endpoint
from hetsched.specs.gateway import INFERENCE_GROUP, INFERENCE_POOL_PLURAL, INFERENCE_VERSION
from hetsched.specs.wire import Label

UNKNOWN_ACCELERATOR = "unknown"
"""The accelerator of an endpoint whose device cannot be told: no catalog profile, so routed by load alone."""
AMD_LABEL_PREFIXES = ("amd.com/", "beta.amd.com/")
"""The AMD node labeller writes ``amd.com/gpu.*``, ``beta.amd.com/gpu.*`` or both, by its flags."""
RELIST_S = 30.0
"""The watcher re-reads the pool and re-lists its pods at least this often (a changed pool spec shows then)."""
NODE_REFRESH_S = 300.0
"""How long the watcher trusts the node labels it read (a node relabelled, e.g. re-partitioned, shows then)."""

_DEVICE_RESOURCE = re.compile(
    r"nvidia\.com/gpu|nvidia\.com/mig-(?P<mig>.+)|amd\.com/gpu|amd\.com/(?P<amd>[a-z]+_nps\d+)")
"""Extended resources a pod asks devices by: whole GPUs, one MIG slice profile, one AMD partition mode."""

log = logging.getLogger(__name__)


class AppProtocol(StrEnum):
    """What the pool's model servers speak on its target ports (``spec.appProtocol``)."""

    HTTP = "http"
    H2C = "kubernetes.io/h2c"


@dataclass(frozen=True)
class PoolEndpoints:
    """The endpoints of one InferencePool per served model, and what a person should know about how they were
    told (one message per pod or pool, stable across listings so a watcher can log each once)."""

    endpoints: dict[str, list[Endpoint]]
    warnings: list[str]
    app_protocol: AppProtocol = AppProtocol.HTTP


@dataclass(frozen=True)
class _Asked:
    """The devices a pod asks for in its containers' limits (else requests)."""

    count: int
    mig_profile: str | None = None
    amd_mode: str | None = None


@dataclass(frozen=True)
class _Untold:
    """Why a node does not tell a pod's device."""

    reason: str


def pool_selector(pool: Mapping[str, Any]) -> dict[str, str]:
    """The pool's ``spec.selector.matchLabels`` (empty when missing)."""
    selector = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {str(k): str(v) for k, v in selector.items()}


def label_selector(match_labels: Mapping[str, str]) -> str:
    """``matchLabels`` as a Kubernetes list call's ``labelSelector`` (``k=v,k2=v2``)."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def endpoints_from_pool(pool: Mapping[str, Any], pods: Iterable[Any], nodes: Mapping[str, Any], *,
                        models: Sequence[str], default_model: str | None, catalog: Catalog) -> PoolEndpoints:
    """Endpoints per model in ``models`` of the pool's selected pods (``kubernetes`` V1Pod or look-alikes) on
    ``nodes`` (node name → V1Node or a look-alike with ``.metadata.labels``), sorted by URL."""
    meta = pool.get("metadata") or {}
    namespace, where = meta.get("namespace"), f"InferencePool {meta.get('namespace')}/{meta.get('name')}"
    found: dict[str, list[Endpoint]] = {m: [] for m in models}
    warnings: list[str] = []
    selector = pool_selector(pool)
    ports, port_problems = _target_ports(pool, where)
    app_protocol, protocol_problems = _app_protocol(pool, where)
    warnings += port_problems + protocol_problems
    if not selector:
        warnings.append(f"{where} has no spec.selector.matchLabels: it selects no pods; set them to the labels of "
                        "its model servers' pods")
        return PoolEndpoints(found, warnings, app_protocol)
    for pod in pods:
        labels = pod.metadata.labels or {}
        if pod.metadata.namespace not in (None, namespace) or not _matches(labels, selector) or not serving(pod):
            continue
        name = f"{pod.metadata.namespace or namespace}/{pod.metadata.name}"
        model = labels.get(Label.MODEL) or default_model
        if model is None:
            warnings.append(f"pod {name} has no {Label.MODEL} label and no default model is set; skipped")
            continue
        if model not in found:
            log.debug("pod %s serves %s, not one of this picker's models; skipped", name, model)
            continue
        try:
            told = read_pod_labels(labels)
        except ValueError as exc:
            warnings.append(f"pod {name}: {exc}; skipped")
            continue
        asked = _asked(pod)
        accelerator = told.accelerator or _node_device(pod, nodes, asked, catalog)
        if isinstance(accelerator, _Untold):
            warnings.append(f"pod {name}: accelerator {UNKNOWN_ACCELERATOR} (no {Label.ACCELERATOR} label, "
                            f"{accelerator.reason}); routed by load alone")
            accelerator = UNKNOWN_ACCELERATOR
        tp = told.tp or asked.count or 1
        events, replay = kv_event_addresses(pod)
        found[model] += [Endpoint(url=f"http://{pod.status.pod_ip}:{port}", model=model, accelerator=accelerator,
                                  tp=tp, role=told.role, kv_events=events, kv_events_replay=replay) for port in ports]
    for endpoints in found.values():
        endpoints.sort(key=lambda e: e.url)
    return PoolEndpoints(found, warnings, app_protocol)


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _target_ports(pool: Mapping[str, Any], where: str) -> tuple[list[int], list[str]]:
    """The pool's port numbers, and a warning for each entry that is not one."""
    ports: list[int] = []
    problems: list[str] = []
    entries = (pool.get("spec") or {}).get("targetPorts") or []
    for i, entry in enumerate(entries):
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            problems.append(f"{where}: spec.targetPorts[{i}].number={number!r} is not a port (1..65535); skipped")
        elif number not in ports:
            ports.append(number)
    if not entries:
        problems.append(f"{where} has no spec.targetPorts: its pods have no endpoint; list the model servers' "
                        "ports there")
    return ports, problems


def _app_protocol(pool: Mapping[str, Any], where: str) -> tuple[AppProtocol, list[str]]:
    """The pool's protocol (HTTP/1.1 when unset), and a warning when it names one the API does not define."""
    value = (pool.get("spec") or {}).get("appProtocol") or AppProtocol.HTTP
    try:
        return AppProtocol(value), []
    except ValueError:
        return AppProtocol.HTTP, [f"{where}: spec.appProtocol={value!r} is not one of {', '.join(AppProtocol)}; "
                                  f"taken as {AppProtocol.HTTP}"]


def _asked(pod: Any) -> _Asked:
    """What devices the pod's containers ask for (the limits, else the requests)."""
    count, mig, amd = 0, None, None
    for container in getattr(pod.spec, "containers", None) or []:
        resources = getattr(container, "resources", None)
        wanted = {**(getattr(resources, "requests", None) or {}), **(getattr(resources, "limits", None) or {})}
        for resource, quantity in wanted.items():
            match = _DEVICE_RESOURCE.fullmatch(resource)
            if match is None or not str(quantity).isdigit():
                continue
            count += int(quantity)
            mig, amd = match["mig"] or mig, match["amd"] or amd
    return _Asked(count, mig, amd)


def _node_device(pod: Any, nodes: Mapping[str, Any], asked: _Asked, catalog: Catalog) -> str | _Untold:
    """The catalog device id the pod's node and requests tell, or why they do not."""
    node_name = getattr(pod.spec, "node_name", None)
    if not node_name:
        return _Untold("it is on no node yet")
    node = nodes.get(node_name)
    if node is None:
        return _Untold(f"node {node_name} could not be read")
    labels: Mapping[str, str] = node.metadata.labels or {}
    nvidia = labels.get(PRODUCT_LABELS[Vendor.NVIDIA])
    amd_key = next((p + "gpu.product-name" for p in AMD_LABEL_PREFIXES if p + "gpu.product-name" in labels), None)
    if nvidia is None and amd_key is None:
        return _Untold(f"node {node_name} has no {PRODUCT_LABELS[Vendor.NVIDIA]} or AMD label")
    product_label = PRODUCT_LABELS[Vendor.NVIDIA] if nvidia is not None else str(amd_key)
    product = labels[product_label]
    accelerator = catalog.by_product(product)
    if accelerator is None:
        return _Untold(f"node {node_name}'s {product_label}={product} names no catalog accelerator; add it to one's "
                       "products in the catalog")
    if nvidia is not None:
        _, _, single = product.partition("-MIG-")
        profile = asked.mig_profile or single or None
    else:
        profile = asked.amd_mode or next((labels[p + "gpu.compute-memory-partition"] for p in AMD_LABEL_PREFIXES
                                          if p + "gpu.compute-memory-partition" in labels), None)
        if accelerator.amd_partitions is None or profile == accelerator.amd_partitions.unpartitioned_mode():
            profile = None  # a whole GPU
    try:
        return catalog.device(f"{accelerator.id}:{profile}" if profile else accelerator.id).id
    except InputError as exc:
        return _Untold(f"node {node_name} runs {accelerator.id} partitioned as {profile}, which the catalog does not "
                       f"know ({exc})")


class InferencePoolWatcher:
    """Watches one InferencePool's pods in a thread and hands each new endpoint set to ``on_change`` on the event
    loop; ``on_synced`` hears True once the pool's pods were listed, False while the pool cannot be read.

    Pod events update the set as they come; the pool is re-read and its pods re-listed at least every
    :data:`RELIST_S`. Node labels are read for the nodes the pods run on and kept :data:`NODE_REFRESH_S`. Each
    warning is logged when it first appears, not on every listing.
    """

    def __init__(self, *, namespace: str, pool_name: str, models: Sequence[str], default_model: str | None,
                 on_change: Callable[[dict[str, list[Endpoint]]], None],
                 on_synced: Callable[[bool], None]) -> None:
        if default_model is not None and default_model not in models:
            raise InputError(f"{default_model!r} is not one of the served models {', '.join(models)}",
                             field="default_model")
        self._namespace, self._pool_name = namespace, pool_name
        self._models, self._default_model = list(models), default_model
        self._on_change, self._on_synced = on_change, on_synced
        self._where = f"InferencePool {namespace}/{pool_name}"
        self._published: dict[str, list[Endpoint]] | None = None
        self._warnings: set[str] = set()
        self._node_problems: set[str] = set()
        self._synced: bool | None = None
        self._nodes: dict[str, Any] = {}
        """Node name → V1Node, or None where it could not be read."""
        self._nodes_read_at = 0.0
        self._stop = threading.Event()
        self._watch: Any = None
        """The pod watch in progress, which ``stop`` breaks off."""
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client

        load_kubernetes_config()
        self._thread = threading.Thread(target=self._run, args=(client.CoreV1Api(), client.CustomObjectsApi(),
                                                                load_catalog(), loop),
                                        name="inference-pool-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # shuts its socket down: the thread ends now, not at the watch's timeout

    def _run(self, core: Any, custom: Any, catalog: Catalog, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                pool = self._read_pool(custom, loop)
                if pool is None:
                    self._stop.wait(5.0)
                    continue
                selector = pool_selector(pool)
                if not selector:  # nothing to list: endpoints_from_pool says why
                    self._publish(pool, {}, core, catalog, loop)
                    self._stop.wait(RELIST_S)
                    continue
                listing = core.list_namespaced_pod(self._namespace, label_selector=label_selector(selector))
                pods = {p.metadata.uid: p for p in listing.items}
                self._publish(pool, pods, core, catalog, loop)
                self._watch = watch.Watch()
                stream = self._watch.stream(core.list_namespaced_pod, self._namespace,
                                            label_selector=label_selector(selector),
                                            resource_version=listing.metadata.resource_version,
                                            timeout_seconds=int(RELIST_S), _request_timeout=RELIST_S + 5)
                for event in stream:
                    if self._stop.is_set():
                        return
                    pod = event["object"]
                    if event["type"] == "DELETED":
                        pods.pop(pod.metadata.uid, None)
                    else:
                        pods[pod.metadata.uid] = pod
                    self._publish(pool, pods, core, catalog, loop)
            except Exception as exc:  # noqa: BLE001 - keep watching through API hiccups
                if self._stop.is_set():
                    return
                log.warning("%s: pod watch failed (%s); retrying in 2 s", self._where, exc)
                self._stop.wait(2.0)

    def _read_pool(self, custom: Any, loop: asyncio.AbstractEventLoop) -> Mapping[str, Any] | None:
        """The pool, or None (logged when it turns unreadable) with readiness off."""
        from kubernetes.client.exceptions import ApiException

        group, version, plural = INFERENCE_GROUP, INFERENCE_VERSION, INFERENCE_POOL_PLURAL
        try:
            pool: Mapping[str, Any] = custom.get_namespaced_custom_object(group, version, self._namespace, plural,
                                                                          self._pool_name)
            return pool
        except ApiException as exc:
            if exc.status == 404:
                problem = (f"{self._where} not found: is the InferencePool CRD ({group}/{version}) installed and "
                           "the pool created in that namespace?")
            elif exc.status == 403:
                problem = (f"{self._where} cannot be read: the picker's service account needs get on {plural}.{group} "
                           f"({exc.reason})")
            else:
                problem = f"{self._where} cannot be read: HTTP {exc.status} {exc.reason}"
        if self._synced is not False:
            log.error("%s; not ready until it can be read", problem)
        self._set_synced(False, loop)
        return None

    def _publish(self, pool: Mapping[str, Any], pods: Mapping[str, Any], core: Any, catalog: Catalog,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._read_nodes(core, {p.spec.node_name for p in pods.values() if p.spec and p.spec.node_name})
        nodes = {name: node for name, node in self._nodes.items() if node is not None}
        found = endpoints_from_pool(pool, pods.values(), nodes, models=self._models,
                                    default_model=self._default_model, catalog=catalog)
        for warning in found.warnings:
            if warning not in self._warnings:
                log.warning("%s", warning)
        self._warnings = set(found.warnings)
        if found.endpoints != self._published:
            self._published = found.endpoints
            loop.call_soon_threadsafe(self._on_change, found.endpoints)
        self._set_synced(True, loop)

    def _read_nodes(self, core: Any, names: set[str]) -> None:
        """Keep the labels of the nodes in ``names``: read the ones not yet known, all of them when stale."""
        from kubernetes.client.exceptions import ApiException

        if time.monotonic() - self._nodes_read_at > NODE_REFRESH_S:
            self._nodes, self._nodes_read_at = {}, time.monotonic()
        for name in sorted(names - self._nodes.keys()):
            try:
                self._nodes[name] = core.read_node(name)
            except ApiException as exc:
                problem = f"node {name} cannot be read (HTTP {exc.status} {exc.reason}): the picker needs get on nodes"
                if problem not in self._node_problems:
                    log.warning("%s: %s; its pods' accelerators are told by their own labels alone", self._where,
                                problem)
                    self._node_problems.add(problem)
                self._nodes[name] = None

    def _set_synced(self, synced: bool, loop: asyncio.AbstractEventLoop) -> None:
        if synced != self._synced:
            self._synced = synced
            loop.call_soon_threadsafe(self._on_synced, synced)
