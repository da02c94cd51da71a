"""Roofline profiles: catalog peaks × efficiencies, sampled into the Profile format.

For hardware not at hand. The step-model constants can be fitted to a measured
kernel profile of the same vendor family (:func:`constants_from_profile`): floors
and shares of the measured device's catalog peaks, applied to the target's peaks.
"""

from __future__ import annotations

from dataclasses import replace

from hetsched.catalog import load_catalog
from hetsched.catalog.host import read_host
from hetsched.catalog.perf import PerfConstants
from hetsched.catalog.types import Device
from hetsched.errors import InputError
from hetsched.perf.calibrate import calibrate
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.profiler.calibration import profile_samples
from hetsched.profiler.plan import powers
from hetsched.profiler.profile import (Measurement, OpTable, Profile, ProfileSource, Provenance, Term, Variable,
                                       hetsched_version)
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch

_TOKEN_OPS = ("attention projections", "mlp", "moe", "linear attention", "elementwise", "all-reduce")


def _op_seconds(model: RooflineModel, shape: StepShape, name: str) -> float:
    return sum(op.seconds for op in model.breakdown(shape) if op.op == name)


def _table(op: str, variable: Variable, points: list[tuple[tuple[float, ...], float]]) -> OpTable:
    return OpTable(op=op, kernel="roofline", variable=variable, dims={},
                   points=tuple(Measurement(coords, s, s) for coords, s in points if s > 0))


def roofline_profile(model: ModelArch, device: Device, *, tp: int = 1, engine: EngineConfig = EngineConfig(),
                     constants: PerfConstants | None = None, calibrated_from: str = "") -> Profile:
    """The analytic model of ``model`` on ``tp`` × ``device``, sampled over the engine's step shapes."""
    roofline = RooflineModel(model, device, tp=tp, engine=replace(engine, step_overhead_ms=0.0), constants=constants)
    overhead_s = RooflineModel(model, device, tp=tp, engine=engine, constants=constants).step_overhead_s
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
    prefill: list[tuple[tuple[float, ...], float]] = []
    for new in powers(16, 4 * engine.max_num_batched_tokens, 2):  # fresh prompts: pairs alone name the shape
        shape = StepShape.build(prefill=[(new, 0)])
        prefill.append(((shape.prefill_attention_pairs,), _op_seconds(roofline, shape, "attention prefill")))
    tables.append(_table("attention prefill", Variable.PREFILL_PAIRS, prefill))
    tables.append(_table("attention decode", Variable.DECODE, [
        ((float(b), float(c)), _op_seconds(roofline, StepShape.build(decode_contexts=[c] * b), "attention decode"))
        for b in powers(1, engine.max_num_seqs, 4) for c in powers(16, model.max_context, 4)]))
    terms += [Term("lm head", "lm head", 1.0), Term("attention prefill", "attention prefill", 1.0),
              Term("attention decode", "attention decode", 1.0)]
    provenance = Provenance.made_here(device={"catalog": device.id, "name": device.accelerator.name,
                                              "constants": roofline.perf.to_dict(), "calibrated_from": calibrated_from},
                                      versions={"hetsched": hetsched_version()})
    return Profile(model=model.name, accelerator=device.id, source=ProfileSource.ROOFLINE,
                   backend=str(device.accelerator.vendor), tables=tuple(tables), terms=tuple(terms),
                   provenance=provenance, sweep={"max_tokens": engine.max_num_batched_tokens,
                                                 "max_seqs": engine.max_num_seqs},
                   tp=tp, dtype=str(model.dtype), step_overhead_s=overhead_s)


def measured_device(profile: Profile) -> Device:
    """The catalog device a measured profile ran on: for ``cpu``, this host with the cores its sweep's threads used."""
    host = read_host()
    threads = int(profile.sweep.get("cpu_threads") or 0)
    if profile.accelerator == "cpu" and 0 < threads < host.cores:
        host = replace(host, cores=threads)
    return load_catalog().device(profile.accelerator, host=host)


def constants_from_profile(measured: Profile, *, target: Device) -> PerfConstants:
    """Step-model constants fitted to ``measured`` (a kernel profile), for ``target`` of the same vendor."""
    if measured.source is not ProfileSource.KERNEL:
        raise InputError(f"calibration needs a kernel profile, got a {measured.source} profile",
                         field="--calibrate-from")
    device = measured_device(measured)
    if device.accelerator.vendor is not target.accelerator.vendor:
        raise InputError(f"profile is from {device.accelerator.vendor} ({measured.accelerator}); {target.id} is "
                         f"{target.accelerator.vendor}: calibrate from the same vendor family",
                         field="--calibrate-from")
    base = target.accelerator.perf
    assert base is not None
    result = calibrate(profile_samples([measured]), device=device, base=base,
                       source=f"fitted to kernel profile {measured.digest[:12]} of {measured.model} on "
                              f"{measured.accelerator}")
    return result.constants
