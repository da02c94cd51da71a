"""Fit a device's step-model constants to measured operator timings, and score them.

Each operator class is fitted on its own (a least-squares fit of log time, so a 10 µs
kernel weighs as much as a 10 ms one) with the cost functions of
:mod:`hetsched.perf.costs`; classes without samples keep the base set's constants and
are reported as not measured. The residuals say how well the fitted curves follow the
measurements; a large median error means the constants should not be trusted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from hetsched.catalog.perf import (MIN_COLLECTIVE_BLEND, CollectiveConstants, DecodeAttentionConstants,
                                   GemmConstants, MemoryKernel, PerfConstants, PrefillAttentionConstants)
from hetsched.catalog.types import Device
from hetsched.errors import InputError
from hetsched.specs.dtypes import DType
from hetsched.perf.costs import (all_reduce_seconds, decode_attention_seconds, gemm_seconds, memory_kernel_seconds,
                                 prefill_attention_seconds, send_recv_seconds)

TRUSTED_MEDIAN_ERROR = 0.15
"""A class whose fitted median error exceeds this is flagged: its curve does not follow the data."""


class OpClass(StrEnum):
    """Operator classes with their own constants."""

    GEMM = "gemm"
    NORM = "norm"
    ROPE = "rope"
    ACTIVATION = "activation"
    RESIDUAL_ADD = "residual_add"
    EMBEDDING = "embedding"
    DECODE_ATTENTION = "decode_attention"
    PREFILL_ATTENTION = "prefill_attention"
    ALL_REDUCE = "all_reduce"
    SEND_RECV = "send_recv"


MEMORY_CLASSES = (OpClass.NORM, OpClass.ROPE, OpClass.ACTIVATION, OpClass.RESIDUAL_ADD, OpClass.EMBEDDING)


@dataclass(frozen=True)
class OpSample:
    """One measured launch: its class, its shape and its median seconds.

    Shape keys by class: gemm ``m, k, n, weight_bytes``; memory kernels ``bytes, width``;
    decode attention ``seqs, kv_bytes, heads, context`` (query heads per shard, tokens per sequence); prefill attention
    ``tokens, causal_flops, prefix_flops, kv_bytes``;
    collectives ``bytes, ranks``.
    """

    op: OpClass
    shape: dict[str, float]
    seconds: float
    label: str = ""


@dataclass(frozen=True)
class ErrorStats:
    """Relative errors of predictions against measurements, (predicted − measured) / measured."""

    count: int
    median_abs: float
    p90_abs: float
    median_signed: float

    @classmethod
    def of(cls, errors: Iterable[float]) -> ErrorStats:
        values = list(errors)
        if not values:
            return cls(0, 0.0, 0.0, 0.0)
        absolute = sorted(abs(e) for e in values)
        return cls(count=len(values), median_abs=statistics.median(absolute),
                   p90_abs=absolute[min(len(absolute) - 1, int(0.9 * len(absolute)))],
                   median_signed=statistics.median(values))


@dataclass(frozen=True)
class Calibration:
    """Fitted constants and how well they follow the measurements, per class."""

    constants: PerfConstants
    residuals: dict[str, ErrorStats]
    unmeasured: tuple[str, ...]

    @property
    def trusted(self) -> bool:
        return all(stats.median_abs <= TRUSTED_MEDIAN_ERROR for stats in self.residuals.values())

    @property
    def untrusted_classes(self) -> list[str]:
        return [name for name, stats in self.residuals.items() if stats.median_abs > TRUSTED_MEDIAN_ERROR]


def _column(samples: Sequence[OpSample], key: str) -> np.ndarray:
    return np.array([s.shape[key] for s in samples], dtype=float)


def predict(samples: Sequence[OpSample], constants: PerfConstants, device: Device) -> np.ndarray:
    """Predicted seconds for samples of one class."""
    if not samples:
        return np.zeros(0)
    op = samples[0].op
    if any(s.op is not op for s in samples):
        raise ValueError("predict takes samples of one class")
    peak, bandwidth = device.peak_tflops(DType.FP16) * 1e12, device.memory_tbs * 1e12
    link = device.accelerator.one_way_link_gbs * 1e9

    def col(key: str) -> np.ndarray:
        return _column(samples, key)

    if op is OpClass.GEMM:
        return gemm_seconds(col("m"), col("k"), col("n"), peak_flops=peak, bandwidth=bandwidth, c=constants.gemm,
                            weight_bytes=2.0, compute_units=device.compute_units)
    if op in MEMORY_CLASSES:
        return memory_kernel_seconds(col("bytes"), bandwidth=bandwidth, c=getattr(constants, op.value),
                                     width=col("width"), cycles_per_s=device.compute_unit_cycles_per_s)
    if op is OpClass.DECODE_ATTENTION:
        return decode_attention_seconds(col("seqs"), col("kv_bytes"), bandwidth=bandwidth,
                                        c=constants.decode_attention, heads=col("heads"), context=col("context"),
                                        compute_units=device.compute_units)
    if op is OpClass.PREFILL_ATTENTION:
        return prefill_attention_seconds(col("tokens"), col("causal_flops"), col("prefix_flops"), col("kv_bytes"),
                                         peak_flops=peak,
                                         bandwidth=bandwidth, c=constants.prefill_attention)
    if op is OpClass.ALL_REDUCE:
        ranks = col("ranks")
        out = np.zeros(len(samples))
        for r in np.unique(ranks):
            mask = ranks == r
            out[mask] = all_reduce_seconds(col("bytes")[mask], int(r), link_bytes_per_s=link, c=constants.collective)
        return out
    return send_recv_seconds(col("bytes"), link_bytes_per_s=link, c=constants.collective)


def errors(samples: Sequence[OpSample], constants: PerfConstants, device: Device) -> dict[OpClass, ErrorStats]:
    """Error statistics per class of ``constants`` on ``samples``."""
    out: dict[OpClass, ErrorStats] = {}
    for op, group in _by_class(samples).items():
        measured = np.array([s.seconds for s in group])
        out[op] = ErrorStats.of(((predict(group, constants, device) - measured) / measured).tolist())
    return out


def _by_class(samples: Iterable[OpSample]) -> dict[OpClass, list[OpSample]]:
    groups: dict[OpClass, list[OpSample]] = {}
    for s in samples:
        groups.setdefault(s.op, []).append(s)
    return groups


@dataclass(frozen=True)
class _Group:
    """How one class's constants map to a parameter vector, with bounds."""

    attr: str
    names: tuple[str, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]


