"""``hetsched calibrate``: a failed export stores nothing, YAML on stdout is only YAML, and it says what it stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import InputError

runner = CliRunner()
A40_OPS = Path(__file__).resolve().parents[1] / "data" / "measurements" / "vidur" / "a40" / "ops" / "Llama-2-7b-hf.csv"


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store holding Vidur's A40 operator timings, which fit a trusted calibration."""
    path = tmp_path_factory.mktemp("store") / "db.sqlite"
    result = runner.invoke(app, ["profiles", "import-vidur", str(A40_OPS), "-o", "json"],
                           env={"HETSCHED_DATABASE_URL": f"sqlite:///{path}"})
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture
def a40_profiles(imported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of that store of this test's own."""
    copy = tmp_path / "db.sqlite"
    shutil.copyfile(imported, copy)
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{copy}")


def _stored() -> list[dict]:
    return json.loads(runner.invoke(app, ["calibrations", "-o", "json"]).stdout)


def test_an_export_that_cannot_be_written_stores_nothing(a40_profiles: None, tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate", "a40", "--export-yaml", str(tmp_path / "no-such-folder" / "c.yaml")])
    assert isinstance(result.exception, InputError)
    assert str(result.exception).startswith("--export-yaml: cannot write")
    assert _stored() == []
    folder = runner.invoke(app, ["calibrate", "a40", "--export-yaml", str(tmp_path)])
    assert isinstance(folder.exception, InputError) and "is a folder" in str(folder.exception)
    assert _stored() == []


def test_an_export_to_a_file_is_written_whole_next_to_the_stored_row(a40_profiles: None, tmp_path: Path) -> None:
    path = tmp_path / "perf.yaml"
    result = runner.invoke(app, ["calibrate", "a40", "--export-yaml", str(path), "-o", "json"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(path.read_text())["devices"]["a40"] == json.loads(result.stdout)["constants"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert len(_stored()) == 1


def test_yaml_on_stdout_is_all_that_stdout_carries(a40_profiles: None) -> None:
    result = runner.invoke(app, ["calibrate", "a40", "--export-yaml", "-"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert set(yaml.safe_load(result.stdout)) == {"devices"}
    assert "Calibration of a40" in result.stderr and "stored as calibration #1" in result.stderr
    both = runner.invoke(app, ["calibrate", "a40", "--export-yaml", "-", "-o", "json"])
    assert isinstance(both.exception, InputError) and str(both.exception).startswith("--export-yaml:")


def test_no_save_says_the_fit_is_not_used(a40_profiles: None) -> None:
    result = runner.invoke(app, ["calibrate", "a40", "--no-save"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "trusted: not stored (--no-save)" in result.stdout and "use it" not in result.stdout
    assert _stored() == []


def test_an_engine_fit_refuses_an_export_it_would_not_write(a40_profiles: None, tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate", "a40", "--endpoint", "http://127.0.0.1:9", "--model", "llama-2-7b",
                                 "--export-yaml", str(tmp_path / "c.yaml")])
    assert isinstance(result.exception, InputError)
    assert str(result.exception).startswith("--export-yaml: cannot be used with --endpoint")
