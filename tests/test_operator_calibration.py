"""The operator's recalibration: engine pods' metrics teach each hardware's correction; one that moves re-plans."""

from __future__ import annotations

import math

import pytest

from hetsched.autoscale.signals import PodSample
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.operator.calibration import FleetCalibration
from hetsched.perf.correction import IDENTITY, StepCorrection
from hetsched.perf.online import CorrectionKey
from hetsched.router.predict import EndpointProfile, predict
from hetsched.router.profiles import roofline_profile
from hetsched.router.types import Endpoint, EndpointView, RouteRequest
from hetsched.sim.roles import Role
from hetsched.specs.wire import OptionKey

OPTION = OptionKey("serving/chat", "a100", "a100-80gb", 1, Role.UNIFIED)
KEY = CorrectionKey("llama-3.1-8b", "a100-80gb", 1)
SHAPES = [(300, 150, 4), (1200, 80, 12), (600, 300, 24), (150, 60, 2)]
"""(prompt, output, running) of the rounds, in turn: the engines see several batch sizes."""


def _profile(key: CorrectionKey) -> EndpointProfile | None:
    return roofline_profile(key.model, key.accelerator, key.tp) if key == KEY else None


def _engine(rounds: int, slow: StepCorrection, *, pod_factor: float = 1.0) -> list[EngineMetrics]:
    """Cumulative metrics of an engine after each round: 20 requests a round of the round's shape, timed as
    hardware ``slow`` (× ``pod_factor``) would at the round's mean batch (the running gauge's mean over the
    round's two readings, which is all an engine's metrics tell of it)."""
    profile = _profile(KEY)
    assert profile is not None
    totals = {"requests": 0.0, "ttft": 0.0, "tpot": 0.0, "prompt": 0.0, "output": 0.0}
    found = []
    for r in range(rounds):
        prompt, output, running = SHAPES[r % len(SHAPES)]
        others = max(round((running + SHAPES[(r - 1) % len(SHAPES)][2]) / 2) - 1, 0)
        view = EndpointView(Endpoint("x", "", ""), in_flight=others, in_flight_prompt_tokens=others * prompt,
                            in_flight_max_tokens=others * output, running=others, waiting=0)
        p = predict(profile, view, RouteRequest(model="", prompt_tokens=prompt, max_tokens=output), slo=None)
        assert p.ttft_parts is not None and p.tpot_parts is not None
        totals["requests"] += 20
        totals["ttft"] += 20 * slow.seconds(p.ttft_parts) * pod_factor
        totals["tpot"] += 20 * slow.seconds(p.tpot_parts) * pod_factor
        totals["prompt"] += 20 * prompt
        totals["output"] += 20 * output

        def histogram(total: float) -> Histogram:
            return Histogram((1.0, math.inf), (totals["requests"],) * 2, total)

        found.append(EngineMetrics(completed=totals["requests"], running=running, waiting=0,
                                   ttft_s=histogram(totals["ttft"]), tpot_s=histogram(totals["tpot"]),
                                   queue_s=histogram(0.0), input_tokens=histogram(totals["prompt"]),
                                   output_tokens=histogram(totals["output"])))
    return found


def _run(calibration: FleetCalibration, pods: dict[str, list[EngineMetrics]]) -> list:
    moves = []
    rounds = len(next(iter(pods.values())))
    for r in range(rounds):
        samples = [PodSample(pod=name, key=OPTION, ready=True, scraped_at=r * 5.0, metrics=metrics[r])
                   for name, metrics in pods.items()]
        moves += calibration.observe(samples, {OPTION: KEY}, now=r * 5.0)
    return moves


def test_a_slow_type_moves_its_correction_once_and_names_its_models() -> None:
    calibration = FleetCalibration(profile=_profile, threshold=0.1)
    slow = StepCorrection(1.4, 1.4)
    [move] = _run(calibration, {f"chat-{i}": _engine(40, slow) for i in range(3)})
    assert move.key == KEY and move.before == IDENTITY and move.models == ("serving/chat",)
    assert move.estimate.correction.decode_scale == pytest.approx(1.4, rel=0.1)
    assert move.estimate.correction.prefill_scale == pytest.approx(1.4, rel=0.1)
    assert calibration.in_force[KEY] == move.estimate.correction
    assert "llama-3.1-8b on a100-80gb" in move.message and "re-planning" in move.message


