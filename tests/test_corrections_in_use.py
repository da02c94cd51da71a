"""A trusted step-model correction in the store: ``estimate``, ``capacity``, ``plan``, the optimizer's capacities and
the web planner use the one for exactly their model, device and TP, and say which; an untrusted one, one of another
TP and one learned under a named attention backend are not used."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.cli import capacity as cli_capacity
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate
from hetsched.settings import Settings, StoreSettings
from hetsched.sim.capacity import Binding, Capacity
from hetsched.sim.metrics import LatencyStats
from hetsched.store import Store, open_store
from hetsched.store import cache as capacity_cache
from hetsched.store.cache import cached_capacity_source
from hetsched.store.corrections import save_correction
from hetsched.web import create_app

runner = CliRunner()

KEY = CorrectionKey("qwen3-0.6b", "l4", 1)
SLOWER = 1.5
"""Every step 1.5 times as long as the catalog says."""

NOT_IN_FORCE = [("untrusted", KEY, False), ("other TP", CorrectionKey("qwen3-0.6b", "l4", 2), True),
                ("named backend", CorrectionKey("qwen3-0.6b", "l4", 1, attention_backend="FLASHINFER"), True),
                ("other model", CorrectionKey("qwen3-8b", "l4", 1), True)]
"""Corrections stored but not for a command's (qwen3-0.6b, l4, TP=1): each would triple its step."""


def _estimate(scale: float, *, key: CorrectionKey = KEY, trusted: bool = True) -> Estimate:
    return Estimate(key=key, correction=StepCorrection(scale, scale, 0.0, 0.002), sd=(0.02, 0.02, 1e-4, 1e-3),
                    observations=400, sources=2, first_at=0.0, last_at=300.0, residual_median=0.03,
                    residual_p90=0.08, trusted=trusted)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """The store the commands use (a SQLite file), its capacity searches on one seed to be quick."""
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    monkeypatch.setenv("HETSCHED_DATABASE_URL", url)
    monkeypatch.setattr(capacity_cache, "find_capacity",
                        lambda *a, find=capacity_cache.find_capacity, **kw: find(*a, **{**kw, "seeds": (0,)}))
    opened = open_store(url)
    yield opened
    opened.engine.dispose()


def _save(store: Store, scale: float, *, key: CorrectionKey = KEY, trusted: bool = True) -> int:
    return save_correction(store, _estimate(scale, key=key, trusted=trusted), origin="hetsched calibrate --live test")


def _save_not_in_force(store: Store) -> None:
    for _what, key, trusted in NOT_IN_FORCE:
        _save(store, 3.0, key=key, trusted=trusted)


