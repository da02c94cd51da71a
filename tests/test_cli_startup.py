"""Start-up of the command line: ``--help`` and the commands a script calls once per shape (``fit``, ``estimate``,
``models show``, ``capacity`` on a cached answer) import no heavy dependency, and the help they list is true.

The tests read what a command line loads from a fresh interpreter's ``sys.modules`` instead of timing it, so they
hold on a loaded machine too."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetsched.catalog import load_catalog
from hetsched.cli import COMMANDS, app, loaded_commands
from hetsched.perf.calibrate import Calibration
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate
from hetsched.sim.capacity import find_capacity
from hetsched.store import cache, open_store
from hetsched.store.calibrations import save_calibration
from hetsched.store.corrections import save_correction

runner = CliRunner()

HEAVY = ("alembic", "sqlalchemy", "scipy", "fastapi", "starlette", "uvicorn", "httpx", "kopf", "kubernetes", "torch")
SIMULATOR = ("numpy",)
"""What the simulator cannot go without; the quick commands, a capacity answered from the cache among them, do."""
VALIDATION = ("pydantic", "pydantic_core")
"""What Typer loads to coerce a parameter's value, whatever its type (its own ``--help`` flag's too): every command
line that runs a command loads it. The code of ``fit``, ``estimate`` and ``models show`` goes without."""

_PROBE = """
import json, sys
report, *argv = sys.argv[1:]
sys.argv = ["hetsched", *argv]
from hetsched.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(report, "w") as f:
    json.dump({"code": code, "modules": sorted(m.partition(".")[0] for m in sys.modules)}, f)
"""


_CALL = """
import json, sys
from hetsched.cli import loaded_commands
from hetsched.cli.output import OutputFormat
report, module, names, arguments = sys.argv[1:]
first, *rest = names.split()
command = loaded_commands(module)[first]
for name in rest:
    command = command.commands[name]
kwargs = json.loads(arguments)
if "output" in kwargs:
    kwargs["output"] = OutputFormat(kwargs["output"])
command.callback(**kwargs)
with open(report, "w") as f:
    json.dump({"code": 0, "modules": sorted(m.partition(".")[0] for m in sys.modules)}, f)
