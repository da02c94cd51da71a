"""The driver: plan a sweep from the model, run it in worker processes, fit, and return a Profile."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from hetsched.backends.base import BackendKind
from hetsched.catalog import load_catalog
from hetsched.catalog.loader import load_perf_table
from hetsched.errors import InfeasibleError
from hetsched.profiler.plan import SweepPlan, SweepSettings, plan_sweep
from hetsched.profiler.profile import Measurement, OpTable, PointFailure, Profile, ProfileSource, Provenance
from hetsched.profiler.worker import PointResult, RunnerFactory, SweepOutcome, import_and_call, run_sweep
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch


def accelerator_id(device: dict[str, Any]) -> str:
    """The catalog id of a measured device (``cpu``, ``h100-sxm``, ``h100-sxm:3g.40gb``), else its product label."""
    backend = device.get("backend")
    if backend == BackendKind.CPU:
        return "cpu"
    label = "-".join(str(device.get("name", "unknown")).split())
    acc = load_catalog().by_product(label) or load_catalog().by_product(label.removeprefix("NVIDIA-"))
    base = acc.id if acc is not None else label.lower()
    instances: Sequence[dict[str, Any]] = device.get("mig_instances") or ()
    partition = (device.get("extra") or {}).get("partition", "")
    if device.get("mig_enabled") and len(instances) == 1:
        return f"{base}:{instances[0]['profile']}"
    if partition and not partition.startswith("spx"):
        return f"{base}:{partition}"
    return base


def step_overhead_ms(accelerator: str, backend: BackendKind, engine: EngineConfig) -> float:
    """The engine's stated step overhead, else the catalog's for the device (its vendor's default when unknown)."""
    if engine.step_overhead_ms is not None:
        return engine.step_overhead_ms
    vendor = {BackendKind.CPU: "cpu", BackendKind.ROCM: "amd", BackendKind.NVIDIA: "nvidia"}[backend]
    return load_perf_table().for_accelerator(accelerator.partition(":")[0], vendor).step_overhead_ms


def build_profile(model: ModelArch, plan: SweepPlan, outcome: SweepOutcome, *, backend: BackendKind,
                  engine: EngineConfig, started: float) -> Profile:
    """Tables from the timed points; every operator needs at least one timing."""
    by_op: dict[str, list[PointResult]] = {}
    for result in outcome.results:
        by_op.setdefault(result.point.op, []).append(result)
    tables, missing = [], []
    for op in plan.ops:
        timed = [r for r in by_op.get(op.op, []) if r.timing is not None]
        if not timed:
            errors = [r.error for r in by_op.get(op.op, []) if r.error]
            missing.append(f"{op.op} ({errors[0] if errors else 'no points'})")
            continue
        tables.append(OpTable(op=op.op, kernel=str(op.kernel), variable=op.variable, dims=dict(op.dims),
                              points=tuple(Measurement(tuple(float(c) for c in r.point.coords), r.timing.median_s,
                                                       r.timing.p90_s) for r in timed if r.timing is not None)))
    if missing:
        raise InfeasibleError("no timing for " + "; ".join(missing) + " — the profile would be incomplete")
    device = outcome.device.get("device", {})
    provenance = Provenance.made_here(device=device, driver=str(device.get("driver", "")),
                                      versions=dict(outcome.device.get("versions", {})),
                                      duration_s=round(time.time() - started, 2))
    failures = tuple(PointFailure(op=r.point.op, params=dict(r.point.params), reason=r.error or "")
                     for r in outcome.results if r.timing is None)
    accelerator = accelerator_id(device)
    return Profile(
        model=model.name, accelerator=accelerator, source=ProfileSource.KERNEL, backend=str(backend),
        tables=tuple(tables), terms=plan.terms, provenance=provenance,
        sweep={**plan.settings.as_dict(), "points": len(plan.points), "worker_restarts": outcome.restarts},
        dtype=plan.settings.dtype, step_overhead_s=step_overhead_ms(accelerator, backend, engine) / 1e3, failures=failures,
    )


def default_factory(backend: BackendKind, device: int, settings: SweepSettings) -> RunnerFactory:
    """The kernel runner, imported in the worker only: the driver's process never loads torch."""
    return functools.partial(import_and_call, "hetsched.profiler.runner", "kernel_runner", backend, device, settings)


def profile_kernels(model: ModelArch, *, backend: BackendKind, device: int = 0, engine: EngineConfig = EngineConfig(),
                    quick: bool = False, point_timeout_s: float = 120.0, kv_budget_gb: float = 1.0,
                    host_clock: str = "wall", cpu_threads: int = 0, factory: RunnerFactory | None = None,
                    on_plan: Callable[[SweepPlan], None] | None = None,
                    on_device: Callable[[dict[str, Any]], None] | None = None,
                    on_result: Callable[[PointResult], None] | None = None) -> Profile:
    """Time ``model``'s operators on ``backend`` and return the measured Profile.

    ``factory`` builds the point runner inside the worker (default: the kernel
    runner for ``backend``/``device``).
    """
    started = time.time()
    settings = SweepSettings.for_engine(model, engine, quick=quick, kv_budget_gb=kv_budget_gb,
                                        point_timeout_s=point_timeout_s, host_clock=host_clock,
                                        cpu_threads=cpu_threads)
    plan = plan_sweep(model, settings)
    if on_plan is not None:
        on_plan(plan)
    outcome = run_sweep(plan.points, factory or default_factory(backend, device, settings),
                        point_timeout_s=point_timeout_s, on_result=on_result, on_device=on_device)
    return build_profile(model, plan, outcome, backend=backend, engine=engine, started=started)
