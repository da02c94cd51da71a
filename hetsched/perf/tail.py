"""The tail of a replica's latencies: how much its steps vary, and the front end its requests pass through.

A step model (corrected or not) predicts mean step times, and a simulation on means has a P99 barely above its
median. An SLO is on the P99, and a real engine's P99 follows two things the means never show:

- **Dispersion.** A step the model says takes ``t`` takes ``t·X``, with ``X`` drawn afresh for every step from a
  distribution of mean 1 (so the means, which the correction learned, stay where they are). The distribution is
  a few quantiles of ``X``, linear between them (:class:`Dispersion`): a lognormal of σ is one such table, the
  ratio of an engine's token gaps to their mean another.
- **The front end.** The engine's API server is a queue of its own (:class:`FrontEnd`): one server, first come
  first served, that spends ``request_s`` on each request on its way in (HTTP, tokenizing) before the scheduler
  sees it, then ``latency_s`` more that hold no server (the hand-off to the engine's scheduler), and ``token_s`` on
  each token on its way out. A front end busy with others' tokens holds a new request back: that is how an API
  server saturates before its engine does, and why a client's TTFT can be seconds while the engine's own is
  milliseconds.

Together they are a :class:`Tail`, learned per :class:`~hetsched.perf.online.CorrectionKey` beside the step
correction and run by the simulator (:mod:`hetsched.sim.simulator`) and the twin (:mod:`hetsched.simworker`).

The estimators here are plain functions of what was observed: :meth:`Dispersion.of_samples` (ratios of observed
to predicted step times), :meth:`Dispersion.of_histogram` (an engine's inter-token-latency histogram against its
own mean), and :func:`fit_front_end` (the gap between a client's mean TTFT and the engine's own, at several
loads). No clock, no I/O, no NumPy.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hetsched.errors import InputError

PROBABILITIES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0)
"""Where a learned dispersion keeps a quantile (those a sample is too small for are left out)."""
LOGNORMAL_TAIL = 1e-4
"""A lognormal's table stops at this probability from either end (its true extremes are unbounded)."""
LOGNORMAL_MORE = (0.001, 0.02, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.85, 0.97, 0.98, 0.9975, 0.9995)
"""Knots a lognormal's table has besides :data:`PROBABILITIES`: linear between fewer, its mean would be off."""
MIN_SAMPLES = 20
"""Ratios a dispersion needs before it is worth learning."""
RESOLUTION = 0.5
"""Widest bucket, relative to its upper bound, a histogram's quantile may fall in to be read as a quantile."""


