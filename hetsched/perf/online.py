"""Learning a step model's correction online, from the latencies a fleet observes.

Each observation is one measured time (a request's TTFT, its time per output token, or a window's mean from an
engine's histograms) beside the base model's prediction of it as :data:`~hetsched.perf.correction.Parts`. The
corrected prediction is linear in the four numbers of a :class:`~hetsched.perf.correction.StepCorrection`, so a
Kalman filter per key estimates them with their uncertainty:

- it starts from a prior (no correction, or a stored one) and moves as far as the evidence carries it;
- the noise of an observation is relative (latencies vary in proportion to their size), and an observation far
  from the prediction weighs less (Huber), so one stalled request cannot drag the estimate;
- between observations the parameters may drift (a random walk): their variance grows with the time that passed,
  never past the prior's, and the estimate itself does not move without data;
- one pod that runs far from its siblings is an *outlier*: its observations are kept out of its type's estimate and
  it is reported with its own ratio. A source's first observations wait until it can be compared with its
  siblings (or until it is clear it has too few to compare with).

Everything here is a plain function of the observations and the times they carry: no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from enum import StrEnum

from hetsched.perf.correction import PHASE_PARTS, Parts, StepCorrection


class Metric(StrEnum):
    """What an observation measured."""

    TTFT = "ttft"
    TPOT = "tpot"
    PREFILL = "prefill"
    """The steps that compute a prompt, alone: an engine's own prefill time (no queue, no front end)."""


@dataclass(frozen=True, order=True)
class CorrectionKey:
    """What one correction applies to: a model on one accelerator (or slice) at one TP, under one engine build and
    attention backend when known. A correction learned under one backend is not applied to another."""

    model: str
    accelerator: str
    tp: int = 1
    engine: str = ""
    attention_backend: str = ""

    @property
    def label(self) -> str:
        extra = "".join(f", {part}" for part in (self.engine, self.attention_backend) if part)
        return f"{self.model} on {self.accelerator} TP={self.tp}{extra}"


@dataclass(frozen=True)
class Observation:
    """One measured time of ``metric`` at ``source``, and the base model's prediction of it as parts."""

    source: str
    metric: Metric
    parts: Parts
    observed_s: float
    at: float
    """Seconds on the caller's clock: how much the parameters may have drifted since the last observation."""
    predicted_s: float | None = None
    """What was predicted with the correction then in force (for the prediction-error ratio); None: not known."""


@dataclass(frozen=True)
class EstimatorSettings:
    prior_sd: Parts = (0.5, 0.5, 0.0003, 0.003)
    """Standard deviation of the prior: relative for the two scales, seconds for the step and request overheads."""
    noise: float = 0.2
    """Relative standard deviation of one observation."""
    huber: float = 2.5
    queue_gate: float = 3.0
    """A TTFT this many standard deviations above its prediction, once the key has its trusted number of
    observations, is a request that queued, not a slower device: queueing only ever lengthens a TTFT. It is not
    learned from (counted as gated)."""
    """Observations beyond this many standard deviations of the prediction weigh as if their noise were larger."""
    drift_per_hour: Parts = (0.05, 0.05, 0.0005, 0.005)
    """How far (one standard deviation) the parameters may wander in an hour without data."""
    warmup: int = 8
    """A source's observations are held until it has this many, so it can be compared with its siblings first."""
    siblings: int = 3
    """Sources a key needs before one of them can be called an outlier."""
    outlier_ratio: float = 1.4
    """A source whose times run this many times its siblings' (or 1/this) is an outlier."""
    window: int = 64
    """Recent observations per source (outlier test) and per metric (error ratio, residuals)."""
    trusted_sd: float = 0.1
    """A correction is trusted when it predicts the times it learned from (the last of each metric) to this
    relative standard deviation ..."""
    trusted_observations: int = 50
    """... from at least this many observations."""
    prior_band: float = 0.1
    """The prior stays in force while it predicts each metric's recent observations (the median of observed over
    predicted) within this share: the step model's own error at loads it predicts as a mean is of this order, and
    a correction fitted inside it follows that error, not the hardware. Once out of it, the prior is back only
    within half of it (0: the estimate is in force as soon as it is trusted)."""
    prior_window: int = 256
    """Recent observations per metric the prior is judged on; it gives way after staying out of the band through
    half as many ..."""
    prior_patience_s: float = 30.0
    """... and for this long (on the observations' clock): a load that changes fast (a burst's first seconds) puts
    the step model's own error out of the band for a while, and a correction fitted to it would follow it."""
    min_scale: float = 0.2
    """Physical bounds: a scale below this says the device runs faster than the model's peak allows."""
    max_scale: float = 20.0

    def __post_init__(self) -> None:
        if len(self.prior_sd) != PHASE_PARTS or len(self.drift_per_hour) != PHASE_PARTS:
            raise ValueError("prior_sd and drift_per_hour need one figure per correction parameter")


