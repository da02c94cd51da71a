"""Capacity search, its agreement with known serving behaviour, the store cache and the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from hetsched.catalog import Device, load_catalog
from hetsched.cli import app
from hetsched.cli import capacity as cli_capacity
from hetsched.errors import HetschedError, InfeasibleError, InputError
from hetsched.optimizer.build import CapacityQuery, model_buckets
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.spec import Role
from hetsched.perf.correction import StepCorrection, corrected
from hetsched.perf.online import CorrectionKey
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.profiler.roofline_source import roofline_profile
from hetsched.sim.metrics import LatencyStats
from hetsched.sim.simulator import simulate
from hetsched.sim.capacity import (
    Binding, Capacity, Replica, batch1_tpot_ms, bucket_capacities, device_capacity, find_capacity, run_at_rate, saturation_rate,
    search_rate,
)
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, ArrivalKind, ArrivalProcess, LengthDistribution, Workload, load_workload
from hetsched.store import open_store
from hetsched.store import cache as capacity_cache
from hetsched.store.cache import cached_capacity, cached_capacity_source, capacity_key, code_digest, source_digest
from hetsched.store.corrections import StoredCorrection
from hetsched.store.profiles import save_profile
from hetsched.store.tables import CapacityRow

CATALOG = load_catalog()
SMALL = load_model("qwen3-0.6b")
SLO_CHAT = SLO(ttft_ms=500, tpot_ms=50)
SHORT = Workload(name="short", input_len=LengthDistribution.lognormal(p50=256, p99=1024, max_tokens=1500),
                 output_len=LengthDistribution.lognormal(p50=64, p99=256, max_tokens=400))


def device(acc: str) -> Device:
    return Device.whole(CATALOG.accelerators[acc])


def test_capacity_meets_the_slo_and_a_little_more_load_does_not() -> None:
    replica = Replica.build(SMALL, device("l4"), workload=SHORT)
    best, binding = search_rate(replica, SHORT, SLO_CHAT, seeds=(0, 1))
    assert best.passed and best.summary.ttft_ms.p99 <= 500 and best.summary.tpot_ms.p99 <= 50
    above = run_at_rate(replica, SHORT, SLO_CHAT, best.rate * 1.1, seeds=(0, 1))
    assert not above.passed and above.binding is binding


def test_one_token_answers_have_no_tpot_and_take_no_share_of_its_late_budget() -> None:
    """With 60 % one-token answers, a budget counted over every request would allow 2.5 % of the others late:
    the capacity's own P99 TPOT would break the target."""
    terse = Workload(name="terse", input_len=LengthDistribution.lognormal(p50=256, p99=1024, max_tokens=1500),
                     output_len=LengthDistribution.histogram([0, 1, 256], [0.6, 0.4]))
    found = find_capacity(SMALL, device("l4"), workload=terse, slo=SLO_CHAT, seeds=(0, 1))
    assert found.binding is Binding.TPOT
    assert found.tpot_ms.at_slo_percentile <= SLO_CHAT.tpot_ms


def test_find_capacity_is_deterministic_and_reports_latencies_at_the_rate() -> None:
    a = find_capacity(SMALL, device("l4"), workload=SHORT, slo=SLO_CHAT, seeds=(0,))
    b = find_capacity(SMALL, device("l4"), workload=SHORT, slo=SLO_CHAT, seeds=(0,))
    assert a == b
    assert a.requests_per_s > 1 and a.max_concurrency >= 1 and a.binding in Binding
    assert a.ttft_ms.p50 <= a.ttft_ms.p99 <= SLO_CHAT.ttft_ms
    assert Capacity.from_json(a.to_json()) == a


def test_throughput_rises_with_rate_then_flattens_and_ttft_explodes() -> None:
    replica = Replica.build(SMALL, device("l4"), workload=SHORT)
    saturation = saturation_rate(replica, SHORT)
    probes = [run_at_rate(replica, SHORT, SLO_CHAT, saturation * k, seeds=(0,), measured_per_seed=300,
                          stop_early=False).summary for k in (0.1, 0.2, 2.0, 4.0)]
    low, low2, over, over2 = probes
    assert low2.throughput_rps == pytest.approx(2 * low.throughput_rps, rel=0.15)  # tracks the offered load
    assert over2.throughput_rps < 1.15 * over.throughput_rps  # saturated: doubling load adds almost nothing
    assert over.ttft_ms.p99 > 20 * low.ttft_ms.p99  # queueing past saturation


