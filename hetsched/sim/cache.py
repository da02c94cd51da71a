"""Capacities cached in the store, keyed by everything that changes the answer.

The key is a SHA-256 over (step-model identity, workload, SLO, engine settings,
dtypes, seeds, bucket edges, :data:`SEARCH_VERSION`). A step model's identity is
its ``digest`` attribute when it has one (measured profiles), else the repr of
a frozen dataclass (the roofline: model, device, TP, dtypes, efficiencies).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from hetsched.catalog.types import Device
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepLatencyModel
from hetsched.sim.capacity import DEFAULT_SEEDS, Capacity, find_capacity
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch
from hetsched.specs.workload import SLO, Workload
from hetsched.store import Store
from hetsched.store.tables import CapacityRow

SEARCH_VERSION = 1
"""Bumped whenever the simulator or the search changes its answers."""


def step_model_identity(step_model: StepLatencyModel) -> str:
    """A stable string naming what a step model predicts from."""
    digest = getattr(step_model, "digest", None)
    if isinstance(digest, str) and digest:
        return digest
    if dataclasses.is_dataclass(step_model):
        return repr(step_model)
    raise InputError(f"{type(step_model).__name__} has no 'digest'; cached capacities need a stable identity",
                     field="step_model")


def capacity_key(step_model: StepLatencyModel, *, workload: Workload, slo: SLO, engine: EngineConfig,
                 weight_dtype: DType | None, kv_dtype: DType | None, seeds: Sequence[int],
                 input_edges: Sequence[int], output_edges: Sequence[int]) -> tuple[str, dict[str, Any]]:
    """The cache key and the inputs it digests (stored alongside for inspection)."""
    inputs = {
        "search_version": SEARCH_VERSION,
        "step_model": hashlib.sha256(step_model_identity(step_model).encode()).hexdigest(),
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


def cached_capacity(store: Store, model: ModelArch, device: Device, *, tp: int = 1, workload: Workload, slo: SLO,
                    engine: EngineConfig = EngineConfig(), step_model: StepLatencyModel | None = None,
                    weight_dtype: DType | None = None, kv_dtype: DType | None = None,
                    seeds: Sequence[int] = DEFAULT_SEEDS, input_edges: Sequence[int] = (),
                    output_edges: Sequence[int] = (), profile_id: int | None = None) -> Capacity:
    """:func:`find_capacity` through the store: answered from the ``capacities`` table when known.

    Infeasible answers are not stored (they are cheap to find again).
    """
    step = step_model or RooflineModel(model, device, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                       engine=engine)
    key, inputs = capacity_key(step, workload=workload, slo=slo, engine=engine, weight_dtype=weight_dtype,
                               kv_dtype=kv_dtype, seeds=seeds, input_edges=input_edges, output_edges=output_edges)
    try:
        with store.transaction() as session:
            row = session.scalars(select(CapacityRow).where(CapacityRow.key == key)).first()
            if row is not None:
                return Capacity.from_json(row.result)
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot read cached capacities: {exc}") from exc
    capacity = find_capacity(model, device, tp=tp, workload=workload, slo=slo, engine=engine, step_model=step,
                             weight_dtype=weight_dtype, kv_dtype=kv_dtype, seeds=seeds, input_edges=input_edges,
                             output_edges=output_edges)
    try:
        with store.transaction() as session:
            session.add(CapacityRow(key=key, model=model.name, device=device.id, tp=tp, profile_id=profile_id,
                                    requests_per_s=capacity.requests_per_s, inputs=inputs,
                                    result=capacity.to_json()))
    except IntegrityError:
        pass  # another process stored the same answer first
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot store the capacity: {exc}") from exc
    return capacity
