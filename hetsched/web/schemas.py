"""What the planner's HTTP API takes and returns (pydantic: this is a boundary)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonDict

from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec, ModelSpec
from hetsched.store.tables import NAME_LENGTH
from hetsched.web.whatif import PlanDiff, WhatIfChanges


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlanOrigin(StrEnum):
    """Who made a stored plan."""

    CLI = "cli"
    WEB = "web"
    OPERATOR = "operator"


class ModelSource(StrEnum):
    BUNDLED = "bundled"
    UPLOADED = "uploaded"


class MigProfileInfo(_Body):
    name: str
    compute_slices: int
    memory_slices: int
    memory_gb: float
    max_count: int
    starts: list[int]


class MigInfo(_Body):
    compute_slices: int
    memory_slices: int
    profiles: list[MigProfileInfo]


class AcceleratorInfo(_Body):
    """One catalog accelerator with the prices in effect."""

    id: str
    name: str
    vendor: str
    memory_gb: float
    memory_tbs: float
    bf16_tflops: float
    price_per_hour: float
    catalog_price_per_hour: float
    gpus_per_node: int
    splittable: bool = Field(description="MIG profiles (NVIDIA) or compute partitions (AMD) exist")
    mig: MigInfo | None = None
    partition_modes: list[str] = Field(default_factory=list)


class ModelInfo(_Body):
    """A model the planner can place: shipped with hetsched, or uploaded."""

    name: str
    source: ModelSource
    model_type: str
    attention: str
    layers: int
    total_params_b: float
    active_params_b: float
    max_context: int
    dtype: str
    created_at: datetime | None = None


class ProfileInfo(_Body):
    id: int
    model: str
    accelerator: str
    source: str
    backend: str
    tp: int
    created_at: datetime


class CorrectionInfo(_Body):
    """The step-model correction a capacity was searched under."""

    id: int
    label: str = Field(description="which correction, e.g. 'correction #3 (prefill x1.4, …; 412 observations, …)'")
    prefill_scale: float
    decode_scale: float
    step_overhead_s: float
    request_overhead_s: float = Field(description="learned with it; not part of a step, so no capacity uses it")
    tail: dict[str, Any] | None = Field(None, description="the step dispersion and front end learned with it, which "
                                                          "the capacity search runs too; null: none")


class CapacityInfo(_Body):
    id: int
    model: str
    device: str
    tp: int
    requests_per_s: float
    profile_id: int | None
    inputs: dict[str, Any]
    created_at: datetime
    correction: CorrectionInfo | None = Field(
        None, description="the step-model correction in force when it was searched; None: the bare step model")


class PlanSummary(_Body):
    id: int
    name: str
    origin: str
    status: str
    cost_per_hour: float | None
    note: str
    created_at: datetime


class StoredPlan(PlanSummary):
    """A stored plan with the spec that produced it: enough to reopen, re-solve or export it."""

    spec: ClusterSpec | None = Field(description="the input; null for a plan stored without it (the operator "
                                                 "stores none when its inputs were not at hand)")
    plan: Plan


_SPEC_EXAMPLE: JsonDict = {
    "name": "example",
    "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "partition_allowed": True},
              {"name": "l40s", "accelerator": "l40s", "nodes": 1}],
    "models": [{"name": "llama-3.1-8b", "slo": {"ttft_ms": 500, "tpot_ms": 60},
                "workload": {"rate_rps": 6, "input_tokens": 512, "output_tokens": 128}}],
    "capacities": [{"model": "llama-3.1-8b", "device": "h100-sxm", "requests_per_s": 20},
                   {"model": "llama-3.1-8b", "device": "h100-sxm:3g.40gb", "requests_per_s": 8},
                   {"model": "llama-3.1-8b", "device": "l40s", "requests_per_s": 6}],
}


class StorableModelSpec(ModelSpec):
    """A model whose name fits the store, where its capacities are cached under it."""

    name: str = Field(min_length=1, max_length=NAME_LENGTH,
                      description="unique in the cluster file; a bundled or uploaded model name by default")


class StorableSpec(ClusterSpec):
    """A cluster spec whose names fit the store: checked before any work, so every backend refuses a long name
    alike (PostgreSQL would refuse it only when the solved plan is stored)."""

    name: str = Field("plan", max_length=NAME_LENGTH)
    models: list[StorableModelSpec] = Field(min_length=1)  # type: ignore[assignment]  # narrower items; frozen


class SolveRequest(_Body):
    """A cluster spec to solve; models without ``capacities`` rows get them from the simulator's SLO search."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"spec": _SPEC_EXAMPLE, "note": "first try"}]})

    spec: StorableSpec
    note: str = Field("", max_length=2000)


class ClusterFile(_Body):
    """The text of a cluster file, as ``hetsched plan`` reads it."""

    text: str = Field(max_length=1_000_000)
    filename: str = Field("cluster.yaml", max_length=200, description="'.json' parses as JSON, anything else as YAML")


class WhatIfRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"changes": {"prices": {"h100": 2.5}, "demand": {"llama-3.1-8b": 12}}}]})

    changes: WhatIfChanges
    note: str = Field("", max_length=2000)


class WhatIfResult(_Body):
    """The re-solved plan (stored) and its difference against the base plan."""

    base_id: int
    result: StoredPlan
    diff: PlanDiff


class ErrorBody(_Body):
    """Every error the API returns: a message, and the field it concerns where there is one."""

    detail: str
    field: str | None = None
    errors: list[dict[str, Any]] | None = Field(None, description="every validation error, for a 422")


class ServerInfo(_Body):
    """What the page needs to know about this server."""

    version: str
    auth_required: bool
    solve_timeout_s: float
    max_body_bytes: int
    database: str = Field(description="the store's URL, password hidden")
