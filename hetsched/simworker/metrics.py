"""vLLM's Prometheus metric names, fed by a simulated engine (times in simulated-hardware seconds)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hetsched.simworker.engine import RequestTiming, SimEngine, StepObserver

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
"""vLLM's buckets for both the per-token inter-token latency and the per-request time per output token."""
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets (0.32) for end-to-end latency and queue time."""
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM declares a ``request_success`` series for each before any request finishes."""


def length_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … up to ``max_model_len``."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class CountedHistogram(Collector):
    """A histogram of one label set whose observations come with a count.

    The engine delivers a decode step's token to every running request at once (several steps at once at a high
    time scale): one call per request and step, not one per token, keeps the metrics cheaper than the step.
    """

    def __init__(self, name: str, documentation: str, labels: dict[str, str], *, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labels, self._bounds = name, documentation, labels, buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int) -> None:
        self._counts[bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        edges = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        family.add_metric(list(self._labels.values()), list(zip(edges, accumulate(self._counts))), self._sum)
        yield family


class VllmMetrics(StepObserver):
    """The gauges, counters and histograms a vLLM server exports, labelled ``model_name`` and ``engine``."""

    def __init__(self, *, model_name: str, block_size: int, num_blocks: int, max_model_len: int,
                 prefix_caching: bool = False, hash_algorithm: str = "sha256") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ("model_name", "engine")
        self._values = (model_name, "0")
        self._prefix_seen = (0, 0)
        """The engine's prefix-cache queries and hits the counters hold."""
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", labels, registry=r)
        cache_info = {"block_size": str(block_size), "enable_prefix_caching": str(prefix_caching),
                      "num_gpu_blocks": str(num_blocks), "prefix_caching_hash_algo": hash_algorithm, "engine": "0"}
        cache = Gauge("vllm:cache_config_info", "Information of the KV cache configuration", tuple(cache_info),
                      registry=r)
        cache.labels(**cache_info).set(1)  # vLLM labels the series with its CacheConfig, str() of each field
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.success = Counter("vllm:request_success", "Successfully processed requests",
                               (*labels, "finished_reason"), registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = CountedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                    dict(zip(labels, self._values)), buckets=TPOT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", labels,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue", labels,
                               buckets=E2E_BUCKETS, registry=r)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", labels,
                                    buckets=length_buckets(max_model_len), registry=r)
        self.generation_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request", labels,
                                        buckets=length_buckets(max_model_len), registry=r)
        for reason in FINISH_REASONS:  # as vLLM does: a scraper sees every series from the start
            self.success.labels(*self._values, reason)
        self.preemptions.labels(*self._values)
        self.prefix_queries.labels(*self._values)
        self.prefix_hits.labels(*self._values)

    def on_step(self, engine: SimEngine) -> None:
        v = self._values
        self.running.labels(*v).set(engine.num_running)
        self.waiting.labels(*v).set(engine.num_waiting)
        self.kv_usage.labels(*v).set(engine.kv_usage)
        queries, hits = engine.prefix_queries, engine.prefix_hits
        seen_queries, seen_hits = self._prefix_seen
        if queries > seen_queries:
            self.prefix_queries.labels(*v).inc(queries - seen_queries)
            self.prefix_hits.labels(*v).inc(hits - seen_hits)
            self._prefix_seen = (queries, hits)

    def on_tokens(self, gap_s: float, count: int) -> None:
        self.itl.observe(gap_s, count)

    def on_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(*self._values).inc(prompt_tokens)
        self.prompt_len.labels(*self._values).observe(prompt_tokens)

    def on_finished(self, timing: RequestTiming) -> None:
        v = self._values
        self.success.labels(*v, "length").inc()
        self.generation_tokens.labels(*v).inc(timing.output_tokens)
        self.generation_len.labels(*v).observe(timing.output_tokens)
        self.ttft.labels(*v).observe(timing.ttft_s)
        self.e2e.labels(*v).observe(timing.e2e_s)
        self.queue.labels(*v).observe(timing.queue_s)
        decode_tokens = timing.output_tokens - 1  # vLLM observes 0 for a one-token request
        self.tpot.labels(*v).observe((timing.e2e_s - timing.ttft_s) / decode_tokens if decode_tokens > 0 else 0.0)

    def on_aborted(self) -> None:
        """Nothing: vLLM 0.32 counts no request its client abandoned in ``request_success`` (measured)."""

    def on_preempted(self, count: int) -> None:
        self.preemptions.labels(*self._values).inc(count)
