"""Per-request latencies of a simulation run and their aggregates."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from hetsched.specs.workload import SLO


@dataclass(frozen=True)
class LatencyStats:
    """P50/P90/P99 and the SLO percentile of one latency, in milliseconds."""

    p50: float
    p90: float
    p99: float
    at_slo_percentile: float

    @classmethod
    def of(cls, values_s: np.ndarray, percentile: float) -> LatencyStats:
        if not len(values_s):
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = values_s * 1e3
        p50, p90, p99, px = np.percentile(ms, [50, 90, 99, percentile], method="inverted_cdf")
        return cls(float(p50), float(p90), float(p99), float(px))


@dataclass(frozen=True)
class RequestTimes:
    """Times of each measured request in seconds (NaN where it never happened)."""

    arrival: np.ndarray
    scheduled: np.ndarray
    first_token: np.ndarray
    finished: np.ndarray
    output_tokens: np.ndarray
    preemptions: np.ndarray
    rejected: np.ndarray

    @property
    def queue(self) -> np.ndarray:
        return self.scheduled - self.arrival

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Mean time per output token after the first (NaN for one-token answers)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output_tokens > 1, (self.finished - self.first_token) / (self.output_tokens - 1), np.nan)

    @property
    def e2e(self) -> np.ndarray:
        return self.finished - self.arrival


@dataclass(frozen=True)
class RunSummary:
    """Aggregates of one or more runs at one arrival rate."""

    rate: float
    requests: int
    completed: int
    failure_rate: float
    throughput_rps: float
    goodput_rps: float
    """Completed requests per second that met every SLO threshold."""
    output_tokens_per_s: float
    queue_ms: LatencyStats
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    preemptions: int
    mean_running: float
    max_running: int
    aborted: bool
    """Stopped early because the SLO was already certain to fail."""


def summarize(times: list[RequestTimes], *, rate: float, slo: SLO, spans_s: list[float],
              running: list[tuple[float, int]], aborted: bool) -> RunSummary:
    """Pool runs (several seeds) into one summary; ``spans_s`` are their measured time spans.

    ``running`` holds each run's (time-averaged, peak) number of running requests.
    """
    t = RequestTimes(**{f.name: np.concatenate([getattr(x, f.name) for x in times]) for f in fields(RequestTimes)})
    done = ~np.isnan(t.finished)
    ttft, tpot = t.ttft[done], t.tpot[done]
    tpot_ok = np.isnan(tpot) | (tpot * 1e3 <= slo.tpot_ms)
    good = int(np.sum((ttft * 1e3 <= slo.ttft_ms) & tpot_ok))
    span = sum(spans_s) or 1.0
    n = len(t.arrival)
    return RunSummary(
        rate=rate, requests=n, completed=int(done.sum()),
        failure_rate=float(t.rejected.sum() / n) if n else 0.0,
        throughput_rps=float(done.sum() / span), goodput_rps=good / span,
        output_tokens_per_s=float(t.output_tokens[done].sum() / span),
        queue_ms=LatencyStats.of(t.queue[~np.isnan(t.scheduled)], slo.percentile),
        ttft_ms=LatencyStats.of(ttft, slo.percentile),
        tpot_ms=LatencyStats.of(tpot[~np.isnan(tpot)], slo.percentile),
        e2e_ms=LatencyStats.of(t.e2e[done], slo.percentile),
        preemptions=int(t.preemptions.sum()),
        mean_running=float(np.mean([r for r, _ in running])) if running else 0.0,
        max_running=max((m for _, m in running), default=0),
        aborted=aborted,
    )
