"""The router learns each hardware's step-model correction from its own timings, and predicts with it."""

from __future__ import annotations

import math
import random
import time

import pytest

from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.perf.correction import IDENTITY, StepCorrection
from hetsched.perf.online import Metric
from hetsched.router.learning import window_observations
from hetsched.router.predict import alone_ttft, decodes_as_modelled, life_step, predict, prefill_span
from hetsched.router.config import parse_router_config
from hetsched.router.picker import Picker
from hetsched.router.state import RouterState, Ticket
from hetsched.catalog.host import read_host
from hetsched.router.types import Endpoint, EndpointView, Front, RouteRequest

MODEL = "llama-3.1-8b"
SLOW, FAST = "http://slow-1:8000", "http://fast:8000"


def _state(*, time_scale: float = 1.0, online: bool = True, slow_pods: int = 1) -> RouterState:
    endpoints = [{"url": f"http://slow-{i}:8000", "accelerator": "a100-80gb"} for i in range(1, slow_pods + 1)]
    config = parse_router_config({"policy": "slo", "time_scale": time_scale, "calibration": {"online": online},
                                  "models": {MODEL: {"slo": {"ttft_ms": 2000, "tpot_ms": 100},
                                                     "endpoints": [*endpoints,
                                                                   {"url": FAST, "accelerator": "h100-sxm"}]}}})
    state = RouterState(config, rng=random.Random(0))
    state.set_endpoints(MODEL, config.static_endpoints())
    return state


def _serve(state: RouterState, url: str, true: StepCorrection, *, requests: int, time_scale: float = 1.0,
           seed: int = 1, start: float = 0.0) -> None:
    """Send ``requests`` one after another to ``url``, answering each as hardware ``true`` × the model would
    (in wall time at ``time_scale``), with 5 % noise."""
    rng = random.Random(seed)
    for i in range(requests):
        request = RouteRequest(model=MODEL, prompt_tokens=rng.randint(100, 1500), max_tokens=rng.randint(50, 300))
        now = start + i / time_scale
        ticket = state.start(url, request, now=now)
        prediction = ticket.prediction
        assert prediction is not None and prediction.ttft_parts is not None and prediction.tpot_parts is not None
        ttft = true.seconds(prediction.ttft_parts) * rng.uniform(0.95, 1.05) / time_scale
        tpot = true.seconds(prediction.tpot_parts) * rng.uniform(0.95, 1.05) / time_scale
        state.learn(ticket, ttft_s=ttft, tpot_s=tpot, now=now)
        state.finish(ticket)


def test_a_slow_type_is_learned_and_its_endpoints_predict_with_it() -> None:
    state = _state()
    before = state.get(SLOW).profile
    assert before is not None and before.correction == IDENTITY
    _serve(state, SLOW, StepCorrection(1.4, 1.4), requests=200)
    learned = state.get(SLOW).profile
    assert learned is not None
    assert learned.correction.prefill_scale == pytest.approx(1.4, rel=0.1)
    assert learned.correction.decode_scale == pytest.approx(1.4, rel=0.1)
    assert state.get(FAST).profile.correction == IDENTITY  # another type learns nothing from it
    request = RouteRequest(model=MODEL, prompt_tokens=500, max_tokens=100)
    ticket = state.start(SLOW, request, now=1e4)
    assert ticket.prediction is not None
    assert ticket.prediction.tpot_s == pytest.approx(learned.correction.seconds(ticket.prediction.tpot_parts))


def test_a_correct_catalog_moves_nothing_much() -> None:
    state = _state()
    _serve(state, SLOW, IDENTITY, requests=200)
    correction = state.get(SLOW).profile.correction
    assert correction.prefill_scale == pytest.approx(1.0, abs=0.03)
    assert correction.decode_scale == pytest.approx(1.0, abs=0.03)


def test_twins_at_a_time_scale_are_learned_in_the_model_s_time() -> None:
    state = _state(time_scale=10.0)
    _serve(state, SLOW, StepCorrection(1.4, 1.4), requests=200, time_scale=10.0)
    assert state.get(SLOW).profile.correction.decode_scale == pytest.approx(1.4, rel=0.1)


def test_a_new_pod_of_a_learned_type_starts_with_its_correction() -> None:
    state = _state()
    _serve(state, SLOW, StepCorrection(1.4, 1.4), requests=200)
    learned = state.get(SLOW).profile.correction
    endpoints = state.endpoints(MODEL)
    state.set_endpoints(MODEL, [*endpoints, Endpoint("http://slow-2:8000", MODEL, "a100-80gb")])
    assert state.get("http://slow-2:8000").profile.correction == learned


