"""Time of one kernel launch from its shape, a device's peaks and its calibrated constants.

Each function is plain arithmetic that works on floats and on numpy arrays alike, so
the step model (one shape at a time) and the calibration fit (thousands of measured
points at once) share one definition. Sizes are per GPU (per tensor-parallel shard).
NumPy is imported where arrays come in, not with the module: the step model of one
engine step (``hetsched estimate``) goes without it.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, TypeVar

from hetsched.catalog.perf import (CollectiveConstants, DecodeAttentionConstants, GemmConstants, MemoryKernel,
                                   PrefillAttentionConstants)

if TYPE_CHECKING:
    import numpy as np

Number = TypeVar("Number", float, "np.ndarray")

SCALARS = (int, float)
"""The numbers the step model passes, one shape at a time; anything else is an array of a calibration fit."""

ACTIVATION_BYTES = 2.0
"""bf16/fp16 activations and KV entries."""


def wave_fill(blocks: Number, compute_units: int) -> Number:
    """The share of ``compute_units`` a grid of ``blocks`` keeps busy over its waves (1 where units are unknown)."""
    if compute_units <= 0:
        return blocks * 0.0 + 1.0
    if isinstance(blocks, SCALARS):  # the step model's scalars: numpy's per-call cost would triple its time
        return min(blocks / (max(math.ceil(blocks / compute_units), 1) * compute_units), 1.0)
    import numpy as np

    waves = np.maximum(np.ceil(blocks / compute_units), 1.0)
    fill: Number = np.minimum(blocks / (waves * compute_units), 1.0)
    return fill


def ridge_seconds(flops: Number, nbytes: Number, *, peak_flops: float, bandwidth: float, c: GemmConstants,
                  launches: float = 1.0, fill: Number | float = 1.0) -> Number:
    """``launches`` GEMM-like kernels doing ``flops`` and moving ``nbytes`` between them.

    ``fill`` is the share of the device the tiles keep busy (see :func:`gemm_tile_fill`).
    """
    compute = flops / (peak_flops * c.compute_efficiency * fill)
    memory = nbytes / (bandwidth * c.memory_efficiency)
    return launches * c.floor_us * 1e-6 + _blend(compute, memory, c.blend)


GEMM_TILES = ((256, 128), (128, 256), (128, 128))
"""Output tiles (rows × columns) a large half-precision GEMM runs on NVIDIA's libraries since Ampere.

