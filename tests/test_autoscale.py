"""Autoscaler: signal parsing, windows, and the scaling policy."""

from __future__ import annotations

import copy
import math

import pytest

from hetsched.autoscale.fleet import build_fleet, observed_shares
from hetsched.autoscale.policy import Decision, Reason, ReplicaCount, ScaleState, decide
from hetsched.autoscale.replan import replan
from hetsched.autoscale.signals import PodSample, Replica, RouterRefusals
from hetsched.autoscale.step import ScaleMemory, scale_step
from hetsched.autoscale.window import History, ModelSignals, PodCounts, model_signals, observe
from hetsched.catalog import load_catalog
from hetsched.engine_metrics.parse import parse_metrics_text, parse_prometheus_vector
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.errors import InputError
from hetsched.optimizer.spec import ClusterSpec, Role
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO

MODEL = "llama-3.1-8b"
H100 = OptionKey(MODEL, "h100", "h100-sxm", 1, Role.UNIFIED)
L40S = OptionKey(MODEL, "l40s", "l40s", 1, Role.UNIFIED)
A10G = OptionKey(MODEL, "a10g", "a10g", 1, Role.UNIFIED)

VLLM_NEW = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3
vllm:num_requests_running{model_name="m",engine="1"} 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 1
vllm:num_requests_waiting{model_name="m",engine="1"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.4
vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.7
# TYPE vllm:request_success counter
vllm:request_success_total{model_name="m",finished_reason="stop"} 90
vllm:request_success_total{model_name="m",finished_reason="length"} 10
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 51200
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 40000
vllm:prefix_cache_queries_total{model_name="m",engine="1"} 11200
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 30000
vllm:prefix_cache_hits_total{model_name="m",engine="1"} 2000
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 50
vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.5"} 95
vllm:time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} 100
vllm:time_to_first_token_seconds_sum{model_name="m"} 20
vllm:time_to_first_token_seconds_count{model_name="m"} 100
"""

VLLM_OLD = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:request_success_total{model_name="m"} 7
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.05"} 8
vllm:time_per_output_token_seconds_bucket{le="+Inf"} 10
vllm:time_per_output_token_seconds_sum 0.6
vllm:time_per_output_token_seconds_count 10
"""

SGLANG = """\
sglang:num_running_reqs{model_name="m"} 4
sglang:num_queue_reqs{model_name="m"} 2
sglang:token_usage{model_name="m"} 0.5
sglang:num_requests_total{model_name="m"} 12
"""


def test_parses_new_vllm_names_summing_engines():
    m = parse_metrics_text(VLLM_NEW)
    assert (m.running, m.waiting, m.completed, m.prompt_tokens) == (5, 1, 100, 51200)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (51200, 32000)  # summed over engines
    assert m.kv_usage == pytest.approx(0.7)  # the fullest engine
    assert m.arrived == 106
    assert m.ttft_s is not None and m.ttft_s.count == 100
    assert m.ttft_s.quantile(0.5) == pytest.approx(0.1)
    assert m.ttft_s.at_most(0.3) == pytest.approx(72.5)


def test_parses_old_vllm_and_sglang_names():
    old = parse_metrics_text(VLLM_OLD)
    assert old.kv_usage == pytest.approx(0.25)
    assert old.tpot_s is not None and old.tpot_s.count == 10
    sg = parse_metrics_text(SGLANG)
    assert (sg.running, sg.waiting, sg.kv_usage, sg.completed) == (4, 2, 0.5, 12)
    assert sg.prefix_cache_hits is None  # not exported


def _latency_page(requests: int) -> str:
    """A vLLM page after ``requests`` requests of 11 tokens: 1 token gap in 10 took 150 ms (a long prefill step in
    the batch), the rest 20 ms, so every request's mean TPOT is 33 ms."""
    gaps = 10 * requests
    return f"""\
# TYPE vllm:request_success counter
vllm:request_success_total{{model_name="m",engine="0"}} {requests}
vllm:num_requests_running{{model_name="m",engine="0"}} 0
vllm:num_requests_waiting{{model_name="m",engine="0"}} 0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{model_name="m",engine="0",le="0.1"}} {requests}
vllm:time_to_first_token_seconds_bucket{{model_name="m",engine="0",le="+Inf"}} {requests}
vllm:time_to_first_token_seconds_sum{{model_name="m",engine="0"}} {0.05 * requests}
vllm:time_to_first_token_seconds_count{{model_name="m",engine="0"}} {requests}
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{model_name="m",engine="0",le="0.025"}} {gaps * 9 // 10}
vllm:inter_token_latency_seconds_bucket{{model_name="m",engine="0",le="0.2"}} {gaps}
vllm:inter_token_latency_seconds_bucket{{model_name="m",engine="0",le="+Inf"}} {gaps}
vllm:inter_token_latency_seconds_sum{{model_name="m",engine="0"}} {0.033 * gaps}
vllm:inter_token_latency_seconds_count{{model_name="m",engine="0"}} {gaps}
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{{model_name="m",engine="0",le="0.025"}} 0
vllm:request_time_per_output_token_seconds_bucket{{model_name="m",engine="0",le="0.05"}} {requests}
vllm:request_time_per_output_token_seconds_bucket{{model_name="m",engine="0",le="+Inf"}} {requests}
vllm:request_time_per_output_token_seconds_sum{{model_name="m",engine="0"}} {0.033 * requests}
vllm:request_time_per_output_token_seconds_count{{model_name="m",engine="0"}} {requests}
"""


