"""Peers' files as a ClusterSpec: Mélange's solver input and AIBrix's GPU optimizer profiles.

A Mélange file is recognised by its ``gpu_info`` and ``workload_distribution``
keys; it loads unchanged (its repository's ``melange/config/example.json``)::

    gpu_info:                            # a mapping by name, or a list of {name: ...}
      A10G: {cost: 1.01, tputs: [[2, 1], [5, 2]]}
      A100-80GB: {cost: 3.67, tputs: [[20, 20], [40, 20]]}
    workload_distribution: [[0.2, 0.1], [0.5, 0.2]]   # rows: input sizes, columns: output sizes
    total_request_rate: 30               # requests/s
    slice_factor: 1                      # accepted and ignored: the split here is continuous

A GPU name that is neither a catalog id nor in ``GPU_ALIASES`` becomes an
opaque accelerator type (``ClusterSpec.accelerators``) at the entry's cost,
served by its throughputs: the planner buys it as any other, and the plan's
notes name it (and the catalog id it may have meant).

hetsched's own optional keys: ``name``, ``model``, ``slo`` (informational),
``input_edges``/``output_edges`` (inclusive upper bounds of all but the last
bucket), ``matrix_order`` (``input_output``, Mélange's, by default), per GPU
``accelerator`` (a catalog id) and ``count`` (GPUs available; default: enough
for the whole demand), and ``solver``.

An AIBrix file is recognised by its ``aibrix_profiles`` key. It names the
profiles AIBrix's ``gen_profile.py`` writes, one per deployment × GPU
(``{"gpu": <deployment>, "cost": 1.0, "tputs": [[...]], "indexes": [[output
ticks], [input ticks]], "created": ..., "e2e": [[...]], "slos": {"percentile":
99, "e2e": 5.0}}``, ``tputs[output][input]`` requests/s, 0 where no rate met
the SLO), and the demand AIBrix's optimizer builds from gateway traffic::

    model: llama2-7b
    aibrix_profiles:                     # files (one profile, a JSON list or JSON lines), directories of
      - profiles/                        # *.json, {path: ..., accelerator: ..., count: ...}, or {profile: {...}}
    total_request_rate: 20
    workload_distribution: [[...]]       # over the profiles' ticks: rows output, columns input (AIBrix's order)

Both formats: one pool per GPU entry, one GPU per replica, ``cost`` as the
price per GPU-hour, no SLO (the throughputs were measured at one), and
headroom 0, as the source tool plans, unless the file's ``solver`` sets it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetsched.catalog import Accelerator, Catalog
from hetsched.errors import InputError, NotFoundError, invalid_input
from hetsched.specs.files import parse_json, read_text
from hetsched.optimizer.spec import (
    SLO,
    BucketSpec,
    CapacityEntry,
    ClusterSpec,
    ModelSpec,
    OpaqueAccelerator,
    PoolSpec,
    SolverSettings,
    WorkloadSpec,
)

GPU_ALIASES: dict[str, str] = {"H100": "h100-sxm", "H100-80GB": "h100-sxm", "A100-80G": "a100-80gb"}
"""GPU names Mélange's files and paper use that are not catalog ids (the rest, ``A100-80GB``, ``A10G``,
``L4``, ``L40S``, are ids in any case). Mélange's H100 is the 80 GB SXM5 part of its paper's evaluation;
an H100 PCIe entry names ``accelerator: h100-pcie``."""

NonNegative = Annotated[float, Field(ge=0)]
_Model = TypeVar("_Model", bound=BaseModel)


def resolve_gpu(name: str, catalog: Catalog) -> Accelerator | None:
    """The accelerator a peer's GPU name means: a catalog id, an alias or a node-label product, in any case."""
    wanted = _plain(name)
    ids = {_plain(a): a for a in catalog.accelerators} | {_plain(k): v for k, v in GPU_ALIASES.items()}
    if wanted in ids:
        return catalog.get(ids[wanted])
    return catalog.by_product(name)


def gpu_type(name: str, catalog: Catalog, *, cost: float) -> Accelerator | OpaqueAccelerator:
    """The accelerator a peer's GPU name means, else an opaque type of that name priced at ``cost``."""
    return resolve_gpu(name, catalog) or OpaqueAccelerator(id=_slug(name), name=name, price_per_hour=cost)