"""
"""Calls a registered command's function with values as Typer would pass them, without Typer's parsing."""


def _store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.sqlite'}"


def _imported_by(tmp_path: Path, *argv: str, probe: str = _PROBE) -> set[str]:
    """Top-level packages loaded by one ``hetsched`` command line (or ``probe`` given ``argv``), run in a fresh
    interpreter."""
    report = tmp_path / "report.json"
    env = {"HETSCHED_DATABASE_URL": _store_url(tmp_path), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", probe, str(report), *argv], env=env, check=True, capture_output=True,
                   timeout=120)
    result = json.loads(report.read_text())
    assert result["code"] == 0, result
    return set(result["modules"])


@pytest.mark.parametrize("argv", [["--help"], ["fit", "llama-3.1-8b"], ["fit", "qwen3-8b", "h100-sxm:3g.40gb", "l4"],
                                  ["fit", "--help"], ["estimate", "qwen3-0.6b", "h100-sxm"],
                                  ["estimate", "llama-3.1-8b", "l4", "--batch", "8", "--prefill", "512", "-o", "json"],
                                  ["models", "show", "qwen3-0.6b"], ["models", "show", "deepseek-v3", "-o", "json"]])
def test_quick_commands_import_no_heavy_package(tmp_path: Path, argv: list[str]) -> None:
    imported = _imported_by(tmp_path, *argv)
    assert "typer" in imported  # the probe ran the real command line
    heavy = imported & {*HEAVY, *SIMULATOR}
    assert not heavy, f"hetsched {' '.join(argv)} imported {sorted(heavy)}"
    assert not (tmp_path / "store.sqlite").exists()  # reading the calibrations of no store creates none


@pytest.mark.parametrize(("command", "kwargs"), [
    ("fit", {"model": "llama-3.1-8b"}),
    ("fit", {"model": "qwen3-8b", "accelerators": ["h100-sxm:3g.40gb", "l4"], "output": "json"}),
    ("estimate", {"model": "qwen3-0.6b", "accelerator": "h100-sxm"}),
    ("estimate", {"model": "llama-3.1-8b", "accelerator": "l4", "batch": 8, "prefill": 512, "output": "json"}),
    ("models show", {"model": "qwen3-0.6b"}),
    ("models show", {"model": "deepseek-v3", "output": "json"}),
])
def test_quick_commands_leave_pydantic_to_typers_coercion(tmp_path: Path, command: str,
                                                          kwargs: dict[str, object]) -> None:
    """The command line loads pydantic for Typer (see :data:`VALIDATION`); the commands themselves load none."""
    imported = _imported_by(tmp_path, COMMANDS[command.split()[0]][0], command, json.dumps(kwargs), probe=_CALL)
    heavy = imported & {*HEAVY, *SIMULATOR, *VALIDATION}
    assert not heavy, f"{command} {kwargs} imported {sorted(heavy)}"


def test_estimate_reads_a_stored_calibration_without_the_database_library(tmp_path: Path) -> None:
    perf = load_catalog().get("a100-80gb").perf
    assert perf is not None
    store = open_store(_store_url(tmp_path))
    fitted = Calibration(dataclasses.replace(perf, source="fitted here"), {}, ())
    save_calibration(store, "a100-80gb", fitted, profile_ids=[])
    store.engine.dispose()
    imported = _imported_by(tmp_path, "estimate", "qwen3-0.6b", "a100-80gb", "-o", "json")
    assert not imported & {*HEAVY, *SIMULATOR}
    shown = runner.invoke(app, ["estimate", "qwen3-0.6b", "a100-80gb", "-o", "json"],
                          env={"HETSCHED_DATABASE_URL": _store_url(tmp_path)})
    assert json.loads(shown.stdout)["step_model"].startswith("stored calibration #1 (fitted here)")


def test_estimate_and_a_cached_capacity_read_a_stored_correction_without_the_database_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(_store_url(tmp_path))
    estimate = Estimate(key=CorrectionKey("qwen3-0.6b", "l4", 1), correction=StepCorrection(1.5, 1.5), sd=(0, 0, 0, 0),
                        observations=400, sources=2, first_at=0.0, last_at=60.0, residual_median=0.03,
                        residual_p90=0.08, trusted=True)
    correction_id = save_correction(store, estimate, origin="test")
    store.engine.dispose()
    monkeypatch.setenv("HETSCHED_DATABASE_URL", _store_url(tmp_path))
    monkeypatch.setattr(cache, "find_capacity", lambda *a, **kw: find_capacity(*a, **{**kw, "seeds": (0,)}))
    for argv in (["estimate", "qwen3-0.6b", "l4", "-o", "json"], ["capacity", "qwen3-0.6b", "l4", "-o", "json"]):
        shown = runner.invoke(app, argv)  # the capacity is searched, and cached, here
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["correction"]["id"] == correction_id
        imported = _imported_by(tmp_path, *argv)
        assert not imported & {*HEAVY, *SIMULATOR}, argv


def test_capacity_answered_from_the_cache_imports_neither_numpy_nor_the_database_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run searches (on one seed, to be quick) and caches; the second reads the cache only: had it
    missed, it would have opened the store, loading SQLAlchemy, and searched, loading NumPy and SciPy."""
    monkeypatch.setenv("HETSCHED_DATABASE_URL", _store_url(tmp_path))
    monkeypatch.setattr(cache, "find_capacity", lambda *a, **kw: find_capacity(*a, **{**kw, "seeds": (0,)}))
    argv = ["capacity", "qwen3-0.6b", "l4", "-o", "json"]
    first = runner.invoke(app, argv)
    assert first.exit_code == 0, first.output
    imported = _imported_by(tmp_path, *argv)
    heavy = imported & {*HEAVY, *SIMULATOR}
    assert "typer" in imported and not heavy, sorted(heavy)


def test_a_command_loads_its_module_when_it_runs(tmp_path: Path) -> None:
    assert "sqlalchemy" in _imported_by(tmp_path, "profiles", "list")


def test_the_listed_commands_are_the_registered_ones_with_their_help() -> None:
    registered = {}
    for module in {module for module, _ in COMMANDS.values()}:
        registered |= {name: (module, command) for name, command in loaded_commands(module).items()}
    assert set(registered) == set(COMMANDS)
    for name, (module, help_text) in COMMANDS.items():
        command_module, command = registered[name]
        assert command_module == module, name
        first_paragraph = inspect.cleandoc(command.help or "").split("\n\n")[0].replace("\n", " ")
        assert help_text == first_paragraph, name
