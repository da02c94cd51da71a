"""The autoscale command and the local applier over real simulated workers behind the real router."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from hetsched.autoscale.local import LocalApplier, LocalRouter
from hetsched.cli import app
from hetsched.errors import InputError
from hetsched.optimizer.spec import Role
from hetsched.router.config import parse_router_config
from hetsched.simworker import WorkerSpec, start_worker_thread
from hetsched.simworker.launch import free_port
from hetsched.specs.wire import OptionKey

MODEL = "qwen3-0.6b"
L4 = OptionKey(MODEL, "l4", "l4", 1, Role.UNIFIED)
runner = CliRunner()

CLUSTER = {
    "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}, {"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
    "models": [{"name": MODEL, "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                "workload": {"rate_rps": 1, "input_tokens": 256, "output_tokens": 64}}],
    "capacities": [{"model": MODEL, "device": "l4", "requests_per_s": 5},
                   {"model": MODEL, "device": "h100-sxm", "requests_per_s": 40}],
}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_local_applier_routes_only_ready_workers_and_stops_starting_ones_first():
    router = LocalRouter(parse_router_config({"port": 0, "models": {MODEL: {"endpoints": []}}}))
    clock = _Clock()
    applier = LocalApplier(router, archs={}, time_scale=1.0, startup_s=10.0, drain_s=0.0, clock=clock)
    try:
        applier.start(L4, 2)
        assert [r.ready for r in applier.replicas()] == [False, False]
        assert httpx.get(f"{router.url}/router/endpoints").json()["endpoints"] == []
        clock.now = 11.0
        ready = applier.replicas()
        assert all(r.ready for r in ready)
        routed = {e["url"] for e in httpx.get(f"{router.url}/router/endpoints").json()["endpoints"]}
        assert routed == {r.url for r in ready}
        applier.start(L4, 1)
        applier.stop(L4, 1)  # the one still starting goes, the Ready ones stay
        assert {r.name for r in applier.replicas()} == {r.name for r in ready}
        reply = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                           timeout=10)
        assert reply.status_code == 200
    finally:
        applier.close()
        router.stop()


def _write(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "autoscale.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_autoscale_static_reports_decisions_as_json(tmp_path: Path):
    worker = start_worker_thread(WorkerSpec(model=MODEL, accelerator="l4"))
    try:
        config = _write(tmp_path, {
            "cluster": CLUSTER, "autoscale": {"interval_s": 0.2, "stable_window_s": 2, "panic_window_s": 1,
                                              "slo_window_s": 1},
            "applier": {"kind": "static"},
            "workers": [{"model": MODEL, "pool": "l4", "device": "l4", "url": worker.url},
                        {"model": MODEL, "pool": "l4", "device": "l4", "url": "http://127.0.0.1:9"}]})
        result = runner.invoke(app, ["autoscale", "--config", str(config), "--duration", "0.5", "-o", "json"])
        assert result.exit_code == 0, result.output
        rounds = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        assert rounds and rounds[-1]["model"] == MODEL
        assert rounds[-1]["stale_pods"] == 1  # the endpoint that does not answer is counted, not waited for
        assert {"reason", "message", "desired", "demand_rps", "unmet_rps"} <= set(rounds[-1])
        assert rounds[-1]["replicas"] == [{"pool": "l4", "device": "l4", "tp": 1, "replicas": 2, "ready": 2}]
    finally:
        worker.stop()


def test_local_autoscale_serves_through_its_router_and_stops_cleanly_on_sigterm(tmp_path: Path):
    config = _write(tmp_path, {
        "cluster": CLUSTER, "autoscale": {"interval_s": 1, "stable_window_s": 10, "panic_window_s": 2,
                                          "slo_window_s": 5},
        "applier": {"kind": "local", "time_scale": 10, "startup_s": 0, "min_step_wall_s": 0.02},
        "router": {"port": free_port(), "policy": "least-request"},
        "workers": [{"model": MODEL, "pool": "l4", "device": "l4", "replicas": 1}]})
    port = yaml.safe_load(config.read_text())["router"]["port"]
    process = subprocess.Popen([sys.executable, "-m", "hetsched", "autoscale", "--config", str(config), "-o", "json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(process.stdout.readline())  # type: ignore[union-attr]
        assert first["replicas"] == [{"pool": "l4", "device": "l4", "tp": 1, "replicas": 1, "ready": 1}]
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 40, "stream": True})
        assert reply.status_code == 200 and reply.text.count("data:") == 41  # 40 tokens and [DONE]
        assert 'policy="least-request"' in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        ages = []
        for _ in range(6):  # engine signals are read every 0.1 s of wall time at time x10 (1 s simulated)
            rows = httpx.get(f"http://127.0.0.1:{port}/router/endpoints").json()["endpoints"]
            ages += [row["signals_age_s"] for row in rows]
            time.sleep(0.1)
        assert ages and max(ages) < 0.5
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0, process.stderr.read()  # type: ignore[union-attr]
    finally:
        process.kill()


@pytest.mark.parametrize(("change", "field"), [
    ({"workers": [{"model": "nope", "pool": "l4", "device": "l4"}]}, "workers[0].model"),
    ({"workers": [{"model": MODEL, "pool": "l4", "device": "a10g"}]}, "workers[0]"),
    ({"autoscale": {"headroom": -1}}, "autoscale.headroom"),
    ({"applier": {"kind": "static"}, "workers": [{"model": MODEL, "pool": "l4", "device": "l4"}]}, "workers"),
])
def test_bad_autoscale_files_name_the_field(tmp_path: Path, change: dict, field: str):
    config = _write(tmp_path, {"cluster": CLUSTER, **change})
    result = runner.invoke(app, ["autoscale", "--config", str(config), "--duration", "0"])
    assert isinstance(result.exception, InputError) and result.exception.exit_code == 2
    assert field in str(result.exception)


def test_an_autoscale_file_with_a_cpu_pool_runs(tmp_path: Path):
    cluster = {**CLUSTER, "pools": [{"name": "here", "accelerator": "cpu", "nodes": 1}],
               "capacities": [{"model": MODEL, "device": "cpu", "requests_per_s": 2}]}
    config = _write(tmp_path, {"cluster": cluster, "applier": {"kind": "static"},
                               "workers": [{"model": MODEL, "pool": "here", "device": "cpu",
                                            "url": "http://127.0.0.1:9"}]})
    result = runner.invoke(app, ["autoscale", "--config", str(config), "--duration", "0"])
    assert result.exit_code == 0, result.output


def test_missing_config_file_is_an_input_error(tmp_path: Path):
    result = runner.invoke(app, ["autoscale", "--config", str(tmp_path / "none.yaml"), "--duration", "0"])
    assert isinstance(result.exception, InputError) and "--config" in str(result.exception)


def test_operator_pods_become_replicas_keyed_like_the_fleet():
    from hetsched.operator.replicas import replicas_from_pods

    options = [OptionKey("inference/chat", "h100", "h100-sxm", tp, Role.UNIFIED) for tp in (1, 2)]

    def pod(name: str, *, tp: int, ready: bool, ip: str | None = "10.0.0.5", **meta: object) -> dict:
        return {"metadata": {"name": name, "namespace": "inference", **meta,
                             "labels": {"hetsched.io/model": "chat", "hetsched.io/pool": "h100",
                                        "hetsched.io/accelerator": "h100-sxm", "hetsched.io/role": "unified"}},
                "spec": {"containers": [{"args": ["--model", "m", "--tensor-parallel-size", str(tp)],
                                         "env": [{"name": "HETSCHED_DEVICE", "value": "h100-sxm"}],
                                         "ports": [{"name": "http", "containerPort": 8000}]}]},
                "status": {"podIP": ip, "phase": "Running",
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    replicas = replicas_from_pods([pod("a", tp=2, ready=True), pod("b", tp=1, ready=False, ip=None),
                                   pod("c", tp=1, ready=True, deletionTimestamp="now"),
                                   {"metadata": {"name": "other", "labels": {}}}], options)
    assert [(r.name, r.key.tp, r.ready, r.url) for r in replicas] == [
        ("inference/a", 2, True, "http://10.0.0.5:8000"), ("inference/b", 1, False, "")]


def test_the_shipped_autoscale_example_names_options_of_its_cluster():
    from hetsched.autoscale.config import load_autoscale_file, worker_options
    from hetsched.autoscale.fleet import build_fleet
    from hetsched.catalog import load_catalog

    file, spec = load_autoscale_file(Path(__file__).parent.parent / "examples" / "autoscale-local.yaml")
    fleet = build_fleet(spec, load_catalog(), max_replicas=file.max_replicas)
    keys = worker_options(file, fleet)
    assert len(keys) == len(file.workers) and all(key.model in {m.name for m in spec.models} for key in keys)