def is_melange(raw: dict[str, Any]) -> bool:
    return "gpu_info" in raw and "workload_distribution" in raw


def is_aibrix(raw: dict[str, Any]) -> bool:
    return "aibrix_profiles" in raw


class MatrixOrder(StrEnum):
    """What the rows and columns of a Mélange file's matrices are."""

    INPUT_OUTPUT = "input_output"
    OUTPUT_INPUT = "output_input"


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class _GridFile(_Strict):
    """What a Mélange and an AIBrix file share: one model, its demand over a size grid, solver settings."""

    name: str = "plan"
    model: str = "model"
    slo: SLO | None = Field(None, description="informational: the throughputs were measured at it")
    total_request_rate: float = Field(ge=0)
    workload_distribution: list[list[NonNegative]]
    solver: SolverSettings = SolverSettings(headroom=0.0)

    @field_validator("solver", mode="before")
    @classmethod
    def _no_headroom_unless_set(cls, value: Any) -> Any:
        """The source tools plan without headroom; a file that wants some says so."""
        return {"headroom": 0.0, **value} if isinstance(value, dict) else value


class MelangeGpu(_Strict):
    name: str | None = None
    cost: float = Field(ge=0, description="$/hour per GPU")
    tputs: list[list[NonNegative]]
    accelerator: str | None = None
    count: int | None = Field(None, ge=0)


