"""``hetsched web``: flags reach the server, bad ones are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.cli.web import planner_url
from hetsched.errors import InputError

runner = CliRunner()


def test_web_serves_the_planner_on_the_given_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    served: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **kwargs: served.update(app=asgi, **kwargs))
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    result = runner.invoke(app, ["web", "--host", "0.0.0.0", "--port", "9123", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert "http://127.0.0.1:9123/" in result.output
    assert served["host"] == "0.0.0.0" and served["port"] == 9123
    assert isinstance(served["app"], FastAPI)
    assert TestClient(served["app"]).get("/api/info").json()["database"] == url
    assert (tmp_path / "plans.sqlite").is_file()


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
