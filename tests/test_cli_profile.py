"""``hetsched profile``: flags and the store are checked before a sweep starts, so no measurement is lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import HetschedError

runner = CliRunner()


def _error(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The exit code and message ``hetsched`` gives for a failing command line."""
    result = runner.invoke(app, list(args), env=env)
    assert isinstance(result.exception, HetschedError), result.output
    return result.exception.exit_code, str(result.exception)


def test_an_unusable_store_fails_before_any_point_is_measured(tmp_path: Path) -> None:
    missing = f"sqlite:///{tmp_path / 'no-such-folder' / 'x.sqlite'}"
    # rocm is not on this machine: reaching the backend would mean the sweep had started
    code, message = _error("profile", "qwen3-0.6b", "--backend", "rocm", env={"HETSCHED_DATABASE_URL": missing})
    assert code == 2
    assert message.startswith("HETSCHED_DATABASE_URL: the folder") and "no-such-folder" in message


@pytest.mark.parametrize("seconds", ["0", "-5", "nan", "inf"])
def test_a_point_timeout_must_be_a_positive_number_of_seconds(seconds: str, tmp_path: Path) -> None:
    code, message = _error("profile", "qwen3-0.6b", f"--point-timeout={seconds}",
                           env={"HETSCHED_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}"})
    assert code == 2
    assert message.startswith("--point-timeout: expected a positive, finite number of seconds")