def test_more_kv_raises_capacity_for_long_contexts() -> None:
    long_docs = Workload(name="long", input_len=LengthDistribution.fixed(6000), output_len=LengthDistribution.fixed(300))
    slo = SLO(ttft_ms=10_000, tpot_ms=200)
    replica = Replica.build(load_model("llama-3.1-8b"), device("a10g"), tp=1, workload=long_docs)
    doubled = dataclasses.replace(replica, num_blocks=replica.num_blocks * 2)
    base, binding = search_rate(replica, long_docs, slo, seeds=(0,))
    more, _ = search_rate(doubled, long_docs, slo, seeds=(0,))
    assert binding is Binding.MEMORY
    assert more.rate > 1.3 * base.rate


def test_tpot_grows_with_batch_size_as_the_step_model_says() -> None:
    replica = Replica.build(SMALL, device("l4"), workload=SHORT)
    fixed = Workload(input_len=LengthDistribution.fixed(200), output_len=LengthDistribution.fixed(400))
    tpots = {}
    for batch in (1, 16, 64):
        # ``batch`` requests arriving together decode side by side for most of their answers
        run = simulate(replica.step_model, fixed.sample(batch, rate=1e6, seed=0), engine=replica.engine,
                       num_blocks=replica.num_blocks, max_model_len=replica.max_model_len)
        tpots[batch] = float(np.median(run.times.tpot)) * 1e3
        model = replica.step_model.step_time(StepShape(decode_seqs=batch, decode_kv_tokens=batch * 400)) * 1e3
        assert tpots[batch] == pytest.approx(model, rel=0.1)
    assert tpots[1] < tpots[16] < tpots[64]


def test_tpot_below_the_batch1_step_is_infeasible_with_the_floor() -> None:
    replica = Replica.build(SMALL, device("t4"), workload=SHORT)
    floor = batch1_tpot_ms(replica, SHORT)
    with pytest.raises(InfeasibleError, match=rf"floor is {floor:.1f} ms"):
        find_capacity(SMALL, device("t4"), workload=SHORT, slo=SLO(ttft_ms=500, tpot_ms=floor * 0.8))


def test_ttft_below_one_prompt_alone_is_infeasible() -> None:
    with pytest.raises(InfeasibleError, match="TTFT target 1 ms is below the batch-1 prefill"):
        find_capacity(SMALL, device("t4"), workload=SHORT, slo=SLO(ttft_ms=1, tpot_ms=500))


def test_a_model_that_does_not_fit_is_infeasible() -> None:
    with pytest.raises(InfeasibleError, match="does not fit t4"):
        find_capacity(load_model("llama-3.1-70b"), device("t4"), workload=SHORT, slo=SLO_CHAT)


def test_requests_longer_than_the_context_count_as_failures() -> None:
    too_long = Workload(input_len=LengthDistribution.fixed(5000), output_len=LengthDistribution.fixed(10))
    with pytest.raises(InfeasibleError, match="100.0% of requests need more than 4096 tokens"):
        find_capacity(load_model("llama-2-7b"), device("h100-sxm"), workload=too_long, slo=SLO_CHAT)


def test_device_capacity_moves_to_a_larger_tp_when_one_device_is_not_enough() -> None:
    row = device_capacity(load_model("llama-3.1-8b"), device("t4"), workload=SHORT,
                          slo=SLO(ttft_ms=2000, tpot_ms=200), find=_one_seed)
    assert row.tp == 2 and row.capacity is not None and row.reason is None
    none = device_capacity(load_model("llama-3.1-70b"), device("t4"), workload=SHORT, slo=SLO_CHAT, find=_one_seed)
    assert none.capacity is None and "does not fit" in none.reason  # type: ignore[operator]


def _one_seed(model, device, **kwargs) -> Capacity:  # type: ignore[no-untyped-def]
    return find_capacity(model, device, seeds=(0,), **kwargs)


def test_buckets_get_their_own_capacities() -> None:
    cap = find_capacity(SMALL, device("l4"), workload=SHORT, slo=SLO_CHAT, seeds=(0,), input_edges=[512])
    assert [b.input_range for b in cap.buckets] == [(1, 512), (513, None)]
    short, long = cap.buckets
    assert short.capacity is not None and long.capacity is not None and short.share > long.share
    assert short.capacity.requests_per_s > long.capacity.requests_per_s
    assert Capacity.from_json(cap.to_json()) == cap


