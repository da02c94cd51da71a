"""Per-request latencies of a simulation run and their aggregates.

NumPy loads where a run's arrays are summarized, not with the module: a capacity answered from the cache reads
its latencies back without it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from hetsched.specs.workload import SLO

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


@dataclass(frozen=True)
class LatencyStats:
    """P50/P90/P99 and the SLO percentile of one latency, in milliseconds."""

    p50: float
    p90: float
    p99: float
    at_slo_percentile: float

    @classmethod
    def of(cls, values_s: np.ndarray, percentile: float) -> LatencyStats:
        import numpy as np

        if not len(values_s):
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = values_s * 1e3
        p50, p90, p99, px = np.percentile(ms, [50, 90, 99, percentile], method="inverted_cdf")
        return cls(float(p50), float(p90), float(p99), float(px))


@dataclass(frozen=True)
class RequestTimes:
    """Times of each measured request in seconds (NaN where it never happened)."""

    arrival: NDArray[np.float64]
    scheduled: NDArray[np.float64]
    first_token: NDArray[np.float64]
    finished: NDArray[np.float64]
    output_tokens: NDArray[np.int64]
    preemptions: np.ndarray
    rejected: np.ndarray
    admitted: NDArray[np.float64]
    """When the engine took it: its arrival, or, behind a front end, once the front end served it (vLLM's arrival
    time, from which its own TTFT runs; the front end's fixed latency comes after it)."""
    engine_first_token: NDArray[np.float64]
    """When the engine produced its first token: ``first_token``, or, behind a front end, before it was sent."""

    @property
    def queue(self) -> np.ndarray:
        return self.scheduled - self.arrival

    @property
    def engine_ttft(self) -> np.ndarray:
        """The engine's own time to first token, from when it took the request (vLLM's TTFT metric)."""
        return self.engine_first_token - self.admitted

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Mean time per output token after the first (NaN for one-token answers)."""
        import numpy as np

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
    """Throughput times the share of measured requests that met every SLO threshold."""
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


@dataclass(frozen=True)
class TokenGaps:
    """Each step's seconds, and how many sequences decoding in it had that gap before their token (an engine's
    inter-token latencies, by weight)."""

    seconds: tuple[float, ...]
    weights: tuple[int, ...]

    def quantile(self, q: float) -> float | None:
        """The token gap at cumulative share ``q`` of all tokens (0..1); None without any."""
        total = sum(self.weights)
        if not total:
            return None
        rank, seen = q * total, 0
        for seconds, weight in sorted(zip(self.seconds, self.weights)):
            seen += weight
            if seen >= rank:
                return seconds
        return max(self.seconds)


@dataclass(frozen=True)
class RunResult:
    """One simulation run: the measured requests' times and what the engine went through."""

    times: RequestTimes
    window_s: float
    """From the first to the last measured arrival: the steady-state window."""
    completed_in_window: int
    """Requests (measured or not) that finished inside the window."""
    output_tokens_in_window: int
    mean_running: float
    max_running: int
    steps: int
    peak_kv_fraction: float
    """Largest share of KV blocks in use at any step."""
    late_ttft: int
    late_tpot: int
    failed: int
    aborted: bool
    token_gaps: TokenGaps | None = None
    """Every step's time as a token gap, when the run was asked to keep them."""


def summarize(runs: list[RunResult], *, rate: float, slo: SLO) -> RunSummary:
    """Pool runs (several seeds) into one summary.

    Throughput counts completions inside each run's arrival window, so it is
    the steady-state rate and not diluted by the drain of the longest requests.
    """
    import numpy as np

    t = RequestTimes(**{f.name: np.concatenate([getattr(r.times, f.name) for r in runs]) for f in fields(RequestTimes)})
    done = ~np.isnan(t.finished)
    ttft, tpot = t.ttft[done], t.tpot[done]
    tpot_ok = np.isnan(tpot) | (tpot * 1e3 <= slo.tpot_ms)
    good_share = float(np.mean((ttft * 1e3 <= slo.ttft_ms) & tpot_ok)) if done.any() else 0.0
    window = sum(r.window_s for r in runs)
    throughput = sum(r.completed_in_window for r in runs) / window if window > 0 else 0.0
    n = len(t.arrival)
    return RunSummary(
        rate=rate, requests=n, completed=int(done.sum()),
        failure_rate=float(t.rejected.sum() / n) if n else 0.0,
        throughput_rps=throughput, goodput_rps=throughput * good_share,
        output_tokens_per_s=sum(r.output_tokens_in_window for r in runs) / window if window > 0 else 0.0,
        queue_ms=LatencyStats.of(t.queue[~np.isnan(t.scheduled)], slo.percentile),
        ttft_ms=LatencyStats.of(ttft, slo.percentile),
        tpot_ms=LatencyStats.of(tpot[~np.isnan(tpot)], slo.percentile),
        e2e_ms=LatencyStats.of(t.e2e[done], slo.percentile),
        preemptions=int(t.preemptions.sum()),
        mean_running=float(np.mean([r.mean_running for r in runs])) if runs else 0.0,
        max_running=max((r.max_running for r in runs), default=0),
        aborted=any(r.aborted for r in runs),
    )
