"""Roofline profiles: catalog peaks × efficiencies, sampled into the Profile format.

For hardware not at hand. The efficiencies can be calibrated from a measured
kernel profile of the same vendor family (:func:`calibrate_efficiency`):
achieved GEMM and prefill-attention FLOP/s and decode-attention bandwidth at
the largest measured shapes, as shares of the measured device's catalog peaks.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace

from hetsched.catalog import load_catalog
from hetsched.catalog.host import read_host
from hetsched.catalog.types import Device
from hetsched.errors import InputError
from hetsched.perf.roofline import Efficiency, RooflineModel
from hetsched.perf.step import StepShape
from hetsched.profiler.plan import Kernel, powers
from hetsched.profiler.profile import (Measurement, OpTable, Profile, ProfileSource, Provenance, Term, Variable,
                                       hetsched_version)
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch

_TOKEN_OPS = ("attention projections", "mlp", "moe", "linear attention", "elementwise", "all-reduce")


def _op_seconds(model: RooflineModel, shape: StepShape, name: str) -> float:
    return sum(op.seconds for op in model.breakdown(shape) if op.op == name)


def _table(op: str, variable: Variable, points: list[tuple[tuple[float, ...], float]]) -> OpTable:
    return OpTable(op=op, kernel="roofline", variable=variable, dims={},
                   points=tuple(Measurement(coords, s, s) for coords, s in points if s > 0))


def roofline_profile(model: ModelArch, device: Device, *, tp: int = 1, engine: EngineConfig = EngineConfig(),
                     efficiency: Efficiency = Efficiency(), calibrated_from: str = "") -> Profile:
    """The roofline model of ``model`` on ``tp`` × ``device``, sampled over the engine's step shapes."""
    roofline = RooflineModel(model, device, tp=tp, engine=replace(engine, step_overhead_ms=0.0), efficiency=efficiency)
    tokens = powers(1, engine.max_num_batched_tokens, 2)
    tables, terms = [], []
    for name in _TOKEN_OPS:
        table = _table(name, Variable.TOKENS, [((float(m),), _op_seconds(roofline, StepShape(prefill_tokens=m), name))
                                               for m in tokens])
        if table.points:
            tables.append(table)
            terms.append(Term(name=name, table=name, multiplier=1.0))
    tables.append(_table("lm head", Variable.SAMPLED, [
        ((float(s),), _op_seconds(roofline, StepShape(decode_seqs=s, decode_kv_tokens=s), "lm head"))
        for s in powers(1, engine.max_num_seqs, 2)]))
    prefill = []
    for new in powers(16, engine.max_num_batched_tokens, 2):
        for cached in (0, new, 4 * new):
            shape = StepShape.build(prefill=[(new, cached)])
            prefill.append(((shape.prefill_attention_pairs,), _op_seconds(roofline, shape, "attention prefill")))
    tables.append(_table("attention prefill", Variable.PREFILL_PAIRS, prefill))
    tables.append(_table("attention decode", Variable.DECODE, [
        ((float(b), float(c)), _op_seconds(roofline, StepShape.build(decode_contexts=[c] * b), "attention decode"))
        for b in powers(1, engine.max_num_seqs, 4) for c in powers(16, model.max_context, 4)]))
    terms += [Term("lm head", "lm head", 1.0), Term("attention prefill", "attention prefill", 1.0),
              Term("attention decode", "attention decode", 1.0)]
    provenance = Provenance.made_here(device={"catalog": device.id, "name": device.accelerator.name,
                                              "efficiency": asdict(efficiency), "calibrated_from": calibrated_from},
                                      versions={"hetsched": hetsched_version()})
    return Profile(model=model.name, accelerator=device.id, source=ProfileSource.ROOFLINE,
                   backend=str(device.accelerator.vendor), tables=tuple(tables), terms=tuple(terms),
                   provenance=provenance, sweep={"max_tokens": engine.max_num_batched_tokens,
                                                 "max_seqs": engine.max_num_seqs},
                   tp=tp, dtype=str(model.dtype), step_overhead_s=engine.step_overhead_ms / 1e3)


def measured_device(profile: Profile) -> Device:
    """The catalog device a measured profile ran on (the host CPU for ``cpu``)."""
    return load_catalog().device(profile.accelerator, host=read_host())


def calibrate_efficiency(measured: Profile, *, target: Device, base: Efficiency = Efficiency()) -> Efficiency:
    """Efficiencies achieved in ``measured`` (a kernel profile), for a roofline of ``target`` of the same vendor."""
    if measured.source is not ProfileSource.KERNEL:
        raise InputError(f"calibration needs a kernel profile, got a {measured.source} profile",
                         field="--calibrate-from")
    device = measured_device(measured)
    if device.accelerator.vendor is not target.accelerator.vendor:
        raise InputError(f"profile is from {device.accelerator.vendor} ({measured.accelerator}); {target.id} is "
                         f"{target.accelerator.vendor}: calibrate from the same vendor family",
                         field="--calibrate-from")
    dtype = DType(measured.dtype) if measured.dtype in {d.value for d in DType} else DType.BF16
    peak = device.peak_tflops(dtype) * 1e12
    bandwidth = device.memory_tbs * 1e12
    gemm, attention, memory = [], [], []
    for table in measured.tables:
        top = max(table.points, key=lambda p: p.coords)
        d = table.dims
        if table.kernel == Kernel.GEMM and table.op != "lm_head":
            gemm.append(2.0 * top.coords[0] * d["k"] * d["n"] / top.median_s / peak)
        elif table.kernel == Kernel.PREFILL_ATTENTION:
            attention.append(4.0 * d["heads"] * d["head_dim"] * top.coords[0] / top.median_s / peak)
        elif table.kernel == Kernel.DECODE_ATTENTION:
            batch, context = top.coords
            memory.append(batch * context * 2 * d["kv_heads"] * d["head_dim"] * 2 / top.median_s / bandwidth)

    def clamp(values: list[float], default: float) -> float:
        return min(1.0, max(0.01, statistics.median(values))) if values else default

    return replace(base, gemm=clamp(gemm, base.gemm), attention=clamp(attention, base.attention),
                   memory=clamp(memory, base.memory))