def test_tpot_attainment_is_per_request_not_per_token_gap():
    history = History()
    for at, requests in ((0.0, 100), (10.0, 300)):
        samples = [_sample("h100-0", H100, at, parse_metrics_text(_latency_page(requests)))]
        history, counts = observe(history, samples, now=at, settings=SETTINGS)
    sig = model_signals(history, MODEL, samples, counts[MODEL], now=10.0, settings=SETTINGS)
    slo = SLO(ttft_ms=500, tpot_ms=100)  # token gaps miss it at p99, every request's TPOT meets it
    assert sig.tpot_s is not None and sig.tpot_s.count == 200  # requests, not token gaps
    assert sig.attainment(slo) == pytest.approx(1.0)
    assert sig.percentile_ms(slo)[1] < 100


def test_token_gaps_are_never_read_as_tpot():
    only_gaps = "\n".join(line for line in _latency_page(10).splitlines() if "request_time_per_output" not in line)
    assert parse_metrics_text(only_gaps).tpot_s is None
    legacy_alias = only_gaps.replace("inter_token_latency", "time_per_output_token") + "\n" + only_gaps
    assert parse_metrics_text(legacy_alias).tpot_s is None  # newer vLLM: the old name is an alias of the gaps


def test_bad_metrics_text_names_the_field():
    with pytest.raises(InputError, match="metrics"):
        parse_metrics_text("vllm:num_requests_running{model_name=\"m\" 3\n")
    with pytest.raises(InputError, match="not an inference engine's metrics page"):
        parse_metrics_text("# TYPE http_requests_total counter\nhttp_requests_total 3\n")


def test_parses_a_prometheus_api_vector_per_pod():
    payload = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"__name__": "vllm:num_requests_running", "pod": "a"}, "value": [100.0, "2"]},
        {"metric": {"__name__": "vllm:num_requests_waiting", "pod": "a"}, "value": [99.0, "1"]},
        {"metric": {"__name__": "vllm:request_success_total", "pod": "a"}, "value": [100.0, "40"]},
        {"metric": {"__name__": "vllm:kv_cache_usage_perc", "pod": "b"}, "value": [100.0, "0.3"]},
        {"metric": {"__name__": "vllm:num_requests_running"}, "value": [100.0, "9"]},
    ]}}
    pods = parse_prometheus_vector(payload)
    assert set(pods) == {"a", "b"}
    at, metrics = pods["a"]
    assert at == 99.0 and metrics.arrived == 43
    assert pods["b"][1].arrived is None  # b reports no counters: it will count as stale
    with pytest.raises(InputError, match="prometheus"):
        parse_prometheus_vector({"status": "error", "error": "bad query"})
    with pytest.raises(InputError, match="prometheus.data"):
        parse_prometheus_vector({"status": "success", "data": {"resultType": "matrix", "result": []}})


def test_histogram_difference_handles_resets():
    before = Histogram((0.1, math.inf), (5.0, 10.0), 1.0)
    after = Histogram((0.1, math.inf), (8.0, 14.0), 1.5)
    assert after.minus(before).counts == (3.0, 4.0)
    assert before.minus(after) is before  # counter went down: the pod restarted


# --- windows ------------------------------------------------------------------

SETTINGS = AutoscaleSettings()


def _metrics(arrived: float, *, waiting: int = 0) -> EngineMetrics:
    return EngineMetrics(completed=arrived - waiting, running=0, waiting=waiting, kv_usage=0.5,
                         prompt_tokens=arrived * 512, generation_tokens=arrived * 128)


def _sample(pod: str, key, at: float, metrics: EngineMetrics | None, *, ready: bool = True) -> PodSample:
    return PodSample(pod=pod, key=key, ready=ready, scraped_at=at, metrics=metrics)


def test_rates_come_from_fresh_pods_and_stale_or_missing_ones_are_counted():
    history = History()
    for t in range(0, 65, 5):
        samples = [_sample("a", H100, t, _metrics(10.0 * t)),
                   _sample("b", L40S, t, _metrics(2.0 * t) if t < 30 else None),  # stops reporting
                   _sample("c", L40S, 0.0, _metrics(0.0))]  # reported once, long ago
        history, counts = observe(history, samples, now=float(t), settings=SETTINGS)
    sig = model_signals(history, MODEL, samples, counts[MODEL], now=60.0, settings=SETTINGS)
    assert counts[MODEL].fresh == 1 and counts[MODEL].stale == 2
    assert sig.pods.fresh_by_key == {H100: 1} and sig.pods.stale_by_key == {L40S: 2}
    # 60 s window: pod a did 600 requests; pod b 50 until its last good scrape at 25 s, and its
    # 2 req/s carry on for the 35 s since; pod c never showed a rate, so nothing is carried for it
    assert sig.stable_rps == pytest.approx((600 + 50 + 70) / 60)
    assert sig.panic_rps == pytest.approx(12.0)
    assert sig.mean_input_tokens == pytest.approx(512)


def test_a_pod_that_returns_after_a_gap_is_spread_not_a_burst():
    history = History()
    for t, value in ((0, 0.0), (5, 50.0), (30, 300.0)):  # nothing usable between 5 s and 30 s
        history, counts = observe(history, [_sample("a", H100, t, _metrics(value))], now=float(t), settings=SETTINGS)
    sig = model_signals(history, MODEL, [], counts[MODEL], now=30.0, settings=SETTINGS)
    assert sig.panic_rps == pytest.approx(10.0)


# --- policy -------------------------------------------------------------------

