"""Start-up of the command line: ``--help`` and ``fit`` import no heavy dependency, and the help they list is true."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetsched.cli import COMMANDS, loaded_commands

HEAVY = ("alembic", "sqlalchemy", "scipy", "fastapi", "starlette", "uvicorn", "httpx", "kopf", "kubernetes", "torch")

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


def _imported_by(tmp_path: Path, *argv: str) -> set[str]:
    """Top-level packages loaded by one ``hetsched`` command line, run in a fresh interpreter."""
    report = tmp_path / "report.json"
    env = {"HETSCHED_DATABASE_URL": f"sqlite:///{tmp_path / 'store.sqlite'}", "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", _PROBE, str(report), *argv], env=env, check=True, capture_output=True,
                   timeout=120)
    result = json.loads(report.read_text())
    assert result["code"] == 0, result
    return set(result["modules"])


@pytest.mark.parametrize("argv", [["--help"], ["fit", "llama-3.1-8b"], ["fit", "qwen3-8b", "h100-sxm:3g.40gb", "l4"],
                                  ["fit", "--help"]])
def test_quick_commands_import_no_heavy_package(tmp_path: Path, argv: list[str]) -> None:
    imported = _imported_by(tmp_path, *argv)
    assert "typer" in imported  # the probe ran the real command line
    assert not imported & set(HEAVY), f"hetsched {' '.join(argv)} imported {sorted(imported & set(HEAVY))}"


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
