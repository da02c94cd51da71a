"""Errors name what the user typed (a flag, an environment variable, a place in a file), and the docs say so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import HetschedError
from hetsched.specs.registry import bundled_model_names

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _error(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """The exit code and message of a failing command line, run on a store of its own."""
    result = runner.invoke(app, args, env={"HETSCHED_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}"})
    if isinstance(result.exception, HetschedError):
        return result.exception.exit_code, str(result.exception)
    return result.exit_code, result.output


@pytest.mark.parametrize(("args", "start"), [
    (["capacity", "qwen3-0.6b", "l4", "--max-num-seqs", "0"], "Invalid value for '--max-num-seqs'"),
    (["capacity", "qwen3-0.6b", "l4", "--max-num-batched-tokens", "0"], "Invalid value for '--max-num-batched-tokens'"),
    (["capacity", "qwen3-0.6b", "l4", "--no-cache", "--input-buckets", "2048,512"],
     "--input-buckets: expected increasing positive token counts"),
    (["capacity", "qwen3-0.6b", "l4", "--no-cache", "--output-buckets", "0"],
     "--output-buckets: expected increasing positive token counts"),
])
def test_bad_capacity_flags_are_named(args: list[str], start: str, tmp_path: Path) -> None:
    code, message = _error(args, tmp_path)
    assert code == 2
    assert start in message and "max_num" not in message and "_edges" not in message


def test_a_current_plan_that_is_not_one_names_the_flag(tmp_path: Path) -> None:
    current = tmp_path / "current.yaml"
    current.write_text("x: 1\n")
    chat = str(ROOT / "examples" / "chat.yaml")
    code, message = _error(["plan", chat, "--current", str(current)], tmp_path)
    assert code == 2 and message.startswith("--current: ") and "written by 'hetsched plan -o yaml'" in message
    code, message = _error(["plan", chat, "--current", str(tmp_path / "missing.yaml")], tmp_path)
    assert code == 2 and message.startswith("--current: no such file")


def test_an_unusable_database_url_names_the_variable(tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrations"],
                           env={"HETSCHED_DATABASE_URL": f"sqlite:///{tmp_path / 'no-such-folder' / 'x.sqlite'}"})
    assert isinstance(result.exception, HetschedError) and result.exception.exit_code == 2
    assert str(result.exception).startswith("HETSCHED_DATABASE_URL: the folder")


def test_an_unknown_name_in_a_cluster_file_is_bad_input_in_that_file(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({
        "pools": [{"name": "h100", "accelerator": "h100", "nodes": 1}],
        "models": [{"name": "llama-3.1-8b", "slo": {"ttft_ms": 500, "tpot_ms": 60},
                    "workload": {"rate_rps": 10, "input_tokens": 512, "output_tokens": 128}}]}))
    code, message = _error(["plan", str(cluster)], tmp_path)
    assert code == 2 and message.startswith("pools[0].accelerator: unknown accelerator 'h100'")
    assert _error(["fit", "qwen3-8b", "h100"], tmp_path)[0] == 3  # the same name on the command line


def test_the_docs_count_the_bundled_models() -> None:
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
             "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
    said = re.search(r"(\w+) real model configs are bundled", (ROOT / "docs" / "perf.md").read_text())
    assert said is not None and said.group(1).lower() == words[len(bundled_model_names())]
