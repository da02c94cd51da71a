"""What the router learns of its endpoints' hardware from the requests it serves.

Each request answered by a unified endpoint is two observations for :mod:`hetsched.perf.online`: its TTFT and its
time per output token, beside what the step model predicted for it when it was sent (as parts). Observed times are
wall time; with twins run at a ``time_scale`` they are turned into the step model's time first. A TTFT that the
prediction spent partly waiting for a sequence slot or KV space is not learned from: that wait is a mean-value
guess, and fitting the step model to it would bend the hardware's figures to the queueing formula's error.

An engine's own ``/metrics`` teach the same way, a window at a time (:func:`window_observations`): between two
scrapes, the mean time per output token at the mean batch, and the mean TTFT less the mean wait in the queue
(the engine's own time to a first token), and, where the engine reports it, the mean prefill time (its prompt's
steps alone, which tell the prefill scale from the time before a first step), each beside the prediction for a
request of the window's mean size.
That is what ``hetsched calibrate --live`` and the operator learn from; no router is needed.

Endpoints of one model on the same accelerator, TP, engine build and attention backend share one correction.
Once it is trusted it is in force on all of them (:meth:`RouterState.apply_correction`); each pod's own figure
is kept to report an outlier.
"""

from __future__ import annotations

import math

from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.perf.correction import IDENTITY, Parts, StepCorrection
from hetsched.perf.online import CorrectionKey, EstimatorSettings, Metric, Observation, OnlineEstimator
from hetsched.router.predict import EndpointProfile, predict
from hetsched.router.types import Endpoint, EndpointView, Prediction, RouteRequest

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
                tpot_s: float | None, at: float, tpot_parts: Parts | None = None) -> StepCorrection | None:
        """Learn from one answered request (wall seconds); returns the key's correction when the one in force
        changes (:data:`~hetsched.perf.correction.IDENTITY` when it stops being trusted). ``tpot_parts``: the step
        the request decoded in, when known better than the prediction's (made as it was sent)."""
        scale = self.time_scale
        if ttft_s is not None and prediction.ttft_parts is not None and prediction.queue_wait_s == 0.0:
            self.estimator.observe(key, Observation(source, Metric.TTFT, prediction.ttft_parts, ttft_s * scale,
                                                    at * scale, predicted_s=prediction.ttft_s))
        decoded = tpot_parts or prediction.tpot_parts
        if tpot_s is not None and decoded is not None:
            self.estimator.observe(key, Observation(source, Metric.TPOT, decoded, tpot_s * scale, at * scale,
                                                    predicted_s=prediction.tpot_s))
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

    def error_ratio(self, key: CorrectionKey, metric: Metric) -> float | None:
        return self.estimator.error_ratio(key, metric)


MIN_WINDOW_REQUESTS = 5
"""Finished requests a window needs before its means are worth an observation."""
WINDOW_SETTINGS = EstimatorSettings(prior_window=16, prior_patience_s=0.0)
"""The estimator's settings for engine windows: each observation is a mean over many requests and over the time
between two scrapes, so the prior is judged on fewer of them than on single requests, with no further wait."""


def _delta(after: Histogram | None, before: Histogram | None) -> Histogram | None:
    if after is None:
        return None
    return after if before is None else after.minus(before)