def _fleet(*, nodes: dict[str, int] | None = None, min_replicas: int = 1, max_replicas: int | None = None):
    nodes = nodes or {}
    spec = ClusterSpec.model_validate({
        "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "max_gpus": nodes.get("h100", 8)},
                  {"name": "l40s", "accelerator": "l40s", "nodes": 1, "max_gpus": nodes.get("l40s", 8)},
                  {"name": "a10g", "accelerator": "a10g", "nodes": 1, "max_gpus": nodes.get("a10g", 8)}],
        "models": [{"name": MODEL, "slo": {"ttft_ms": 500, "tpot_ms": 60}, "min_replicas": min_replicas,
                    "workload": {"rate_rps": 10, "input_tokens": 512, "output_tokens": 128}}],
        "capacities": [{"model": MODEL, "device": "h100-sxm", "requests_per_s": 22},
                       {"model": MODEL, "device": "l40s", "requests_per_s": 6.5},
                       {"model": MODEL, "device": "a10g", "requests_per_s": 3.4}]})
    return build_fleet(spec, load_catalog(), max_replicas={MODEL: max_replicas} if max_replicas else None)


def _signals(stable: float, panic: float | None = None, *, attainment_miss: float = 0.0, waiting: int = 0,
             fresh: int = 1, stale: int = 0) -> dict[str, ModelSignals]:
    good = 1000 * (1 - attainment_miss)
    ttft = Histogram((0.5, math.inf), (good, 1000.0), 100.0)
    return {MODEL: ModelSignals(MODEL, stable, stable if panic is None else panic, stable * 60, 512, 128, None, None,
                                waiting, 0, None, ttft, None,
                                PodCounts(fresh=fresh, stale=stale, fresh_by_key={H100: fresh},
                                          stale_by_key={H100: stale} if stale else {}))}


def _run(fleet, steps, *, placement=None, settings=SETTINGS, state=None):
    """Apply each decision at once (replicas Ready immediately); returns the decisions."""
    placement = dict(placement or {})
    state = state or ScaleState()
    out: list[Decision] = []
    for now, sig in steps:
        decision, state = decide(sig, placement, fleet=fleet, settings=settings, now=now, state=state)
        placement = {k: ReplicaCount(n, n) for k, n in decision.desired.items()}
        out.append(decision)
    return out, placement, state


def _total(decision: Decision) -> int:
    return sum(decision.desired.values())


def test_scale_up_goes_to_the_cheapest_cover_and_reports_reason():
    fleet = _fleet()
    (d,), _, _ = _run(fleet, [(0.0, _signals(40.0))])
    m = d.model(MODEL)
    assert m.reason is Reason.SCALE_UP
    assert d.desired == {H100: 2}  # 44 req/s: two H100 ($5.98) beat seven L40S ($8.75)
    assert m.needed_rps == pytest.approx(44.0) and m.unmet_rps == 0
    assert "+2 h100/h100-sxm" in m.message


def test_inventory_exhausted_scales_on_the_next_cheapest_and_reports_unmet():
    fleet = _fleet(nodes={"h100": 1, "l40s": 2, "a10g": 1})
    (d,), _, _ = _run(fleet, [(0.0, _signals(60.0))])
    m = d.model(MODEL)
    assert d.desired == {H100: 1, L40S: 2, A10G: 1}
    assert m.capacity_rps == pytest.approx(22 + 13 + 3.4)
    assert m.unmet_rps == pytest.approx(66 - 38.4)
    assert "unmet 27.6 req/s" in m.message


def test_min_and_max_replicas_bound_the_decision():
    (d,), _, _ = _run(_fleet(min_replicas=2), [(0.0, _signals(0.0))])
    assert _total(d) == 2 and d.model(MODEL).reason is Reason.MIN_REPLICAS
    (d,), _, _ = _run(_fleet(max_replicas=3), [(0.0, _signals(200.0))])
    assert _total(d) == 3 and d.model(MODEL).unmet_rps > 0
    assert "max_replicas 3" in d.model(MODEL).message
    (d,), _, _ = _run(_fleet(max_replicas=1), [(0.0, _signals(1.0))], placement={L40S: ReplicaCount(3, 3)})
    assert _total(d) == 1 and d.model(MODEL).reason is Reason.MAX_REPLICAS


def test_burst_panics_up_fast_then_scales_down_slowly_by_half_at_most():
    fleet = _fleet()
    steps = [(float(t), _signals(10.0)) for t in range(0, 60, 5)]
    steps += [(60.0, _signals(12.0, panic=30.0)), (65.0, _signals(15.0, panic=30.0))]
    steps += [(float(t), _signals(10.0)) for t in range(70, 1200, 5)]
    decisions, _, _ = _run(fleet, steps)
    burst = decisions[12].model(MODEL)
    assert burst.reason is Reason.PANIC and burst.capacity_rps >= 33.0
    totals = [_total(d) for d in decisions]
    peak = max(totals)
    # nothing goes within the stabilization window after the burst
    assert all(n == peak for n, (t, _) in zip(totals, steps) if 65 <= t < 65 + SETTINGS.scale_down_stabilization_s)
    downs = [(a, b) for a, b in zip(totals, totals[1:]) if b < a]
    assert downs and all(b >= math.floor(a / 2) for a, b in downs)
    assert decisions[-1].model(MODEL).capacity_rps < burst.capacity_rps
    assert decisions[-1].model(MODEL).capacity_rps >= 11.0


def test_noisy_demand_does_not_flap():
    fleet = _fleet()
    rates = [10.0, 16.0, 9.0, 15.0, 8.0, 17.0, 10.0, 14.0] * 40
    decisions, _, _ = _run(fleet, [(5.0 * i, _signals(r)) for i, r in enumerate(rates)])
    events = []
    for i, (a, b) in enumerate(zip(decisions, decisions[1:]), 1):
        if _total(b) != _total(a):
            events.append((5.0 * i, 1 if _total(b) > _total(a) else -1))
    for (t1, d1), (t2, d2), (t3, d3) in zip(events, events[1:], events[2:]):
        assert not (d1 > 0 > d2 and d3 > 0 and t3 - t1 < SETTINGS.scale_down_stabilization_s)


