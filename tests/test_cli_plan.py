"""``hetsched plan --partition-config-out``: the folder holds exactly the new plan's files, or stays as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import InputError

EXAMPLES = Path(__file__).parent.parent / "examples"
runner = CliRunner()


def _amd_cluster(tmp_path: Path) -> Path:
    """A plan with AMD partitions, so that it writes dcm-config.json too."""
    cluster = tmp_path / "amd.yaml"
    cluster.write_text(yaml.safe_dump({
        "pools": [{"name": "mi300x", "accelerator": "mi300x", "nodes": 2, "mig_allowed": True}],
        "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                    "workload": {"rate_rps": 10, "input_tokens": 500, "output_tokens": 100}}],
        "capacities": [{"model": "qwen3-0.6b", "device": "mi300x", "requests_per_s": 8},
                       {"model": "qwen3-0.6b", "device": "mi300x:cpx_nps1", "requests_per_s": 5}]}))
    return cluster


def _plan(cluster: Path, out: Path) -> object:
    return runner.invoke(app, ["plan", str(cluster), "--partition-config-out", str(out), "-o", "json"])


def test_the_former_flag_name_still_writes_the_files_and_says_it_is_going(tmp_path: Path) -> None:
    out = tmp_path / "configs"
    result = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml"), "--mig-config-out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "node-labels.yaml"]
    assert ("warning: --mig-config-out is deprecated and read until the next release: use --partition-config-out"
            in " ".join(result.stderr.split()))
    both = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml"), "--mig-config-out", str(out),
                               "--partition-config-out", str(out)])
    assert isinstance(both.exception, InputError)
    assert str(both.exception) == "--mig-config-out: give --partition-config-out or its former name --mig-config-out, not both"
    assert "--mig-config-out" not in runner.invoke(app, ["plan", "--help"]).output


def test_a_mistake_in_a_models_config_file_is_reported_at_the_field_that_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({
        "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
        "models": [{"name": "tiny", "model": "./tiny", "workload": {"rate_rps": 1, "input_tokens": 500, "output_tokens": 100}}],
        "capacities": [{"model": "tiny", "device": "l4", "requests_per_s": 8}]}))
    result = runner.invoke(app, ["plan", str(cluster)])
    assert isinstance(result.exception, InputError) and result.exception.field == "models[0].model"
    assert str(result.exception) == (f"models[0].model: num_hidden_layers: required field is missing in "
                                     f"{tmp_path / 'tiny' / 'config.json'}")


def test_a_file_the_new_plan_does_not_make_is_removed(tmp_path: Path) -> None:
    out = tmp_path / "configs"
    first = _plan(_amd_cluster(tmp_path), out)
    assert first.exit_code == 0, first.output
    assert (out / "dcm-config.json").exists()
    (out / "notes.txt").write_text("mine")
    second = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml"), "--partition-config-out", str(out),
                                 "-o", "json"])
    assert second.exit_code == 0, second.output
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "node-labels.yaml", "notes.txt"]
    said = "".join(second.stderr.split())  # as printed, less the line breaks of the terminal's width
    assert f"removed{out / 'dcm-config.json'},whichthisplandoesnotneed" in said


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "configs"
    assert _plan(_amd_cluster(tmp_path), out).exit_code == 0
    before = {p.name: p.read_text() for p in out.iterdir()}
    (out / "dcm-config.json").unlink()
    (out / "dcm-config.json").mkdir()  # the last file of the set cannot go in
    before.pop("dcm-config.json")
    result = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml"), "--partition-config-out", str(out)])
    assert isinstance(result.exception, InputError)
    assert str(result.exception).startswith(f"--partition-config-out: {out / 'dcm-config.json'} is a folder")
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "dcm-config.json", "node-labels.yaml"]


def test_an_unwritable_folder_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml"), "--partition-config-out",
                                 str(blocker / "configs")])
    assert isinstance(result.exception, InputError)
    assert str(result.exception).startswith(f"--partition-config-out: cannot create the folder {blocker / 'configs'}")


def test_a_write_that_fails_part_way_puts_nothing_in_place(tmp_path: Path) -> None:
    out = tmp_path / "configs"
    cluster = _amd_cluster(tmp_path)
    assert _plan(cluster, out).exit_code == 0
    before = {p.name: p.read_text() for p in out.iterdir()}
    (out / ".dcm-config.json.tmp").mkdir()  # config.yaml and node-labels.yaml are written before this one fails
    result = _plan(cluster, out)
    assert isinstance(result.exception, InputError)
    assert f"cannot write {out / 'dcm-config.json'}" in str(result.exception)
    assert f"{out} was left as it was" in str(result.exception)
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == before