def test_a_bucket_the_replica_cannot_serve_says_why() -> None:
    slo = SLO(ttft_ms=25, tpot_ms=50)  # a t4 prefills a 512-token prompt in ~15 ms, a 1000-token one in ~38 ms
    with pytest.raises(InfeasibleError, match="TTFT target 25 ms"):
        find_capacity(SMALL, device("t4"), workload=SHORT, slo=slo, seeds=(0,))
    short, long = bucket_capacities(SMALL, device("t4"), workload=SHORT, slo=slo, seeds=(0,), input_edges=[512])
    assert short.capacity is not None and short.capacity.requests_per_s > 0 and short.reason is None
    assert long.capacity is None and "TTFT target 25 ms is below the batch-1 prefill" in long.reason  # type: ignore[operator]


def test_capacities_are_cached_in_the_store(store) -> None:
    kwargs = dict(workload=SHORT, slo=SLO_CHAT, seeds=(0,))
    first = cached_capacity(store, SMALL, device("l4"), **kwargs)
    again = cached_capacity(store, SMALL, device("l4"), **kwargs)
    assert again == first
    cached_capacity(store, SMALL, device("l4"), workload=SHORT, slo=SLO(ttft_ms=800, tpot_ms=50), seeds=(0,))
    with store.transaction() as session:
        assert session.scalar(select(func.count()).select_from(CapacityRow)) == 2
        row = session.scalars(select(CapacityRow)).first()
        assert row.model == "qwen3-0.6b" and row.device == "l4" and row.requests_per_s == first.requests_per_s


def test_the_optimizers_capacity_source_over_the_store_searches_once(store, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 500, "tpot_ms": 50},
                                      "workload": {"rate_rps": 1, "input_tokens": 256, "output_tokens": 64}}]})
    query = CapacityQuery(spec.models[0], SMALL, device("l4"), 1, Role.UNIFIED, model_buckets(spec.models[0])[0], None)
    searched: list[int] = []
    monkeypatch.setattr(capacity_cache, "find_capacity",
                        lambda *a, **kw: searched.append(1) or find_capacity(*a, **{**kw, "seeds": (0,)}))
    first = cached_capacity_source(store)(query)
    assert first > 0 and cached_capacity_source(store)(query) == first and searched == [1]
    with store.transaction() as session:
        assert session.scalars(select(CapacityRow)).one().requests_per_s == first


def test_a_corrected_step_model_has_a_cache_key_of_its_own() -> None:
    roofline = RooflineModel(SMALL, device("l4"))
    profile = roofline_profile(SMALL, device("l4"))
    slower, slower_decode = StepCorrection(1.5, 1.5), StepCorrection(1.0, 1.5)

    def key(step_model: StepLatencyModel) -> str:
        return capacity_key(step_model, workload=SHORT, slo=SLO_CHAT, engine=EngineConfig(), weight_dtype=None,
                            kv_dtype=None, seeds=(0,), input_edges=(), output_edges=())[0]

    keys = [key(m) for m in (roofline, corrected(roofline, slower), corrected(roofline, slower_decode), profile,
                             corrected(profile, slower))]
    assert len(set(keys)) == len(keys)
    assert key(corrected(roofline, StepCorrection())) == key(roofline)


def test_a_capacity_searched_under_a_correction_is_cached_apart_from_the_bare_one(store) -> None:
    slower = StoredCorrection(7, CorrectionKey("qwen3-0.6b", "l4", 1), StepCorrection(1.5, 1.5), 100, "test")
    kwargs = dict(workload=SHORT, slo=SLO_CHAT, seeds=(0,))
    bare = cached_capacity(store, SMALL, device("l4"), **kwargs)
    under = cached_capacity(store, SMALL, device("l4"), correction=slower, **kwargs)
    assert under.requests_per_s < bare.requests_per_s
    assert cached_capacity(store, SMALL, device("l4"), correction=slower, **kwargs) == under
    assert cached_capacity(store, SMALL, device("l4"), **kwargs) == bare
    with store.transaction() as session:
        named = {(row.inputs["correction"] or {}).get("id"): row.requests_per_s
                 for row in session.scalars(select(CapacityRow))}
    assert named == {None: bare.requests_per_s, 7: under.requests_per_s}