def test_low_slo_attainment_adds_capacity_although_the_estimate_is_enough():
    fleet = _fleet()
    steps = [(float(t), _signals(10.0)) for t in range(0, 40, 5)] + [(40.0, _signals(10.0, attainment_miss=0.05))]
    decisions, placement, state = _run(fleet, steps)
    m = decisions[-1].model(MODEL)
    assert m.reason is Reason.SLO_MISS and m.attainment == pytest.approx(0.95)
    assert _total(decisions[-1]) > _total(decisions[-2])
    assert m.correction and all(c < 1 for c in m.correction.values())
    assert {k: state.correction[k] for k in m.correction} == m.correction
    # while the new replica starts, the old misses are not held against the placement again
    starting = {k: ReplicaCount(n, n - 1 if k == max(placement) else n) for k, n in decisions[-1].desired.items()}
    decision, _ = decide(_signals(10.0, attainment_miss=0.05), starting, fleet=fleet, settings=SETTINGS, now=75.0,
                         state=state)
    assert decision.model(MODEL).reason is Reason.STEADY


def test_an_slo_miss_derates_only_the_options_that_miss_and_adds_capacity_elsewhere():
    """Behind least-request routing a small replica among big ones gets more than its share and misses alone."""
    fleet = _fleet()

    def signals(a10g_miss: float) -> dict[str, ModelSignals]:
        sig = _signals(20.0, attainment_miss=a10g_miss * 0.25)[MODEL]
        good = Histogram((0.5, math.inf), (250.0, 250.0), 10.0)
        a10g = Histogram((0.5, math.inf), (250.0 * (1 - a10g_miss), 250.0), 10.0)
        return {MODEL: ModelSignals(**{**sig.__dict__, "by_option": {H100: (good, None), A10G: (a10g, None)}})}

    placement = {H100: ReplicaCount(1, 1), A10G: ReplicaCount(2, 2)}  # 28.8 req/s held for 22 needed
    steps = [(float(t), signals(0.0)) for t in range(0, 40, 5)] + [(40.0, signals(0.2))]
    decisions, placement, state = _run(fleet, steps, placement=placement)
    m = decisions[-1].model(MODEL)
    assert m.reason is Reason.SLO_MISS and set(m.correction) == {A10G}
    assert "a10g TP=1 derated to 80%" in m.message
    assert decisions[-1].desired == {H100: 1, A10G: 2, L40S: 1}  # not a third A10G, although it is the cheapest cover
    # while the A10Gs meet the SLO again, their estimate comes back; an option without replicas keeps what it learnt
    state = ScaleState(**{**state.__dict__, "correction": {**state.correction, L40S: 0.8}})
    placement = {H100: ReplicaCount(1, 1), A10G: ReplicaCount(2, 2)}
    decision, state = decide(signals(0.0), placement, fleet=fleet, settings=SETTINGS, now=200.0, state=state)
    assert 0.8 < state.correction[A10G] < 1 and state.correction[L40S] == 0.8


def test_per_option_latency_comes_from_each_options_pods():
    h100, a10g = ("h100-0", H100), ("a10g-0", A10G)

    def metrics(arrived: float, slow: float) -> EngineMetrics:
        ttft = Histogram((0.5, math.inf), (arrived - slow, arrived), 0.0)
        return EngineMetrics(completed=arrived, running=0, waiting=0, ttft_s=ttft)

    history = History()
    for at, slow in ((0.0, 0.0), (10.0, 5.0)):
        samples = [_sample(*h100, at, metrics(10 * at + 1, 0.0)), _sample(*a10g, at, metrics(10 * at + 1, slow))]
        history, counts = observe(history, samples, now=at, settings=SETTINGS)
    sig = model_signals(history, MODEL, samples, counts[MODEL], now=10.0, settings=SETTINGS)
    slo = SLO(ttft_ms=500, tpot_ms=100)
    assert sig.option_attainment(H100, slo, min_requests=20) == pytest.approx(1.0)
    assert sig.option_attainment(A10G, slo, min_requests=20) == pytest.approx(0.95)
    assert sig.option_attainment(A10G, slo, min_requests=200) is None
    assert sig.attainment(slo) == pytest.approx(0.975)


def test_queue_backlog_counts_as_demand():
    (d,), _, _ = _run(_fleet(), [(0.0, _signals(10.0, waiting=200))])
    assert d.model(MODEL).demand_rps == pytest.approx(10.0 + 200 / SETTINGS.queue_drain_s)


def test_stale_pods_do_not_block_scaling():
    placement = {H100: ReplicaCount(2, 2)}
    (d,), _, _ = _run(_fleet(), [(0.0, _signals(50.0, fresh=1, stale=1))], placement=placement)
    m = d.model(MODEL)
    assert m.reason is Reason.SCALE_UP and m.stale_pods == 1 and _total(d) > 2
    assert "1 pod(s) stale or missing" in m.message
    (d,), _, _ = _run(_fleet(), [(0.0, _signals(30.0, fresh=0, stale=2))], placement=placement)
    assert d.model(MODEL).reason is Reason.NO_SIGNALS and d.desired == {H100: 2}


def test_not_ready_replicas_do_not_stall_scale_down():
    fleet = _fleet()
    settings = AutoscaleSettings(scale_down_stabilization_s=10.0)
    placement = {L40S: ReplicaCount(6, 2)}  # four never became Ready
    state = ScaleState()
    for now in (0.0, 5.0, 20.0):
        decision, state = decide(_signals(2.0), placement, fleet=fleet, settings=settings, now=now, state=state)
        placement = {k: ReplicaCount(n, min(n, 2)) for k, n in decision.desired.items()}
    assert sum(decision.desired.values()) < 6


