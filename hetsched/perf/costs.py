"""Time of one kernel launch from its shape, a device's peaks and its calibrated constants.

Each function is plain arithmetic that works on floats and on numpy arrays alike, so
the step model (one shape at a time) and the calibration fit (thousands of measured
points at once) share one definition. Sizes are per GPU (per tensor-parallel shard).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from hetsched.catalog.perf import (CollectiveConstants, DecodeAttentionConstants, GemmConstants, MemoryKernel,
                                   PrefillAttentionConstants)

Number = TypeVar("Number", float, np.ndarray)

ACTIVATION_BYTES = 2.0
"""bf16/fp16 activations and KV entries."""


def ridge_seconds(flops: Number, nbytes: Number, *, peak_flops: float, bandwidth: float, c: GemmConstants,
                  launches: float = 1.0) -> Number:
    """``launches`` GEMM-like kernels doing ``flops`` and moving ``nbytes`` between them."""
    compute = flops / (peak_flops * c.compute_efficiency)
    memory = nbytes / (bandwidth * c.memory_efficiency)
    return launches * c.floor_us * 1e-6 + _blend(compute, memory, c.blend)


def gemm_seconds(m: Number, k: Number, n: Number, *, peak_flops: float, bandwidth: float, c: GemmConstants,
                 weight_bytes: float = 2.0) -> Number:
    """``[m×k] @ [k×n]``: floor plus the smooth ridge of compute and memory."""
    return ridge_seconds(2.0 * m * k * n, k * n * weight_bytes + ACTIVATION_BYTES * (m * k + m * n),
                         peak_flops=peak_flops, bandwidth=bandwidth, c=c)


ON_CHIP_BLEND = 4.0
"""How sharply a memory-bound launch turns from its on-chip limit to the memory's (the ``p`` of a blend).

Chosen among 2–6 with the A100 set's transfer to the A40 and H100 in view (``benchmarks/model_accuracy.py``):
lower blurs the turn (a gather on GDDR comes out too slow), higher sharpens it (norms near the turn too fast).
"""


def memory_kernel_seconds(nbytes: Number, *, bandwidth: float, c: MemoryKernel, width: Number | float = 0.0,
                          cycles_per_s: float = 0.0) -> Number:
    """An elementwise or row-reduction launch moving ``nbytes``; ``width`` elements per row.

    ``cycles_per_s`` is the device's SM/CU count times its clock: with the kernel's
    ``bytes_per_cycle`` it caps the transfer rate from the chip's side.
    """
    transfer = nbytes / (bandwidth * c.efficiency)
    if c.bytes_per_cycle > 0 and cycles_per_s > 0:
        transfer = _blend(transfer, nbytes / (cycles_per_s * c.bytes_per_cycle), ON_CHIP_BLEND)
    return _blend(c.floor_us * 1e-6 + c.per_row_ns * 1e-9 * width, transfer, c.blend)


def decode_attention_seconds(seqs: Number, kv_bytes: Number, *, bandwidth: float,
                             c: DecodeAttentionConstants) -> Number:
    """One layer's paged decode attention over ``seqs`` sequences reading ``kv_bytes`` of cache."""
    return c.floor_us * 1e-6 + c.per_seq_us * 1e-6 * seqs + kv_bytes / (bandwidth * c.efficiency)


def prefill_attention_seconds(new_tokens: Number, flops: Number, kv_bytes: Number, *, peak_flops: float,
                              bandwidth: float, c: PrefillAttentionConstants) -> Number:
    """One layer's prefill attention: ``flops`` over causal pairs, ``kv_bytes`` of cached prefix read."""
    return (c.floor_us * 1e-6 + c.per_token_ns * 1e-9 * new_tokens + flops / (peak_flops * c.efficiency)
            + kv_bytes / bandwidth)


def all_reduce_seconds(nbytes: Number, ranks: int, *, link_bytes_per_s: float, c: CollectiveConstants) -> Number:
    """A ring all-reduce of ``nbytes`` over ``ranks`` GPUs (NCCL's cost model)."""
    if ranks <= 1:
        return nbytes * 0.0
    steps = 2 * (ranks - 1)
    return _blend(c.base_us * 1e-6 + steps * c.step_us * 1e-6,
                  steps / ranks * nbytes / (link_bytes_per_s * c.bus_efficiency), c.blend)


def send_recv_seconds(nbytes: Number, *, link_bytes_per_s: float, c: CollectiveConstants) -> Number:
    """A point-to-point transfer of ``nbytes`` (one ring step)."""
    return _blend(c.base_us * 1e-6 + c.step_us * 1e-6, nbytes / (link_bytes_per_s * c.bus_efficiency), c.blend)


def _blend(latency: Number | float, transfer: Number, blend: float) -> Number:
    """``(latency^p + transfer^p)^(1/p)``: their sum at ``p = 1``, the larger as ``p`` grows."""
    # typeshed types ``float ** float`` as Any (a negative base gives a complex); both are non-negative here
    blended: Number = latency + transfer if blend == 1.0 else (latency ** blend + transfer ** blend) ** (1.0 / blend)
    return blended
