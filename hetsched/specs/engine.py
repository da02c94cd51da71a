"""Engine settings: the knobs of a vLLM-style engine that change capacity."""

from __future__ import annotations

from dataclasses import dataclass

from hetsched.errors import InputError


@dataclass(frozen=True)
class EngineConfig:
    """Per-replica engine settings (vLLM names)."""

    gpu_memory_utilization: float = 0.90
    """Share of device memory the engine may use (weights + activations + KV)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (prefill chunks plus one token per decode)."""
    max_num_seqs: int = 256
    """Most sequences in one step."""
    block_size: int = 16
    """KV cache block size in tokens."""
    runtime_reserve_gb: float = 1.5
    """Per-device memory for the runtime (CUDA context, graphs, NCCL buffers)."""
    step_overhead_ms: float | None = None
    """Fixed host-side time per step (scheduling, sampling, launch); None: the device's, from the catalog."""

    def __post_init__(self) -> None:
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise InputError(f"expected 0.05..1.0, got {self.gpu_memory_utilization}", field="gpu_memory_utilization")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise InputError(f"expected a positive integer, got {getattr(self, name)}", field=name)
        if self.runtime_reserve_gb < 0 or (self.step_overhead_ms is not None and self.step_overhead_ms < 0):
            raise InputError("expected a non-negative value", field="runtime_reserve_gb/step_overhead_ms")
