"""The spec commands: tables for people, stable JSON for scripts, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hetsched.cli import app

runner = CliRunner()


def run_json(*args: str) -> object:
    result = runner.invoke(app, [*args, "-o", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_models_list_json_has_stable_fields() -> None:
    models = run_json("models", "list")
    assert isinstance(models, list) and len(models) >= 10
    first = models[0]
    for field in ("name", "attention", "layers", "total_params", "active_params", "layer_kinds", "moe", "mla"):
        assert field in first


def test_models_show_table() -> None:
    result = runner.invoke(app, ["models", "show", "deepseek-v3"])
    assert result.exit_code == 0
    assert "kv_lora_rank" in result.stdout


def test_accelerators_list_and_show() -> None:
    accs = run_json("accelerators", "list")
    ids = {a["id"] for a in accs}  # type: ignore[index]
    assert {"h100-sxm", "mi300x", "cpu"} <= ids
    h100 = run_json("accelerators", "show", "h100-sxm")
    assert "3g.40gb" in h100["mig_profiles"]  # type: ignore[index]
    assert h100["mig_layouts"] > 20  # type: ignore[index]


def test_fit_json_for_slices_and_partitions() -> None:
    fits = run_json("fit", "qwen3-8b", "l4", "h100-sxm:1g.10gb", "mi300x:cpx_nps4", "--context", "4096")
    by_device = {f["device"]: f for f in fits}  # type: ignore[union-attr]
    assert by_device["l4"]["fits"] and not by_device["h100-sxm:1g.10gb"]["fits"]
    assert "GB" in by_device["h100-sxm:1g.10gb"]["reason"]


def test_fit_defaults_to_the_whole_catalog_with_smallest_tp() -> None:
    fits = run_json("fit", "llama-3.1-70b", "--dtype", "fp8")
    assert len(fits) >= 14  # type: ignore[arg-type]
    assert all(f["weight_dtype"] == "fp8" for f in fits)  # type: ignore[union-attr]


def test_estimate_json() -> None:
    out = run_json("estimate", "llama-3.1-8b", "h100-sxm", "--batch", "16", "--context", "2048")
    assert out["step_ms"] > 0 and out["tokens"] == 16  # type: ignore[index]
    assert {op["op"] for op in out["ops"]} >= {"mlp", "attention decode"}  # type: ignore[index]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["fit", "no-such-model", "l4"], 3, "unknown model"),
        (["fit", "qwen3-8b", "h100"], 3, "did you mean"),
        (["fit", "qwen3-8b", "l4", "--dtype", "fp7"], 2, "--dtype: expected one of"),
        (["estimate", "qwen3-8b", "l4", "--batch", "0"], 2, "--batch"),
        (["fit", "qwen3-8b", "h100-sxm:9g.99gb"], 3, "unknown MIG profile"),
    ],
)
def test_errors_have_exit_codes_and_messages(args: list[str], code: int, message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "hetsched", *args], capture_output=True, text=True)
    assert result.returncode == code
    assert message in result.stderr