def test_replan_moves_make_before_break():
    fleet = _fleet()
    settings = AutoscaleSettings(churn_weight=0.0)
    placement = {A10G: ReplicaCount(4, 4)}
    decision, state = decide(_signals(5.0), placement, fleet=fleet, settings=settings, now=0.0, state=ScaleState())
    target = replan(fleet, decision, placement, settings=settings)
    assert target == {L40S: 1}  # 5.5 req/s: one L40S ($1.25) beats two A10G ($2.02)
    state = state.following(target, now=0.0)
    decision, state = decide(_signals(5.0), placement, fleet=fleet, settings=settings, now=5.0, state=state)
    # the L40S is added; old replicas go only while Ready capacity still covers 5.5 req/s
    assert decision.desired == {A10G: 2, L40S: 1} and decision.model(MODEL).reason is Reason.MOVE
    placement = {A10G: ReplicaCount(2, 2), L40S: ReplicaCount(1, 1)}  # the new replica is Ready
    decision, state = decide(_signals(5.0), placement, fleet=fleet, settings=settings, now=10.0, state=state)
    assert decision.desired == {A10G: 0, L40S: 1} and state.target is None


def test_observed_mix_picks_bucket_shares():
    spec = ClusterSpec.model_validate({
        "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
        "models": [{"name": MODEL, "slo": {"ttft_ms": 500, "tpot_ms": 60},
                    "workload": {"rate_rps": 1, "buckets": [
                        {"name": "short", "input_tokens": 512, "output_tokens": 128, "share": 0.8},
                        {"name": "long", "input_tokens": 8192, "output_tokens": 256, "share": 0.2}]}}],
        "capacities": [{"model": MODEL, "device": "h100-sxm", "bucket": "short", "requests_per_s": 20},
                       {"model": MODEL, "device": "h100-sxm", "bucket": "long", "requests_per_s": 2}]})
    bounds = build_fleet(spec, load_catalog()).model(MODEL)
    assert observed_shares(bounds, mean_input=None, mean_output=None) == {"short": 0.8, "long": 0.2}
    assert observed_shares(bounds, mean_input=7000, mean_output=300) == {"long": 1.0}
    hist_in = Histogram((1024.0, 16384.0, math.inf), (50.0, 100.0, 100.0), 0.0)
    hist_out = Histogram((512.0, math.inf), (100.0, 100.0), 0.0)
    assert observed_shares(bounds, mean_input=None, mean_output=None, input_hist=hist_in,
                           output_hist=hist_out) == pytest.approx({"short": 0.5, "long": 0.5})


def test_settings_reject_bad_values_by_name():
    with pytest.raises(InputError, match="autoscale.headroom"):
        AutoscaleSettings.from_mapping({"headroom": -1})
    with pytest.raises(InputError, match="unknown settings"):
        AutoscaleSettings.from_mapping({"window": 3})
    with pytest.raises(InputError, match="autoscale.panic_window_s"):
        AutoscaleSettings(panic_window_s=120.0)


def test_an_idle_engine_with_declared_but_untouched_series_reads_as_zero():
    idle = "# HELP vllm:num_requests_running Requests running\n# TYPE vllm:num_requests_running gauge\n"
    assert parse_metrics_text(idle).arrived == 0
    with pytest.raises(InputError, match="not an inference engine"):  # unknown, never idle: the pod counts as stale
        parse_metrics_text("# TYPE other_metric gauge\nother_metric 1\n")


def test_attainment_interpolates_and_its_optimistic_bound_takes_the_whole_bucket():
    ttft = Histogram((1.0, 2.5, math.inf), (80.0, 100.0, 100.0), 100.0)  # 20 requests between 1 s and 2.5 s
    sig = _signals(1.0)[MODEL]
    sig = ModelSignals(**{**sig.__dict__, "ttft_s": ttft})
    slo = SLO(ttft_ms=2000, tpot_ms=100)
    assert sig.attainment(slo) == pytest.approx(1 - 20 * (0.5 / 1.5) / 100)
    assert sig.attainment(slo, optimistic=True) == pytest.approx(1.0)


def test_the_operator_seam_maps_the_decision_onto_planned_deployments():
    from hetsched.operator.scaling import scaling_for
    from hetsched.operator.objects import ReplicaTarget

    (d,), _, _ = _run(_fleet(nodes={"h100": 1}), [(0.0, _signals(30.0))])
    targets = [ReplicaTarget("llama-h100", "h100", "h100-sxm", 1, Role.UNIFIED, planned=3),
               ReplicaTarget("llama-a10g", "a10g", "a10g", 1, Role.UNIFIED, planned=2)]
    scaling = scaling_for(d, MODEL, targets)
    assert scaling.replicas == {"llama-h100": 1}  # the A10G group is left as planned
    assert scaling.reasons[0].startswith("scale-up")
    assert any("l40s/l40s" in r and "no Deployment" in r for r in scaling.reasons)
    assert scaling.observed_rps == pytest.approx(d.model(MODEL).demand_rps) and scaling.observed_rps > 0
    assert scaling.slo_attainment == d.model(MODEL).attainment
    assert scaling_for(None, MODEL, targets).replicas == {}
    assert scaling_for(None, MODEL, targets).observed_rps is None