def test_a_capacity_cached_by_other_code_is_searched_again(store, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = dict(workload=SHORT, slo=SLO_CHAT, seeds=(0,))
    first = cached_capacity(store, SMALL, device("l4"), **kwargs)
    monkeypatch.setattr(capacity_cache, "code_digest", lambda: "0" * 64)
    searched: list[int] = []
    monkeypatch.setattr(capacity_cache, "find_capacity", lambda *a, **kw: searched.append(1) or find_capacity(*a, **kw))
    assert cached_capacity(store, SMALL, device("l4"), **kwargs) == first
    assert cached_capacity(store, SMALL, device("l4"), **kwargs) == first
    assert searched == [1]
    with store.transaction() as session:
        codes = sorted(row.inputs["code"] for row in session.scalars(select(CapacityRow)))
    assert codes == sorted(["0" * 64, code_digest.__wrapped__()])


def test_the_code_digest_follows_every_source_and_data_file_but_not_compiled_caches(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "data").mkdir(parents=True)
    (package / "search.py").write_text("RATE = 1\n")
    (package / "data" / "devices.yaml").write_text("l4: 24\n")
    before = source_digest([package])
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "search.cpython-311.pyc").write_bytes(b"\0compiled")
    assert source_digest([package]) == before
    (package / "data" / "devices.yaml").write_text("l4: 25\n")
    assert source_digest([package]) != before
    (package / "data" / "devices.yaml").write_text("l4: 24\n")
    (package / "data" / "devices.yaml").rename(package / "devices.yaml")
    assert source_digest([package]) != before
    assert len(code_digest()) == 64 and code_digest() == code_digest.__wrapped__()


def test_engine_settings_are_checked() -> None:
    with pytest.raises(InputError, match="max_num_batched_tokens"):
        find_capacity(SMALL, device("l4"), workload=SHORT, slo=SLO_CHAT,
                      engine=EngineConfig(max_num_batched_tokens=64, max_num_seqs=128))


# --- the command line ----------------------------------------------------------------

runner = CliRunner()


