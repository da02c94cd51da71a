"""Cluster files: hetsched's own format, and the Mélange-style profile format, into a ClusterSpec.

The Mélange-style format is recognised by its ``gpu_info`` and
``workload_distribution`` keys::

    slo: {ttft_ms: 1000, tpot_ms: 120}   # what the throughputs were measured under
    input_edges: [256, 1024]             # inclusive upper bounds of all but the last bucket
    output_edges: [128]
    matrix_order: output_input           # tputs[output_bucket][input_bucket] (or input_output)
    total_request_rate: 20               # requests/s
    workload_distribution: [[...]]       # share of requests per bucket, same shape as tputs
    gpu_info:                            # a mapping by name, or a list of {name: ...}
      A10G: {cost: 1.01, tputs: [[...]], accelerator: a10g, count: 16}

Each GPU serves one replica (TP 1) at ``tputs`` requests/s per bucket.
``accelerator`` defaults to the catalog id that matches the name; ``count``
(GPUs available) defaults to enough for the whole demand.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetsched.catalog import Accelerator, Catalog, load_catalog
from hetsched.errors import InputError, NotFoundError, invalid_input
from hetsched.specs.files import read_document
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import (
    SLO,
    BucketSpec,
    CapacityEntry,
    ClusterSpec,
    ModelSpec,
    PoolSpec,
    SolverSettings,
    WorkloadSpec,
)


_Model = TypeVar("_Model", bound=BaseModel)


def load_cluster(path: str | Path, *, catalog: Catalog | None = None) -> ClusterSpec:
    """Read a cluster file (YAML or JSON, either format)."""
    return parse_cluster(read_document(path, field="cluster"), source=Path(path).name, catalog=catalog)


def parse_cluster(raw: Any, *, source: str = "cluster", catalog: Catalog | None = None) -> ClusterSpec:
    """Validate a cluster mapping; errors name the field path, e.g. ``models[0].workload.rate_rps``."""
    if not isinstance(raw, dict):
        raise InputError(f"{source}: expected a mapping with pools and models", field="cluster")
    if "gpu_info" in raw and "workload_distribution" in raw:
        return melange_to_cluster(_validate(MelangeProfile, raw, source), catalog=catalog or load_catalog())
    return _validate(ClusterSpec, raw, source)


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``hetsched plan -o json|yaml`` (e.g. the current one, for churn)."""
    return _validate(Plan, read_document(path, field="current"), Path(path).name)


class MatrixOrder(StrEnum):
    OUTPUT_INPUT = "output_input"
    INPUT_OUTPUT = "input_output"


