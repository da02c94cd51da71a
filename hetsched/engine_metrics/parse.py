"""Parse engine signals from ``/metrics`` text or a Prometheus HTTP API response.

vLLM and SGLang names, old and new: ``vllm:kv_cache_usage_perc`` (newer) and
``vllm:gpu_cache_usage_perc`` (older) are both read. TPOT is per request:
``vllm:request_time_per_output_token_seconds``, one observation per finished
request. ``vllm:inter_token_latency_seconds`` holds one observation per token
gap, and one slow step shows in many of them, so it is never read as TPOT; the
older ``vllm:time_per_output_token_seconds`` is read only from an engine that
has neither newer name. Several engines in one pod are summed (the KV usage is
the fullest engine's).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.errors import InputError

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
COMPLETED = ("vllm:request_success", "sglang:num_requests")
PROMPT_TOKENS = ("vllm:prompt_tokens", "sglang:prompt_tokens")
GENERATION_TOKENS = ("vllm:generation_tokens", "sglang:generation_tokens")
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
TPOT = ("vllm:request_time_per_output_token_seconds", "sglang:time_per_output_token_seconds")
"""Per-request time per output token, (e2e − TTFT) / (output tokens − 1)."""
ITL = ("vllm:inter_token_latency_seconds", "sglang:inter_token_latency_seconds")
"""Per-token gaps, never TPOT: an engine that has them keeps :data:`OLD_TPOT`, if at all, as an alias of them."""
OLD_TPOT = ("vllm:time_per_output_token_seconds",)
"""What vLLM exposed before it split ITL from per-request TPOT: read only where neither newer name is."""
ROUTER_REJECTED = "hetsched_router_rejected"
ROUTER_QUEUED_DEMAND = "hetsched_router_flow_queued_demand"
BEST_EFFORT_REASON = "best-effort"
"""The refusals of a best-effort class: never demand that adds replicas."""
"""Requests the router turned away (no endpoint, all saturated) by ``model``: demand no engine saw."""
QUEUE_TIME = ("vllm:request_queue_time_seconds", "sglang:queue_time_seconds")
"""Per request: waiting before its first step (TTFT less this is the engine's own time to its first token)."""
PREFILL_TIME = ("vllm:request_prefill_time_seconds",)
"""Per request: from its first step to its first token (the prefill steps alone, no queue, no front end)."""
PREFIX_CACHE_QUERIES = ("vllm:prefix_cache_queries",)
PREFIX_CACHE_HITS = ("vllm:prefix_cache_hits",)
"""The prefix cache's lookups and hits, in prompt tokens."""
INPUT_TOKENS = ("vllm:request_prompt_tokens",)
OUTPUT_TOKENS = ("vllm:request_generation_tokens",)
"""Each tuple lists the names of one signal in order of preference; the first one present wins."""

_HISTOGRAMS = (*TTFT, *TPOT, *ITL, *OLD_TPOT, *QUEUE_TIME, *PREFILL_TIME, *INPUT_TOKENS, *OUTPUT_TOKENS)
_GAUGES_AND_COUNTERS = (*RUNNING, *WAITING, *KV_USAGE, *COMPLETED, *PROMPT_TOKENS, *GENERATION_TOKENS,
                        *PREFIX_CACHE_QUERIES, *PREFIX_CACHE_HITS)

_ENGINE_PREFIXES = ("vllm:", "sglang:")
ENGINE_SERIES_QUERY = '{__name__=~"vllm:.*|sglang:.*"}'
"""A Prometheus query for every engine series (of any engine this module reads)."""

Sample = tuple[str, Mapping[str, str], float]
"""(name, labels, value) of one series."""


def parse_metrics_text(text: str) -> EngineMetrics:
    """Signals of one pod's ``/metrics`` (Prometheus text format)."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise InputError(f"not Prometheus text format ({exc})", field="metrics") from exc
    if not any(f.name.startswith(_ENGINE_PREFIXES) for f in families):
        raise InputError("no vllm: or sglang: metric family: not an inference engine's metrics page", field="metrics")
    samples = [(s.name, s.labels, s.value) for family in families for s in family.samples]
    return assemble(samples, engine_declared=True)


def parse_prometheus_vector(payload: Any, *, pod_label: str = "pod") -> dict[str, tuple[float, EngineMetrics]]:
    """Signals per pod from a Prometheus ``/api/v1/query`` instant-vector response.

    The query should select the engines' series, e.g. :data:`ENGINE_SERIES_QUERY`.
    Returns ``{pod: (sample time, metrics)}``; the sample time is the oldest of the pod's series.
    """
    if not isinstance(payload, dict) or payload.get("status") != "success":
        error = payload.get("error") if isinstance(payload, dict) else None
        raise InputError(f"Prometheus query failed: {error or 'not a success response'}", field="prometheus")
    data = payload.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise InputError("expected an instant vector (data.resultType 'vector')", field="prometheus.data")
    by_pod: dict[str, list[Sample]] = defaultdict(list)
    times: dict[str, float] = {}
    for n, series in enumerate(data["result"]):
        try:
            labels = dict(series["metric"])
            stamp, value = float(series["value"][0]), float(series["value"][1])
            name = labels.pop("__name__")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise InputError(f"series {n} is not {{metric, value: [time, value]}}", field="prometheus.data.result") \
                from exc
        pod = labels.get(pod_label)
        if pod is None:
            continue
        by_pod[pod].append((name, labels, value))
        times[pod] = min(times.get(pod, stamp), stamp)
    return {pod: (times[pod], assemble(samples)) for pod, samples in by_pod.items()}


def assemble(samples: Iterable[Sample], *, engine_declared: bool = False) -> EngineMetrics:
    """Signals from raw series: counters and gauges summed over label sets, histograms merged.

    ``engine_declared``: the exposition declares engine metric families, so a
    request counter or gauge without samples (a labelled series nobody has
    touched yet, as on an idle engine) reads as 0 rather than unknown.
    """
    scalars: dict[str, float] = defaultdict(float)
    kv: dict[str, float] = {}
    buckets: dict[str, dict[tuple[tuple[str, str], ...], dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    sums: dict[str, float] = defaultdict(float)
    for name, labels, value in samples:
        if math.isnan(value):
            continue
        base = name.removesuffix("_total")
        if base in KV_USAGE:
            kv[base] = max(kv.get(base, 0.0), value)
        elif base in _GAUGES_AND_COUNTERS:
            scalars[base] += value
        elif name.endswith("_bucket") and name.removesuffix("_bucket") in _HISTOGRAMS and "le" in labels:
            series = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            buckets[name.removesuffix("_bucket")][series][float(labels["le"])] = value
        elif name.endswith("_sum") and name.removesuffix("_sum") in _HISTOGRAMS:
            sums[name.removesuffix("_sum")] += value

    def first(names: tuple[str, ...]) -> float | None:
        return next((scalars[n] for n in names if n in scalars), None)

    def histogram(names: tuple[str, ...]) -> Histogram | None:
        name = next((n for n in names if n in buckets), None)
        if name is None:
            return None
        merged: Histogram | None = None
        for series in buckets[name].values():
            le = tuple(sorted(series))
            if not le or not math.isinf(le[-1]):
                continue
            one = Histogram(le, tuple(series[b] for b in le), 0.0)
            merged = one if merged is None else merged.plus(one)
        return Histogram(merged.le, merged.counts, sums.get(name, 0.0)) if merged else None

    running, waiting, completed = first(RUNNING), first(WAITING), first(COMPLETED)
    if engine_declared:
        running, waiting, completed = running or 0.0, waiting or 0.0, completed or 0.0
    usage = next((kv[n] for n in KV_USAGE if n in kv), None)
    tpot_names = TPOT if any(n in buckets for n in (*TPOT, *ITL)) else OLD_TPOT
    return EngineMetrics(
        completed=completed,
        running=int(running) if running is not None else None,
        waiting=int(waiting) if waiting is not None else None,
        kv_usage=min(max(usage, 0.0), 1.0) if usage is not None else None,
        prompt_tokens=first(PROMPT_TOKENS),
        generation_tokens=first(GENERATION_TOKENS),
        ttft_s=histogram(TTFT), tpot_s=histogram(tpot_names), queue_s=histogram(QUEUE_TIME),
        input_tokens=histogram(INPUT_TOKENS), output_tokens=histogram(OUTPUT_TOKENS),
        itl_s=histogram(ITL), prefill_s=histogram(PREFILL_TIME),
        prefix_cache_queries=first(PREFIX_CACHE_QUERIES), prefix_cache_hits=first(PREFIX_CACHE_HITS),
    )


def parse_router_rejections(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """Per model: the requests the router refused before reaching an engine (cumulative; a best-effort class's
    not among them), and those waiting in its flow-control queue now (best-effort classes' not among them)."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise InputError(f"not Prometheus text format ({exc})", field="router metrics") from exc
    refused: dict[str, float] = defaultdict(float)
    queued: dict[str, float] = defaultdict(float)
    for family in families:
        for sample in family.samples:
            if "model" not in sample.labels:
                continue
            name = sample.name.removesuffix("_total")
            if name == ROUTER_REJECTED and sample.labels.get("reason") != BEST_EFFORT_REASON:
                refused[sample.labels["model"]] += sample.value
            elif name == ROUTER_QUEUED_DEMAND:
                queued[sample.labels["model"]] += sample.value
    return dict(refused), dict(queued)