def test_holt_winters_forecasts_a_daily_ramp_before_it_arrives():
    from hetsched.autoscale.forecast import HoltWinters

    day = 4800.0
    model = HoltWinters(season_s=day, slots=48)
    for t in range(0, int(3 * day), 25):
        model = model.update(float(t), 10 + 8 * math.sin(2 * math.pi * t / day))
    now = 3 * day + 0.2 * day  # rising towards the peak a quarter of a day in
    ahead = model.forecast(now, 0.05 * day)
    assert ahead == pytest.approx(10 + 8 * math.sin(2 * math.pi * 0.25), abs=1.5)
    assert HoltWinters(season_s=day).forecast(0.0, 60.0) is None


def test_forecast_setting_scales_ahead_of_a_recurring_ramp():
    settings = AutoscaleSettings(forecast=True, season_s=600.0, forecast_horizon_s=60.0)

    def rate(t: float) -> float:
        return 12.0 if t % 600 >= 300 else 2.0

    steps = [(float(t), _signals(rate(t))) for t in range(0, 1485, 5)]
    decisions, _, _ = _run(_fleet(), steps, settings=settings)
    before_ramp = decisions[-1].model(MODEL)  # t = 1480: the ramp comes back at 1500
    assert rate(1480) == 2.0 and before_ramp.demand_rps > 8.0


# --- one round on samples (scale_step) and its shells ------------------------------------

def _pod_rounds(fleet, rate, times, *, placement, settings=SETTINGS):
    """Rounds of ``scale_step`` on pod samples: each replica reports its share of ``rate(t)`` req/s; every decision is
    applied at once, its replicas Ready at once."""
    memory = ScaleMemory()
    served: dict[str, float] = {}
    decisions = []
    previous = times[0]
    for now in times:
        pods = [(f"{key.device}-{i}", key) for key, count in sorted(placement.items()) for i in range(count.desired)]
        for pod, _ in pods:
            served[pod] = served.get(pod, 0.0) + rate(now) * (now - previous) / len(pods)
        samples = [_sample(pod, key, now, _metrics(served[pod])) for pod, key in pods]
        decision, memory = scale_step(fleet, samples, placement, settings=settings, now=now, memory=memory)
        placement = {k: ReplicaCount(n, n) for k, n in decision.desired.items() if n}
        decisions.append(decision)
        previous = now
    return decisions, memory


def test_a_round_on_pod_samples_is_pure_and_hands_its_memory_to_the_next():
    from hetsched.operator.objects import ReplicaTarget
    from hetsched.operator.scaling import DecisionAdjuster

    fleet = _fleet()
    placement = {L40S: ReplicaCount(1, 1)}
    memory = ScaleMemory()
    for now in (0.0, 5.0, 10.0):
        before = copy.deepcopy(memory)
        samples = [_sample("l40s-0", L40S, now, _metrics(40.0 * now))]
        decision, memory = scale_step(fleet, samples, placement, settings=SETTINGS, now=now, memory=before)
        assert scale_step(fleet, samples, placement, settings=SETTINGS, now=now, memory=before) == (decision, memory)
        assert before == copy.deepcopy(before)
    m = decision.model(MODEL)
    assert m.reason is Reason.SCALE_UP and m.demand_rps == pytest.approx(40.0)
    assert decision.desired[H100] >= 1  # 44 req/s needed: the cheapest cover is on H100
    assert memory.history.last["l40s-0"][0] == 10.0 and memory.state.last_up[MODEL] == 10.0

    class Model:
        key = MODEL

    scaling = DecisionAdjuster(decision)(Model(), [ReplicaTarget("chat-l40s", "l40s", "l40s", 1, Role.UNIFIED,  # type: ignore[arg-type]
                                                                 planned=1)])
    assert scaling.reasons[0].startswith("scale-up")
    assert any("h100" in r and "no Deployment" in r for r in scaling.reasons)  # an H100 the plan lacks
    assert DecisionAdjuster(None)(Model(), []).replicas == {}  # type: ignore[arg-type]


def test_rounds_on_pod_samples_scale_up_at_once_and_down_only_to_the_largest_need_of_the_stabilization_window():
    settings = AutoscaleSettings(resolve_interval_s=0)  # no re-solve: the incremental steps alone
    times = [float(t) for t in range(0, 905, 5)]
    decisions, _ = _pod_rounds(_fleet(), lambda t: 40.0 if t < 120 else 5.0, times, placement={L40S: ReplicaCount(1, 1)},
                               settings=settings)
    totals = [_total(d) for d in decisions]
    ups = [t for t, a, b in zip(times[1:], totals, totals[1:]) if b > a]
    downs = [t for t, a, b in zip(times[1:], totals, totals[1:]) if b < a]
    assert ups == [5.0]  # the second round sees 40 req/s
    assert downs and downs[0] >= ups[-1] + settings.scale_down_stabilization_s  # up, then down: no flap
    held = [d.model(MODEL).capacity_rps for t, d in zip(times, decisions)
            if 5 <= t < 120 + settings.scale_down_stabilization_s]
    assert min(held) >= 44.0 - 1e-6  # the burst's need (40 req/s + 10 %) holds until it leaves the window
    assert 5.5 <= decisions[-1].model(MODEL).capacity_rps < 44.0 and totals[-1] < max(totals)


def test_a_due_re_solve_sets_the_placement_the_next_rounds_move_to():
    settings = AutoscaleSettings(churn_weight=0.0, resolve_interval_s=10.0)
    decisions, memory = _pod_rounds(_fleet(), lambda t: 5.0, [0.0, 5.0, 10.0], placement={A10G: ReplicaCount(4, 4)},
                                    settings=settings)
    assert [d.replan_due for d in decisions] == [False, False, True]
    assert memory.state.target == {L40S: 1} and memory.state.last_replan == 10.0  # 5.5 req/s: one L40S