def test_a_different_attention_backend_learns_on_its_own() -> None:
    state = _state()
    endpoints = state.endpoints(MODEL)
    other = Endpoint("http://slow-fi:8000", MODEL, "a100-80gb", attention_backend="FLASHINFER")
    state.set_endpoints(MODEL, [*endpoints, other])
    _serve(state, SLOW, StepCorrection(1.4, 1.4), requests=200)
    assert state.get(other.url).profile.correction == IDENTITY


def test_without_online_calibration_nothing_is_predicted_or_learned() -> None:
    state = _state(online=False)
    ticket = state.start(SLOW, RouteRequest(model=MODEL, prompt_tokens=100, max_tokens=10), now=0.0)
    assert ticket.prediction is None
    assert state.learn(ticket, ttft_s=1.0, tpot_s=0.1, now=1.0) is None


def test_a_request_answered_after_its_endpoint_left_teaches_nothing() -> None:
    state = _state()
    ticket = state.start(SLOW, RouteRequest(model=MODEL, prompt_tokens=100, max_tokens=10), now=0.0)
    state.set_endpoints(MODEL, [e for e in state.endpoints(MODEL) if e.url != SLOW])
    assert state.learn(ticket, ttft_s=1.0, tpot_s=0.1, now=1.0) is None


def test_the_picker_s_gauges_show_the_correction_in_force_and_the_prediction_error() -> None:
    from hetsched.router.answers import StreamStats

    config = parse_router_config({"policy": "slo", "models": {MODEL: {
        "slo": {"ttft_ms": 2000, "tpot_ms": 100}, "endpoints": [{"url": SLOW, "accelerator": "a100-80gb"}]}}})
    clock = [0.0]
    picker = Picker(config, front=Front.HTTP, host=read_host())
    picker.clock = lambda: clock[0]
    endpoint = picker.state.get(SLOW).endpoint
    text = picker.metrics.exposition().decode()
    assert f'hetsched_router_step_model_scale{{accelerator="a100-80gb",model="{MODEL}",phase="decode"}} 1.0' in text
    rng = random.Random(2)
    for i in range(200):
        request = RouteRequest(model=MODEL, prompt_tokens=rng.randint(100, 1500), max_tokens=50)
        clock[0] = float(i)
        ticket: Ticket = picker.start(endpoint, request)
        assert ticket.prediction is not None
        stats = StreamStats()
        slow = StepCorrection(1.5, 1.5)  # the hardware, whatever is predicted
        stats.first = clock[0] + slow.seconds(ticket.prediction.ttft_parts)
        stats.usage_tokens = 50
        stats.last = stats.first + 49 * slow.seconds(ticket.prediction.tpot_parts)
        clock[0] = stats.last
        picker.answered(endpoint, "200", started=float(i), stats=stats, ticket=ticket)
        picker.finish(ticket, endpoint)
    text = picker.metrics.exposition().decode()
    scale = next(line for line in text.splitlines()
                 if line.startswith("hetsched_router_step_model_scale") and 'phase="decode"' in line)
    assert float(scale.split()[-1]) > 1.3  # one batch size: a step overhead takes a share of the difference
    ratio = next(line for line in text.splitlines()
                 if line.startswith("hetsched_router_prediction_error_ratio") and 'metric="tpot"' in line)
    assert float(ratio.split()[-1]) == pytest.approx(1.0, abs=0.1)  # predictions caught up with what was seen


def test_the_picker_counts_the_cpu_its_learning_costs_and_none_without_it() -> None:
    from hetsched.router.answers import StreamStats

    def served(online: bool) -> tuple[float, float]:
        """The counter after 100 answered streams, and the CPU this thread spent serving them."""
        config = parse_router_config({"policy": "slo", "calibration": {"online": online}, "models": {MODEL: {
            "endpoints": [{"url": SLOW, "accelerator": "a100-80gb"}]}}})
        clock = [0.0]
        picker = Picker(config, front=Front.HTTP, host=read_host())
        picker.clock = lambda: clock[0]
        endpoint = picker.state.get(SLOW).endpoint
        began = time.thread_time()
        for i in range(100):
            clock[0] = float(i)
            ticket = picker.start(endpoint, RouteRequest(model=MODEL, prompt_tokens=500, max_tokens=20))
            stats = StreamStats()
            stats.first, stats.last, stats.usage_tokens = clock[0] + 0.05, clock[0] + 0.5, 20
            clock[0] = stats.last
            picker.answered(endpoint, "200", started=float(i), stats=stats, ticket=ticket)
            picker.finish(ticket, endpoint)
        spent = time.thread_time() - began
        line = next(line for line in picker.metrics.exposition().decode().splitlines()
                    if line.startswith("hetsched_router_calibration_cpu_seconds_total"))
        return float(line.split()[-1]), spent

    learning, serving = served(online=True)
    assert 0.0 < learning < serving  # a share of what serving the requests took, every request learned from here
    assert served(online=False)[0] == 0.0