_GROUPS: dict[OpClass, _Group] = {
    # Shares of the catalog's peaks may pass 1 where the catalog undersells a device (a CPU's bf16 units).
    # Shares of bandwidth pass 1 where the data stays in a cache (a CPU's small launches).
    OpClass.GEMM: _Group("gemm", ("floor_us", "compute_efficiency", "memory_efficiency", "blend"),
                         (0.0, 0.05, 0.05, 1.0), (200.0, 4.0, 20.0, 20.0)),
    OpClass.NORM: _Group("norm", ("floor_us", "efficiency", "per_row_ns", "blend"), (0.0, 0.02, 0.0, 1.0),
                         (200.0, 20.0, 100.0, 20.0)),
    **{op: _Group(op.value, ("floor_us", "efficiency", "blend"), (0.0, 0.02, 1.0), (200.0, 20.0, 20.0))
       for op in MEMORY_CLASSES if op is not OpClass.NORM},
    OpClass.DECODE_ATTENTION: _Group("decode_attention", ("floor_us", "per_seq_us", "efficiency"),
                                     (0.0, 0.0, 0.05), (200.0, 50.0, 20.0)),
    OpClass.PREFILL_ATTENTION: _Group("prefill_attention", ("floor_us", "per_token_ns", "efficiency",
                                                            "prefix_efficiency"),
                                      (0.0, 0.0, 0.01, 0.01), (200.0, 5000.0, 4.0, 4.0)),
    OpClass.ALL_REDUCE: _Group("collective", ("base_us", "step_us", "bus_efficiency", "blend"),
                               (0.0, 0.0, 0.02, MIN_COLLECTIVE_BLEND), (500.0, 200.0, 1.5, 20.0)),
    OpClass.SEND_RECV: _Group("collective", ("base_us", "step_us", "bus_efficiency", "blend"),
                              (0.0, 0.0, 0.02, MIN_COLLECTIVE_BLEND), (500.0, 200.0, 1.5, 20.0)),
}


_SIZE_KEYS: dict[OpClass, str] = {
    OpClass.GEMM: "m", OpClass.NORM: "bytes", OpClass.ROPE: "bytes", OpClass.ACTIVATION: "bytes",
    OpClass.RESIDUAL_ADD: "bytes", OpClass.EMBEDDING: "bytes", OpClass.DECODE_ATTENTION: "kv_bytes",
    OpClass.PREFILL_ATTENTION: "tokens", OpClass.ALL_REDUCE: "bytes", OpClass.SEND_RECV: "bytes",
}