class MelangeProfile(_GridFile):
    """Mélange's solver input, with hetsched's optional keys."""

    input_edges: list[int] = Field(default_factory=list)
    output_edges: list[int] = Field(default_factory=list)
    matrix_order: MatrixOrder = MatrixOrder.INPUT_OUTPUT
    gpu_info: dict[str, MelangeGpu]
    slice_factor: int | None = Field(None, description="accepted and ignored: the split here is continuous")

    @field_validator("gpu_info", mode="before")
    @classmethod
    def _list_by_name(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {str(item.get("name", i)) if isinstance(item, dict) else str(i): item
                    for i, item in enumerate(value)}
        return value


class AibrixProfile(BaseModel):
    """One profile as AIBrix's ``gen_profile.py`` writes it; fields AIBrix adds later are ignored, as AIBrix does."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    gpu: str = Field(min_length=1, description="the deployment's name")
    cost: float = Field(ge=0, description="$/hour per replica")
    tputs: list[list[NonNegative]] = Field(description="requests/s at the SLO, [output tick][input tick]")
    indexes: tuple[list[Annotated[float, Field(gt=0)]], list[Annotated[float, Field(gt=0)]]] = Field(
        description="[output ticks, input ticks]: the token counts benchmarked")
    created: float | None = None
    slos: dict[str, float] = Field(default_factory=dict, description="percentile (0: mean) and the targets met")

    @field_validator("indexes")
    @classmethod
    def _ascending(cls, value: tuple[list[float], list[float]]) -> tuple[list[float], list[float]]:
        for ticks in value:
            if not ticks or any(b <= a for a, b in zip(ticks, ticks[1:])):
                raise ValueError(f"expected non-empty increasing token counts, got {ticks}")
        return value


class AibrixSource(_Strict):
    """Where profiles come from: a path (file or directory) or one inline profile; optionally what it runs on."""

    path: str | None = None
    profile: AibrixProfile | None = None
    accelerator: str | None = Field(None, description="catalog id; default: resolved from the deployment name")
    count: int | None = Field(None, ge=0, description="GPUs available; default: enough for the whole demand")

    @model_validator(mode="before")
    @classmethod
    def _bare_path(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> AibrixSource:
        if (self.path is None) == (self.profile is None):
            raise ValueError("give exactly one of: path; profile")
        return self


class AibrixFile(_GridFile):
    """AIBrix GPU profiles and a demand over their ticks."""

    aibrix_profiles: list[AibrixSource] = Field(min_length=1)


def melange_cluster(raw: dict[str, Any], *, source: str, catalog: Catalog) -> ClusterSpec:
    """A Mélange file: one model, one pool per ``gpu_info`` entry, capacities from the throughput matrices."""
    profile = validate(MelangeProfile, raw, source)
    shares = _oriented(profile.workload_distribution, profile.matrix_order, "workload_distribution")
    inputs = _edged(profile.input_edges, len(shares), "input_edges")
    outputs = _edged(profile.output_edges, len(shares[0]), "output_edges")
    gpus = []
    for name, gpu in profile.gpu_info.items():
        where = f"gpu_info.{name}"
        tputs = _oriented(gpu.tputs, profile.matrix_order, f"{where}.tputs")
        if (len(tputs), len(tputs[0])) != (len(shares), len(shares[0])):
            raise InputError("expected a matrix of the shape of workload_distribution", field=f"{where}.tputs")
        accelerator: Accelerator | OpaqueAccelerator
        if gpu.accelerator is not None:
            accelerator = _catalog_id(gpu.accelerator, catalog, field=f"{where}.accelerator")
        else:
            accelerator = gpu_type(name, catalog, cost=gpu.cost)
        gpus.append(_GridGpu(name, where, accelerator, gpu.cost, tputs, gpu.count))
    return _grid_cluster(profile, shares, inputs, outputs, gpus, measured_under=None)


def aibrix_cluster(raw: dict[str, Any], *, source: str, catalog: Catalog, base: Path | None) -> ClusterSpec:
    """An AIBrix file: one pool per profile, capacities from ``tputs``, demand over the profiles' ticks.

    Paths are relative to ``base`` (the cluster file's folder); without one only inline profiles are read.
    """
    spec = validate(AibrixFile, raw, source)
    gpus: list[_GridGpu] = []
    ticks: tuple[list[float], list[float]] | None = None
    slos: list[str] = []
    for i, ref in enumerate(spec.aibrix_profiles):
        for label, profile in _profiles(ref, base, f"aibrix_profiles[{i}]"):
            if ticks is None:
                ticks = profile.indexes
            elif profile.indexes != ticks:
                mine, first = (" × ".join(map(_ticks, side)) for side in (profile.indexes, ticks))
                raise InputError(f"{label}: ticks {mine} differ from the first profile's {first}; AIBrix plans over "
                                 "one grid", field=f"aibrix_profiles[{i}].indexes")
            if _shape(profile.tputs, f"aibrix_profiles[{i}].tputs") != (len(ticks[0]), len(ticks[1])):
                raise InputError(f"{label}: expected {len(ticks[0])} rows (output ticks) of {len(ticks[1])} "
                                 "(input ticks)", field=f"aibrix_profiles[{i}].tputs")
            accelerator: Accelerator | OpaqueAccelerator
            if ref.accelerator is not None:
                accelerator = _catalog_id(ref.accelerator, catalog, field=f"aibrix_profiles[{i}].accelerator")
            else:
                accelerator = _deployment_accelerator(profile.gpu, catalog=catalog, cost=profile.cost)
            tputs = _oriented(profile.tputs, MatrixOrder.OUTPUT_INPUT, f"aibrix_profiles[{i}].tputs")
            gpus.append(_GridGpu(profile.gpu, f"aibrix_profiles[{i}]", accelerator, profile.cost, tputs, ref.count))
            slos.append(f"{profile.gpu}: {_slo_words(profile.slos)}")
    assert ticks is not None
    if _shape(spec.workload_distribution, "workload_distribution") != (len(ticks[0]), len(ticks[1])):
        raise InputError(f"expected {len(ticks[0])} rows (output ticks {_ticks(ticks[0])}) of {len(ticks[1])} "
                         f"(input ticks {_ticks(ticks[1])}), as the profiles' tputs", field="workload_distribution")
    shares = _oriented(spec.workload_distribution, MatrixOrder.OUTPUT_INPUT, "workload_distribution")
    outputs, inputs = (_Axis(tuple(f"{t:g}" for t in side), tuple(max(1, round(t)) for t in side)) for side in ticks)
    return _grid_cluster(spec, shares, inputs, outputs, gpus, measured_under="AIBrix profiles: " + "; ".join(slos))


def validate(kind: type[_Model], raw: Any, source: str) -> _Model:
    """``kind`` from raw data; the first problem as an InputError naming its field."""
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc, source=source) from exc


@dataclass(frozen=True)
class _Axis:
    """The input or output side of the grid: a label and a representative token count per position."""

    labels: tuple[str, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class _GridGpu:
    """One GPU entry of a peer's file, resolved: its throughputs are ``[input][output]``."""

    name: str
    where: str
    accelerator: Accelerator | OpaqueAccelerator
    cost: float
    tputs: list[list[float]]
    count: int | None


def _grid_cluster(file: _GridFile, shares: list[list[float]], inputs: _Axis, outputs: _Axis, gpus: list[_GridGpu],
                  *, measured_under: str | None) -> ClusterSpec:
    """One model whose buckets are the grid's non-empty cells; one pool and its own capacity rows per GPU entry."""
    total = sum(map(sum, shares))
    if total <= 0:
        raise InputError("expected shares with a positive sum", field="workload_distribution")
    buckets: list[BucketSpec] = []
    cells: list[tuple[int, int, str]] = []
    for i, row in enumerate(shares):
        for o, share in enumerate(row):
            if share > 0:
                bucket = BucketSpec(name=f"in {inputs.labels[i]} / out {outputs.labels[o]}",
                                    input_tokens=inputs.tokens[i], output_tokens=outputs.tokens[o], share=share / total)
                buckets.append(bucket)
                cells.append((i, o, bucket.label))
    demand = file.total_request_rate * (1 + file.solver.headroom)
    # rounding of the shares to a sum of 1 within the spec's tolerance
    buckets[-1] = buckets[-1].model_copy(update={"share": buckets[-1].share + 1.0 - sum(b.share for b in buckets)})
    pools: list[PoolSpec] = []
    capacities: list[CapacityEntry] = []
    for gpu in gpus:
        pool = _slug(gpu.name)
        if pool in {p.name for p in pools}:
            raise InputError(f"a second GPU entry makes pool {pool!r}; give each entry its own name", field=gpu.where)
        # by default the GPUs that would serve alone every bucket this GPU can: no plan needs more of them
        alone = sum(demand * b.share / gpu.tputs[i][o] for (i, o, _), b in zip(cells, buckets) if gpu.tputs[i][o] > 0)
        count = gpu.count if gpu.count is not None else math.ceil(alone) + 1
        pools.append(PoolSpec(name=pool, accelerator=gpu.accelerator.id,
                              nodes=max(1, math.ceil(count / gpu.accelerator.gpus_per_node)),
                              price_per_hour=gpu.cost, max_gpus=count))
        # the pool's own throughputs: two entries may share an accelerator (spot and on-demand A100s)
        capacities += [CapacityEntry(model=file.model, device=gpu.accelerator.id, pool=pool, bucket=label,
                                     requests_per_s=gpu.tputs[i][o]) for i, o, label in cells]
    model = ModelSpec(name=file.model, slo=file.slo, measured_under=None if file.slo else measured_under,
                      min_replicas=0, workload=WorkloadSpec(rate_rps=file.total_request_rate, buckets=buckets))
    opaque = {g.accelerator.id: g.accelerator for g in gpus if isinstance(g.accelerator, OpaqueAccelerator)}
    return ClusterSpec(name=file.name, pools=pools, models=[model], capacities=capacities,
                       accelerators=list(opaque.values()), solver=file.solver)


def _profiles(ref: AibrixSource, base: Path | None, where: str) -> list[tuple[str, AibrixProfile]]:
    """The profiles one entry names, each with a label for errors (its file, and its place in a list)."""
    if ref.profile is not None:
        return [(where, ref.profile)]
    assert ref.path is not None
    if base is None:
        raise InputError("profile paths are read next to a cluster file; give the profile inline with 'profile:'",
                         field=f"{where}.path")
    path = base / ref.path
    files = ([(f"{ref.path.rstrip('/')}/{f.name}", f) for f in sorted(path.glob("*.json"))] if path.is_dir()
             else [(ref.path, path)])
    if not files:
        raise InputError(f"no *.json profiles in {ref.path}", field=f"{where}.path")
    found = [(label, _profile(raw, label, where))
             for shown, file in files for label, raw in _documents(file, shown, where)]
    if len(found) > 1 and ref.accelerator is not None:
        raise InputError(f"{ref.path} holds {len(found)} profiles; 'accelerator' names the GPU of one",
                         field=f"{where}.accelerator")
    return found


def _profile(raw: Any, label: str, where: str) -> AibrixProfile:
    """One profile read from a file; a problem names the entry, the field and the file."""
    try:
        return AibrixProfile.model_validate(raw)
    except ValidationError as exc:
        inner = invalid_input(exc, source=label)
        message = str(inner).removeprefix(f"{inner.field}: ")
        raise InputError(message, field=f"{where}.{inner.field}" if inner.field else where) from exc


def _documents(file: Path, name: str, where: str) -> list[tuple[str, Any]]:
    """A profile file's profiles, as AIBrix reads them: one JSON object, a JSON list of them, or JSON lines
    (several lines, the first a whole object), each through the file boundary of ``specs.files``."""
    field = f"{where}.path"
    if not file.is_file():
        raise InputError(f"no such file: {name}", field=field)  # as the cluster file names it
    text = read_text(file, field=field)
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise InputError(f"{name} holds no profile", field=field)
    if len(lines) > 1 and lines[0][1].startswith("{") and lines[0][1].endswith("}"):
        return [(f"{name} line {n}", parse_json(line, name=f"{name} line {n}", field=field)) for n, line in lines]
    data = parse_json(text, name=name, field=field)
    if isinstance(data, dict):
        return [(name, data)]
    if isinstance(data, list):
        return [(f"{name}[{k}]", item) for k, item in enumerate(data)]
    raise InputError(f"{name} is neither a JSON profile, a list of them nor JSON lines", field=field)


def _deployment_accelerator(deployment: str, *, catalog: Catalog, cost: float) -> Accelerator | OpaqueAccelerator:
    """The GPU an AIBrix deployment names: the whole name, else its longest hyphen-separated tail
    (``llama2-7b-a10g`` → a10g), resolved as Mélange's names are; else the deployment is its own opaque type,
    as AIBrix's optimizer keys GPU types by deployment."""
    parts = deployment.split("-")
    for k in range(len(parts)):
        found = resolve_gpu("-".join(parts[k:]), catalog)
        if found is not None:
            return found
    return OpaqueAccelerator(id=_slug(deployment), name=deployment, price_per_hour=cost)


def _catalog_id(accelerator: str, catalog: Catalog, *, field: str) -> Accelerator:
    try:
        return catalog.get(accelerator)
    except NotFoundError as exc:
        raise InputError(str(exc), field=field) from exc


def _slo_words(slos: dict[str, float]) -> str:
    """AIBrix's ``slos`` in words: ``P99 e2e < 5 s``; throughput floors as ``tput ≥ 2``."""
    percentile = int(slos.get("percentile", 0))
    at = f"P{percentile}" if percentile else "mean"
    parts = [f"{key} ≥ {value:g}" if key in ("tput", "tt") else f"{at} {key} < {value:g} s"
             for key, value in slos.items() if key != "percentile"]
    return ", ".join(parts) or "no SLO recorded"


def _ticks(values: Sequence[float]) -> str:
    """Token ticks as a person writes them: ``[64, 256]``."""
    return "[" + ", ".join(f"{t:g}" for t in values) + "]"


def _oriented(matrix: list[list[float]], order: MatrixOrder, field: str) -> list[list[float]]:
    """``matrix`` as ``[input][output]``."""
    _shape(matrix, field)
    return [list(row) for row in (zip(*matrix) if order is MatrixOrder.OUTPUT_INPUT else matrix)]


def _shape(matrix: list[list[float]], field: str) -> tuple[int, int]:
    if not matrix or not matrix[0] or any(len(row) != len(matrix[0]) for row in matrix):
        raise InputError("expected a non-empty rectangular matrix", field=field)
    return len(matrix), len(matrix[0])


def _edged(edges: list[int], n: int, field: str) -> _Axis:
    """Labels and upper token counts of ``n`` buckets split at ``edges`` (none: positions ``#0``, ``#1``, …)."""
    if edges and len(edges) != n - 1:
        raise InputError(f"{n} buckets need {n - 1} edges, got {len(edges)}", field=field)
    if edges != sorted(set(edges)) or any(e < 1 for e in edges):
        raise InputError(f"expected increasing positive token counts, got {edges}", field=field)
    if not edges:
        return _Axis(tuple(f"#{k}" for k in range(n)), (1,) * n)
    lows = [1, *(e + 1 for e in edges)]
    labels = tuple(f"{low}-{high}" for low, high in zip(lows, edges)) + (f"{lows[-1]}+",)
    return _Axis(labels, (*edges, 2 * edges[-1]))


def _plain(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
