"""A small async Kubernetes client for the operator shell: list/get/create/patch/delete with retries.

Conflicts (409), throttling (429), server errors (5xx) and timeouts are
retried with exponential backoff; what still fails becomes a
``BackendUnavailableError``. Listing filters by labels on this side too, so
a server that ignores ``labelSelector`` still gives the right answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from hetsched.errors import BackendUnavailableError, InputError
from hetsched.settings.operator import RetryPolicy
from hetsched.specs.gateway import INFERENCE_POOL_API, INFERENCE_POOL_PLURAL
from hetsched.specs.wire import ACCELERATOR_POOL_PLURAL, API_VERSION, MODEL_DEPLOYMENT_PLURAL, PLACEMENT_PLAN_PLURAL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate; shared by kopf's watches and this client."""

    server: str
    token: str | None = None
    ca_path: str | None = None
    certificate_path: str | None = None
    private_key_path: str | None = None
    insecure: bool = False


def connection_from_kubeconfig(path: Path | None = None, *, context: str | None = None) -> Connection:
    """In-cluster service-account credentials, or a kubeconfig file (``$KUBECONFIG`` / ``~/.kube/config``)."""
    from kubernetes import config as kube_config
    from kubernetes.client import Configuration

    configuration = Configuration()
    try:
        if path is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            kube_config.load_kube_config(config_file=str(path) if path else None, context=context,
                                         client_configuration=configuration)
    except kube_config.ConfigException as exc:
        raise InputError(f"no usable Kubernetes credentials: {exc}", field="--kubeconfig") from exc
    bearer = (configuration.api_key or {}).get("authorization") or (configuration.api_key or {}).get("BearerToken")
    token = bearer.removeprefix("Bearer ").strip() if bearer else None
    return Connection(server=configuration.host, token=token, ca_path=configuration.ssl_ca_cert,
                      certificate_path=configuration.cert_file, private_key_path=configuration.key_file,
                      insecure=not configuration.verify_ssl)


@dataclass(frozen=True)
class Kind:
    """Where a kind of object lives in the API."""

    api: str
    plural: str
    namespaced: bool

    def collection(self, namespace: str | None = None) -> str:
        prefix = "/api/v1" if self.api == "v1" else f"/apis/{self.api}"
        if self.namespaced and namespace:
            return f"{prefix}/namespaces/{namespace}/{self.plural}"
        return f"{prefix}/{self.plural}"

    def item(self, name: str, namespace: str | None = None) -> str:
        return f"{self.collection(namespace)}/{name}"


KINDS: dict[str, Kind] = {
    "Node": Kind("v1", "nodes", False),
    "Pod": Kind("v1", "pods", True),
    "Service": Kind("v1", "services", True),
    "ConfigMap": Kind("v1", "configmaps", True),
    "Event": Kind("v1", "events", True),
    "Deployment": Kind("apps/v1", "deployments", True),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets", True),
    "InferencePool": Kind(INFERENCE_POOL_API, INFERENCE_POOL_PLURAL, True),
    "AcceleratorPool": Kind(API_VERSION, ACCELERATOR_POOL_PLURAL, False),
    "ModelDeployment": Kind(API_VERSION, MODEL_DEPLOYMENT_PLURAL, True),
    "PlacementPlan": Kind(API_VERSION, PLACEMENT_PLAN_PLURAL, False),
}


_RETRIED = {409, 429, 500, 502, 503, 504}


