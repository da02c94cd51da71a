"""Capacities cached in the store, keyed by everything that changes the answer.

The key is a SHA-256 over (step-model identity, step-model correction, workload,
SLO, engine settings, dtypes, seeds, bucket edges, code digest). A step model's
identity is its ``digest`` attribute when it has one (measured profiles), else
the repr of a frozen dataclass (the roofline: model, device, TP, dtypes,
efficiencies); a corrected one's is its base's with the correction's four
numbers, so a capacity searched under a correction never answers for the bare
step model, nor the reverse. The correction in force is also named (id and
label) in the inputs stored with the answer. The code digest
(:func:`code_digest`) covers the source and data files of the packages that
compute a capacity, and the module of the step model's class: a commit that
changes the simulator, the search, the cost model or the catalog misses every
capacity cached before it, without anyone remembering to say so.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any

from hetsched.catalog.types import Device
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.correction import CorrectedStepModel
from hetsched.perf.in_force import NamedCorrection, correction_json, replica_step_model
from hetsched.perf.step import StepLatencyModel
from hetsched.sim.capacity import DEFAULT_SEEDS, Capacity, find_capacity
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch
from hetsched.specs.workload import SLO, Workload
from hetsched.store.peek import StoreOnDemand

if TYPE_CHECKING:
    from hetsched.optimizer.capacity import SimulatedCapacity
    from hetsched.store.db import Store

CACHED_RESULT = "SELECT result FROM capacities WHERE key = ?"
"""A cached capacity by its key, as SQL a store's file answers without SQLAlchemy (which loads only to open the
store: for a capacity not cached yet, or a store that cannot be peeked at)."""

ANSWER_PACKAGES = ("hetsched.sim", "hetsched.perf", "hetsched.specs", "hetsched.catalog")
"""The packages whose code and data files decide a capacity: the search and simulator, the cost model, the
model and workload specs with their bundled configs, the accelerator catalog."""
_SKIPPED = ("__pycache__",)


def source_digest(roots: Iterable[Traversable]) -> str:
    """SHA-256 over every file under ``roots`` (names and bytes, in name order), compiled caches left out."""
    digest = hashlib.sha256()
    for n, root in enumerate(roots):
        stack = [(str(n), root)]
        while stack:
            name, node = stack.pop()
            if node.is_dir():
                stack += sorted(((f"{name}/{child.name}", child) for child in node.iterdir()
                                 if child.name not in _SKIPPED), reverse=True)
            elif not node.name.endswith(".pyc"):
                data = node.read_bytes()
                digest.update(f"{name}\0{len(data)}\0".encode())
                digest.update(data)
    return digest.hexdigest()


@functools.cache
def code_digest() -> str:
    """The digest of :data:`ANSWER_PACKAGES`, read once per process (about 300 kB: milliseconds)."""
    return source_digest(resources.files(package) for package in ANSWER_PACKAGES)


@functools.cache
def _module_digest(module: str) -> str:
    """The digest of the source of ``module`` (a step model defined outside :data:`ANSWER_PACKAGES`)."""
    if module.startswith(tuple(f"{package}." for package in ANSWER_PACKAGES)):
        return ""
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return ""
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()


def step_model_identity(step_model: StepLatencyModel) -> str:
    """A stable string naming what a step model predicts from."""
    if isinstance(step_model, CorrectedStepModel):
        return f"{step_model_identity(step_model.base)} corrected by {step_model.correction.vector()!r}"
    digest = getattr(step_model, "digest", None)
    if isinstance(digest, str) and digest:
        return digest
    if dataclasses.is_dataclass(step_model):
        return repr(step_model)
    raise InputError(f"{type(step_model).__name__} has no 'digest'; cached capacities need a stable identity",
                     field="step_model")


def _step_model_code(step_model: StepLatencyModel) -> str:
    """The digest of the module of the step model's class, through a correction to the model it corrects."""
    if isinstance(step_model, CorrectedStepModel):
        return _step_model_code(step_model.base)
    return _module_digest(type(step_model).__module__)