def _size_weights(samples: Sequence[OpSample]) -> np.ndarray:
    """Weights that even out the half-octaves of size within each measured series (1/√count).

    Sweeps are often spaced linearly (every 8 tokens, every 8 KB): unweighted, the few small
    shapes a decode step runs would count for almost nothing against the many large ones.
    """
    keys = [(s.label, round(2 * np.log2(max(s.shape[_SIZE_KEYS[s.op]], 1.0)))) for s in samples]
    counts: dict[tuple[str, int], int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return np.array([1.0 / np.sqrt(counts[key]) for key in keys])


def _on_chip(group: _Group, current: MemoryKernel, base: PerfConstants, device: Device
             ) -> tuple[_Group, MemoryKernel]:
    """On a device with known SMs/CUs a memory-bound launch's own rate is its on-chip limit.

    The memory's share is then the one the weight-streaming GEMMs reach on the same device: one
    launch cannot tell the two limits apart, and the on-chip one is what carries over to a device
    whose memory is faster or slower than its units.
    """
    efficiency = base.gemm.memory_efficiency
    rate = current.efficiency * device.memory_tbs * 1e12 / device.compute_unit_cycles_per_s
    names = tuple("bytes_per_cycle" if n == "efficiency" else n for n in group.names)
    lower = tuple(0.001 if n == "bytes_per_cycle" else v for n, v in zip(names, group.lower, strict=True))
    upper = tuple(500.0 if n == "bytes_per_cycle" else v for n, v in zip(names, group.upper, strict=True))
    start = current.bytes_per_cycle or rate
    return _Group(group.attr, names, lower, upper), replace(current, efficiency=efficiency, bytes_per_cycle=start)


def _fit_group(samples: list[OpSample], base: PerfConstants, device: Device) -> PerfConstants:
    from scipy.optimize import least_squares  # SciPy loads for a fit, not for the calibrations a command reads

    group = _GROUPS[samples[0].op]
    current = getattr(base, group.attr)
    if samples[0].op in MEMORY_CLASSES and device.compute_unit_cycles_per_s > 0:
        group, current = _on_chip(group, current, base, device)
    names, lower, upper = list(group.names), list(group.lower), list(group.upper)
    start = np.clip([getattr(current, n) for n in names], lower, upper)
    measured = np.log([s.seconds for s in samples])
    weights = np.sqrt(_size_weights(samples))

    def with_params(params: np.ndarray) -> PerfConstants:
        return replace(base, **{group.attr: replace(current, **dict(zip(names, map(float, params), strict=True)))})

    residual: Callable[[np.ndarray], np.ndarray] = (
        lambda params: weights * (np.log(np.maximum(predict(samples, with_params(params), device), 1e-12)) - measured))
    result = least_squares(residual, start, bounds=(lower, upper), x_scale="jac")
    return with_params(np.round(result.x, 4))


def calibrate(samples: Sequence[OpSample], *, device: Device, base: PerfConstants, source: str) -> Calibration:
    """Constants for ``device`` fitted to ``samples``; unmeasured classes keep ``base``'s."""
    if not samples:
        raise InputError("no measured operators to calibrate from", field="profiles")
    bad = [s for s in samples if not (s.seconds > 0 and np.isfinite(s.seconds))]
    if bad:
        raise InputError(f"a measured time must be a positive number, got {bad[0].seconds} ({bad[0].label})",
                         field="profiles")
    groups = _by_class(samples)
    if OpClass.ALL_REDUCE in groups:
        groups.pop(OpClass.SEND_RECV, None)  # tensor parallelism runs all-reduces: fit those
    constants = base
    for op in sorted(groups, key=lambda op: op is not OpClass.GEMM):  # memory kernels take the GEMMs' memory share
        constants = _fit_group(groups[op], constants, device)
    constants = constants.with_source(source)
    fitted = [s for g in groups.values() for s in g]
    residuals = {str(op): stats for op, stats in errors(fitted, constants, device).items()}
    measured_attrs = {_GROUPS[op].attr for op in groups}
    unmeasured = tuple(g.attr for op, g in _GROUPS.items() if g.attr not in measured_attrs and op is not OpClass.SEND_RECV)
    return Calibration(constants=constants, residuals=residuals, unmeasured=tuple(dict.fromkeys(unmeasured)))