def _metrics(*, requests: float, ttft_s: float, tpot_s: float, queue_s: float, prompt: float, output: float,
             running: int, completed: float | None = None) -> EngineMetrics:
    """An engine's cumulative counters after ``requests`` requests of these mean times and sizes."""
    def histogram(mean: float) -> Histogram:
        return Histogram((1.0, math.inf), (requests, requests), requests * mean)

    return EngineMetrics(completed=requests if completed is None else completed, running=running, waiting=0,
                         ttft_s=histogram(ttft_s), tpot_s=histogram(tpot_s), queue_s=histogram(queue_s),
                         input_tokens=histogram(prompt), output_tokens=histogram(output))


def test_an_engine_window_gives_its_mean_tpot_and_own_ttft_beside_their_predictions() -> None:
    profile = _state().get(SLOW).profile
    assert profile is not None
    before = _metrics(requests=100, ttft_s=0.2, tpot_s=0.02, queue_s=0.05, prompt=500, output=200, running=8)
    after = _metrics(requests=150, ttft_s=0.2, tpot_s=0.02, queue_s=0.05, prompt=500, output=200, running=8)
    found, reason = window_observations(profile, "pod-a", before, after, at=30.0)
    assert reason == ""
    by_metric = {o.metric: o for o in found}
    assert by_metric[Metric.TPOT].observed_s == pytest.approx(0.02)
    assert by_metric[Metric.TTFT].observed_s == pytest.approx(0.15)  # the wait in the queue is not the engine's
    expected = predict(profile, EndpointView(Endpoint("x", "", ""), in_flight=7, in_flight_prompt_tokens=3500,
                                             in_flight_max_tokens=1400, running=7, waiting=0),
                       RouteRequest(model="", prompt_tokens=500, max_tokens=200), slo=None)
    assert by_metric[Metric.TPOT].parts == expected.tpot_parts
    assert all(o.source == "pod-a" and o.at == 30.0 for o in found)


@pytest.mark.parametrize("change, reason", [
    ({"requests": 120}, ""),  # too few finished in the window: quiet, no warning
    ({"requests": 50}, "restarted"),
    ({"requests": 150, "completed": 10.0}, "restarted"),
])
def test_a_window_without_enough_or_with_reset_counters_teaches_nothing(change: dict, reason: str) -> None:
    profile = _state().get(SLOW).profile
    assert profile is not None
    sizes = {"ttft_s": 0.2, "tpot_s": 0.02, "queue_s": 0.0, "prompt": 500, "output": 200, "running": 4}
    before = _metrics(requests=118, **sizes)
    after = _metrics(**{**sizes, **change})
    found, why = window_observations(profile, "pod-a", before, after, at=1.0)
    assert found == [] and reason in why


def test_an_engine_without_latency_histograms_is_named_and_skipped() -> None:
    profile = _state().get(SLOW).profile
    assert profile is not None
    found, why = window_observations(profile, "pod-a", EngineMetrics(running=1), EngineMetrics(running=1), at=1.0)
    assert found == [] and "lack" in why


def test_a_router_file_names_an_endpoint_s_backend_as_vllm_spells_it() -> None:
    from hetsched.errors import InputError

    raw = {"models": {MODEL: {"endpoints": [{"url": FAST, "accelerator": "h100-sxm",
                                             "attention_backend": "FLASHINFER", "engine": "vllm 0.11.0"}]}}}
    [endpoint] = parse_router_config(raw).static_endpoints()
    assert (endpoint.attention_backend, endpoint.engine) == ("FLASHINFER", "vllm 0.11.0")
    raw["models"][MODEL]["endpoints"][0]["attention_backend"] = "flash attn"
    with pytest.raises(InputError, match=r"endpoints\[0\]\.attention_backend"):
        parse_router_config(raw)


