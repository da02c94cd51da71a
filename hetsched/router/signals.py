"""Engine signals from Prometheus text: vLLM (old and new KV names) and SGLang.

The engine metric names and their summing are the autoscaler's
(:func:`hetsched.engine_metrics.parse.assemble`); the router adds the KV capacity
vLLM declares in ``cache_config_info``.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from hetsched.engine_metrics.parse import KV_USAGE, RUNNING, WAITING, Sample, assemble
from hetsched.errors import InputError
from hetsched.router.types import EngineSignals

CACHE_CONFIG = "vllm:cache_config_info"
READ = (*RUNNING, *WAITING, *KV_USAGE, CACHE_CONFIG)
"""The only series routing reads; every other line of an engine's page is skipped unparsed."""


def routing_lines(text: str) -> str:
    """The sample lines of ``text`` that may be a :data:`READ` series.

    An engine's page is mostly histograms routing never reads (vLLM's runs to hundreds of lines), and the
    Prometheus client's parser is pure Python: the router scrapes every engine every second from the process
    that serves requests, so it parses only these (a few lines, a tenth of the time on sim-worker's page).
    """
    return "\n".join(line for line in text.splitlines() if line.startswith(READ)) + "\n"


def parse_engine_metrics(text: str, *, scraped_at: float) -> EngineSignals:
    """Sum running/waiting over engines and take the fullest KV cache; absent names stay None."""
    samples: list[Sample] = []
    capacity: int | None = None
    try:
        for family in text_string_to_metric_families(routing_lines(text)):
            for sample in family.samples:
                labels = sample.labels
                if sample.name != CACHE_CONFIG:
                    samples.append((sample.name, labels, sample.value))
                elif "num_gpu_blocks" in labels and "block_size" in labels:
                    capacity = (capacity or 0) + int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (ValueError, TypeError, IndexError) as exc:
        raise InputError(f"not Prometheus text format ({exc})", field="metrics") from exc
    metrics = assemble(samples)
    return EngineSignals(scraped_at=scraped_at, running=metrics.running, waiting=metrics.waiting,
                         kv_usage=metrics.kv_usage, kv_capacity_tokens=capacity)


def fresh(signals: EngineSignals | None, *, now: float, stale_after_s: float) -> EngineSignals | None:
    """The signals when recent enough to trust, else None (unknown, never idle)."""
    if signals is None or now - signals.scraped_at > stale_after_s:
        return None
    return signals