def test_router_refusals_are_demand_of_a_model_that_has_no_replica():
    fleet = _fleet(min_replicas=0)
    memory = ScaleMemory()
    for now, refused in ((0.0, 0.0), (10.0, 100.0)):
        decision, memory = scale_step(fleet, [], {}, settings=SETTINGS, now=now, memory=memory,
                                      refusals=RouterRefusals(read_at=now, refused={MODEL: refused}))
    m = decision.model(MODEL)
    assert m.reason is Reason.SCALE_UP and m.demand_rps == pytest.approx(10.0) and _total(decision) >= 1


def test_requests_queued_in_the_router_are_a_backlog_to_drain():
    history = History()
    samples = [_sample("a", H100, 0.0, _metrics(0.0))]
    history, counts = observe(history, samples, now=0.0, settings=SETTINGS,
                              refusals=RouterRefusals(read_at=0.0, refused={}, queued={MODEL: 40.0}))
    assert model_signals(history, MODEL, samples, counts[MODEL], now=0.0, settings=SETTINGS).waiting == 40
    history, counts = observe(history, samples, now=5.0, settings=SETTINGS)  # no reading: the last one holds
    assert model_signals(history, MODEL, samples, counts[MODEL], now=5.0, settings=SETTINGS).waiting == 40


def test_router_refusals_are_arrivals_and_a_missed_reading_is_spread_over_the_gap():
    history = History()
    for at, refused in ((0.0, 0.0), (10.0, 100.0), (20.0, None), (30.0, 300.0)):
        samples = [_sample("a", H100, at, _metrics(10.0 * at))]
        reading = RouterRefusals(read_at=at, refused={MODEL: refused}) if refused is not None else None
        history, counts = observe(history, samples, now=at, settings=SETTINGS, refusals=reading)
    sig = model_signals(history, MODEL, samples, counts[MODEL], now=30.0, settings=SETTINGS)
    assert sig.stable_rps == pytest.approx((300 + 300) / 30)  # the pod's 10 req/s and 10 refused per second
    assert sig.panic_rps == pytest.approx(20.0)  # 200 refused over 20 s, not a burst when the router answers again
    assert counts[MODEL].fresh == 1  # refusals are demand, not a pod
    history, _ = observe(history, samples, now=35.0, settings=SETTINGS,
                         refusals=RouterRefusals(read_at=35.0, refused={MODEL: 50.0}))
    assert history.refused[MODEL][-1].count == 50.0  # the counter went down: the router restarted


def test_the_local_loop_applies_each_round_through_its_applier_and_reads_the_router():
    import httpx

    from hetsched.autoscale.loop import Autoscaler
    from hetsched.autoscale.scrape import RouterScraper

    now = [0.0]
    readings = iter(["0", "100", None])

    def router(request: httpx.Request) -> httpx.Response:
        value = next(readings)
        if value is None:
            return httpx.Response(503, text="down")
        return httpx.Response(200, text=f'# TYPE hetsched_router_rejected counter\n'
                                        f'hetsched_router_rejected_total{{model="{MODEL}",reason="no-endpoint"}} {value}\n')

    class Applier:
        def __init__(self) -> None:
            self.running: list[Replica] = []
            self.started: list[tuple[object, int]] = []

        def replicas(self) -> list[Replica]:
            return list(self.running)

        def start(self, key, count: int) -> None:
            self.started.append((key, count))
            self.running += [Replica(f"{key.device}-{i}", key, "", False) for i in range(count)]

        def stop(self, key, count: int) -> None:
            raise AssertionError("nothing to stop")

    class Source:
        def collect(self, replicas, *, now):
            return [_sample(r.name, r.key, now, None, ready=r.ready) for r in replicas]

    applier = Applier()
    scaler = Autoscaler(_fleet(min_replicas=0), SETTINGS, applier, Source(), clock=lambda: now[0],
                        router=RouterScraper("http://router", lambda: now[0],
                                             client=httpx.Client(transport=httpx.MockTransport(router))))
    assert scaler.step().desired == {}
    now[0] = 10.0
    decision = scaler.step()
    assert decision.model(MODEL).demand_rps == pytest.approx(10.0)
    assert applier.started == sorted(decision.desired.items()) and applier.started
    now[0] = 15.0
    assert scaler.step().model(MODEL).reason is not Reason.SCALE_UP  # the router is down: its last reading stands
    assert len(applier.started) == 1


def test_prometheus_source_matches_series_to_replicas_and_marks_the_rest_stale():
    import httpx

    from hetsched.autoscale.scrape import PrometheusSource

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query" and "vllm" in request.url.params["query"]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"__name__": "vllm:request_success_total", "pod": "a"}, "value": [50.0, "10"]},
            {"metric": {"__name__": "vllm:num_requests_running", "pod": "a"}, "value": [50.0, "1"]},
            {"metric": {"__name__": "vllm:num_requests_waiting", "pod": "a"}, "value": [50.0, "0"]}]}})

    source = PrometheusSource("http://prom:9090", client=httpx.Client(transport=httpx.MockTransport(answer)))
    samples = source.collect([Replica("a", H100, "", True), Replica("b", H100, "", True)], now=52.0)
    assert samples[0].metrics is not None and samples[0].metrics.arrived == 11 and samples[0].scraped_at == 50.0
    assert samples[1].metrics is None
    down = PrometheusSource("http://prom:9090", client=httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(503, text="down"))))
    assert [s.metrics for s in down.collect([Replica("a", H100, "", True)], now=52.0)] == [None]


