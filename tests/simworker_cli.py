"""``hetsched sim-worker`` run up to where it would serve, for the tests of its flags."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from typer.testing import CliRunner

from hetsched.cli import app as cli
from hetsched.simworker.app import SimWorker

MODEL = "qwen3-0.6b"
runner = CliRunner()
Start = Callable[..., tuple[SimWorker, str]]


@pytest.fixture
def start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Start:
    """``hetsched sim-worker`` with these flags, up to where it would serve: its worker and its banner."""
    served: list[Starlette] = []
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **kwargs: served.append(asgi))
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{tmp_path / 'store.sqlite'}")

    def run(*flags: str) -> tuple[SimWorker, str]:
        result = runner.invoke(cli, ["sim-worker", "--model", MODEL, "--accelerator", "l4", "--max-model-len",
                                     "2048", *flags])
        assert result.exit_code == 0, result.output
        return served.pop().state.worker, " ".join(result.output.split())  # as one line, however it wrapped

    return run
