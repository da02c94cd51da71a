"""Fit a replica's tail (:mod:`hetsched.perf.tail`) to what an engine and its clients showed, by simulating it.

The engine's token gaps (its inter-token-latency histogram) vary for two reasons: the batch changes and some
steps prefill a prompt beside the decodes, which the simulator reproduces on its own, and each step varies beyond
what its shape says, which is the dispersion to learn. Reading the dispersion off the histogram alone would count
the first twice. So the fit simulates each observed rate on the (corrected) step model and moves the dispersion's
quantiles until the simulated gaps, pooled as the observed ones are, have the observed shape: each round, the
factor at probability ``p`` is multiplied by (observed gap at ``p``) / (simulated gap at ``p``), then the table is
made non-decreasing and of mean 1 again (the scale is the correction's, not the tail's).

The front end is fitted to the gap between the clients' mean TTFT and the engine's own at each rate
(:func:`~hetsched.perf.tail.fit_front_end`), the batch it sends tokens in being the simulated one.

Deterministic: the simulations are seeded.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetsched.perf.step import StepLatencyModel
from hetsched.perf.tail import (MIN_SAMPLES, PROBABILITIES, RESOLUTION, Dispersion, FrontEnd, FrontEndWindow,
                                GapHistogram, Tail, fit_front_end)
from hetsched.sim.metrics import RunResult, TokenGaps
from hetsched.sim.simulator import simulate
from hetsched.specs.engine import EngineConfig
from hetsched.specs.workload import Workload

ROUNDS = 4
REQUESTS = 1200
"""Requests simulated per observed rate and round."""
BEYOND = 5
"""Observed gaps a quantile needs above it before the fit follows it."""

MAX_STEP = 2.0
"""Most a factor moves in one round (× or ÷)."""


@dataclass(frozen=True)
class TailWindow:
    """Traffic at one rate as the engine and its clients saw it."""

    rate: float
    workload: Workload
    """The requests' lengths (their arrivals are drawn anew at ``rate``)."""
    gaps: GapHistogram | None = None
    """The engine's token gaps over the window."""
    client_ttft_s: float | None = None
    """Mean TTFT the clients measured."""
    engine_ttft_s: float | None = None
    """Mean TTFT the engine reported (from when it took each request)."""


@dataclass(frozen=True)
class TailFit:
    """The tail, and how the simulated token gaps compare with the observed ones before and after it."""

    tail: Tail
    probabilities: tuple[float, ...] = ()
    observed_gaps_s: tuple[float, ...] = ()
    simulated_gaps_s: tuple[float, ...] = ()
    """Pooled over the windows at ``probabilities``, with the fitted tail."""
    untailed_gaps_s: tuple[float, ...] = ()
    """The same without any dispersion."""
    front_end_windows: tuple[FrontEndWindow, ...] = field(default=())


