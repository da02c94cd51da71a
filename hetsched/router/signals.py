"""Engine signals from Prometheus text: vLLM (old and new KV names) and SGLang."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from hetsched.errors import InputError
from hetsched.router.types import EngineSignals

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
"""Newer vLLM first; older vLLM releases only export ``gpu_cache_usage_perc``."""
CACHE_CONFIG = "vllm:cache_config_info"


def parse_engine_metrics(text: str, *, scraped_at: float) -> EngineSignals:
    """Sum running/waiting over engines and take the fullest KV cache; absent names stay None."""
    values: dict[str, list[float]] = {}
    capacity: int | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG:
                    labels = sample.labels
                    if "num_gpu_blocks" in labels and "block_size" in labels:
                        capacity = (capacity or 0) + int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                elif sample.name in RUNNING or sample.name in WAITING or sample.name in KV_USAGE:
                    values.setdefault(sample.name, []).append(sample.value)
    except ValueError as exc:
        raise InputError(f"not Prometheus text format ({exc})", field="metrics") from exc

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((values[n] for n in names if n in values), None)

    running, waiting, kv = first(RUNNING), first(WAITING), first(KV_USAGE)
    return EngineSignals(
        scraped_at=scraped_at,
        running=int(sum(running)) if running is not None else None,
        waiting=int(sum(waiting)) if waiting is not None else None,
        kv_usage=min(max(kv), 1.0) if kv else None,
        kv_capacity_tokens=capacity,
    )


def fresh(signals: EngineSignals | None, *, now: float, stale_after_s: float) -> EngineSignals | None:
    """The signals when recent enough to trust, else None (unknown, never idle)."""
    if signals is None or now - signals.scraped_at > stale_after_s:
        return None
    return signals