@dataclass(frozen=True)
class Dispersion:
    """Per-step delay factors ``X``: the inverse of their distribution function as knots, linear between them.

    Knots are ``(probability, factor)`` from ``(0, lowest)`` to ``(1, highest)``, both non-decreasing. Build one
    with :meth:`lognormal`, :meth:`of_samples`, :meth:`of_histogram` or :meth:`parse`; those give mean 1.
    """

    knots: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        knots = self.knots
        if len(knots) < 2 or knots[0][0] != 0.0 or knots[-1][0] != 1.0:
            raise InputError("expected knots from probability 0 to probability 1, e.g. 0:0.5,0.5:0.9,1:3",
                             field="dispersion")
        for (p0, x0), (p1, x1) in zip(knots, knots[1:]):
            if not p1 > p0 or not x1 >= x0:
                raise InputError(f"expected increasing probabilities and non-decreasing factors, got {p0:g}:{x0:g} "
                                 f"before {p1:g}:{x1:g}", field="dispersion")
        if not all(math.isfinite(x) and x > 0 for _, x in knots):
            raise InputError("expected finite factors above 0", field="dispersion")

    # --- what it is -------------------------------------------------------------------
    def quantile(self, q: float) -> float:
        """The factor at cumulative probability ``q`` (0..1); a uniform ``q`` makes it a draw of ``X``."""
        knots = self.knots
        i = bisect.bisect_right(knots, (q, math.inf)) - 1
        if i >= len(knots) - 1:
            return knots[-1][1]
        (p0, x0), (p1, x1) = knots[max(i, 0)], knots[max(i, 0) + 1]
        return x0 + (x1 - x0) * (q - p0) / (p1 - p0)

    @property
    def identity(self) -> bool:
        """Every factor is 1: steps take what the model says."""
        return all(x == 1.0 for _, x in self.knots)

    @property
    def mean(self) -> float:
        return sum((p1 - p0) * (x0 + x1) / 2 for (p0, x0), (p1, x1) in zip(self.knots, self.knots[1:]))

    def normalized(self) -> Dispersion:
        """The same shape with mean 1."""
        mean = self.mean
        return Dispersion(tuple((p, x / mean) for p, x in self.knots))

    @property
    def spec(self) -> str:
        """The knots as ``sim-worker --step-dispersion`` takes them."""
        return ",".join(f"{p:g}:{x:.4g}" for p, x in self.knots)

    def describe(self) -> str:
        """A person's summary: where the median and the tail lie, × the mean step."""
        return ", ".join(f"p{q * 100:g} ×{self.quantile(q):.2f}" for q in (0.5, 0.9, 0.99, 0.999))

    # --- building one -------------------------------------------------------------------
    @classmethod
    def lognormal(cls, sigma: float) -> Dispersion:
        """A lognormal of shape ``sigma`` with mean 1, as a table (cut :data:`LOGNORMAL_TAIL` from either end)."""
        if not math.isfinite(sigma) or sigma < 0:
            raise InputError(f"expected a finite sigma of 0 or more, got {sigma}", field="dispersion")
        probabilities = sorted({LOGNORMAL_TAIL, 1 - LOGNORMAL_TAIL, *PROBABILITIES[1:-1], *LOGNORMAL_MORE})
        inner = [(p, math.exp(sigma * _normal_quantile(p) - sigma * sigma / 2)) for p in probabilities]
        return cls(((0.0, inner[0][1]), *inner, (1.0, inner[-1][1]))).normalized()

    @classmethod
    def of_samples(cls, ratios: Sequence[float]) -> Dispersion | None:
        """The distribution of observed ÷ predicted step times, normalized to mean 1; None from fewer than
        :data:`MIN_SAMPLES` positive finite ratios (the others are left out)."""
        values = sorted(r for r in ratios if math.isfinite(r) and r > 0)
        n = len(values)
        if n < MIN_SAMPLES:
            return None
        knots = []
        for p in PROBABILITIES:
            if 0 < p < 1 and (1 - p) * n < 1:
                continue  # beyond the sample's resolution: its largest value closes the table
            rank = p * (n - 1)
            low = int(rank)
            high = min(low + 1, n - 1)
            knots.append((p, values[low] + (values[high] - values[low]) * (rank - low)))
        return cls(tuple(knots)).normalized()

    @classmethod
    def of_histogram(cls, bounds: Sequence[float], cumulative: Sequence[float], total: float) -> Dispersion | None:
        """The shape of a latency histogram (Prometheus buckets: upper ``bounds``, the last +Inf, ``cumulative``
        counts, ``total`` the sum of the values) against its own mean; None without :data:`MIN_SAMPLES`
        observations or when the buckets are too coarse to place three of its quantiles to within
        :data:`RESOLUTION` (vLLM's default inter-token buckets hold a fast engine's gaps all in the first).

        Within a bucket values are taken as evenly spread (as ``histogram_quantile`` does); in the +Inf bucket, at
        the last finite bound."""
        count = cumulative[-1] if cumulative else 0.0
        if count < MIN_SAMPLES or total <= 0 or len(bounds) != len(cumulative):
            return None
        histogram = GapHistogram(tuple(bounds), tuple(cumulative), total)
        if sum(histogram.resolution(p) <= RESOLUTION for p in PROBABILITIES[1:-1]) < 3:
            return None
        mean = total / count
        knots = []
        for p in PROBABILITIES:
            if 0 < p < 1 and (1 - p) * count < 1:
                continue
            knots.append((p, _histogram_quantile(bounds, cumulative, p) / mean))
        if knots[0][1] <= 0:
            knots[0] = (0.0, min(x for _, x in knots if x > 0))
        return cls(tuple(knots))

    @classmethod
    def parse(cls, text: str) -> Dispersion:
        """``0.3`` (a lognormal's sigma) or knots ``p:x,p:x,…`` from 0 to 1 (normalized to mean 1)."""
        text = text.strip()
        try:
            return cls.lognormal(float(text))
        except ValueError:
            pass
        try:
            knots = tuple((float(p), float(x)) for p, x in (part.split(":") for part in text.split(",")))
        except ValueError as exc:
            raise InputError(f"expected a lognormal sigma such as 0.3, or knots such as 0:0.6,0.5:0.9,0.99:2.5,1:4 "
                             f"(probability:factor), got {text!r}", field="dispersion") from exc
        return cls(knots).normalized()