class ApiError(BackendUnavailableError):
    """The API server answered an error that retries did not cure."""

    def __init__(self, message: str, *, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def _labels_match(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class KubeClient:
    """Async JSON client over httpx; one per operator process."""

    def __init__(self, connection: Connection, *, retry: RetryPolicy = RetryPolicy(),
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Accept": "application/json"}
        if connection.token:
            headers["Authorization"] = f"Bearer {connection.token}"
        verify: Any = False if connection.insecure else (connection.ca_path or True)
        cert: str | tuple[str, str] | None = None
        if connection.certificate_path:  # a certificate file holds its key too where no key file is named
            cert = ((connection.certificate_path, connection.private_key_path) if connection.private_key_path
                    else connection.certificate_path)
        self._http = httpx.AsyncClient(base_url=connection.server, headers=headers, verify=verify, cert=cert,
                                       timeout=retry.timeout_s, transport=transport)
        self._retry = retry

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, json: Any = None, params: Mapping[str, str] | None = None,
                       content_type: str | None = None, missing_ok: bool = False) -> dict[str, Any] | None:
        delay = self._retry.initial_delay_s
        last = ""
        status: int | None = None
        for attempt in range(1, self._retry.attempts + 1):
            try:
                response = await self._http.request(
                    method, path, json=json, params=params,
                    headers={"Content-Type": content_type} if content_type else None)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                status, last = None, f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status == 404 and missing_ok:
                    return None
                if status < 400:
                    return response.json() if response.content else {}
                last = f"HTTP {status}: {response.text[:300]}"
                if status not in _RETRIED or (status == 409 and method == "POST"):
                    break
            if attempt < self._retry.attempts:
                log.warning("%s %s failed (%s); retry %d in %.1fs", method, path, last, attempt, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry.max_delay_s)
        raise ApiError(f"{method} {path}: {last}", status=status)

    async def list(self, kind: str, *, namespace: str | None = None,
                   labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else None
        answer = await self._request("GET", KINDS[kind].collection(namespace), params=params)
        items = (answer or {}).get("items") or []
        return [i for i in items if _labels_match(i, labels or {})]

    async def get(self, kind: str, name: str, *, namespace: str | None = None) -> dict[str, Any] | None:
        return await self._request("GET", KINDS[kind].item(name, namespace), missing_ok=True)

    async def create(self, kind: str, body: Mapping[str, Any], *, namespace: str | None = None,
                     adopt: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Create. An object of that name that already exists (say, after a restart mid-apply) is patched
        when it carries the ``adopt`` labels, and is an error otherwise: someone else's object stays as it is."""
        name = (body.get("metadata") or {})["name"]
        try:
            return await self._request("POST", KINDS[kind].collection(namespace), json=body) or {}
        except ApiError as exc:
            if exc.status != 409 or adopt is None:
                raise
        existing = await self.get(kind, name, namespace=namespace)
        if existing is None or not _labels_match(existing, adopt):
            where = f"{namespace}/{name}" if namespace else name
            raise ApiError(f"{kind} {where} already exists and is not managed by hetsched; rename or remove it",
                           status=409)
        return await self.patch(kind, name, body, namespace=namespace)

    async def patch(self, kind: str, name: str, body: Mapping[str, Any], *, namespace: str | None = None,
                    subresource: str | None = None) -> dict[str, Any]:
        path = KINDS[kind].item(name, namespace) + (f"/{subresource}" if subresource else "")
        return await self._request("PATCH", path, json=body, content_type="application/merge-patch+json") or {}

    async def delete(self, kind: str, name: str, *, namespace: str | None = None) -> None:
        await self._request("DELETE", KINDS[kind].item(name, namespace),
                            json={"propagationPolicy": "Foreground"}, missing_ok=True)

    async def post_event(self, involved: Mapping[str, Any], *, type: str, reason: str, message: str,
                         namespace: str) -> None:
        """A core/v1 Event on ``involved`` (best effort: a failure is logged, not raised)."""
        meta = involved.get("metadata") or {}
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event_namespace = meta.get("namespace") or namespace
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta.get('name', 'hetsched')}.{time.time_ns():x}", "namespace": event_namespace},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "type": type, "reason": reason, "message": message[:1024],
            "source": {"component": "hetsched-operator"}, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": "hetsched-operator",
        }
        try:
            await self._request("POST", KINDS["Event"].collection(event_namespace), json=body)
        except BackendUnavailableError as exc:
            log.warning("could not post event %s on %s: %s", reason, meta.get("name"), exc)
