"""``hetsched web``: flags reach the server, bad ones are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from hetsched.server.serve import uvicorn_options
from hetsched.cli import app
from hetsched.cli.web import planner_url
from hetsched.errors import InputError
from hetsched.settings.server import ServerLimits

runner = CliRunner()


def test_web_serves_the_planner_on_the_given_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    served: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **kwargs: served.update(app=asgi, **kwargs))
    monkeypatch.setenv("HETSCHED_WEB_TOKEN", "s3cret")
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    result = runner.invoke(app, ["web", "--host", "0.0.0.0", "--port", "9123", "--database-url", url])
    assert result.exit_code == 0, result.output
    banner = " ".join(result.output.split())
    assert "0.0.0.0:9123 (every IPv4 interface)" in banner and "http://127.0.0.1:9123/" in banner
    assert served["host"] == "0.0.0.0" and served["port"] == 9123
    limits = uvicorn_options(ServerLimits())  # the servers' head and keep-alive limits, on whichever HTTP stack
    assert served["timeout_keep_alive"] == 5 and set(limits) <= set(served)
    assert all(served[k] == v for k, v in limits.items() if k != "http") and served["http"].__name__ == \
        limits["http"].__name__
    assert isinstance(served["app"], FastAPI)
    assert TestClient(served["app"]).get("/api/info").json()["database"] == url
    assert (tmp_path / "plans.sqlite").is_file()


def test_listening_beyond_loopback_without_a_token_needs_insecure(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    served: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **kwargs: served.update(app=asgi, **kwargs))
    monkeypatch.delenv("HETSCHED_WEB_TOKEN", raising=False)
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    refused = runner.invoke(app, ["web", "--host", "0.0.0.0", "--database-url", url])
    assert isinstance(refused.exception, InputError) and refused.exception.field == "--host"
    assert "HETSCHED_WEB_TOKEN" in str(refused.exception) and not served
    allowed = runner.invoke(app, ["web", "--host", "0.0.0.0", "--database-url", url, "--insecure"])
    assert allowed.exit_code == 0 and "WARNING" in allowed.output and served["host"] == "0.0.0.0"
    served.clear()
    local = runner.invoke(app, ["web", "--host", "127.0.0.1", "--database-url", url])
    assert local.exit_code == 0 and "WARNING" not in local.output and served["host"] == "127.0.0.1"


def test_bad_flags_are_refused() -> None:
    bad_url = runner.invoke(app, ["web", "--database-url", "nonsense"])
    assert isinstance(bad_url.exception, InputError) and bad_url.exception.field == "--database-url"
    assert bad_url.exception.exit_code == 2
    bad_port = runner.invoke(app, ["web", "--port", "0"])
    assert bad_port.exit_code == 2 and "--port" in bad_port.output


def test_wildcard_hosts_are_opened_on_localhost() -> None:
    assert planner_url("0.0.0.0", 8080) == "http://127.0.0.1:8080/"
    assert planner_url("::1", 80) == "http://[::1]:80/"
    assert planner_url("planner.internal", 8080) == "http://planner.internal:8080/"
