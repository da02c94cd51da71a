"""The router's and the simulated worker's guards through ASGI (token, content type, body size and time, Host),
and their commands' refusal to listen beyond loopback without a token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from typer.testing import CliRunner

from hetsched.cli import app as cli
from hetsched.errors import InputError
from hetsched.router.app import create_router_app
from hetsched.router.config import parse_router_config
from hetsched.settings.server import ServerLimits
from hetsched.simworker import WorkerSpec, create_worker_app

MODEL = "qwen3-0.6b"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
runner = CliRunner()


def _router(**overrides: object) -> Starlette:
    raw: dict = {"models": {MODEL: {"endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "l4"}]}}}
    raw.update(overrides)
    return create_router_app(parse_router_config(raw))


def _call(app: Starlette, method: str, path: str, *, base_url: str = "http://testserver",
          **kwargs: object) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as client:
            return await client.request(method, path, **kwargs)  # type: ignore[arg-type]
    return asyncio.run(run())


async def _trickle() -> AsyncIterator[bytes]:
    yield b'{"model": '
    await asyncio.sleep(0.5)
    yield b'"x"}'


def test_the_router_token_covers_every_route_but_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_ROUTER_TOKEN", "s3cret")
    app = _router(auth_token_env="TEST_ROUTER_TOKEN")
    assert _call(app, "GET", "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/router/endpoints"), ("GET", "/metrics"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        for header in (None, "Bearer wrong", "Basic s3cret", "s3cret"):
            response = _call(app, method, path, json=BODY, headers={"Authorization": header} if header else {})
            assert response.status_code == 401, (method, path, header)
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret"):
        assert _call(app, "GET", "/router/endpoints", headers={"Authorization": header}).status_code == 200
        assert _call(app, "GET", "/metrics", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_the_router_refuses_posts_that_are_not_json(content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    response = _call(_router(), "POST", "/v1/completions", content=b'{"model": "x"}', headers=headers)
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"


def test_the_router_refuses_large_and_slow_bodies_before_routing() -> None:
    """Told by status, not by the clock: the two bytes under a huge Content-Length would pass a check of the body
    read, and the trickle's whole body would be routed (a 404 for model "x") had its time not run out."""
    app = _router(max_body_bytes=2048, body_timeout_s=0.2)
    claimed = _call(app, "POST", "/v1/completions", content=b"{}",
                    headers={"Content-Type": "application/json", "Content-Length": "999999999999"})
    assert claimed.status_code == 413 and claimed.json()["error"]["code"] == "request_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b" " * 1000

    chunked = _call(app, "POST", "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and chunked.headers["connection"] == "close"
    slow = _call(app, "POST", "/v1/completions", content=_trickle(), headers={"Content-Type": "application/json"})
    assert slow.status_code == 408 and slow.json()["error"]["type"] == "timeout"


def test_the_router_checks_host_names() -> None:
    local = _router()
    base = "http://127.0.0.1:8000"
    ok = _call(local, "GET", "/router/endpoints", base_url=base, headers={"Host": "localhost:8000"})
    assert ok.status_code == 200
    rebound = _call(local, "GET", "/router/endpoints", base_url=base, headers={"Host": "evil.example"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
    assert _call(local, "GET", "/health", base_url="http://127.0.0.1:8000", headers={"Host": "10.1.2.3"}).status_code \
        == 200
    listed = _router(allowed_hosts=["router.serving.svc"])
    assert _call(listed, "GET", "/router/endpoints", headers={"Host": "router.serving.svc:8000"}).status_code == 200
    assert _call(listed, "GET", "/router/endpoints", headers={"Host": "evil.example"}).status_code == 400


def test_the_worker_has_a_body_limit_a_body_timeout_and_an_api_key_on_v1() -> None:
    app = create_worker_app(WorkerSpec(model=MODEL, accelerator="l4"), api_key="k3y",
                            limits=ServerLimits(max_body_bytes=2048, body_timeout_s=0.2))
    key = {"Authorization": "Bearer k3y"}
    assert _call(app, "GET", "/v1/models").status_code == 401
    assert _call(app, "GET", "/v1/models", headers=key).status_code == 200
    assert _call(app, "GET", "/health").status_code == 200
    assert _call(app, "GET", "/metrics").status_code == 200
    big = _call(app, "POST", "/v1/completions", json={**BODY, "prompt": "x" * 4096}, headers=key)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    plain = _call(app, "POST", "/v1/completions", content=b"{}", headers={**key, "Content-Type": "text/plain"})
    assert plain.status_code == 415
    slow = _call(app, "POST", "/v1/completions", content=_trickle(),
                 headers={**key, "Content-Type": "application/json"})
    assert slow.status_code == 408


def test_the_worker_limits_bodies_by_default() -> None:
    app = create_worker_app(WorkerSpec(model=MODEL, accelerator="l4"))
    huge = _call(app, "POST", "/v1/completions", content=b"{}",
                 headers={"Content-Type": "application/json", "Content-Length": str(ServerLimits.max_body_bytes + 1)})
    assert huge.status_code == 413


def test_route_and_sim_worker_refuse_to_listen_beyond_loopback_without_a_token(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    served: list[dict[str, object]] = []
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **kwargs: served.append(kwargs))
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{tmp_path / 'store.sqlite'}")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"auth_token_env": "TEST_ROUTER_TOKEN", "models": {MODEL: {"endpoints": []}}}))
    open_config = tmp_path / "open.yaml"
    open_config.write_text(yaml.safe_dump({"models": {MODEL: {"endpoints": []}}}))
    worker = ["sim-worker", "--model", MODEL, "--accelerator", "l4", "--host", "0.0.0.0"]
    for args in (["route", "-c", str(open_config), "--host", "0.0.0.0"], worker):
        refused = runner.invoke(cli, args)
        assert isinstance(refused.exception, InputError) and refused.exception.field == "--host", refused.output
        assert "--insecure" in str(refused.exception) and not served
        warned = runner.invoke(cli, [*args, "--insecure"])
        assert warned.exit_code == 0 and "WARNING" in warned.output and "0.0.0.0:" in warned.output
        assert served.pop()["host"] == "0.0.0.0"
    monkeypatch.setenv("TEST_ROUTER_TOKEN", "s3cret")
    with_token = runner.invoke(cli, ["route", "-c", str(config), "--host", "0.0.0.0", "--port", "8001"])
    assert with_token.exit_code == 0 and "WARNING" not in with_token.output
    assert "0.0.0.0:8001 (every IPv4 interface)" in " ".join(with_token.output.split())
    assert served.pop()["timeout_keep_alive"] == ServerLimits.keep_alive_s
    keyed = tmp_path / "keyed.yaml"
    keyed.write_text(yaml.safe_dump({"api_keys": [{"key_env": "TEST_UNSET_KEY", "tenant": "t"}],
                                     "models": {MODEL: {"endpoints": []}}}))
    monkeypatch.delenv("TEST_UNSET_KEY", raising=False)
    unset = runner.invoke(cli, ["route", "-c", str(keyed)])
    assert isinstance(unset.exception, InputError) and unset.exception.field == "api_keys[0].key_env"
    assert "listening" not in unset.output and not served
    with_key = runner.invoke(cli, [*worker, "--api-key", "k3y"])
    assert with_key.exit_code == 0 and "WARNING" not in with_key.output
