"""The online estimator: converges to what it observes, ignores one slow pod, holds still without data."""

from __future__ import annotations

import math
import random

import pytest

from hetsched.perf.correction import Parts, StepCorrection
from hetsched.perf.online import CorrectionKey, EstimatorSettings, Metric, Observation, OnlineEstimator

KEY = CorrectionKey("llama-3.1-8b", "h100-sxm")


def _requests(true: StepCorrection, *, count: int, pods: int = 4, slow: dict[str, float] | None = None,
              seed: int = 7, start: float = 0.0) -> list[Observation]:
    """TTFT and TPOT of ``count`` requests spread over ``pods``, drawn around ``true`` with 10 % noise."""
    rng = random.Random(seed)
    found = []
    for i in range(count):
        pod = f"pod-{i % pods}"
        batch, prompt = rng.randint(1, 64), rng.randint(100, 2000)
        decode = 0.01 + 0.0002 * batch
        shapes: dict[Metric, Parts] = {Metric.TTFT: (2e-5 * prompt, decode, 1.5, 1.0),
                                       Metric.TPOT: (1e-5 * batch, decode, 1.0, 0.0)}
        for metric, parts in shapes.items():
            seconds = true.seconds(parts) * (slow or {}).get(pod, 1.0) * math.exp(rng.gauss(0.0, 0.1))
            found.append(Observation(pod, metric, parts, seconds, at=start + 0.5 * i))
    return found


def _fed(observations: list[Observation], estimator: OnlineEstimator | None = None) -> OnlineEstimator:
    estimator = estimator or OnlineEstimator()
    for observation in observations:
        assert estimator.observe(KEY, observation)
    return estimator


@pytest.mark.parametrize("scale", [1.4, 0.75])
def test_converges_to_a_mis_specified_type_within_200_requests(scale: float) -> None:
    estimate = _fed(_requests(StepCorrection(scale, scale), count=200)).estimate(KEY)
    assert estimate.trusted
    assert estimate.correction.prefill_scale == pytest.approx(scale, rel=0.1)
    assert estimate.correction.decode_scale == pytest.approx(scale, rel=0.1)
    assert estimate.observations == 400


def test_a_correct_prior_barely_moves() -> None:
    estimate = _fed(_requests(StepCorrection(), count=200)).estimate(KEY)
    assert estimate.correction.prefill_scale == pytest.approx(1.0, abs=0.05)
    assert estimate.correction.decode_scale == pytest.approx(1.0, abs=0.05)


def test_a_stored_prior_is_where_it_starts() -> None:
    prior = StepCorrection(1.3, 1.2, 0.001, 0.0)
    estimator = OnlineEstimator(priors={KEY: prior})
    assert estimator.estimate(KEY).correction == prior
    assert not estimator.estimate(KEY).trusted


def test_one_slow_pod_does_not_move_its_type_and_is_reported() -> None:
    estimate = _fed(_requests(StepCorrection(), count=300, slow={"pod-2": 2.0})).estimate(KEY)
    assert estimate.correction.prefill_scale == pytest.approx(1.0, abs=0.05)
    assert estimate.correction.decode_scale == pytest.approx(1.0, abs=0.05)
    [outlier] = estimate.outliers
    assert outlier.source == "pod-2"
    assert outlier.ratio == pytest.approx(2.0, rel=0.15)


def test_a_whole_slow_type_is_no_outlier() -> None:
    estimate = _fed(_requests(StepCorrection(2.0, 2.0), count=200)).estimate(KEY)
    assert estimate.outliers == ()
    assert estimate.correction.decode_scale == pytest.approx(2.0, rel=0.1)


def test_a_lone_pod_is_learned_from_after_its_warmup() -> None:
    settings = EstimatorSettings()
    estimator = _fed(_requests(StepCorrection(1.5, 1.5), count=4, pods=1))
    assert estimator.estimate(KEY).observations == settings.warmup
    assert estimator.estimate(KEY).correction.decode_scale > 1.0


def test_without_traffic_the_estimate_holds_and_its_uncertainty_widens_up_to_the_prior() -> None:
    estimator = _fed(_requests(StepCorrection(1.4, 1.4), count=200))
    now = estimator.estimate(KEY)
    assert now.last_at is not None and now.trusted
    later = estimator.estimate(KEY, at=now.last_at + 6 * 3600)
    assert later.correction == now.correction
    assert later.sd[1] > now.sd[1]
    much_later = estimator.estimate(KEY, at=now.last_at + 1e9)
    assert much_later.correction == now.correction and not much_later.trusted
    assert much_later.sd[1] == pytest.approx(EstimatorSettings().prior_sd[1], rel=0.01)


