"""``hetsched plan``: readable tables, YAML/JSON a tool can reload, mig-parted files, stored plans, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select
from typer.testing import CliRunner

import hetsched
from hetsched.cli import app
from hetsched.errors import InfeasibleError, InputError
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import Role
from hetsched.partition.render import mig_parted_yaml
from hetsched.store import open_store
from hetsched.store.tables import PlanRow

EXAMPLES = Path(__file__).parent.parent / "examples"
runner = CliRunner()


def test_table_output_shows_replicas_pools_nodes_and_binding_constraints() -> None:
    result = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml")], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for text in ("Plan mig-small-models", "optimal", "$/hour", "Replicas", "Pools", "Nodes", "MIG 3g.40gb@",
                 "Binding constraints", "h100-sxm:3g.40gb"):
        assert text in result.stdout


def test_json_and_yaml_outputs_load_back_as_plans(tmp_path: Path) -> None:
    as_json = runner.invoke(app, ["plan", str(EXAMPLES / "chat.yaml"), "-o", "json"])
    as_yaml = runner.invoke(app, ["plan", str(EXAMPLES / "chat.yaml"), "-o", "yaml"])
    assert as_json.exit_code == 0 and as_yaml.exit_code == 0
    from_json = Plan.model_validate(json.loads(as_json.stdout))
    from_yaml = Plan.model_validate(yaml.safe_load(as_yaml.stdout))
    assert from_json.cost_per_hour == pytest.approx(from_yaml.cost_per_hour)
    assert from_json.replica_counts() == from_yaml.replica_counts()


def test_current_plan_with_churn_weight_reports_replicas_moved(tmp_path: Path) -> None:
    current = tmp_path / "current.yaml"
    current.write_text(runner.invoke(app, ["plan", str(EXAMPLES / "mixed.yaml"), "-o", "yaml"]).stdout)
    result = runner.invoke(app, ["plan", str(EXAMPLES / "mixed.yaml"), "--current", str(current),
                                 "--churn-weight", "1", "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["replicas_moved"] == 0


def test_partition_config_out_writes_mig_parted_config_and_node_labels(tmp_path: Path) -> None:
    out = tmp_path / "mig"
    result = runner.invoke(app, ["plan", str(EXAMPLES / "mig-small-models.yaml"), "--partition-config-out", str(out), "-o", "json"])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((out / "config.yaml").read_text())
    labels = yaml.safe_load((out / "node-labels.yaml").read_text())
    assert config["version"] == "v1"
    for node, node_labels in labels.items():
        name = node_labels["nvidia.com/mig.config"]
        groups = config["mig-configs"][name]
        assert any(g["mig-enabled"] and g["mig-devices"] for g in groups), node
        assert sorted(d for g in groups for d in g["devices"]) == list(range(8))
    assert not list(out.glob(".*.tmp"))
    assert not (out / "dcm-config.json").exists()  # no AMD partitions in this plan
    plan = Plan.model_validate_json(result.stdout)
    assert (out / "config.yaml").read_text() == mig_parted_yaml(plan.mig_configs)  # the file the operator writes


def test_partition_config_out_writes_the_amd_device_config_manager_profiles(tmp_path: Path) -> None:
    cluster = tmp_path / "amd.yaml"
    slo = {"ttft_ms": 1000, "tpot_ms": 100}
    cluster.write_text(yaml.safe_dump({
        "pools": [{"name": "mi300x", "accelerator": "mi300x", "nodes": 2, "mig_allowed": True}],
        "models": [{"name": "qwen3-0.6b", "slo": slo, "workload": {"rate_rps": 10, "input_tokens": 500, "output_tokens": 100}}],
        "capacities": [{"model": "qwen3-0.6b", "device": "mi300x", "requests_per_s": 8},
                       {"model": "qwen3-0.6b", "device": "mi300x:cpx_nps1", "requests_per_s": 5}]}))
    out = tmp_path / "configs"
    result = runner.invoke(app, ["plan", str(cluster), "--partition-config-out", str(out), "-o", "json"])
    assert result.exit_code == 0, result.output
    profiles = json.loads((out / "dcm-config.json").read_text())["gpu-config-profiles"]
    labels = yaml.safe_load((out / "node-labels.yaml").read_text())
    assert yaml.safe_load((out / "config.yaml").read_text())["mig-configs"] == {  # no MIG layout: the manager's own
        "all-disabled": [{"devices": "all", "mig-enabled": False}]}
    (node_labels,) = labels.values()
    profile = profiles[node_labels["dcm.amd.com/gpu-config-profile"]]
    assert sum(p["numGPUsAssigned"] for p in profile["profiles"]) == 8
    assert profile["profiles"] == [{"computePartition": "CPX", "memoryPartition": "NPS1", "numGPUsAssigned": 8}]


def test_save_stores_plan_and_spec(tmp_path: Path, database_url: str) -> None:
    result = runner.invoke(app, ["plan", str(EXAMPLES / "chat.yaml"), "--save", "-o", "json"],
                           env={"HETSCHED_DATABASE_URL": database_url})
    assert result.exit_code == 0, result.output
    assert "saved as plan" in result.stderr
    store = open_store(database_url)
    with store.transaction() as session:
        (row,) = session.scalars(select(PlanRow)).all()
        assert (row.name, row.origin, row.status) == ("chat", "cli", "optimal")
        assert Plan.model_validate(row.plan).cost_per_hour == pytest.approx(row.cost_per_hour)
        assert row.spec["name"] == "chat"
    store.engine.dispose()


def test_a_model_config_path_is_read_from_the_cluster_files_folder_and_saved_inline(
        tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "clusters" / "my-model"
    folder.mkdir(parents=True)
    config = json.loads((Path(hetsched.__file__).parent / "specs" / "models" / "qwen3-0.6b.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    cluster = tmp_path / "clusters" / "mine.yaml"
    cluster.write_text(yaml.safe_dump({
        "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
        "models": [{"name": "mine", "model": "my-model", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                    "workload": {"rate_rps": 1, "input_tokens": 256, "output_tokens": 64}}],
        "capacities": [{"model": "mine", "device": "l4", "requests_per_s": 5}]}))
    monkeypatch.chdir(tmp_path)  # not the file's folder: the path is the file's, not the shell's
    result = runner.invoke(app, ["plan", str(cluster), "--save"], env={"HETSCHED_DATABASE_URL": database_url})
    assert result.exit_code == 0, result.output
    store = open_store(database_url)
    with store.transaction() as session:
        (row,) = session.scalars(select(PlanRow)).all()
        assert row.spec["models"][0]["config"] == config  # the stored spec solves again without the file
    store.engine.dispose()


def test_a_plan_name_too_long_to_store_is_refused_naming_it_and_nothing_is_stored(tmp_path: Path,
                                                                                  database_url: str) -> None:
    spec = yaml.safe_load((EXAMPLES / "chat.yaml").read_text())
    spec["name"] = "p" * 201
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["plan", str(path), "--save"], env={"HETSCHED_DATABASE_URL": database_url})
    assert isinstance(result.exception, InputError)
    assert str(result.exception) == "name: a stored plan's name takes at most 200 characters, got 201"
    store = open_store(database_url)
    with store.transaction() as session:
        assert session.scalars(select(PlanRow)).all() == []
    store.engine.dispose()


def test_infeasible_cluster_prints_the_reason_and_raises(tmp_path: Path) -> None:
    spec = yaml.safe_load((EXAMPLES / "chat.yaml").read_text())
    spec["pools"] = [{"name": "a10g", "accelerator": "a10g", "nodes": 1, "max_gpus": 2}]
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["plan", str(path)], env={"COLUMNS": "200"})
    assert isinstance(result.exception, InfeasibleError)
    assert "demand for llama-3.1-8b exceeds everything the inventory can supply by" in result.stdout


def test_a_cpu_pool_is_planned_on_this_machine(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({
        "pools": [{"name": "here", "accelerator": "cpu", "nodes": 1}],
        "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 2000, "tpot_ms": 200},
                    "workload": {"rate_rps": 1, "input_tokens": 128, "output_tokens": 64}}],
        "capacities": [{"model": "qwen3-0.6b", "device": "cpu", "requests_per_s": 2}]}))
    result = runner.invoke(app, ["plan", str(path), "-o", "json"])
    assert result.exit_code == 0, result.output
    plan = Plan.model_validate(json.loads(result.stdout))
    assert plan.replica_counts() == {("qwen3-0.6b", "here", "cpu", 1, Role.UNIFIED): 1}


def test_malformed_cluster_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("pools: [{name: x, accelerator: l4, nodes: two}]\nmodels: []\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert isinstance(result.exception, InputError)
    assert result.exception.field == "pools[0].nodes"
    path.write_text("pools: [oops\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert isinstance(result.exception, InputError) and "not valid YAML" in str(result.exception)


@pytest.mark.parametrize(("pool", "rate", "field", "message"), [
    ("nodes: 12501", "1", "pools[0].nodes",
     "pool 'l4' brings the pools to 100,008 GPUs, more than solver.max_inventory_gpus (100,000)"),
    ("nodes: 1, price_per_hour: .inf", "1", "pools[0].price_per_hour", "finite number"),
    ("nodes: 1", ".nan", "models[0].workload.rate_rps", "finite number"),
])
def test_sizes_and_numbers_beyond_bounds_are_refused_with_the_field(tmp_path: Path, pool: str, rate: str, field: str,
                                                                    message: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"pools: [{{name: l4, accelerator: l4, {pool}}}]\n"
                    "models: [{name: m, slo: {ttft_ms: 500, tpot_ms: 50}, "
                    f"workload: {{rate_rps: {rate}, input_tokens: 100, output_tokens: 10}}}}]\n"
                    "capacities: [{model: m, device: l4, requests_per_s: 2}]\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert isinstance(result.exception, InputError), result.output
    assert result.exception.field == field and message in str(result.exception)


def test_exit_code_of_an_infeasible_plan_is_4(tmp_path: Path) -> None:
    path = tmp_path / "none.yaml"
    path.write_text(yaml.safe_dump({
        "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1, "max_gpus": 1}],
        "models": [{"name": "m", "slo": {"ttft_ms": 100, "tpot_ms": 10},
                    "workload": {"rate_rps": 10, "input_tokens": 10, "output_tokens": 10}}],
        "capacities": [{"model": "m", "device": "l4", "requests_per_s": 1}]}))
    done = subprocess.run([sys.executable, "-m", "hetsched", "plan", str(path)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "300"})
    assert done.returncode == 4, done.stderr
    assert "demand for m exceeds everything the inventory can supply by 1000%" in done.stderr


def test_native_writes_to_stdout_go_to_stderr_and_leave_the_json_whole() -> None:
    # as the HiGHS bundled with SciPy does on large plans: a debug line written straight to descriptor 1; during
    # the solve the optimizer mutes it, around it the command sends it to stderr
    code = ("import os, sys\n"
            "import hetsched.optimizer.optimize as optimize\n"
            "import hetsched.optimizer.solve as solving\n"
            "from hetsched.cli import main\n"
            "solve, rounding = optimize.solve, solving.round_relaxation\n"
            "def chatty(problem):\n"
            "    os.write(1, b'native line around the solve\\n')\n"
            "    return solve(problem)\n"
            "def chatty_rounding(*args, **kwargs):\n"
            "    os.write(1, b'native line in the solve\\n')\n"
            "    return rounding(*args, **kwargs)\n"
            "optimize.solve, solving.round_relaxation = chatty, chatty_rounding\n"
            f"sys.argv = ['hetsched', 'plan', {str(EXAMPLES / 'chat.yaml')!r}, '-o', 'json']\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "chat"
    assert "native line around the solve" in done.stderr
    assert "native line in the solve" not in done.stderr + done.stdout


def test_melange_and_aibrix_files_plan_with_headroom_and_gap_from_flags(tmp_path: Path) -> None:
    path = tmp_path / "example.json"  # Mélange's melange/config/example.json, as its repository ships it
    path.write_text(json.dumps({"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 2]]},
                                             "A100-80GB": {"cost": 3.67, "tputs": [[20, 20], [40, 20]]}},
                                "workload_distribution": [[0.2, 0.1], [0.5, 0.2]], "total_request_rate": 30.0,
                                "slice_factor": 1}))
    plain = Plan.model_validate(json.loads(runner.invoke(app, ["plan", str(path), "-o", "json"]).stdout))
    assert plain.cost_per_hour == pytest.approx(4.68) and plain.models[0].headroom < 0.01
    result = runner.invoke(app, ["plan", str(path), "-o", "json", "--headroom", "0.2", "--mip-gap", "0"])
    assert result.exit_code == 0, result.output
    padded = Plan.model_validate(json.loads(result.stdout))
    assert padded.cost_per_hour > plain.cost_per_hour and padded.models[0].headroom >= 0.2 - 1e-6
    result = runner.invoke(app, ["plan", str(path), "--headroom", "-1"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--headroom"
    result = runner.invoke(app, ["plan", str(EXAMPLES / "aibrix-profiles.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "no SLO given" in result.stdout and "P99 e2e < 5 s" in result.stdout
