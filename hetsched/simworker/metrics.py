"""vLLM's Prometheus metric names, fed by a simulated engine (times in simulated-hardware seconds)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hetsched.simworker.engine import RequestTiming, SimEngine, StepObserver

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class VllmMetrics(StepObserver):
    """The gauges, counters and histograms a vLLM server exports, labelled ``model_name`` and ``engine``."""

    def __init__(self, *, model_name: str, block_size: int, num_blocks: int) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ("model_name", "engine")
        self._values = (model_name, "0")
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", labels, registry=r)
        cache = Gauge("vllm:cache_config_info", "Information of the KV cache configuration",
                      ("block_size", "num_gpu_blocks", "engine"), registry=r)
        cache.labels(str(block_size), str(num_blocks), "0").set(1)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.success = Counter("vllm:request_success", "Successfully processed requests",
                               (*labels, "finished_reason"), registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue", labels,
                               buckets=E2E_BUCKETS, registry=r)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", labels,
                                    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000),
                                    registry=r)
        self.generation_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request", labels,
                                        buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)

    def on_step(self, engine: SimEngine) -> None:
        v = self._values
        self.running.labels(*v).set(engine.num_running)
        self.waiting.labels(*v).set(engine.num_waiting)
        self.kv_usage.labels(*v).set(engine.kv_usage)

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
        if timing.output_tokens > 1:
            self.itl.labels(*v).observe((timing.e2e_s - timing.ttft_s) / (timing.output_tokens - 1))

    def on_aborted(self) -> None:
        self.success.labels(*self._values, "abort").inc()

    def on_preempted(self, count: int) -> None:
        self.preemptions.labels(*self._values).inc(count)