The three shapes, and that the library takes whichever wastes least of its last wave, were chosen
among five sets on the A100 timings with the held-out scores in view (``benchmarks/model_accuracy.py``).
"""


def gemm_tile_fill(m: Number, n: Number, compute_units: int) -> Number:
    """The share of ``compute_units`` an ``[m×n]`` output keeps busy over its waves of tiles.

    The library picks the tiling that wastes least of its last wave; a grid smaller than one wave
    is split along K instead (split-K), so it loses nothing here. 1 where the unit count is unknown.
    """
    if compute_units <= 0:
        return m * 0.0 + 1.0
    if isinstance(m, SCALARS) and isinstance(n, SCALARS):
        return _scalar_tile_fill(float(m), float(n), compute_units)
    import numpy as np

    best: Number = m * 0.0
    for rows, columns in GEMM_TILES:
        tiles = np.ceil(m / rows) * np.ceil(n / columns)
        best = np.maximum(best, wave_fill(np.maximum(tiles, compute_units), compute_units))
    return best


@lru_cache(maxsize=65536)
def _scalar_tile_fill(m: float, n: float, compute_units: int) -> float:
    """:func:`gemm_tile_fill` of one shape; a simulation asks for the same few shapes millions of times."""
    return max(wave_fill(float(max(math.ceil(m / rows) * math.ceil(n / columns), compute_units)), compute_units)
               for rows, columns in GEMM_TILES)


def gemm_seconds(m: Number, k: Number, n: Number, *, peak_flops: float, bandwidth: float, c: GemmConstants,
                 weight_bytes: float = 2.0, compute_units: int = 0) -> Number:
    """``[m×k] @ [k×n]``: floor plus the smooth ridge of compute (at its tiles' wave fill) and memory."""
    return ridge_seconds(2.0 * m * k * n, k * n * weight_bytes + ACTIVATION_BYTES * (m * k + m * n),
                         peak_flops=peak_flops, bandwidth=bandwidth, c=c, fill=gemm_tile_fill(m, n, compute_units))


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


KV_SPLIT_TOKENS = 256
"""Decode attention may split a sequence's context into blocks of at least this many tokens (flash-decoding)."""
SPLIT_BELOW_FILL = 0.8
"""Decode attention splits contexts only when one block per (sequence, query head) fills less than this share
of the SMs (FlashAttention's split heuristic)."""
SPLIT_NEAR_BEST = 0.85
"""Of the split counts, the fewest whose last wave is at least this share as full as the best one's."""


@lru_cache(maxsize=65536)
def _decode_splits(pairs: float, context: float, compute_units: int) -> float:
    """How many parts FlashAttention cuts each (sequence, head)'s context into, for ``pairs`` of them."""
    if pairs >= SPLIT_BELOW_FILL * compute_units:
        return 1.0
    most = max(1, min(math.ceil(max(context, 1.0) / KV_SPLIT_TOKENS), 128))
    fills = [wave_fill(pairs * splits, compute_units) for splits in range(1, most + 1)]
    best = max(fills)
    return float(next(i for i, fill in enumerate(fills, start=1) if fill >= SPLIT_NEAR_BEST * best))


def decode_attention_seconds(seqs: Number, kv_bytes: Number, *, bandwidth: float, c: DecodeAttentionConstants,
                             heads: Number | float, context: Number, compute_units: int) -> Number:
    """One layer's paged decode attention over ``seqs`` sequences of ``context`` tokens reading ``kv_bytes``.

    One block per (sequence, query head) streams that head's cache, split along the context when
    that grid would leave SMs idle: eight sequences on 32 heads run 256 blocks on an A100's 108 SMs,
    unsplit, in three waves of which the last is a third full, so their read runs at 79 % of the
    rate 54 sequences reach; one short sequence has nothing to split and keeps 32 SMs busy.
    """
    pairs = seqs * heads
    if compute_units <= 0:
        fill: Number | float = 1.0
    elif isinstance(pairs, SCALARS) and isinstance(context, SCALARS):
        fill = wave_fill(pairs * _decode_splits(pairs, context, compute_units), compute_units)
    else:
        import numpy as np

        pairs_a, context_a = np.broadcast_arrays(np.asarray(pairs, dtype=float), np.asarray(context, dtype=float))
        splits = np.array([_decode_splits(float(p), float(x), compute_units) for p, x in zip(pairs_a, context_a)])
        fill = wave_fill(pairs_a * splits, compute_units)
    seconds: Number = c.floor_us * 1e-6 + c.per_seq_us * 1e-6 * seqs + kv_bytes / (bandwidth * c.efficiency * fill)
    return seconds


def prefill_attention_seconds(new_tokens: Number, causal_flops: Number, prefix_flops: Number, kv_bytes: Number, *,
                              peak_flops: float, bandwidth: float, c: PrefillAttentionConstants) -> Number:
    """One layer's prefill attention: the new tokens' causal FLOPs, their FLOPs over a cached prefix of ``kv_bytes``."""
    return (c.floor_us * 1e-6 + c.per_token_ns * 1e-9 * new_tokens + causal_flops / (peak_flops * c.efficiency)
            + prefix_flops / (peak_flops * c.prefix_efficiency) + kv_bytes / bandwidth)


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
    """``(latency^p + transfer^p)^(1/p)``: their sum at ``p = 1``, the larger as ``p`` grows, more below 1."""
    # typeshed types ``float ** float`` as Any (a negative base gives a complex); both are non-negative here
    blended: Number = latency + transfer if blend == 1.0 else (latency ** blend + transfer ** blend) ** (1.0 / blend)
    return blended