def _json(argv: list[str]) -> dict:
    result = runner.invoke(app, [*argv, "-o", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _table(argv: list[str]) -> str:
    result = runner.invoke(app, argv, env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


# --- estimate ----------------------------------------------------------------------------------------------------

ESTIMATE = ["estimate", "qwen3-0.6b", "l4", "--batch", "8", "--prefill", "256"]


def test_estimate_takes_the_correction_of_its_model_device_and_tp_and_names_it(store: Store) -> None:
    bare = _json(ESTIMATE)
    assert bare["correction"] is None
    correction_id = _save(store, SLOWER)
    corrected = _json(ESTIMATE)
    assert corrected["step_ms"] == pytest.approx(SLOWER * bare["step_ms"])
    assert corrected["step_model"] == bare["step_model"]  # the constants it corrects
    assert corrected["correction"]["id"] == correction_id and corrected["correction"]["prefill_scale"] == SLOWER
    assert corrected["correction"]["label"].startswith(f"correction #{correction_id} (prefill x1.5, decode x1.5")
    assert f"step model: corrected by correction #{correction_id} (prefill x1.5" in _table(ESTIMATE)
    assert _json([*ESTIMATE, "--tp", "2"])["correction"] is None


def test_estimate_uses_no_correction_stored_for_another_key_or_untrusted(store: Store) -> None:
    bare = _json(ESTIMATE)
    _save_not_in_force(store)
    assert _json(ESTIMATE) == bare
    assert "corrected by" not in _table(ESTIMATE)


def test_a_slices_correction_is_the_slices_alone(store: Store) -> None:
    whole = ["estimate", "qwen3-0.6b", "a100-80gb", "--batch", "4"]
    slice_ = ["estimate", "qwen3-0.6b", "a100-80gb:3g.40gb", "--batch", "4"]
    bare_whole, bare_slice = _json(whole), _json(slice_)
    correction_id = _save(store, SLOWER, key=CorrectionKey("qwen3-0.6b", "a100-80gb:3g.40gb", 1))
    assert _json(whole) == bare_whole
    corrected = _json(slice_)
    assert corrected["correction"]["id"] == correction_id
    assert corrected["step_ms"] == pytest.approx(SLOWER * bare_slice["step_ms"])


# --- capacity ----------------------------------------------------------------------------------------------------

CAPACITY = ["capacity", "qwen3-0.6b", "l4"]


def test_capacity_is_searched_under_the_correction_and_says_so(store: Store) -> None:
    bare = _json(CAPACITY)
    assert bare["correction"] is None
    correction_id = _save(store, SLOWER)
    corrected = _json(CAPACITY)  # not the bare answer from the cache
    assert corrected["requests_per_s"] < bare["requests_per_s"] / 1.2
    assert corrected["correction"]["id"] == correction_id
    assert f"step model: corrected by correction #{correction_id}" in _table(CAPACITY)
    assert _json([*CAPACITY, "--tp", "2"])["correction"] is None


def test_a_correction_s_tail_is_searched_with_it_and_keyed_apart(store: Store) -> None:
    from hetsched.perf.tail import FrontEnd, Tail

    plain_id = _save(store, 1.0)
    plain = _json(CAPACITY)
    assert plain["correction"]["id"] == plain_id and plain["correction"]["tail"] is None
    slow_front = Tail(front_end=FrontEnd(request_s=0.1))  # 100 ms of API server per request: 10 req/s at most
    tailed_id = save_correction(store, _estimate(1.0), origin="hetsched calibrate --endpoint test", tail=slow_front)
    tailed = _json(CAPACITY)  # the same scales, now with a front end: not the cached answer
    assert tailed["correction"]["id"] == tailed_id and tailed["correction"]["tail"] is not None
    assert tailed["requests_per_s"] < plain["requests_per_s"]
    assert tailed["requests_per_s"] <= 10.0


def test_capacity_uses_no_correction_stored_for_another_key_or_untrusted(store: Store) -> None:
    bare = _json(CAPACITY)
    _save_not_in_force(store)
    assert _json(CAPACITY) == bare
    assert "corrected by" not in _table(CAPACITY)


def test_the_capacity_table_names_the_correction_of_each_row(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(model, device, *, tp, workload, slo, engine, correction=None, **_):  # type: ignore[no-untyped-def]
        scale = correction.correction.decode_scale if correction else 1.0
        return Capacity(model=model.name, device=device.id, tp=tp, requests_per_s=12.0 / scale, max_concurrency=9,
                        mean_concurrency=4.0, binding=Binding.TPOT, ttft_ms=LatencyStats(1, 2, 3, 3),
                        tpot_ms=LatencyStats(4, 5, 6, 6), e2e_ms=LatencyStats(7, 8, 9, 9),
                        queue_ms=LatencyStats(0, 0, 1, 1), failure_rate=0.0, output_tokens_per_s=100.0,
                        kv_tokens=1000, requests_simulated=2100)

    monkeypatch.setattr(cli_capacity, "find_capacity", fake)
    correction_id = _save(store, SLOWER)
    _save_not_in_force(store)
    rows = {r["device"]: r for r in _json(["capacity", "qwen3-0.6b", "--no-cache"])}
    assert rows["l4"]["correction"]["id"] == correction_id and rows["l4"]["capacity"]["requests_per_s"] == 8.0
    assert all(r["correction"] is None and r["capacity"]["requests_per_s"] == 12.0
               for device, r in rows.items() if device != "l4")
    table = _table(["capacity", "qwen3-0.6b", "--no-cache"])
    assert f"l4 TP=1: step model: corrected by correction #{correction_id}" in table
    assert table.count("corrected by") == 1


def test_a_measured_profile_is_used_as_measured(store: Store) -> None:
    from hetsched.catalog import Device, load_catalog
    from hetsched.profiler.roofline_source import roofline_profile
    from hetsched.specs.registry import load_model
    from hetsched.store.profiles import save_profile

    profile_id = save_profile(store, roofline_profile(load_model("qwen3-0.6b"), Device.whole(load_catalog().get("l4"))))
    _save(store, SLOWER)
    assert _json([*CAPACITY, "--profile", str(profile_id)])["correction"] is None


# --- the optimizer and plan ----------------------------------------------------------------------------------------

CLUSTER = {"name": "corrected", "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
           "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 400, "tpot_ms": 40},
                       "workload": {"rate_rps": 50, "input_tokens": 300, "output_tokens": 100}}]}
"""About 33 req/s a replica on the bare step model, 20 on one 1.5 times as slow: 2 replicas, or 3."""


def _replicas(plan: object) -> int:
    return sum(g.replicas for m in plan.models for g in m.replicas)  # type: ignore[attr-defined]


def test_the_optimizers_capacities_follow_the_correction_in_force_when_each_plan_is_built(store: Store) -> None:
    spec = parse_cluster(CLUSTER)
    source = cached_capacity_source(store)
    bare = optimize(spec, capacity_source=source)
    assert bare.explanation.corrections == []
    _save_not_in_force(store)
    assert optimize(spec, capacity_source=source).cost_per_hour == bare.cost_per_hour
    correction_id = _save(store, SLOWER)
    corrected = optimize(spec, capacity_source=source)  # the same source: a correction stored since is used
    assert corrected.cost_per_hour > bare.cost_per_hour and _replicas(corrected) > _replicas(bare)
    [used] = corrected.explanation.corrections
    assert (used.model, used.device, used.tp, used.correction_id) == ("qwen3-0.6b", "l4", 1, correction_id)
    assert used.label.startswith(f"correction #{correction_id} (prefill x1.5")


def test_a_model_that_names_its_attention_backend_is_planned_under_that_backend_s_correction(store: Store) -> None:
    flash = CorrectionKey(KEY.model, KEY.accelerator, KEY.tp, attention_backend="FLASHINFER")
    correction_id = _save(store, SLOWER, key=flash)
    source = cached_capacity_source(store)
    bare = optimize(parse_cluster(CLUSTER), capacity_source=source)
    assert bare.explanation.corrections == []  # a model that names no backend: not this correction
    named = {**CLUSTER, "models": [{**m, "attention_backend": "FLASHINFER"} for m in CLUSTER["models"]]}
    corrected = optimize(parse_cluster(named), capacity_source=source)
    assert [c.correction_id for c in corrected.explanation.corrections] == [correction_id]
    assert corrected.cost_per_hour > bare.cost_per_hour
    other = {**CLUSTER, "models": [{**m, "attention_backend": "FLASH_ATTN"} for m in CLUSTER["models"]]}
    assert optimize(parse_cluster(other), capacity_source=source).explanation.corrections == []


def test_plan_names_the_correction_each_option_used(store: Store, tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    bare = _json(["plan", str(cluster)])
    assert bare["explanation"]["corrections"] == []
    correction_id = _save(store, SLOWER)
    corrected = _json(["plan", str(cluster)])
    assert corrected["cost_per_hour"] > bare["cost_per_hour"]
    assert [c["correction_id"] for c in corrected["explanation"]["corrections"]] == [correction_id]
    assert f"qwen3-0.6b on l4 TP=1: corrected by correction #{correction_id}" in _table(["plan", str(cluster)])


# --- the web planner -----------------------------------------------------------------------------------------------

def test_the_web_planners_plans_and_capacities_name_the_correction(store: Store) -> None:
    settings = Settings(store=StoreSettings(database_url=str(store.engine.url)))
    with TestClient(create_app(settings)) as client:
        bare = client.post("/api/plans", json={"spec": CLUSTER}).json()["plan"]
        assert bare["explanation"]["corrections"] == []
        correction_id = _save(store, SLOWER)
        response = client.post("/api/plans", json={"spec": CLUSTER})
        assert response.status_code == 201, response.text
        corrected = response.json()["plan"]
        capacities = client.get("/api/capacities").json()
    assert corrected["cost_per_hour"] > bare["cost_per_hour"]
    assert [c["correction_id"] for c in corrected["explanation"]["corrections"]] == [correction_id]
    by_correction = {c["correction"]["id"] if c["correction"] else None: c for c in capacities}
    assert set(by_correction) == {None, correction_id}
    assert by_correction[correction_id]["requests_per_s"] < by_correction[None]["requests_per_s"]
    assert by_correction[correction_id]["correction"]["label"].startswith(f"correction #{correction_id} (")