def test_cli_capacity_json(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{tmp_path / 'h.sqlite'}")
    args = ["capacity", "qwen3-0.6b", "l4", "--slo-ttft", "0.5s", "--slo-tpot", "50ms", "-o", "json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cap = json.loads(result.stdout)
    assert cap["device"] == "l4" and cap["tp"] == 1 and cap["requests_per_s"] > 1
    assert cap["binding"] in {"ttft", "tpot", "memory", "failures"} and cap["ttft_ms"]["p99"] <= 500
    again = runner.invoke(app, args)  # answered from the store
    assert json.loads(again.stdout) == cap


def test_cli_capacity_table_over_the_catalog(monkeypatch) -> None:
    def fake(model, device, *, tp, workload, slo, engine, **_):  # type: ignore[no-untyped-def]
        if device.accelerator.memory_gb < 40:
            raise InfeasibleError(f"too small: {device.id}")
        return dataclasses.replace(FAKE, device=device.id, tp=tp)

    monkeypatch.setattr(cli_capacity, "find_capacity", fake)
    result = runner.invoke(app, ["capacity", "qwen3-0.6b", "--no-cache", "-o", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["device"]: r for r in json.loads(result.stdout)}
    assert set(rows) == set(CATALOG.accelerators)
    assert rows["h100-sxm"]["capacity"]["requests_per_s"] == 12.5 and rows["t4"]["reason"] == "too small: t4"
    table = runner.invoke(app, ["capacity", "qwen3-0.6b", "--all", "--no-cache"], env={"COLUMNS": "200"})
    assert "too small: t4" in table.stdout and "12.50" in table.stdout


FAKE = Capacity(model="qwen3-0.6b", device="", tp=1, requests_per_s=12.5, max_concurrency=9, mean_concurrency=4.0,
                binding=Binding.TPOT, ttft_ms=LatencyStats(1, 2, 3, 3), tpot_ms=LatencyStats(4, 5, 6, 6),
                e2e_ms=LatencyStats(7, 8, 9, 9), queue_ms=LatencyStats(0, 0, 1, 1), failure_rate=0.0,
                output_tokens_per_s=100.0, kv_tokens=1000, requests_simulated=2100)


def test_cost_per_million_requests_counts_every_device_of_the_replica() -> None:
    # 12.5 req/s is 45,000 requests an hour; two devices at $2.25/h cost $4.50 for them
    assert dataclasses.replace(FAKE, tp=2).dollars_per_million_requests(2.25) == pytest.approx(100.0)


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--slo-ttft", "500"], 2, "--slo-ttft: expected a duration with a unit"),
    (["--slo-tpot", "fast"], 2, "--slo-tpot: expected a duration"),
    (["--slo-ttft", "0ms"], 2, "--slo-ttft: expected a positive duration, got '0ms'"),
    (["--slo-tpot", "1ms"], 4, "the floor is"),
    (["--tp", "3"], 4, "do not split evenly"),
    (["--workload", "missing.yaml"], 2, "no such file"),
])
def test_cli_capacity_errors(args: list[str], code: int, message: str) -> None:
    result = runner.invoke(app, ["capacity", "qwen3-0.6b", "l4", "--no-cache", *args])
    assert isinstance(result.exception, HetschedError) and result.exception.exit_code == code
    assert message in str(result.exception)


def test_cli_capacity_exit_code_and_message_on_stderr() -> None:
    result = subprocess.run([sys.executable, "-m", "hetsched", "capacity", "qwen3-0.6b", "l4", "--no-cache",
                             "--slo-tpot", "1ms"], capture_output=True, text=True)
    assert result.returncode == 4
    assert "TPOT target 1 ms is below the batch-1 decode step" in " ".join(result.stderr.split())


def test_cli_capacity_from_a_stored_profile(tmp_path, monkeypatch) -> None:
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    monkeypatch.setenv("HETSCHED_DATABASE_URL", url)
    store = open_store(url)
    profile_id = save_profile(store, roofline_profile(SMALL, device("l4")))
    result = runner.invoke(app, ["capacity", "qwen3-0.6b", "l4", "--profile", str(profile_id), "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests_per_s"] > 1
    with store.transaction() as session:
        assert session.scalars(select(CapacityRow.profile_id)).one() == profile_id
    wrong = runner.invoke(app, ["capacity", "qwen3-0.6b", "t4", "--profile", str(profile_id)])
    assert isinstance(wrong.exception, InputError) and "not qwen3-0.6b on t4" in str(wrong.exception)


def test_bursty_arrivals_lower_the_capacity() -> None:
    poisson = find_capacity(SMALL, device("l4"), workload=SHORT, slo=SLO_CHAT, seeds=(0,))
    bursty = SHORT.model_copy(update={"arrival": ArrivalProcess(kind=ArrivalKind.GAMMA, cv=4.0)})
    assert find_capacity(SMALL, device("l4"), workload=bursty, slo=SLO_CHAT, seeds=(0,)).requests_per_s \
        < 0.9 * poisson.requests_per_s


def test_capacity_of_a_trace_workload(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_s": i * 0.1, "input_tokens": 100 + 37 * (i % 9),
                                           "output_tokens": 20 + 11 * (i % 7)}) for i in range(60)))
    cap = find_capacity(SMALL, device("l4"), workload=load_workload(trace), slo=SLO_CHAT, seeds=(0,))
    assert cap.requests_per_s > 1 and cap.ttft_ms.p99 <= SLO_CHAT.ttft_ms


def test_a_phase_of_disaggregated_serving_holds_more_than_a_replica_doing_both() -> None:
    from hetsched.sim.roles import Role

    model, device = load_model("qwen3-0.6b"), Device.whole(load_catalog().get("l4"))
    workload = Workload(input_len=LengthDistribution.fixed(1024), output_len=LengthDistribution.fixed(64))
    slo = SLO(ttft_ms=300, tpot_ms=30)
    rates = {role: device_capacity(model, device, workload=workload, slo=slo, tp=1, role=role).capacity.requests_per_s
             for role in Role}  # type: ignore[union-attr]
    assert rates[Role.PREFILL] > rates[Role.UNIFIED] and rates[Role.DECODE] > rates[Role.UNIFIED]
    cli = runner.invoke(app, ["capacity", "qwen3-0.6b", "l4", "--role", "prefill", "--no-cache", "-o", "json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["ttft_ms"]["p99"] < 500  # the TTFT target less the KV transfer bound it
    assert runner.invoke(app, ["capacity", "qwen3-0.6b", "l4", "--role", "both"]).exit_code == 2