@dataclass(frozen=True)
class Outlier:
    """A source whose times run ``ratio`` × its siblings' (median of recent observed/predicted)."""

    source: str
    ratio: float
    observations: int


@dataclass(frozen=True)
class Estimate:
    """The correction in force for one key, with its provenance."""

    key: CorrectionKey
    correction: StepCorrection
    sd: Parts
    observations: int
    """Observations the estimate is built on (held and outlying ones excluded)."""
    sources: int
    first_at: float | None
    last_at: float | None
    residual_median: float
    """Median relative error, (predicted − observed) / observed, of recent observations before each update."""
    residual_p90: float
    trusted: bool
    outliers: tuple[Outlier, ...] = ()
    rejected: int = 0
    """Observations refused as invalid (non-finite, negative, no prediction)."""
    gated: int = 0
    """TTFTs left out as queued (:attr:`EstimatorSettings.queue_gate`)."""
    note: str = ""
    """Why an estimate with enough observations is still not trusted."""


@dataclass
class _Source:
    held: list[Observation] = field(default_factory=list)
    seen: int = 0
    log_ratios: deque[float] = field(default_factory=deque)
    applied: bool = False
    """Its observations go into the key's estimate (warmed up and not an outlier when last compared)."""


@dataclass
class _KeyState:
    theta: list[float]
    cov: list[list[float]]
    prior_var: list[float]
    at: float | None = None
    first_at: float | None = None
    count: int = 0
    rejected: int = 0
    gated: int = 0
    sources: dict[str, _Source] = field(default_factory=dict)
    residuals: deque[float] = field(default_factory=deque)
    predicted: dict[Metric, deque[float]] = field(default_factory=dict)
    observed: dict[Metric, deque[float]] = field(default_factory=dict)
    recent: dict[Metric, Parts] = field(default_factory=dict)
    """The last shape learned from per metric: where the estimate's own uncertainty is judged."""
    prior: Parts = (1.0, 1.0, 0.0, 0.0)
    versus_prior: dict[Metric, deque[float]] = field(default_factory=dict)
    """Per metric, observed over what the prior predicts, of the recent observations."""
    prior_off: float = math.inf
    """The largest share by which the prior misses a metric's median (:meth:`OnlineEstimator._judge_prior`)."""
    prior_rejected: bool = False
    out_of_band: int = 0
    """Judgements in a row the prior was out of its band."""
    out_since: float | None = None
    """When the prior last went out of its band (None: it is within it)."""


def _dot(a: Parts | list[float], b: Parts | list[float]) -> float:
    """Of two :data:`PHASE_PARTS`-vectors, written out: it runs several times in every update."""
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3]


def valid(observation: Observation) -> bool:
    """A positive, finite time with finite, non-negative parts, some of them non-zero."""
    parts = observation.parts
    return (math.isfinite(observation.observed_s) and observation.observed_s > 0
            and all(math.isfinite(p) and p >= 0 for p in parts) and any(p > 0 for p in parts))