def test_requests_beyond_the_sampling_rate_are_neither_predicted_nor_learned() -> None:
    state = _state()
    request = RouteRequest(model=MODEL, prompt_tokens=100, max_tokens=10)
    first = state.start(SLOW, request, now=100.0)
    second = state.start(SLOW, request, now=100.01)  # within 1/20 s of the first
    other = state.start(FAST, request, now=100.01)  # another endpoint samples on its own
    later = state.start(SLOW, request, now=100.06)
    assert first.prediction is not None and other.prediction is not None and later.prediction is not None
    assert second.prediction is None
    assert state.learn(second, ttft_s=0.1, tpot_s=0.01, now=11.0) is None


def test_a_ttft_among_others_prompts_is_not_learned_from_but_its_tpot_is() -> None:
    state = _state()
    request = RouteRequest(model=MODEL, prompt_tokens=1000, max_tokens=100)
    crowded = state.start(SLOW, request, now=10.0)
    assert crowded.prediction is not None and crowded.prediction.ttft_parts is not None  # sent alone
    state.start(SLOW, request, now=10.001)  # another prompt before its first token
    state.learn(crowded, ttft_s=0.2, tpot_s=0.02, now=13.0)
    assert state.learner is not None
    key = state.get(SLOW).key
    assert state.learner.error_ratio(key, Metric.TTFT) is None  # not learned from ...
    assert state.learner.error_ratio(key, Metric.TPOT) is not None  # ... while its TPOT is

    late = state.start(SLOW, request, now=10.06)  # the one before is still prefilling: not alone
    assert late.prediction is not None and late.prediction.ttft_parts is None and late.prediction.tpot_parts


def test_a_tpot_counts_the_prompts_sent_during_its_life() -> None:
    profile = _state().get(SLOW).profile
    assert profile is not None
    quiet_life = life_step(profile, 8.0, requests=8, prompt_tokens=8000, max_tokens=1600, decode_steps=200,
                           arrivals=0, arrival_prompt_tokens=0)
    busy_life = life_step(profile, 8.0, requests=8, prompt_tokens=8000, max_tokens=1600, decode_steps=200,
                          arrivals=20, arrival_prompt_tokens=20_000)
    assert profile.correction.seconds(busy_life) > 1.2 * profile.correction.seconds(quiet_life)
    assert busy_life[0] > 0 and quiet_life[0] == 0  # prefill seconds only where prompts came


def test_a_request_sent_alone_is_predicted_from_the_step_model_alone() -> None:
    profile = _state().get(SLOW).profile
    assert profile is not None
    view = EndpointView(Endpoint(SLOW, MODEL, "a100-80gb"), in_flight=4, in_flight_prompt_tokens=4000,
                        in_flight_max_tokens=800)
    request = RouteRequest(model=MODEL, prompt_tokens=1000, max_tokens=100)
    parts = alone_ttft(profile, view, request)
    decode = profile.step_time(decode_seqs=4, context=1200, prefill_tokens=0)
    chunk = profile.step_time(decode_seqs=4, context=1200, prefill_tokens=1000)
    assert IDENTITY.seconds(parts) == pytest.approx(decode / 2 + chunk, rel=0.01)
    assert parts[3] == 1.0  # the front end's time once
    assert prefill_span(profile, view, 1000) == pytest.approx(decode + chunk, rel=0.01)
    assert IDENTITY.seconds(alone_ttft(profile, view, request, cached_tokens=900)) < decode / 2 + chunk


def test_a_tpot_is_learned_beside_a_queue_for_slots_not_one_for_kv_memory() -> None:
    profile = _state().get(SLOW).profile
    assert profile is not None
    endpoint = Endpoint(SLOW, MODEL, "a100-80gb")
    full = profile.max_num_seqs
    slots = EndpointView(endpoint, in_flight=full, in_flight_prompt_tokens=full * 500, in_flight_max_tokens=full * 100,
                         running=full - 3, waiting=3, kv_usage=0.5)
    memory = EndpointView(endpoint, in_flight=full, in_flight_prompt_tokens=full * 500,
                          in_flight_max_tokens=full * 100, running=full - 40, waiting=40, kv_usage=0.999)
    assert decodes_as_modelled(profile, slots)  # the batch is the slots: the step model's steps
    assert not decodes_as_modelled(profile, memory)  # memory holds the batch below the load
    assert not decodes_as_modelled(profile, EndpointView(endpoint, in_flight=full, running=full - 3, waiting=3))
    assert decodes_as_modelled(profile, EndpointView(endpoint, in_flight=4, running=4, waiting=0))