def test_the_router_scraper_reads_refusals_and_queued_demand_per_model_and_nothing_from_a_router_that_does_not_answer():
    import httpx

    from hetsched.autoscale.scrape import RouterScraper
    from hetsched.engine_metrics.parse import parse_router_rejections

    text = ('# TYPE hetsched_router_rejected counter\n'
            'hetsched_router_rejected_total{model="m",reason="no-endpoint"} 3\n'
            'hetsched_router_rejected_total{model="m",reason="all-saturated"} 4\n'
            'hetsched_router_rejected_total{model="m",reason="best-effort"} 50\n'
            '# TYPE hetsched_router_flow_queued_demand gauge\n'
            'hetsched_router_flow_queued_demand{front="http",model="m"} 12\n')
    assert parse_router_rejections(text) == ({"m": 7.0}, {"m": 12.0})  # a best-effort class's refusals are no demand
    scraper = RouterScraper("http://router", lambda: 9.0, client=httpx.Client(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, text=text))))
    assert scraper.read() == RouterRefusals(read_at=9.0, refused={"m": 7.0}, queued={"m": 12.0})
    for down in (httpx.Response(503, text="down"), httpx.Response(200, text="not {prometheus")):
        scraper = RouterScraper("http://router", lambda: 9.0, client=httpx.Client(
            transport=httpx.MockTransport(lambda request, down=down: down)))
        assert scraper.read() is None


def _engine_pod(name: str, *, tp: int = 1, ready: bool = True, ip: str | None = "10.0.0.5",
                deleting: bool = False) -> dict:
    """A pod (or, without status, a Deployment's pod template) as the operator renders them."""
    meta = {"name": name, "namespace": "serving",
            "labels": {"hetsched.io/model": "chat", "hetsched.io/pool": "h100", "hetsched.io/accelerator": "h100-sxm",
                       "hetsched.io/role": "unified", "app.kubernetes.io/managed-by": "hetsched"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    container = {"name": "engine", "args": ["--tensor-parallel-size", str(tp)],
                 "env": [{"name": "HETSCHED_DEVICE", "value": "h100-sxm"}],
                 "ports": [{"name": "http", "containerPort": 8080}]}
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [container]}, "status": status}


def _engine_deployment(name: str, *, tp: int, replicas: int) -> dict:
    template = _engine_pod("template", tp=tp)
    return {"metadata": {"name": name, "namespace": "serving"},
            "spec": {"replicas": replicas, "template": {"metadata": {"labels": template["metadata"]["labels"]},
                                                        "spec": template["spec"]}}}


def test_cluster_replicas_are_the_pods_plus_a_placeholder_per_replica_asked_for_without_a_pod():
    from hetsched.operator.replicas import replicas_in_cluster

    tp1 = OptionKey("serving/chat", "h100", "h100-sxm", 1, Role.UNIFIED)
    tp2, other = tp1._replace(tp=2), tp1._replace(model="serving/other")
    deployments = [_engine_deployment("chat-tp1", tp=1, replicas=3), _engine_deployment("chat-tp2", tp=2, replicas=1)]
    pods = [_engine_pod("chat-tp1-a"), _engine_pod("chat-tp1-b", deleting=True),
            _engine_pod("chat-tp2-a", tp=2), _engine_pod("chat-tp2-b", tp=2, ready=False, ip=None)]
    replicas = replicas_in_cluster(deployments, pods, [tp1, tp2, other])
    by_key = {key: sorted((r.name, r.url, r.ready) for r in replicas if r.key == key) for key in (tp1, tp2)}
    assert by_key[tp1] == [("serving/chat-tp1-a", "http://10.0.0.5:8080", True),
                           ("serving/chat-tp1/pending-0", "", False), ("serving/chat-tp1/pending-1", "", False)]
    # scaling down: more pods than asked for are all counted, none is invented
    assert by_key[tp2] == [("serving/chat-tp2-a", "http://10.0.0.5:8080", True), ("serving/chat-tp2-b", "", False)]
    assert replicas_in_cluster(deployments, pods, [other]) == []


def test_only_ready_replicas_are_scraped():
    from hetsched.operator.scaling import ReadyOnly

    asked: list[str] = []

    class Source:
        def collect(self, replicas, *, now):
            asked.extend(r.name for r in replicas)
            return [PodSample(pod=r.name, key=r.key, ready=True, scraped_at=now, metrics=parse_metrics_text(VLLM_OLD))
                    for r in replicas]

    replicas = [Replica("up", H100, "http://10.0.0.1:8000", True), Replica("starting", H100, "http://10.0.0.2:8000", False),
                Replica("pending", H100, "", False)]
    samples = ReadyOnly(Source()).collect(replicas, now=5.0)
    assert asked == ["up"]
    assert [(s.pod, s.ready, s.metrics is None) for s in samples] == [("up", True, False), ("starting", False, True),
                                                                      ("pending", False, True)]


def test_a_model_without_fresh_metrics_holds_the_replicas_it_runs_at_the_seam():
    from hetsched.operator.scaling import scaling_for
    from hetsched.operator.objects import ReplicaTarget

    (d,), _, _ = _run(_fleet(), [(0.0, {})], placement={H100: ReplicaCount(6, 6)})
    assert d.model(MODEL).reason is Reason.NO_SIGNALS
    targets = [ReplicaTarget("llama-h100", "h100", "h100-sxm", 1, Role.UNIFIED, planned=2)]
    held = scaling_for(d, MODEL, targets)
    assert held.replicas == {"llama-h100": 6}  # not the plan's 2: stale metrics say nothing about load
    assert "no pod reported fresh metrics" in held.reasons[0]
    assert held.observed_rps is None and held.slo_attainment is None  # unknown, not zero