@dataclass(frozen=True)
class _Replica:
    step_model: StepLatencyModel
    engine: EngineConfig
    num_blocks: int
    max_model_len: int
    requests: int
    seed: int

    def run(self, window: TailWindow, tail: Tail) -> RunResult:
        warmup = min(2 * self.engine.max_num_seqs, self.requests // 4)
        batch = window.workload.sample(self.requests, rate=window.rate, seed=self.seed)
        return simulate(self.step_model, batch, engine=self.engine, num_blocks=self.num_blocks,
                        max_model_len=self.max_model_len, measure=range(warmup, self.requests), tail=tail,
                        seed=self.seed, token_gaps=True)


def _pooled_quantiles(runs: Sequence[tuple[TokenGaps, float]], probabilities: Sequence[float]) -> list[float]:
    """Quantiles of several runs' token gaps, each run weighing ``share`` of the whole."""
    points: list[tuple[float, float]] = []
    for gaps, share in runs:
        total = sum(gaps.weights)
        if total:
            points += [(s, w * share / total) for s, w in zip(gaps.seconds, gaps.weights)]
    points.sort()
    cumulative, seen = [], 0.0
    for _, w in points:
        seen += w
        cumulative.append(seen)
    out = []
    for p in probabilities:
        i = min(bisect.bisect_left(cumulative, p * seen), len(points) - 1)
        out.append(points[i][0])
    return out


def fit_tail(step_model: StepLatencyModel, windows: Sequence[TailWindow], *, engine: EngineConfig, num_blocks: int,
             max_model_len: int, latency_s: float = 0.0, rounds: int = ROUNDS, requests: int = REQUESTS,
             seed: int = 0) -> TailFit:
    """The tail that makes ``step_model``'s simulated replica show what ``windows`` showed (module docstring).

    ``latency_s`` is the time before a request's first step that holds no server (a correction's request
    overhead); it is the front end's fixed latency. Without gaps or TTFTs to fit to, that part of the tail is
    left out."""
    replica = _Replica(step_model, engine, num_blocks, max_model_len, requests, seed)
    base = Tail(front_end=FrontEnd(latency_s=latency_s)) if latency_s > 0 else Tail()
    first = [replica.run(w, base) for w in windows]
    front_windows = tuple(
        FrontEndWindow(rate=w.rate, gap_s=w.client_ttft_s - w.engine_ttft_s,
                       output_tokens=float(run.times.output_tokens.mean()), batch=run.mean_running)
        for w, run in zip(windows, first) if w.client_ttft_s is not None and w.engine_ttft_s is not None)
    front = fit_front_end(front_windows, latency_s=latency_s) or base.front_end

    observed: GapHistogram | None = None
    for w in windows:
        if w.gaps is not None and w.gaps.count > 0:
            observed = w.gaps if observed is None else observed.plus(w.gaps)
    if observed is None or observed.count < MIN_SAMPLES:
        return TailFit(Tail(front_end=front), front_end_windows=front_windows)
    # Quantiles the histogram places (vLLM's default inter-token buckets start at 10 ms: a fast engine's gaps all
    # fall in the first; start it with --custom-histogram-buckets for a finer tail) with gaps enough beyond them.
    probabilities = tuple(p for p in PROBABILITIES if 0 < p < 1 and (1 - p) * observed.count >= BEYOND
                          and observed.resolution(p) <= RESOLUTION)
    if len(probabilities) < 3:
        return TailFit(Tail(front_end=front), front_end_windows=front_windows)
    targets = [observed.quantile(p) or 0.0 for p in probabilities]
    shares = [(w.gaps.count / observed.count if w.gaps is not None else 0.0) for w in windows]

    def simulated(tail: Tail) -> list[float]:
        runs = [replica.run(w, tail) for w in windows]
        return _pooled_quantiles([(r.token_gaps, share) for r, share in zip(runs, shares)
                                  if r.token_gaps is not None], probabilities)

    knots = [1.0] * (len(probabilities) + 2)
    untailed = simulated(Tail(front_end=front))
    current = untailed
    dispersion: Dispersion | None = None
    for _ in range(rounds):
        ratios = [min(max(t / s, 1 / MAX_STEP), MAX_STEP) if s > 0 and t > 0 else 1.0
                  for t, s in zip(targets, current)]
        ratios = [ratios[0], *ratios, ratios[-1]]  # the ends follow their neighbours
        knots = [x * r for x, r in zip(knots, ratios)]
        for i in range(1, len(knots)):
            knots[i] = max(knots[i], knots[i - 1])
        dispersion = Dispersion(tuple(zip((0.0, *probabilities, 1.0), knots))).normalized()
        knots = [x for _, x in dispersion.knots]
        current = simulated(Tail(dispersion, front))
    return TailFit(Tail(dispersion, front), probabilities=probabilities, observed_gaps_s=tuple(targets),
                   simulated_gaps_s=tuple(current), untailed_gaps_s=tuple(untailed), front_end_windows=front_windows)


def relative_error(predicted: float | None, observed: float | None) -> float:
    """(predicted − observed) / observed; inf when either is missing."""
    if predicted is None or observed is None or observed <= 0:
        return math.inf
    return (predicted - observed) / observed