def capacity_key(step_model: StepLatencyModel, *, workload: Workload, slo: SLO, engine: EngineConfig,
                 weight_dtype: DType | None, kv_dtype: DType | None, seeds: Sequence[int],
                 input_edges: Sequence[int], output_edges: Sequence[int],
                 correction: NamedCorrection | None = None) -> tuple[str, dict[str, Any]]:
    """The cache key and the inputs it digests (stored alongside for inspection); ``correction`` names the
    correction in force that ``step_model`` carries."""
    inputs = {
        "code": code_digest(),
        "step_model_code": _step_model_code(step_model),
        "step_model": hashlib.sha256(step_model_identity(step_model).encode()).hexdigest(),
        "correction": correction_json(correction),
        "workload": workload.model_dump(mode="json"),
        "slo": slo.model_dump(mode="json"),
        "engine": dataclasses.asdict(engine),
        "weight_dtype": str(weight_dtype) if weight_dtype else None,
        "kv_dtype": str(kv_dtype) if kv_dtype else None,
        "seeds": list(seeds),
        "input_edges": list(input_edges),
        "output_edges": list(output_edges),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return key, inputs


def cached_capacity(store: Store | StoreOnDemand, model: ModelArch, device: Device, *, tp: int = 1, workload: Workload, slo: SLO,
                    engine: EngineConfig = EngineConfig(), step_model: StepLatencyModel | None = None,
                    weight_dtype: DType | None = None, kv_dtype: DType | None = None,
                    seeds: Sequence[int] = DEFAULT_SEEDS, input_edges: Sequence[int] = (),
                    output_edges: Sequence[int] = (), profile_id: int | None = None,
                    correction: NamedCorrection | None = None) -> Capacity:
    """:func:`find_capacity` through the store: answered from the ``capacities`` table when known.

    Infeasible answers are not stored (they are cheap to find again).
    """
    step = replica_step_model(model, device, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, engine=engine,
                              step_model=step_model, correction=correction)
    key, inputs = capacity_key(step, workload=workload, slo=slo, engine=engine, weight_dtype=weight_dtype,
                               kv_dtype=kv_dtype, seeds=seeds, input_edges=input_edges, output_edges=output_edges,
                               correction=correction)
    if isinstance(store, StoreOnDemand):
        peeked = store.peek(CACHED_RESULT, (key,))
        if peeked:
            return Capacity.from_json(json.loads(peeked[0][0]))
        store = store.opened()
    from sqlalchemy import select
    from sqlalchemy.exc import IntegrityError, SQLAlchemyError

    from hetsched.store.db import reason
    from hetsched.store.tables import CapacityRow

    try:
        with store.transaction() as session:
            row = session.scalars(select(CapacityRow).where(CapacityRow.key == key)).first()
            if row is not None:
                return Capacity.from_json(row.result)
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot read cached capacities: {reason(exc)}") from exc
    capacity = find_capacity(model, device, tp=tp, workload=workload, slo=slo, engine=engine, step_model=step,
                             weight_dtype=weight_dtype, kv_dtype=kv_dtype, seeds=seeds, input_edges=input_edges,
                             output_edges=output_edges, tail=correction.tail if correction is not None else None)
    try:
        with store.transaction() as session:
            session.add(CapacityRow(key=key, model=model.name, device=device.id, tp=tp, profile_id=profile_id,
                                    requests_per_s=capacity.requests_per_s, inputs=inputs,
                                    result=capacity.to_json()))
    except IntegrityError:
        pass  # another process stored the same answer first
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot store the capacity: {reason(exc)}") from exc
    return capacity


def cached_capacity_source(store: Store) -> SimulatedCapacity:
    """The optimizer's simulated capacities, each SLO search answered from ``store`` when known and saved to it,
    under the step-model corrections in force there (read again for each problem built, so that a correction
    stored meanwhile is used by the next plan)."""
    from hetsched.optimizer.capacity import SimulatedCapacity  # the optimizer loads for the commands that plan
    from hetsched.store.corrections import corrections_in_force

    return SimulatedCapacity(find=functools.partial(cached_capacity, store),
                             corrections=functools.partial(corrections_in_force, store))