class OnlineEstimator:
    """Corrections per key, learned from observations in the order they come."""

    def __init__(self, settings: EstimatorSettings | None = None,
                 priors: dict[CorrectionKey, StepCorrection] | None = None) -> None:
        self.settings = settings or EstimatorSettings()
        self._priors = dict(priors or {})
        self._keys: dict[CorrectionKey, _KeyState] = {}

    def _state(self, key: CorrectionKey) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            prior = self._priors.get(key, StepCorrection())
            var = [sd * sd for sd in self.settings.prior_sd]
            var[0] *= prior.prefill_scale ** 2
            var[1] *= prior.decode_scale ** 2
            state = self._keys[key] = _KeyState(
                theta=list(prior.vector()), prior_var=var, prior=prior.vector(),
                cov=[[var[i] if i == j else 0.0 for j in range(PHASE_PARTS)] for i in range(PHASE_PARTS)])
        return state

    def keys(self) -> list[CorrectionKey]:
        return sorted(self._keys)

    # --- observations -------------------------------------------------------
    def observe(self, key: CorrectionKey, observation: Observation) -> bool:
        """Take one observation; False when it is invalid and was refused."""
        state = self._state(key)
        if not valid(observation):
            state.rejected += 1
            return False
        source = state.sources.setdefault(observation.source, _Source())
        source.seen += 1
        self._track(state, source, observation)
        if source.applied:
            self._update(state, observation)
        else:
            source.held.append(observation)
        if source.seen == self.settings.warmup or source.seen % self.settings.warmup == 0:
            self._classify(state)
        return True

    def forget(self, key: CorrectionKey, source: str) -> None:
        """A source left (its pod went away): it no longer counts as a sibling; the key keeps what it learned."""
        state = self._keys.get(key)
        if state is not None:
            state.sources.pop(source, None)
            self._classify(state)

    def _track(self, state: _KeyState, source: _Source, observation: Observation) -> None:
        predicted = _dot(state.theta, observation.parts)
        window = self.settings.window
        if predicted > 0:
            source.log_ratios.append(math.log(observation.observed_s / predicted))
            if len(source.log_ratios) > window:
                source.log_ratios.popleft()
        if observation.predicted_s is not None and observation.predicted_s > 0:
            for table, value in ((state.predicted, observation.predicted_s), (state.observed, observation.observed_s)):
                values = table.setdefault(observation.metric, deque())
                values.append(value)
                if len(values) > window:
                    values.popleft()

    def _classify(self, state: _KeyState) -> None:
        """Apply the held observations of sources that may join their key's estimate; stop applying outliers."""
        s = self.settings
        warm = {name: src for name, src in state.sources.items() if src.seen >= s.warmup and src.log_ratios}
        if len(warm) >= s.siblings:
            centre = {name: statistics.median(src.log_ratios) for name, src in warm.items()}
            for name, src in warm.items():
                others = statistics.median(v for n, v in centre.items() if n != name)
                src.applied = abs(centre[name] - others) <= math.log(s.outlier_ratio)
        else:
            undecided = len(state.sources) >= s.siblings
            for src in warm.values():
                # too few siblings to compare with: apply, unless more are on their way and it has not waited long
                src.applied = not undecided or src.seen >= 4 * s.warmup
        for src in state.sources.values():
            if src.applied and src.held:
                for held in src.held:
                    self._update(state, held)
                src.held.clear()
            elif not src.applied and src.seen >= s.warmup and len(src.held) > s.window:
                del src.held[: len(src.held) - s.window]

    def _drifted(self, state: _KeyState, at: float | None) -> list[float]:
        """The parameters' variances at ``at``: grown by the drift since the last observation, never past the
        prior's (unless already wider)."""
        variances = [state.cov[i][i] for i in range(PHASE_PARTS)]
        if at is None or state.at is None or at <= state.at:
            return variances
        hours = (at - state.at) / 3600.0
        for i, sd in enumerate(self.settings.drift_per_hour):
            scale = state.theta[i] if i < 2 else 1.0
            variances[i] = min(variances[i] + (sd * scale) ** 2 * hours, max(state.prior_var[i], variances[i]))
        return variances

    def _drift(self, state: _KeyState, at: float) -> None:
        for i, variance in enumerate(self._drifted(state, at)):
            state.cov[i][i] = variance
        state.at = at if state.at is None else max(state.at, at)

    def _update(self, state: _KeyState, observation: Observation) -> None:
        self._drift(state, observation.at)
        x, y, theta, cov = observation.parts, observation.observed_s, state.theta, state.cov
        predicted = _dot(theta, x)
        px = [_dot(row, x) for row in cov]
        noise = (self.settings.noise * max(predicted, 1e-9)) ** 2  # not y: weighing by what was seen biases low
        spread = _dot(x, px) + noise
        innovation = y - predicted
        z = abs(innovation) / math.sqrt(spread)
        if (observation.metric is Metric.TTFT and innovation > 0 and z > self.settings.queue_gate
                and state.count >= self.settings.trusted_observations):
            state.gated += 1
            return
        if z > self.settings.huber:
            noise *= z / self.settings.huber
            spread = _dot(x, px) + noise
        gain = [v / spread for v in px]
        for i in range(PHASE_PARTS):
            theta[i] += gain[i] * innovation
            row = cov[i]
            for j in range(PHASE_PARTS):
                row[j] -= gain[i] * px[j]
        theta[2], theta[3] = max(theta[2], 0.0), max(theta[3], 0.0)  # no step or request takes negative time
        for i in (0, 1):  # nor does a phase: past the physical bounds, the estimate stays at the bound
            theta[i] = min(max(theta[i], self.settings.min_scale / 2), self.settings.max_scale * 2)
        state.recent[observation.metric] = x
        state.count += 1
        state.first_at = observation.at if state.first_at is None else state.first_at
        state.residuals.append((predicted - y) / y)
        if len(state.residuals) > self.settings.window:
            state.residuals.popleft()
        by_prior = _dot(state.prior, x)
        if by_prior > 0:
            ratios = state.versus_prior.setdefault(observation.metric, deque(maxlen=self.settings.prior_window))
            ratios.append(y / by_prior)
        if state.count % self._judge_every == 0:
            self._judge_prior(state)

    def _judge_prior(self, state: _KeyState) -> None:
        """Whether the prior still predicts every metric's recent observations within the band: it gives way once
        it stayed out of the band while half its window was renewed and for ``prior_patience_s`` (a passing spike
        of the model's own error does not unseat it), and is back once within half the band."""
        least = max(self.settings.prior_window * 5 // 64, 2)  # a metric's observations before it is judged on
        judged = [abs(statistics.median(ratios) - 1.0) for ratios in state.versus_prior.values()
                  if len(ratios) >= least]
        if not judged:
            return
        state.prior_off = max(judged)
        band = self.settings.prior_band
        if state.prior_rejected:
            state.prior_rejected = state.prior_off > band / 2
            state.out_of_band, state.out_since = 0, None
            return
        if state.prior_off <= band:
            state.out_of_band, state.out_since = 0, None
            return
        state.out_of_band += 1
        now = state.at if state.at is not None else 0.0
        state.out_since = now if state.out_since is None else state.out_since
        # A spike of the model's own error is a few tenths of the band past it; a wrong catalog is many bands off,
        # and is shown as surely by fewer observations: the wait shrinks as the square of how far out the prior is.
        wait = (band / state.prior_off) ** 2
        lasted = now - state.out_since >= self.settings.prior_patience_s * wait
        state.prior_rejected = lasted and (
            state.out_of_band * self._judge_every >= self.settings.prior_window // 2 * wait)

    @property
    def _judge_every(self) -> int:
        """Observations of a key between two judgements of its prior (a median over its window each time)."""
        return max(self.settings.prior_window // 32, 1)

    def _prior_holds(self, state: _KeyState) -> bool:
        return self.settings.prior_band > 0 and not state.prior_rejected and math.isfinite(state.prior_off)

    # --- what was learned ----------------------------------------------------
    def estimate(self, key: CorrectionKey, *, at: float | None = None) -> Estimate:
        """The correction for ``key``, trusted or not, with its provenance; its uncertainty as of ``at`` (default:
        the last observation), widened by the drift since."""
        s = self.settings
        state = self._state(key)
        correction = StepCorrection.of(state.theta)
        sd = tuple(math.sqrt(max(v, 0.0)) for v in self._drifted(state, at))
        residuals = sorted(abs(r) for r in state.residuals)
        note = ""
        if not (s.min_scale <= correction.prefill_scale <= s.max_scale
                and s.min_scale <= correction.decode_scale <= s.max_scale):
            note = (f"outside physical bounds: scales {correction.prefill_scale:.3g}/{correction.decode_scale:.3g} "
                    f"(allowed {s.min_scale:g}–{s.max_scale:g})")
        estimate = Estimate(
            key=key, correction=correction, sd=(sd[0], sd[1], sd[2], sd[3]), observations=state.count,
            sources=len(state.sources), first_at=state.first_at, last_at=state.at,
            residual_median=statistics.median(residuals) if residuals else 0.0,
            residual_p90=residuals[min(int(0.9 * len(residuals)), len(residuals) - 1)] if residuals else 0.0,
            trusted=False, outliers=self.outliers(key), rejected=state.rejected, gated=state.gated,
            note=note)
        if not note and self._prior_holds(state) and state.count >= s.trusted_observations:
            note = (f"its prior still predicts the recent observations within {state.prior_off:.1%}: "
                    "no correction needed")
            estimate = replace(estimate, note=note)
        trusted = not note and state.count >= s.trusted_observations and self._certain(state, at)
        return replace(estimate, trusted=True) if trusted else estimate

    def _certain(self, state: _KeyState, at: float | None = None) -> bool:
        """Predictions at the shapes last learned from are known to ``trusted_sd``: the uncertainty that matters,
        not each parameter's (at one batch size a decode scale and a step overhead trade off freely)."""
        variances = self._drifted(state, at)
        for parts in state.recent.values():
            predicted = _dot(state.theta, parts)
            if predicted <= 0:
                return False
            spread = 0.0
            for i, row in enumerate(state.cov):
                across = _dot(row, parts) + (variances[i] - row[i]) * parts[i]  # the drifted variance on the diagonal
                spread += parts[i] * across
            if spread > (self.settings.trusted_sd * predicted) ** 2:
                return False
        return bool(state.recent)

    def in_force(self, key: CorrectionKey) -> StepCorrection | None:
        """The key's correction when it is trusted, else None: :meth:`estimate`'s verdict without its statistics,
        cheap enough to ask after every observation."""
        state = self._keys.get(key)
        s = self.settings
        if state is None or state.count < s.trusted_observations:
            return None
        theta = state.theta
        if not (s.min_scale <= theta[0] <= s.max_scale and s.min_scale <= theta[1] <= s.max_scale):
            return None
        if self._prior_holds(state):
            return None
        return StepCorrection.of(theta) if self._certain(state) else None

    def outliers(self, key: CorrectionKey) -> tuple[Outlier, ...]:
        """Sources kept out of ``key``'s estimate, each with how far its times run from its siblings'."""
        state = self._keys.get(key)
        if state is None:
            return ()
        s = self.settings
        warm = {name: src for name, src in state.sources.items() if src.seen >= s.warmup and src.log_ratios}
        if len(warm) < s.siblings:
            return ()
        centre = {name: statistics.median(src.log_ratios) for name, src in warm.items()}
        found = []
        for name, src in sorted(warm.items()):
            if not src.applied:
                others = statistics.median(v for n, v in centre.items() if n != name)
                found.append(Outlier(name, math.exp(centre[name] - others), src.seen))
        return tuple(found)

    def error_ratio(self, key: CorrectionKey, metric: Metric) -> float | None:
        """Predicted over observed p50 of ``metric`` over the recent window; None before any."""
        state = self._keys.get(key)
        if state is None or not state.observed.get(metric):
            return None
        observed = statistics.median(state.observed[metric])
        return statistics.median(state.predicted[metric]) / observed if observed > 0 else None

