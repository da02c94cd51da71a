"""What an engine's /metrics tell the tail and the prefill scale: its token gaps and its prefill time (issue 28)."""

from __future__ import annotations

import math

import pytest

from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, Metric, OnlineEstimator
from hetsched.router.learning import window_observations
from hetsched.router.profiles import roofline_profile

PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.004",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.008",model_name="m"} 90.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.6
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 4.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.04
"""


def test_the_page_gives_the_token_gaps_and_the_prefill_time() -> None:
    metrics = parse_metrics_text(PAGE)
    assert metrics.itl_s is not None and metrics.itl_s.count == 100 and metrics.itl_s.total == pytest.approx(0.6)
    assert metrics.prefill_s is not None and metrics.prefill_s.total / metrics.prefill_s.count == pytest.approx(0.01)
    assert metrics.tpot_s is None  # the gaps are never read as the per-request TPOT


def _histogram(count: float, mean: float) -> Histogram:
    return Histogram((1.0, math.inf), (count, count), count * mean)


def _window(profile, true: StepCorrection, *, batch: int, prompt: int, requests: float,  # type: ignore[no-untyped-def]
            with_prefill: bool) -> tuple[EngineMetrics, EngineMetrics]:
    """Two readings of an engine that runs ``true`` × the model, ``requests`` apart, at ``batch`` sequences."""
    probe = EngineMetrics(running=batch, waiting=0, completed=1, ttft_s=_histogram(1, 1), tpot_s=_histogram(1, 1),
                          queue_s=_histogram(1, 0), input_tokens=_histogram(1, prompt),
                          output_tokens=_histogram(1, 200), prefill_s=_histogram(1, 1) if with_prefill else None)
    found, _ = window_observations(profile, "pod", EngineMetrics(running=batch), probe, at=0.0, min_requests=1)
    seconds = {o.metric: true.seconds(o.parts) for o in found}
    after = EngineMetrics(running=batch, waiting=0, completed=requests, ttft_s=_histogram(requests, seconds[Metric.TTFT]),
                          tpot_s=_histogram(requests, seconds[Metric.TPOT]), queue_s=_histogram(requests, 0.0),
                          input_tokens=_histogram(requests, prompt), output_tokens=_histogram(requests, 200),
                          prefill_s=_histogram(requests, seconds[Metric.PREFILL]) if with_prefill else None)
    return EngineMetrics(running=batch, waiting=0, completed=0, ttft_s=_histogram(0, 0), tpot_s=_histogram(0, 0),
                         queue_s=_histogram(0, 0), input_tokens=_histogram(0, 0), output_tokens=_histogram(0, 0),
                         prefill_s=_histogram(0, 0) if with_prefill else None), after


def test_a_window_with_the_prefill_time_observes_the_prompt_s_steps_alone() -> None:
    profile = roofline_profile("llama-3.1-8b", "a100-80gb", 1)
    before, after = _window(profile, StepCorrection(), batch=8, prompt=500, requests=20, with_prefill=True)
    found, _ = window_observations(profile, "pod", before, after, at=5.0)
    prefill = next(o for o in found if o.metric is Metric.PREFILL)
    assert prefill.parts == profile.step_parts(decode_seqs=7, context=600, prefill_tokens=500)
    assert prefill.parts[3] == 0.0  # no time before the first step in it
    plain, _ = window_observations(profile, "pod", *_window(profile, StepCorrection(), batch=8, prompt=500,
                                                            requests=20, with_prefill=False), at=5.0)
    assert {o.metric for o in plain} == {Metric.TTFT, Metric.TPOT}


def test_the_prefill_time_tells_the_prefill_scale_from_the_time_before_a_first_step() -> None:
    profile = roofline_profile("llama-3.1-8b", "a100-80gb", 1)
    true = StepCorrection(prefill_scale=0.6, decode_scale=1.1, request_overhead_s=0.004)
    key = CorrectionKey("llama-3.1-8b", "a100-80gb")
    estimator = OnlineEstimator()
    for i in range(40):
        before, after = _window(profile, true, batch=1 + i % 12, prompt=512, requests=30, with_prefill=True)
        for observation in window_observations(profile, "pod", before, after, at=10.0 * i)[0]:
            estimator.observe(key, observation)
    learned = estimator.estimate(key).correction
    assert learned.prefill_scale == pytest.approx(0.6, rel=0.1)
    assert learned.request_overhead_s == pytest.approx(0.004, rel=0.3)


def test_a_window_s_batch_comes_from_its_requests_time_in_the_engine_when_its_span_is_known() -> None:
    from hetsched.router.predict import predict
    from hetsched.router.types import Endpoint, EndpointView, RouteRequest

    profile = roofline_profile("llama-3.1-8b", "a100-80gb", 1)
    before = EngineMetrics(running=2, waiting=0, completed=0, ttft_s=_histogram(0, 0), tpot_s=_histogram(0, 0),
                           queue_s=_histogram(0, 0), input_tokens=_histogram(0, 0), output_tokens=_histogram(0, 0))
    # 100 requests in 10 s, each 0.1 s to its first token (0.02 of it queued) and 200 tokens 0.02 s apart: 4.06 s
    # in the engine, so about 40 run at once, whatever the two readings of the running gauge (2) say
    after = EngineMetrics(running=2, waiting=0, completed=100, ttft_s=_histogram(100, 0.1),
                          tpot_s=_histogram(100, 0.02), queue_s=_histogram(100, 0.02),
                          input_tokens=_histogram(100, 500), output_tokens=_histogram(100, 200))
    found, _ = window_observations(profile, "pod", before, after, at=10.0, span_s=10.0)
    tpot = next(o for o in found if o.metric is Metric.TPOT)
    others = round(100 * (0.1 - 0.02 + 199 * 0.02) / 10.0) - 1
    view = EndpointView(Endpoint("x", "", ""), in_flight=others, in_flight_prompt_tokens=others * 500,
                        in_flight_max_tokens=others * 200, running=others, waiting=0)
    expected = predict(profile, view, RouteRequest(model="", prompt_tokens=500, max_tokens=200), slo=None)
    assert tpot.parts == expected.tpot_parts
    gauge, _ = window_observations(profile, "pod", before, after, at=10.0)  # no span: the gauge's 2
    assert next(o for o in gauge if o.metric is Metric.TPOT).parts != tpot.parts