def window_observations(profile: EndpointProfile, source: str, before: EngineMetrics, after: EngineMetrics, *,
                        at: float, min_requests: int = MIN_WINDOW_REQUESTS,
                        span_s: float | None = None) -> tuple[list[Observation], str]:
    """Observations from what one engine's ``/metrics`` said at two scrapes (``at``: when the second was taken,
    ``span_s`` after the first), in the engine's own time; with none, the reason (a window too quiet is no warning:
    its reason is empty).

    The batch the window ran at is the requests it finished times the time each spent running, over ``span_s``
    (Little's law); without a span, the running count the two scrapes read, which two instants of a busy engine
    can miss by a third."""
    if after.ttft_s is None or after.tpot_s is None:
        return [], "its metrics lack the TTFT and TPOT histograms"
    if before.ttft_s is not None and after.ttft_s.count < before.ttft_s.count or (
            before.completed is not None and after.completed is not None and after.completed < before.completed):
        return [], "its counters went back (the engine restarted): this window is skipped"
    ttft, tpot = _delta(after.ttft_s, before.ttft_s), _delta(after.tpot_s, before.tpot_s)
    assert ttft is not None and tpot is not None
    if ttft.count < min_requests or tpot.count < min_requests:
        return [], ""
    prompts, outputs = _delta(after.input_tokens, before.input_tokens), _delta(after.output_tokens, before.output_tokens)
    if prompts is not None and prompts.count > 0:
        prompt = prompts.total / prompts.count
    elif after.prompt_tokens is not None and before.prompt_tokens is not None:
        prompt = (after.prompt_tokens - before.prompt_tokens) / ttft.count
    else:
        return [], "its metrics lack the prompt lengths"
    if outputs is not None and outputs.count > 0:
        output = outputs.total / outputs.count
    elif after.generation_tokens is not None and before.generation_tokens is not None:
        output = (after.generation_tokens - before.generation_tokens) / tpot.count
    else:
        return [], "its metrics lack the output lengths"
    running = [r for r in (before.running, after.running) if r is not None]
    batch = max(sum(running) / len(running), 1.0) if running else 1.0
    queued = _delta(after.queue_s, before.queue_s)
    if span_s is not None and span_s > 0:
        waited = queued.total / queued.count if queued is not None and queued.count > 0 else 0.0
        in_engine = ttft.total / ttft.count - waited + max(output - 1.0, 0.0) * tpot.total / tpot.count
        if math.isfinite(in_engine) and in_engine > 0:
            batch = max(ttft.count * in_engine / span_s, 1.0)
    others = max(round(batch) - 1, 0)
    view = EndpointView(Endpoint(source, "", ""), in_flight=others, in_flight_prompt_tokens=round(others * prompt),
                        in_flight_max_tokens=round(others * output), running=others, waiting=0)
    request = RouteRequest(model="", prompt_tokens=max(round(prompt), 1), max_tokens=max(round(output), 1))
    predicted = predict(profile, view, request, slo=None)
    assert predicted.ttft_parts is not None and predicted.tpot_parts is not None
    found = [Observation(source, Metric.TPOT, predicted.tpot_parts, tpot.total / tpot.count, at,
                         predicted_s=predicted.tpot_s)]
    if queued is not None and queued.count > 0:
        own = ttft.total / ttft.count - queued.total / queued.count
        found.append(Observation(source, Metric.TTFT, predicted.ttft_parts, own, at, predicted_s=predicted.ttft_s))
    prefill = _delta(after.prefill_s, before.prefill_s)
    if prefill is not None and prefill.count >= min_requests:
        # The prompt's steps alone tell the prefill scale from the time a request spends before its first step,
        # which the TTFT alone cannot when every prompt is about as long.
        room = max(profile.max_num_batched_tokens - others, 1)
        chunks = math.ceil(max(prompt, 1.0) / room)
        step = profile.step_parts(decode_seqs=others, context=prompt + output / 2,
                                  prefill_tokens=min(max(round(prompt), 1), room))
        parts = (chunks * step[0], chunks * step[1], chunks * step[2], chunks * step[3])
        found.append(Observation(source, Metric.PREFILL, parts, prefill.total / prefill.count, at,
                                 predicted_s=profile.correction.seconds(parts)))
    return found, ""


class WindowLearner:
    """Learns from successive scrapes of engines' ``/metrics``: each source's last two readings make a window
    (:func:`window_observations`). A scrape that failed (None) keeps the last reading, so the next good one spans
    the gap."""

    def __init__(self, estimator: OnlineEstimator, *, min_requests: int = MIN_WINDOW_REQUESTS,
                 littles_law: bool = False) -> None:
        self.estimator = estimator
        self.min_requests = min_requests
        self.littles_law = littles_law
        """Each window's batch from the requests it finished and their time in the engine over the time between
        the scrapes (see :func:`window_observations`), not from the running count the two scrapes read: for
        engines whose times and the scrapes' ``at`` share one clock (not twins run at a time scale)."""
        self._last: dict[str, tuple[CorrectionKey, EngineMetrics, float]] = {}

    def scraped(self, key: CorrectionKey, profile: EndpointProfile, source: str, metrics: EngineMetrics | None, *,
                at: float) -> str:
        """Take one scrape of ``source`` (an engine of ``key`` predicted by ``profile``); returns why it taught
        nothing when that is worth a warning, else an empty string."""
        if metrics is None:
            return ""
        last = self._last.get(source)
        self._last[source] = (key, metrics, at)
        if last is None or last[0] != key:
            return ""
        found, reason = window_observations(profile, source, last[1], metrics, at=at, min_requests=self.min_requests,
                                            span_s=at - last[2] if self.littles_law else None)
        refused = sum(not self.estimator.observe(key, observation) for observation in found)
        if refused and not reason:
            reason = f"{refused} of its window's means were not positive finite times"
        return reason

    def forget(self, source: str) -> None:
        """A source went away: its last reading is no window's start, and it is no sibling of its key's others."""
        last = self._last.pop(source, None)
        if last is not None:
            self.estimator.forget(last[0], source)