def test_a_correct_catalog_moves_nothing() -> None:
    calibration = FleetCalibration(profile=_profile, threshold=0.1)
    assert _run(calibration, {f"chat-{i}": _engine(40, IDENTITY) for i in range(3)}) == []
    estimate = calibration.estimator.estimate(KEY)
    assert estimate.correction.decode_scale == pytest.approx(1.0, abs=0.03)
    assert estimate.correction.prefill_scale == pytest.approx(1.0, abs=0.03)


def test_a_slow_pod_is_reported_before_its_type_has_a_trusted_correction(caplog: pytest.LogCaptureFixture) -> None:
    calibration = FleetCalibration(profile=_profile, threshold=0.1)
    pods = {f"chat-{i}": _engine(5, IDENTITY) for i in range(3)}
    pods["chat-slow"] = _engine(5, IDENTITY, pod_factor=2.0)
    assert _run(calibration, pods) == []
    assert not calibration.estimator.estimate(KEY).trusted
    assert "chat-slow runs 2.00x its siblings' times" in caplog.text


def test_one_slow_pod_moves_nothing_and_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    calibration = FleetCalibration(profile=_profile, threshold=0.1)
    pods = {f"chat-{i}": _engine(40, IDENTITY) for i in range(3)}
    pods["chat-slow"] = _engine(40, IDENTITY, pod_factor=2.0)
    assert _run(calibration, pods) == []
    [outlier] = calibration.estimator.estimate(KEY).outliers
    assert outlier.source == "chat-slow" and outlier.ratio == pytest.approx(2.0, rel=0.1)
    assert "chat-slow runs 2.00x its siblings' times" in caplog.text


def test_a_stored_correction_is_where_learning_starts_and_the_threshold_holds_small_moves() -> None:
    stored = StepCorrection(1.35, 1.35)
    calibration = FleetCalibration(profile=_profile, in_force={KEY: stored}, threshold=0.1)
    assert _run(calibration, {f"chat-{i}": _engine(40, StepCorrection(1.4, 1.4)) for i in range(3)}) == []


def test_a_restarted_pod_and_a_failed_scrape_teach_nothing_wrong(caplog: pytest.LogCaptureFixture) -> None:
    calibration = FleetCalibration(profile=_profile, threshold=0.1)
    metrics = _engine(6, IDENTITY)
    restarted = [*metrics[:3], None, *_engine(3, IDENTITY)]  # a scrape timed out, then the counters started over
    for r, reading in enumerate(restarted):
        calibration.observe([PodSample(pod="chat-0", key=OPTION, ready=True, scraped_at=r, metrics=reading)],
                            {OPTION: KEY}, now=float(r))
    assert "restarted" in caplog.text
    assert calibration.estimator.estimate(KEY).correction.decode_scale == pytest.approx(1.0, abs=0.05)


def test_a_model_s_attention_backend_is_part_of_what_its_options_teach() -> None:
    from hetsched.autoscale.fleet import Fleet, ScaleOption
    from hetsched.operator.calibration import correction_keys
    from hetsched.optimizer.spec import ClusterSpec

    spec = ClusterSpec.model_validate({"pools": [{"name": "a100", "accelerator": "a100-80gb", "nodes": 1}],
                                       "models": [{"name": "serving/chat", "model": "llama-3.1-8b",
                                                   "workload": {"rate_rps": 1, "input_tokens": 100,
                                                                "output_tokens": 10}}]})
    fleet = Fleet(models=(), options=(ScaleOption(key=OPTION, gpus=1.0, price_per_hour=1.0, capacity={}),),
                  pool_gpus={}, problem=None)  # type: ignore[arg-type]
    [(key, arch)] = correction_keys(spec, fleet, {"serving/chat": "FLASHINFER"}).values()
    assert key == CorrectionKey("llama-3.1-8b", "a100-80gb", 1, attention_backend="FLASHINFER")
    assert arch.name == "llama-3.1-8b"
