"""The operator's API client: retries with backoff, adoption on conflict, credentials from a kubeconfig."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.operator.kube import ApiError, Connection, KubeClient, connection_from_kubeconfig
from hetsched.settings.operator import RetryPolicy

FAST = RetryPolicy(attempts=3, initial_delay_s=0.001, max_delay_s=0.002, timeout_s=1.0)


def _client(handler) -> KubeClient:
    return KubeClient(Connection(server="http://api", token="t0k"), retry=FAST, transport=httpx.MockTransport(handler))


def test_timeouts_and_server_errors_are_retried_then_reported() -> None:
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        assert request.headers["Authorization"] == "Bearer t0k"
        if len(calls) == 1:
            raise httpx.ReadTimeout("slow", request=request)
        if len(calls) == 2:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json={"items": [{"metadata": {"name": "a", "labels": {"x": "1"}}},
                                                   {"metadata": {"name": "b"}}]})

    items = asyncio.run(_client(flaky).list("Deployment", namespace="ns", labels={"x": "1"}))
    assert [i["metadata"]["name"] for i in items] == ["a"]  # filtered here even if the server ignores the selector
    assert calls == ["GET", "GET", "GET"]

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="boom")

    with pytest.raises(BackendUnavailableError, match="HTTP 500"):
        asyncio.run(_client(down).get("Node", "n1"))


def test_client_errors_are_not_retried_and_missing_objects_are_none() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(404 if request.method == "GET" else 422, text="no")

    client = _client(handler)
    assert asyncio.run(client.get("ConfigMap", "c", namespace="ns")) is None
    with pytest.raises(ApiError, match="HTTP 422"):
        asyncio.run(client.patch("Node", "n1", {"metadata": {"labels": {}}}))
    assert calls == ["/api/v1/namespaces/ns/configmaps/c", "/api/v1/nodes/n1"]


@pytest.mark.parametrize(("labels", "adopted"), [({"app.kubernetes.io/managed-by": "hetsched"}, True), ({}, False)])
def test_create_adopts_only_its_own_objects(labels: dict[str, str], adopted: bool) -> None:
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.headers.get("Content-Type", "")))
        if request.method == "POST":
            return httpx.Response(409, text="exists")
        if request.method == "GET":
            return httpx.Response(200, json={"metadata": {"name": "svc", "labels": labels}})
        return httpx.Response(200, json=json.loads(request.content))

    body = {"metadata": {"name": "svc", "labels": {"app.kubernetes.io/managed-by": "hetsched"}}}
    create = _client(handler).create("Service", body, namespace="ns", adopt={"app.kubernetes.io/managed-by": "hetsched"})
    if adopted:
        assert asyncio.run(create) == body
        assert seen[-1] == ("PATCH", "application/merge-patch+json")
    else:
        with pytest.raises(ApiError, match="not managed by hetsched"):
            asyncio.run(create)
        assert [m for m, _ in seen] == ["POST", "GET"]


def test_connection_from_kubeconfig(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [{"name": "c", "cluster": {"server": "https://k8s.example:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "secret-token"}}],
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u"}}]}))
    connection = connection_from_kubeconfig(config)
    assert connection.server == "https://k8s.example:6443" and connection.token == "secret-token" and connection.insecure
    with pytest.raises(InputError, match="--kubeconfig"):
        connection_from_kubeconfig(tmp_path / "missing")


def test_operator_command_rejects_bad_flags() -> None:
    result = CliRunner().invoke(app, ["operator", "--approval", "sometimes"])
    assert result.exit_code == 2 and "'sometimes' is not one of" in result.output
    result = CliRunner().invoke(app, ["operator", "--mig-configmap", "no-slash"])
    assert isinstance(result.exception, InputError) and "NAMESPACE/NAME" in str(result.exception)
