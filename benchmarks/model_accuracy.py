"""Accuracy of the analytic step model against real A100/A40 measurements, on models it was not fitted to.

    .venv/bin/python benchmarks/model_accuracy.py [--data data/measurements/vidur] [--export-yaml] [--write]
    .venv/bin/python benchmarks/model_accuracy.py --quick    # the A100 alone, one capacity on one seed: a smoke run

Reads Vidur's public operator, attention and collective timings (``data/measurements/vidur``)
through ``hetsched profiles import-vidur``'s parser, fits the A100's constants with the same
``calibrate`` that ``hetsched calibrate`` runs on the operators of four models (Llama-2-7B,
Llama-3-70B, CodeLlama-34B, Qwen-72B), on every other attention point and every other
collective size, and scores the fitted model on the rest: four models it never saw
(Llama-3-8B, Llama-2-70B, InternLM-20B, phi-2), the other attention points and sizes. The H100 and the A40 are
scored twice: with the A100's set on their own catalog peaks (what a device nobody measured gets) and
with a set fitted on their own calibration models.
Per operator class: median and P90 absolute error and the median signed error
((predicted − measured) / measured: negative is too fast). Whole steps sum the measured
operators of a held-out model (projections, MLP, norms, rope, activation, adds, embedding,
all-reduce at TP ≥ 2: the median of the rows within √2 of the payload, the collectives being noisy)
over decode batches 1–256 and prompts 128–16k, against the model's same operators. Cross-device: the A100 set applied to the A40's catalog peaks (what a
device nobody measured gets) scored on every A40 operator. Capacity: the simulator's SLO
capacity of Llama-3-8B on an A100 with the calibrated model beside the capacity with the
measured Llama-3-8B operators (attention and LM head, which Vidur did not time for it,
from the calibrated model in both). ``--export-yaml`` prints the constants fitted to all
the data of each device, the ``devices`` entries of ``hetsched/catalog/data/perf_constants.yaml``.
Bars (issue targets): operators median ≤ 10 %, P90 ≤ 25 % per class; whole step median ≤ 5 %
at TP 1, ≤ 10 % at TP ≥ 2; capacity within 10 %; cross-device median ≤ 15 %.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import report
import yaml

from hetsched.catalog import Device, load_catalog
from hetsched.catalog.perf import PerfConstants
from hetsched.perf.calibrate import Calibration, ErrorStats, OpClass, OpSample, calibrate, predict
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import OpTime, StepShape
from hetsched.profiler.calibration import table_samples
from hetsched.profiler.profile import Profile
from hetsched.profiler.vidur import VidurFile, profiles_from_vidur
from hetsched.sim.capacity import DEFAULT_SEEDS, find_capacity
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, Workload

CALIBRATION_MODELS = {"llama-2-7b", "llama-3.1-70b", "codellama-34b", "qwen-72b"}
DEVICES = {"a100": "a100-80gb", "a40": "a40"}
MEASURED_OPS = ("attention projections", "mlp", "elementwise", "embedding", "all-reduce")
CAPACITY_CASES = (
    ("chat 512→256, P99 TTFT 500 ms / TPOT 50 ms",
     Workload(input_len=LengthDistribution.fixed(512), output_len=LengthDistribution.fixed(256)),
     SLO(ttft_ms=500, tpot_ms=50)),
    ("long 2048→128, P99 TTFT 1 s / TPOT 40 ms",
     Workload(input_len=LengthDistribution.fixed(2048), output_len=LengthDistribution.fixed(128)),
     SLO(ttft_ms=1000, tpot_ms=40)))


def read_device(root: Path, device: str) -> list[Profile]:
    files = [VidurFile(name=str(p.relative_to(root)), text=p.read_text()) for p in sorted((root / device).rglob("*.csv"))]
    return profiles_from_vidur(files)


@dataclass(frozen=True)
class Labelled:
    """A sample with the class it is scored under in the report."""

    sample: OpSample
    report: str
    model: str
    tp: int


def report_class(profile: Profile, table_op: str, sample: OpSample) -> str:
    if sample.op is OpClass.GEMM:
        size = "decode sizes (1–256)" if sample.shape["m"] <= 256 else "prefill sizes (>256)"
        if table_op in ("qkv_proj", "o_proj"):
            return f"QKV+O projections, {size}"
        return f"MLP GEMMs, {size}"
    if sample.op is OpClass.EMBEDDING:
        return "embedding"
    if sample.op in (OpClass.NORM, OpClass.ROPE, OpClass.ACTIVATION, OpClass.RESIDUAL_ADD):
        return "norms + rope + activation + residual add"
    if sample.op is OpClass.ALL_REDUCE:
        return f"all-reduce, TP {int(sample.shape['ranks'])}"
    if sample.op is OpClass.DECODE_ATTENTION:
        return "attention decode, batch ≤ 8" if sample.shape["seqs"] <= 8 else "attention decode, batch > 8"
    return "attention prefill"


def labelled(profiles: Sequence[Profile]) -> list[Labelled]:
    """Every sample once: each (model, TP) profile carries the same collective rows, which count once."""
    out: list[Labelled] = []
    collectives: set[tuple[tuple[str, float], ...]] = set()
    for profile in profiles:
        for table in profile.tables:
            for sample in table_samples(profile, table):
                if sample.op is OpClass.GEMM and sample.shape["m"] > 16384:
                    continue  # the bars speak of prompts up to 16k tokens
                if sample.op is OpClass.ALL_REDUCE:
                    key = tuple(sorted(sample.shape.items()))
                    if key in collectives:
                        continue
                    collectives.add(key)
                out.append(Labelled(sample, report_class(profile, table.op, sample), profile.model, profile.tp))
    return out


def split(samples: list[Labelled]) -> tuple[list[Labelled], list[Labelled]]:
    """Operators: by model; attention and collectives (one model, one network): every other point."""
    train, test = [], []
    counters: dict[str, int] = {}
    for item in samples:
        s = item.sample
        if s.op in (OpClass.DECODE_ATTENTION, OpClass.PREFILL_ATTENTION, OpClass.ALL_REDUCE):
            index = counters.get(item.report, 0)
            counters[item.report] = index + 1
            (train if index % 2 == 0 else test).append(item)
        else:
            (train if item.model in CALIBRATION_MODELS else test).append(item)
    return train, test


def score(items: Sequence[Labelled], constants: PerfConstants, device: Device) -> dict[str, ErrorStats]:
    by_class: dict[str, list[Labelled]] = {}
    for item in items:
        by_class.setdefault(item.report, []).append(item)
    out: dict[str, ErrorStats] = {}
    for name in sorted(by_class):
        group = by_class[name]
        errors: list[float] = []
        for op in {i.sample.op for i in group}:
            samples = [i.sample for i in group if i.sample.op is op]
            measured = np.array([s.seconds for s in samples])
            errors += ((predict(samples, constants, device) - measured) / measured).tolist()
        out[name] = ErrorStats.of(errors)
    return out


def print_stats(title: str, stats: dict[str, ErrorStats]) -> None:
    print(f"\n{title}")
    print(f"  {'class':48} {'points':>6} {'median':>8} {'P90':>8} {'sign':>8}")
    for name, s in stats.items():
        print(f"  {name:48} {s.count:6d} {s.median_abs:8.1%} {s.p90_abs:8.1%} {s.median_signed:+8.1%}")


def measured_ops_seconds(parts: Sequence[OpTime]) -> float:
    return sum(p.seconds for p in parts if p.op in MEASURED_OPS)


def measured_step_seconds(profile: Profile, shape: StepShape) -> float:
    """The profile's operators at ``shape``, its all-reduces at the median of the rows near the payload.

    A profile's curves are the lower envelope of their points, which on Vidur's noisy small-message
    collectives (15–62 µs at neighbouring sizes) is the luckiest row, not a typical one.
    """
    parts = profile.breakdown(shape)
    seconds = sum(p.seconds for p in parts if p.op in MEASURED_OPS and p.op != "all-reduce")
    if any(p.op == "all-reduce" for p in parts):
        points = profile.table("all_reduce").points
        near = [p.median_s for p in points if shape.tokens / 2 ** 0.5 <= p.coords[0] <= shape.tokens * 2 ** 0.5]
        typical = float(np.median(near)) if near else min(points, key=lambda p: abs(p.coords[0] - shape.tokens)).median_s
        seconds += sum(t.multiplier for t in profile.terms if t.table == "all_reduce") * typical
    return seconds


def whole_steps(profiles: Sequence[Profile], device: Device, constants: PerfConstants) -> dict[str, ErrorStats]:
    """Measured operators of each held-out (model, TP) summed per step, against the model's same operators."""
    errors: dict[str, list[float]] = {}
    shapes = ([("decode", StepShape.build(decode_contexts=[1024] * b)) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
              + [("prefill", StepShape.build(prefill=[(n, 0)])) for n in (128, 512, 2048, 8192, 16384)])
    for profile in profiles:
        if profile.model in CALIBRATION_MODELS:
            continue
        has_all_reduce = any(t.op == "all_reduce" for t in profile.tables)
        if profile.tp > 1 and not has_all_reduce:
            continue
        model = RooflineModel(load_model(profile.model), device, tp=profile.tp, constants=constants)
        for phase, shape in shapes:
            measured = measured_step_seconds(profile, shape)
            predicted = measured_ops_seconds(model.breakdown(shape))
            key = f"whole {phase} step, TP {'1' if profile.tp == 1 else '≥ 2'}"
            errors.setdefault(key, []).append((predicted - measured) / measured)
    return {k: ErrorStats.of(v) for k, v in sorted(errors.items())}


@dataclass(frozen=True)
class MeasuredStep:
    """A measured profile's operators, with what it lacks (attention, LM head, overhead) from ``model``."""

    profile: Profile
    model: RooflineModel

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        measured = [p for p in self.profile.breakdown(shape) if p.op in MEASURED_OPS]
        return measured + [p for p in self.model.breakdown(shape) if p.op not in MEASURED_OPS]

    def step_time(self, shape: StepShape) -> float:
        return sum(p.seconds for p in self.breakdown(shape))


def capacity_check(profiles: Sequence[Profile], device: Device, constants: PerfConstants, *,
                   cases: Sequence[tuple[str, Workload, SLO]] = CAPACITY_CASES,
                   seeds: Sequence[int] = DEFAULT_SEEDS) -> None:
    arch = load_model("llama-3.1-8b")
    profile = next(p for p in profiles if p.model == "llama-3.1-8b" and p.tp == 1)
    engine = EngineConfig()
    calibrated = RooflineModel(arch, device, engine=engine, constants=constants)
    print("\nSLO capacity of Llama-3-8B on one A100 80GB (simulator, same engine settings and seeds)")
    for name, workload, slo in cases:
        found = {}
        for label, step in (("calibrated model", calibrated), ("measured operators", MeasuredStep(profile, calibrated))):
            found[label] = find_capacity(arch, device, workload=workload, slo=slo, engine=engine,
                                         step_model=step, seeds=seeds).requests_per_s
        ratio = found["calibrated model"] / found["measured operators"]
        print(f"  {name}: calibrated {found['calibrated model']:.2f} req/s, measured operators "
              f"{found['measured operators']:.2f} req/s, ratio {ratio:.3f}")


def fit(items: Sequence[Labelled], device: Device, source: str) -> Calibration:
    base = device.accelerator.perf
    assert base is not None
    return calibrate([i.sample for i in items], device=device, base=base, source=source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/measurements/vidur"))
    parser.add_argument("--export-yaml", action="store_true", help="print constants fitted to all data per device")
    parser.add_argument("--quick", action="store_true",
                        help="the A100 alone (no other device), the chat capacity on one seed: a smoke run")
    args = parser.parse_args()
    catalog = load_catalog()
    started = time.perf_counter()
    a100 = Device.whole(catalog.get("a100-80gb"))
    a100_profiles = read_device(args.data, "a100")
    samples = labelled(a100_profiles)
    train, test = split(samples)
    fitted = fit(train, a100, "A100 fit on the calibration models")
    print(f"A100: {len(train)} calibration points ({', '.join(sorted(CALIBRATION_MODELS))}; every other "
          f"attention point and collective size), {len(test)} scored points")
    print_stats("A100, calibration points (fit)", score(train, fitted.constants, a100))
    print_stats("A100, held-out models and points", score(test, fitted.constants, a100))
    print_stats("A100, whole steps of held-out models (measured operators summed)",
                whole_steps(a100_profiles, a100, fitted.constants))

    others: dict[str, tuple[Device, list[Labelled]]] = {}
    for vidur, acc in () if args.quick else (("h100", "h100-sxm"), ("a40", "a40")):
        device = Device.whole(catalog.get(acc))
        device_profiles = read_device(args.data, vidur)
        device_samples = labelled(device_profiles)
        others[acc] = (device, device_samples)
        name = device.accelerator.name
        print_stats(f"{name} with the A100 set on its peaks (cross-device, none of its data used)",
                    score(device_samples, fitted.constants, device))
        own_train, own_test = split(device_samples)
        own = fit(own_train, device, f"{name} fit on the calibration models")
        print_stats(f"{name} calibrated on its own calibration models, held-out models",
                    score(own_test, own.constants, device))
        if any(p.tp > 1 and any(t.op == "all_reduce" for t in p.tables) for p in device_profiles):
            print_stats(f"{name}, whole steps of held-out models", whole_steps(device_profiles, device, own.constants))

    if args.quick:
        capacity_check(a100_profiles, a100, fitted.constants, cases=CAPACITY_CASES[:1], seeds=(0,))
    else:
        capacity_check(a100_profiles, a100, fitted.constants)
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.export_yaml:
        out: dict[str, object] = {}
        for acc, device, items in (("a100-80gb", a100, samples), *((a, d, i) for a, (d, i) in others.items())):
            source = (f"fitted to Vidur's {device.accelerator.name} operator timings (github.com/microsoft/vidur "
                      "@7d47513, MIT) by benchmarks/model_accuracy.py --export-yaml")
            out[acc] = fit(items, device, source).constants.to_dict()
        print(yaml.safe_dump({"devices": out}, sort_keys=False, default_flow_style=None, width=120))


if __name__ == "__main__":
    report.main(main, section="model_accuracy")
