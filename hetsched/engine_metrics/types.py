"""What one engine's ``/metrics`` says, and the histogram arithmetic windows need.

Counters and histograms are cumulative as engines export them; whoever keeps
them over time works on differences between scrapes (a counter that went down
was reset: the pod restarted, and its new value is the increase).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts at upper bounds ``le`` (the last is +Inf)."""

    le: tuple[float, ...]
    counts: tuple[float, ...]
    total: float
    """Sum of the observed values."""

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        """Observations since ``earlier``; all of this one when bounds differ or a counter was reset."""
        if earlier.le != self.le or self.count < earlier.count:
            return self
        return Histogram(self.le, tuple(max(a - b, 0.0) for a, b in zip(self.counts, earlier.counts)),
                         max(self.total - earlier.total, 0.0))

    def plus(self, other: Histogram) -> Histogram:
        """Both sets of observations; on different bounds, ``other`` is resampled onto these bounds."""
        if other.le != self.le:
            other = Histogram(self.le, tuple(other.at_most(x) for x in self.le), other.total)
        return Histogram(self.le, tuple(a + b for a, b in zip(self.counts, other.counts)), self.total + other.total)

    def scaled(self, factor: float) -> Histogram:
        return Histogram(self.le, tuple(c * factor for c in self.counts), self.total * factor)

    def at_most(self, x: float) -> float:
        """Observations ≤ ``x``, interpolated linearly inside a bucket (as ``histogram_quantile`` does)."""
        if not self.counts:
            return 0.0
        i = bisect.bisect_left(self.le, x)
        if i >= len(self.le):
            return self.count
        lower = self.le[i - 1] if i > 0 else 0.0
        below = self.counts[i - 1] if i > 0 else 0.0
        upper = self.le[i]
        if math.isinf(upper) or upper <= lower:
            return below if x < upper else self.counts[i]
        return below + (self.counts[i] - below) * (x - lower) / (upper - lower)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), None without observations; in the +Inf bucket, the last finite bound."""
        if self.count <= 0:
            return None
        rank = q * self.count
        i = bisect.bisect_left(self.counts, rank)
        i = min(i, len(self.counts) - 1)
        if math.isinf(self.le[i]):
            return self.le[i - 1] if i > 0 else None
        lower = self.le[i - 1] if i > 0 else 0.0
        below = self.counts[i - 1] if i > 0 else 0.0
        inside = self.counts[i] - below
        return lower + (self.le[i] - lower) * ((rank - below) / inside if inside > 0 else 1.0)


@dataclass(frozen=True)
class EngineMetrics:
    """The autoscaling signals of one engine's ``/metrics``; None where it does not export a value."""

    completed: float | None = None
    """Requests finished (``vllm:request_success_total``, summed over finish reasons)."""
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """Share of the KV cache in use, 0..1 (the fullest engine of the pod)."""
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    ttft_s: Histogram | None = None
    tpot_s: Histogram | None = None
    """Time per output token, one observation per request (``vllm:request_time_per_output_token_seconds``)."""
    queue_s: Histogram | None = None
    """Time a request waited before its first step (``vllm:request_queue_time_seconds``)."""
    input_tokens: Histogram | None = None
    """Prompt length per request (``vllm:request_prompt_tokens``)."""
    output_tokens: Histogram | None = None
    itl_s: Histogram | None = None
    """Every gap between two tokens of a request (``vllm:inter_token_latency_seconds``): how steps vary."""
    prefill_s: Histogram | None = None
    """Per request, from its first step to its first token (``vllm:request_prefill_time_seconds``)."""
    prefix_cache_queries: float | None = None
    """Prompt tokens looked up in the prefix cache (``vllm:prefix_cache_queries_total``)."""
    prefix_cache_hits: float | None = None
    """Of them, tokens found cached (``vllm:prefix_cache_hits_total``)."""

    @property
    def arrived(self) -> float | None:
        """Requests that ever arrived: finished plus those still running or queued."""
        if self.completed is None or self.running is None or self.waiting is None:
            return None
        return self.completed + self.running + self.waiting
