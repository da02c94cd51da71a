"""Measured profiles as calibration samples: each timed kernel point with the shape the cost model reads.

Kernel profiles (hetsched's own sweeps and imported Vidur data) name each table's kernel
and its per-GPU dimensions; this turns their points into :class:`OpSample`s. Kernels the
analytic model has no class for (KV-cache writes, fused MoE, MLA decode) are left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hetsched.errors import InputError
from hetsched.perf.calibrate import OpClass, OpSample
from hetsched.perf.step import causal_pairs
from hetsched.profiler.plan import Kernel
from hetsched.profiler.profile import OpTable, Profile, ProfileSource

_BYTES = 2.0  # fp16/bf16 activations and KV entries


def _memory(op: OpClass, table: OpTable, m: float) -> dict[str, float]:
    d = table.dims
    if op is OpClass.NORM:
        return {"bytes": 2 * _BYTES * m * d["hidden"] + _BYTES * d["hidden"], "width": d["hidden"]}
    if op is OpClass.ROPE:
        return {"bytes": 2 * _BYTES * m * (d["heads"] + d["kv_heads"]) * d["head_dim"], "width": 0.0}
    if op is OpClass.ACTIVATION:
        passes = 3 if d.get("gated", 1) else 2
        return {"bytes": passes * _BYTES * m * d["inter"], "width": 0.0}
    if op is OpClass.RESIDUAL_ADD:
        return {"bytes": 3 * _BYTES * m * d["hidden"], "width": 0.0}
    return {"bytes": 2 * _BYTES * m * d["hidden"], "width": 0.0}


_MEMORY_KERNELS = {Kernel.RMSNORM: OpClass.NORM, Kernel.ROPE: OpClass.ROPE, Kernel.SILU_MUL: OpClass.ACTIVATION,
                   Kernel.ADD: OpClass.RESIDUAL_ADD, Kernel.EMBEDDING: OpClass.EMBEDDING}


def table_samples(profile: Profile, table: OpTable) -> list[OpSample]:
    """The calibration samples of one table (empty for kernels the model has no class for)."""
    label = f"{profile.model} tp{profile.tp} {table.op}"
    d = table.dims
    samples: list[OpSample] = []
    try:
        kernel = Kernel(table.kernel)
    except ValueError:
        return []
    prefill_points = profile.sweep.get("prefill_points") if isinstance(profile.sweep, dict) else None
    for index, point in enumerate(table.points):
        x = point.coords[0]
        if kernel is Kernel.GEMM:
            samples.append(OpSample(OpClass.GEMM, {"m": x, "k": d["k"], "n": d["n"]}, point.median_s, label))
        elif kernel in _MEMORY_KERNELS:
            op = _MEMORY_KERNELS[kernel]  # a point timing several equal launches at once gives each its share
            samples.append(OpSample(op, _memory(op, table, x), point.median_s / d.get("launches", 1), label))
        elif kernel is Kernel.DECODE_ATTENTION:
            batch, context = point.coords
            kv = batch * context * 2 * d["kv_heads"] * d["head_dim"] * _BYTES
            samples.append(OpSample(OpClass.DECODE_ATTENTION, {"seqs": batch, "kv_bytes": kv, "heads": d["heads"],
                                                                "context": context},
                                    point.median_s, label))
        elif kernel is Kernel.PREFILL_ATTENTION:
            if prefill_points and len(prefill_points) == len(table.points):
                new, cached = map(float, prefill_points[index])
            else:  # hetsched's sweeps keep pairs only; a fresh prompt has new ≈ √(2·pairs)
                new, cached = math.sqrt(2 * x), 0.0
            flops_per_pair = 4.0 * d["heads"] * d["head_dim"]
            causal = min(x, causal_pairs(new))
            samples.append(OpSample(OpClass.PREFILL_ATTENTION, {
                "tokens": new, "causal_flops": flops_per_pair * causal, "prefix_flops": flops_per_pair * (x - causal),
                "kv_bytes": cached * 2 * d["kv_heads"] * d["head_dim"] * _BYTES}, point.median_s, label))
        elif kernel is Kernel.ALL_REDUCE:
            samples.append(OpSample(OpClass.ALL_REDUCE, {"bytes": x * d["bytes_per_token"], "ranks": d["workers"]},
                                    point.median_s, label))
    return samples


def profile_samples(profiles: Iterable[Profile]) -> list[OpSample]:
    """Every calibration sample of measured kernel profiles; other sources are refused."""
    samples: list[OpSample] = []
    for profile in profiles:
        if profile.source is not ProfileSource.KERNEL:
            raise InputError(f"calibration needs measured kernel profiles; {profile.model} on {profile.accelerator} "
                             f"is a {profile.source} profile", field="profiles")
        for table in profile.tables:
            samples.extend(table_samples(profile, table))
    return samples
