"""What the router learns of its endpoints' hardware from the requests it serves.

Each request answered by a unified endpoint is two observations for :mod:`hetsched.perf.online`: its TTFT and its
time per output token, beside what the step model predicted for it when it was sent (as parts). Observed times are
wall time; with twins run at a ``time_scale`` they are turned into the step model's time first. A TTFT that the
prediction spent partly waiting for a sequence slot or KV space is not learned from: that wait is a mean-value
guess, and fitting the step model to it would bend the hardware's figures to the queueing formula's error.

Endpoints of one model on the same accelerator, TP, engine build and attention backend share one correction.
Once it is trusted it is in force on all of them (:meth:`RouterState.apply_correction`); each pod's own figure
is kept to report an outlier.
"""

from __future__ import annotations

from hetsched.perf.correction import IDENTITY, StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate, EstimatorSettings, Metric, Observation, OnlineEstimator
from hetsched.router.types import Endpoint, Prediction

MOVED_SCALE = 0.005
"""A trusted correction replaces the one in force when a scale moves by more than this share ..."""
MOVED_OVERHEAD_S = 50e-6
"""... or an overhead by more than this."""


def correction_key(endpoint: Endpoint, arch: str) -> CorrectionKey:
    """The key ``endpoint``'s observations teach: its model's architecture on its hardware and engine."""
    return CorrectionKey(model=arch, accelerator=endpoint.accelerator, tp=endpoint.tp, engine=endpoint.engine,
                         attention_backend=endpoint.attention_backend)


def _moved(current: StepCorrection, new: StepCorrection) -> bool:
    return (abs(new.prefill_scale - current.prefill_scale) > MOVED_SCALE * current.prefill_scale
            or abs(new.decode_scale - current.decode_scale) > MOVED_SCALE * current.decode_scale
            or abs(new.step_overhead_s - current.step_overhead_s) > MOVED_OVERHEAD_S
            or abs(new.request_overhead_s - current.request_overhead_s) > MOVED_OVERHEAD_S)


class FleetLearner:
    """Corrections per key from the router's own timings, and which of them are in force."""

    def __init__(self, *, time_scale: float = 1.0, settings: EstimatorSettings | None = None,
                 priors: dict[CorrectionKey, StepCorrection] | None = None) -> None:
        self.time_scale = time_scale
        self.estimator = OnlineEstimator(settings, priors)
        self._in_force: dict[CorrectionKey, StepCorrection] = {}

    def observe(self, key: CorrectionKey, source: str, prediction: Prediction, *, ttft_s: float | None,
                tpot_s: float | None, at: float) -> StepCorrection | None:
        """Learn from one answered request (wall seconds); returns the key's correction when the one in force
        changes (:data:`~hetsched.perf.correction.IDENTITY` when it stops being trusted)."""
        scale = self.time_scale
        if ttft_s is not None and prediction.ttft_parts is not None and prediction.queue_wait_s == 0.0:
            self.estimator.observe(key, Observation(source, Metric.TTFT, prediction.ttft_parts, ttft_s * scale,
                                                    at * scale, predicted_s=prediction.ttft_s))
        if tpot_s is not None and prediction.tpot_parts is not None:
            self.estimator.observe(key, Observation(source, Metric.TPOT, prediction.tpot_parts, tpot_s * scale,
                                                    at * scale, predicted_s=prediction.tpot_s))
        new = self.estimator.in_force(key) or IDENTITY
        current = self._in_force.get(key, IDENTITY)
        if not _moved(current, new):
            return None
        self._in_force[key] = new
        return new

    def in_force(self, key: CorrectionKey) -> StepCorrection:
        return self._in_force.get(key, IDENTITY)

    def forget(self, key: CorrectionKey, source: str) -> None:
        self.estimator.forget(key, source)

    def estimates(self) -> list[Estimate]:
        return [self.estimator.estimate(key) for key in self.estimator.keys()]

    def error_ratio(self, key: CorrectionKey, metric: Metric) -> float | None:
        return self.estimator.error_ratio(key, metric)