NO_DISPERSION = Dispersion(((0.0, 1.0), (1.0, 1.0)))


def _histogram_quantile(bounds: Sequence[float], cumulative: Sequence[float], q: float) -> float:
    rank = q * cumulative[-1]
    i = min(bisect.bisect_left(cumulative, rank), len(cumulative) - 1)
    while i < len(cumulative) - 1 and cumulative[i] <= 0:
        i += 1
    if math.isinf(bounds[i]):
        return bounds[i - 1] if i > 0 else 0.0
    lower = bounds[i - 1] if i > 0 else 0.0
    below = cumulative[i - 1] if i > 0 else 0.0
    inside = cumulative[i] - below
    return lower + (bounds[i] - lower) * ((rank - below) / inside if inside > 0 else 1.0)


def _normal_quantile(p: float) -> float:
    """The standard normal's quantile (Acklam's rational approximation, relative error below 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    if p < 0.02425:
        s = math.sqrt(-2 * math.log(p))
        return (((((c[0] * s + c[1]) * s + c[2]) * s + c[3]) * s + c[4]) * s + c[5]) / \
            ((((d[0] * s + d[1]) * s + d[2]) * s + d[3]) * s + 1)
    if p > 1 - 0.02425:
        return -_normal_quantile(1 - p)
    s = p - 0.5
    r = s * s
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * s / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


@dataclass(frozen=True)
class GapHistogram:
    """Latencies as a Prometheus histogram keeps them: upper ``bounds`` (the last +Inf), ``cumulative`` counts,
    and the ``total`` of the values (an engine's ``vllm:inter_token_latency_seconds`` between two scrapes)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, values spread evenly inside a bucket; None without observations."""
        if self.count <= 0:
            return None
        return _histogram_quantile(self.bounds, self.cumulative, q)

    def resolution(self, q: float) -> float:
        """Width of the bucket the ``q`` quantile falls in, relative to its upper bound (1: the first bucket, from
        0, or the +Inf one): how far the quantile may be from the truth."""
        if self.count <= 0:
            return 1.0
        i = min(bisect.bisect_left(self.cumulative, q * self.count), len(self.cumulative) - 1)
        if i == 0 or math.isinf(self.bounds[i]):
            return 1.0
        return (self.bounds[i] - self.bounds[i - 1]) / self.bounds[i]

    def plus(self, other: GapHistogram) -> GapHistogram:
        """Both sets of observations (on the same bounds; ``other`` is refused otherwise)."""
        if other.bounds != self.bounds:
            raise InputError("cannot pool histograms with different buckets", field="histogram")
        return GapHistogram(self.bounds, tuple(a + b for a, b in zip(self.cumulative, other.cumulative)),
                            self.total + other.total)

    def dispersion(self) -> Dispersion | None:
        """Its shape against its own mean (:meth:`Dispersion.of_histogram`)."""
        return Dispersion.of_histogram(self.bounds, self.cumulative, self.total)


@dataclass(frozen=True)
class FrontEnd:
    """The engine's API server as one first-come-first-served server (see the module docstring), in seconds."""

    request_s: float = 0.0
    """Service per request on its way in, before the scheduler sees it."""
    token_s: float = 0.0
    """Service per streamed token on its way out."""
    latency_s: float = 0.0
    """Time per request on its way in that holds no server (a correction's request overhead)."""

    def __post_init__(self) -> None:
        for name in ("request_s", "token_s", "latency_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InputError(f"expected a finite number of seconds, 0 or more, got {value}", field=name)

    def utilization(self, rate: float, output_tokens: float) -> float:
        """Share of the server's time ``rate`` requests a second of ``output_tokens`` tokens each keep it busy."""
        return rate * (self.request_s + output_tokens * self.token_s)

    def mean_gap(self, rate: float, *, output_tokens: float, batch: float = 1.0) -> float:
        """Mean seconds a request's first token spends in the front end at ``rate`` (its way in and the first
        token's way out), the engine's own time aside: what :func:`fit_front_end` fits to.

        Each passage waits for the work it finds (an M/G/1 queue's mean unfinished work, counting the requests'
        and the tokens' services as separate arrivals, ``batch`` tokens sent together per step); infinite at or
        beyond saturation. The first token leaves with the step's others (``batch`` decoding beside it)."""
        rho = self.utilization(rate, output_tokens)
        if rho >= 1:
            return math.inf
        batch = max(batch, 0.0)
        second_moment = rate * (self.request_s ** 2 + output_tokens * max(batch, 1.0) * self.token_s ** 2)
        wait = second_moment / (2 * (1 - rho))
        return self.request_s + (batch + 1) * self.token_s + 2 * wait

    @property
    def identity(self) -> bool:
        return self == FrontEnd()


@dataclass
class FrontEndQueue:
    """The front end's one server in motion, on the caller's clock (simulated or wall seconds).

    Work is served in the order it reaches the server: a request on its way in (:meth:`request`), and the tokens
    of the engine's steps, each step's as it ends. The engine announces its steps when it starts them
    (:meth:`steps`), and a request arriving while they run is served after the tokens of the steps that ended
    before it and before the rest (:meth:`sent` returns when the last is out)."""

    front_end: FrontEnd
    scale: float = 1.0
    """Clock seconds per front-end second (a twin at ``time_scale`` s runs its front end 1/s as long)."""
    free_at: float = field(default=-math.inf)
    _run: tuple[float, float, int, float] | None = field(default=None, repr=False)
    """The announced steps not yet served: when the first ends, the spacing, how many, the work of each."""

    def request(self, at: float) -> float:
        """When a request that reached the front end at ``at`` reaches the scheduler."""
        self._serve_steps(until=at)
        done = max(self.free_at, at) + self.front_end.request_s * self.scale
        self.free_at = done
        return done + self.front_end.latency_s * self.scale

    def steps(self, first_at: float, last_at: float, *, steps: int, per_step: int) -> None:
        """The engine started ``steps`` steps of ``per_step`` tokens each, ending evenly from ``first_at`` to
        ``last_at``."""
        self._serve_steps(until=math.inf)
        work = per_step * self.front_end.token_s * self.scale
        if work > 0 and steps > 0:
            self._run = (first_at, (last_at - first_at) / (steps - 1) if steps > 1 else 0.0, steps, work)

    def sent(self, at: float) -> float:
        """When the tokens of the steps announced last, which ended by ``at``, are all sent."""
        if self._run is None:
            return at
        self._serve_steps(until=math.inf)
        return self.free_at

    def _serve_steps(self, *, until: float) -> None:
        """Serve the announced steps that ended by ``until``: ``f_j = max(f_{j−1}, t_j) + w`` over evenly spaced
        ``t_j``, whose largest term is at the first or the last step."""
        if self._run is None:
            return
        first, spacing, steps, work = self._run
        if first > until:
            return
        k = steps if spacing <= 0 or until == math.inf else min(steps, int((until - first) / spacing) + 1)
        last = first + (k - 1) * spacing
        self.free_at = max(self.free_at + k * work, first + k * work, last + work)
        self._run = (first + k * spacing, spacing, steps - k, work) if k < steps else None


@dataclass(frozen=True)
class FrontEndWindow:
    """What a stretch of traffic at one rate says of the front end: the mean gap between a client's TTFT and the
    engine's own, at ``rate`` requests a second of ``output_tokens`` tokens, ``batch`` sequences a step."""

    rate: float
    gap_s: float
    output_tokens: float
    batch: float = 1.0


def fit_front_end(windows: Sequence[FrontEndWindow], *, latency_s: float = 0.0) -> FrontEnd | None:
    """The front end whose :meth:`FrontEnd.mean_gap` follows ``windows`` best (least squares on log gap); None
    without a window of positive finite gap.

    The gap at no load is a request's service and its first token's; how the gap grows with the rate tells the
    per-token service (the work a request brings in all) from it. A per-token service is kept only where it
    explains the windows clearly better than a per-request one alone (:data:`TOKEN_GAIN`): with one window, or
    gaps that grow little, the two trade against each other and the simpler front end is the one to believe."""
    usable = [w for w in windows if math.isfinite(w.gap_s) and w.gap_s > 0 and w.rate > 0 and w.output_tokens > 0]
    if not usable:
        return None
    floor = min(w.gap_s for w in usable)

    def cost(request_s: float, token_s: float) -> float:
        front = FrontEnd(request_s, token_s)
        total = 0.0
        for w in usable:
            gap = front.mean_gap(w.rate, output_tokens=w.output_tokens, batch=w.batch)
            if not math.isfinite(gap) or gap <= 0:
                return math.inf
            total += math.log(gap / w.gap_s) ** 2
        return total / len(usable)

    request_only = _descend(cost, [(floor * i / 40, 0.0) for i in range(1, 41)], floor, tokens=False)
    both = _descend(cost, [(floor * i / 40, floor * t) for i in range(1, 41)
                           for t in (0.0, *(10 ** (k / 8 - 5) for k in range(41)))], floor, tokens=True)
    best = both if both[0] < TOKEN_GAIN * request_only[0] and request_only[0] > TOKEN_FLOOR else request_only
    return FrontEnd(request_s=best[1], token_s=best[2], latency_s=latency_s)


TOKEN_GAIN = 0.5
"""A per-token service is fitted only where it halves the mean squared log error of the per-request one alone ..."""
TOKEN_FLOOR = 0.01
"""... and that error is above this (10 % a window): within it, the windows are noise around one front end."""


def _descend(cost: Callable[[float, float], float], grid: Sequence[tuple[float, float]], scale: float, *,
             tokens: bool) -> tuple[float, float, float]:
    """(cost, request_s, token_s): the best point of ``grid``, refined by halving steps around it (two parameters,
    a smooth cost, no library)."""
    best = min((cost(r, t), r, t) for r, t in grid)
    _, request_s, token_s = best
    step_r, step_t = scale / 40, max(token_s, scale * 1e-5) if tokens else 0.0
    for _ in range(60):
        improved = False
        for dr, dt in ((step_r, 0.0), (-step_r, 0.0), (0.0, step_t), (0.0, -step_t)):
            r, t = request_s + dr, token_s + dt
            if r < 0 or t < 0 or (dr == 0 and dt == 0):
                continue
            c = cost(r, t)
            if c < best[0] - 1e-15:
                best, request_s, token_s, improved = (c, r, t), r, t, True
        if not improved:
            step_r, step_t = step_r / 2, step_t / 2
    return best


@dataclass(frozen=True)
class Tail:
    """What a replica's latencies carry beyond its steps' mean times, as the simulator and the twin run it."""

    dispersion: Dispersion | None = None
    front_end: FrontEnd | None = None

    def to_json(self) -> dict[str, object]:
        front = self.front_end
        return {"dispersion": [list(k) for k in self.dispersion.knots] if self.dispersion else None,
                "front_end": None if front is None else {"request_s": front.request_s, "token_s": front.token_s,
                                                         "latency_s": front.latency_s}}

    @classmethod
    def from_json(cls, raw: object) -> Tail | None:
        """The stored form back; None for none (or a form it cannot read)."""
        if not isinstance(raw, dict):
            return None
        try:
            knots = raw.get("dispersion")
            front = raw.get("front_end")
            return cls(dispersion=Dispersion(tuple((float(p), float(x)) for p, x in knots)) if knots else None,
                       front_end=FrontEnd(**{k: float(v) for k, v in front.items()}) if front else None)
        except (TypeError, ValueError, InputError):
            return None

    @property
    def empty(self) -> bool:
        return self.dispersion is None and self.front_end is None