class MelangeGpu(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str | None = None
    cost: float = Field(ge=0, description="$/hour per GPU")
    tputs: list[list[float]]
    accelerator: str | None = None
    count: int | None = Field(None, ge=0)


class MelangeProfile(BaseModel):
    """A profile in the format of existing heterogeneous-GPU tools (Mélange)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = "plan"
    model: str = "model"
    slo: SLO
    input_edges: list[int] = Field(default_factory=list)
    output_edges: list[int] = Field(default_factory=list)
    matrix_order: MatrixOrder = MatrixOrder.OUTPUT_INPUT
    total_request_rate: float = Field(ge=0)
    workload_distribution: list[list[float]]
    gpu_info: dict[str, MelangeGpu]
    slice_factor: int | None = Field(None, description="accepted and ignored: the split here is continuous")
    solver: SolverSettings = SolverSettings()

    @field_validator("gpu_info", mode="before")
    @classmethod
    def _list_by_name(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {str(item.get("name", i)) if isinstance(item, dict) else str(i): item for i, item in enumerate(value)}
        return value


def melange_to_cluster(profile: MelangeProfile, *, catalog: Catalog) -> ClusterSpec:
    """One model, one pool per GPU type, capacities from the throughput matrices."""
    rows, cols = _shape(profile.workload_distribution, "workload_distribution")
    inputs, outputs = (cols, rows) if profile.matrix_order is MatrixOrder.OUTPUT_INPUT else (rows, cols)
    for field, edges, n in (("input_edges", profile.input_edges, inputs), ("output_edges", profile.output_edges, outputs)):
        if edges and len(edges) != n - 1:
            raise InputError(f"{n} buckets need {n - 1} edges, got {len(edges)}", field=field)
        if edges != sorted(set(edges)) or any(e < 1 for e in edges):
            raise InputError(f"expected increasing positive token counts, got {edges}", field=field)
    total = sum(map(sum, profile.workload_distribution))
    if total <= 0 or any(v < 0 for row in profile.workload_distribution for v in row):
        raise InputError("expected non-negative shares with a positive sum", field="workload_distribution")
    buckets: list[BucketSpec] = []
    cells: list[tuple[int, int, str]] = []
    for r in range(rows):
        for c in range(cols):
            share = profile.workload_distribution[r][c] / total
            if share <= 0:
                continue
            i, o = (c, r) if profile.matrix_order is MatrixOrder.OUTPUT_INPUT else (r, c)
            bucket = BucketSpec(name=_label(i, o, profile), input_tokens=_upper(i, profile.input_edges),
                                output_tokens=_upper(o, profile.output_edges), share=share)
            buckets.append(bucket)
            cells.append((r, c, bucket.label))
    # rounding of the shares to a sum of 1 within the spec's tolerance
    buckets[-1] = buckets[-1].model_copy(update={"share": buckets[-1].share + 1.0 - sum(b.share for b in buckets)})
    pools: list[PoolSpec] = []
    capacities: list[CapacityEntry] = []
    for name, gpu in profile.gpu_info.items():
        where = f"gpu_info.{name}"
        if _shape(gpu.tputs, f"{where}.tputs") != (rows, cols):
            raise InputError(f"expected a {rows}×{cols} matrix like workload_distribution", field=f"{where}.tputs")
        accelerator = _accelerator(name, gpu, catalog, where)
        smallest = min((gpu.tputs[r][c] for r, c, _ in cells if gpu.tputs[r][c] > 0), default=0.0)
        count = gpu.count if gpu.count is not None else (
            math.ceil(profile.total_request_rate * (1 + profile.solver.headroom) / smallest) + 1 if smallest else 1)
        gpn = accelerator.gpus_per_node
        pool = _slug(name)
        pools.append(PoolSpec(name=pool, accelerator=accelerator.id, nodes=max(1, math.ceil(count / gpn)),
                              price_per_hour=gpu.cost, max_gpus=count))
        # the pool's own throughputs: two entries may share an accelerator (spot and on-demand A100s)
        capacities += [CapacityEntry(model=profile.model, device=accelerator.id, pool=pool, bucket=label,
                                     requests_per_s=float(gpu.tputs[r][c])) for r, c, label in cells]
    model = ModelSpec(name=profile.model, slo=profile.slo, min_replicas=0,
                      workload=WorkloadSpec(rate_rps=profile.total_request_rate, buckets=buckets))
    return ClusterSpec(name=profile.name, pools=pools, models=[model], capacities=capacities, solver=profile.solver)




def _validate(kind: type[_Model], raw: Any, source: str) -> _Model:
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc, source=source) from exc


def _shape(matrix: list[list[float]], field: str) -> tuple[int, int]:
    if not matrix or not matrix[0] or any(len(row) != len(matrix[0]) for row in matrix):
        raise InputError("expected a non-empty rectangular matrix", field=field)
    return len(matrix), len(matrix[0])


def _label(i: int, o: int, profile: MelangeProfile) -> str:
    return f"in {_range(i, profile.input_edges)} / out {_range(o, profile.output_edges)}"


def _range(index: int, edges: list[int]) -> str:
    if not edges:
        return f"#{index}"
    low = 1 if index == 0 else edges[index - 1] + 1
    return f"{low}-{edges[index]}" if index < len(edges) else f"{low}+"


def _upper(index: int, edges: list[int]) -> int:
    if not edges:
        return 1
    return edges[index] if index < len(edges) else 2 * edges[-1]


def _accelerator(name: str, gpu: MelangeGpu, catalog: Catalog, where: str) -> Accelerator:
    wanted = gpu.accelerator or name.lower()
    try:
        return catalog.get(wanted)
    except NotFoundError as exc:
        found = catalog.by_product(name)
        if found is not None and gpu.accelerator is None:
            return found
        raise InputError(f"{exc}; name the catalog accelerator with 'accelerator:'", field=f"{where}.accelerator") from exc


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