@pytest.mark.parametrize("seconds, parts", [
    (math.nan, (0.01, 0.01, 1.0, 0.0)), (-0.1, (0.01, 0.01, 1.0, 0.0)), (0.0, (0.01, 0.01, 1.0, 0.0)),
    (0.1, (math.inf, 0.01, 1.0, 0.0)), (0.1, (-0.01, 0.01, 1.0, 0.0)), (0.1, (0.0, 0.0, 0.0, 0.0)),
])
def test_invalid_observations_are_refused_and_counted(seconds: float, parts: Parts) -> None:
    estimator = OnlineEstimator()
    assert not estimator.observe(KEY, Observation("pod", Metric.TPOT, parts, seconds, at=0.0))
    estimate = estimator.estimate(KEY)
    assert estimate.rejected == 1 and estimate.observations == 0
    assert estimate.correction == StepCorrection()


def test_a_correction_past_the_physical_bounds_is_never_trusted() -> None:
    estimate = _fed(_requests(StepCorrection(0.05, 0.05), count=200)).estimate(KEY)
    assert not estimate.trusted
    assert "physical bounds" in estimate.note


def test_error_ratio_compares_what_was_predicted_with_what_was_seen() -> None:
    estimator = OnlineEstimator()
    for i in range(20):
        estimator.observe(KEY, Observation("pod", Metric.TPOT, (0.0, 0.02, 1.0, 0.0), 0.04, at=i,
                                           predicted_s=0.02))
    assert estimator.error_ratio(KEY, Metric.TPOT) == pytest.approx(0.5)
    assert estimator.error_ratio(KEY, Metric.TTFT) is None


def test_a_backend_is_part_of_the_key() -> None:
    estimator = _fed(_requests(StepCorrection(2.0, 2.0), count=200))
    other = CorrectionKey(KEY.model, KEY.accelerator, attention_backend="FLASHINFER")
    assert estimator.estimate(other).correction == StepCorrection()
    assert "FLASHINFER" in other.label


def test_a_prior_within_its_band_stays_in_force_and_says_why() -> None:
    estimator = _fed(_requests(StepCorrection(1.05, 1.05), count=200))
    estimate = estimator.estimate(KEY)
    assert not estimate.trusted and estimator.in_force(KEY) is None
    assert "no correction needed" in estimate.note
    assert estimate.correction.decode_scale == pytest.approx(1.05, rel=0.05)  # learned all the same


def test_a_prior_out_of_its_band_gives_way_and_comes_back_only_well_inside_it() -> None:
    estimator = _fed(_requests(StepCorrection(1.3, 1.3), count=200))
    assert estimator.in_force(KEY) is not None
    _fed(_requests(StepCorrection(1.08, 1.08), count=400, seed=8, start=100.0), estimator)
    assert estimator.in_force(KEY) is not None  # within the band, not within half of it
    _fed(_requests(StepCorrection(), count=400, seed=9, start=400.0), estimator)
    assert estimator.in_force(KEY) is None


def test_without_a_band_a_trusted_estimate_is_in_force_however_close() -> None:
    estimator = _fed(_requests(StepCorrection(1.05, 1.05), count=200), OnlineEstimator(EstimatorSettings(prior_band=0)))
    assert estimator.in_force(KEY) is not None and estimator.estimate(KEY).trusted


def test_a_passing_spike_does_not_unseat_the_prior_but_a_lasting_change_does() -> None:
    settings = EstimatorSettings(prior_window=64)
    spike = _fed(_requests(StepCorrection(), count=100), OnlineEstimator(settings))
    _fed(_requests(StepCorrection(1.2, 1.2), count=45, seed=8, start=50.0), spike)
    assert spike.in_force(KEY) is None  # out of the band through half its window, not yet for long enough
    lasting = _fed(_requests(StepCorrection(), count=100), OnlineEstimator(settings))
    _fed(_requests(StepCorrection(1.2, 1.2), count=80, seed=8, start=50.0), lasting)
    assert lasting.in_force(KEY) is not None
    _fed(_requests(StepCorrection(), count=100, seed=9, start=90.0), lasting)
    assert lasting.in_force(KEY) is None  # back within half the band: the prior again


def _answers_until_in_force(scale: float) -> int | None:
    estimator = OnlineEstimator()
    for i, observation in enumerate(_requests(StepCorrection(scale, scale), count=400)):
        estimator.observe(KEY, observation)
        if estimator.in_force(KEY) is not None:
            return i // 2
    return None


def test_the_further_out_the_prior_the_sooner_it_gives_way() -> None:
    far, near = _answers_until_in_force(1.6), _answers_until_in_force(1.12)
    assert far is not None and near is not None
    assert far <= 30 and 2 * far < near  # a catalog 60 % off within 30 answers; one 12 % off waits its patience
