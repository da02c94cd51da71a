"""The import contracts declare purity per package: a module added to a package is checked without being named."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PURE_BUT_FOR_THEIR_SHELLS = ["operator", "router", "autoscale", "engine_metrics", "simworker", "server", "web",
                             "profiler", "backends", "store", "settings", "specs", "catalog", "partition", "perf",
                             "sim", "optimizer"]
"""Every package with a purity contract: all but the commands, the Triton kernels and the demo."""


def _all_but_sources(folder: str, names: list[str]) -> list[str]:
    """What ``copytree`` leaves out: data files and caches; only the import graph matters."""
    return [name for name in names
            if name == "__pycache__" or not (name.endswith(".py") or (Path(folder) / name).is_dir())]


def _lint(tree: Path) -> str:
    """``lint-imports`` over the package copied to ``tree``, by the project's contracts."""
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         cwd=tree, env={"PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=120)
    return " ".join((run.stdout + run.stderr).split())  # the report wraps long lines


def test_a_new_module_of_every_pure_package_is_held_to_its_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "hetsched", tmp_path / "hetsched", ignore=_all_but_sources)
    for package in PURE_BUT_FOR_THEIR_SHELLS:
        (tmp_path / "hetsched" / package / "added.py").write_text("import httpx\n")
    (tmp_path / "hetsched" / "operator" / "added_beside.py").write_text("from hetsched.operator import kube\n")
    (tmp_path / "hetsched" / "operator" / "added_across.py").write_text("from hetsched.autoscale import scrape\n")
    report = _lint(tmp_path)
    for package in PURE_BUT_FOR_THEIR_SHELLS:
        assert f"hetsched.{package}.added -> httpx" in report, package
    assert "hetsched.operator.added_beside is not allowed to import hetsched.operator.kube" in report
    assert "hetsched.operator.added_across -> hetsched.autoscale.scrape" in report
    assert "hetsched.operator.kube is not allowed" not in report  # a shell may import its libraries
