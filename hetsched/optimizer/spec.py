"""The optimizer's input: inventory, models with their load and SLO, capacities, solver settings.

A ``ClusterSpec`` is what a cluster file (YAML/JSON) holds and what the web
planner and the operator build. Validation errors name the field path.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from hetsched.catalog import Vendor
from hetsched.sim.roles import Role
from hetsched.specs.wire import ATTENTION_BACKEND, OBJECTIVE_NAME
from hetsched.specs.workload import SLO, Workload

__all__ = ["SLO", "BucketSpec", "CapacityEntry", "ClusterSpec", "Disaggregation", "ModelSpec", "ObjectiveSpec",
           "OpaqueAccelerator", "PoolSpec", "Role", "SolverSettings", "Workload", "WorkloadSpec"]


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def former_name(data: Any, old: str, new: str) -> Any:
    """Raw input with a field given under its former name moved to its new one (files written before the rename
    still read); both names at once is an error naming them."""
    if not isinstance(data, dict) or old not in data:
        return data
    if new in data:
        raise ValueError(f"give {new} or its former name {old}, not both")
    return {**{k: v for k, v in data.items() if k != old}, new: data[old]}



class Disaggregation(StrEnum):
    """How a model is served: ``auto`` lets the optimizer plan it both ways and keep the cheaper."""

    UNIFIED = "unified"
    PREFILL_DECODE = "prefill_decode"
    AUTO = "auto"


class OpaqueAccelerator(_Spec):
    """An accelerator type the catalog lacks, known only by its price and the capacity rows given for it.

    A peer's file may name a GPU hetsched has never heard of (Mélange's ``gpu_info`` keys are free text): it is
    still a device type a pool holds and the planner may buy, at the file's price and throughputs. With no
    compute or memory figures nothing can be simulated on it, so every model that may use it needs rows.
    """

    id: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9.-]*$", description="what pools and rows call it")
    name: str | None = Field(None, description="as the source file spells it; default: id")
    price_per_hour: float = Field(ge=0, description="per GPU")
    gpus_per_node: StrictInt = Field(1, ge=1, description="default 1: nothing is known of its nodes")
    vendor: Vendor = Field(Vendor.NVIDIA, description="whose device plugin the operator asks for it")


class PoolSpec(_Spec):
    """Nodes of one accelerator type that the plan may use.

    ``partition_allowed`` lets GPUs of the pool be partitioned: MIG instances on NVIDIA, compute partitions on
    AMD (``mig_allowed``, its former name, is still read).
    """

    name: str = Field(min_length=1)
    accelerator: str = Field(min_length=1, description="catalog id, e.g. 'h100-sxm'")
    nodes: StrictInt = Field(ge=1)
    gpus_per_node: StrictInt | None = Field(None, ge=1, description="default: the catalog's")
    price_per_hour: float | None = Field(None, ge=0, description="per GPU; default: the catalog's")
    partition_allowed: bool = Field(False, description="may the plan partition these GPUs (MIG, AMD partitions)")
    max_gpus: StrictInt | None = Field(None, ge=0, description="use at most this many GPUs of the pool")

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        return former_name(data, "mig_allowed", "partition_allowed")


class BucketSpec(_Spec):
    """A request-size class of a model's traffic: typical lengths and share of requests."""

    name: str | None = Field(None, description="default: '<input>x<output>'")
    input_tokens: StrictInt = Field(ge=1)
    output_tokens: StrictInt = Field(ge=1)
    share: float = Field(gt=0, le=1)

    @property
    def label(self) -> str:
        return self.name or f"{self.input_tokens}x{self.output_tokens}"


class WorkloadSpec(_Spec):
    """Request rate and sizes: explicit ``buckets``, mean lengths (one bucket), or a distribution split by edges."""

    rate_rps: float = Field(ge=0, description="requests per second, all replicas together")
    buckets: list[BucketSpec] | None = None
    input_tokens: StrictInt | None = Field(None, ge=1, description="mean prompt length when no buckets are given")
    output_tokens: StrictInt | None = Field(None, ge=1, description="mean output length when no buckets are given")
    distribution: Workload | None = Field(
        None, description="arrival and length distributions; split into buckets at input_edges × output_edges")
    input_edges: list[StrictInt] = Field(default_factory=list, description="inclusive upper prompt lengths of all but the last bucket")
    output_edges: list[StrictInt] = Field(default_factory=list, description="inclusive upper output lengths of all but the last bucket")

    @model_validator(mode="after")
    def _sizes_given(self) -> WorkloadSpec:
        ways = [self.buckets is not None, self.input_tokens is not None or self.output_tokens is not None,
                self.distribution is not None]
        if sum(ways) != 1:
            raise ValueError("give exactly one of: buckets; input_tokens and output_tokens; a distribution")
        if ways[1] and (self.input_tokens is None or self.output_tokens is None):
            raise ValueError("give both input_tokens and output_tokens")
        if self.buckets is not None:
            if not self.buckets:
                raise ValueError("buckets is empty")
            total = sum(b.share for b in self.buckets)
            if abs(total - 1.0) > 1e-3:
                raise ValueError(f"bucket shares must add up to 1, they add up to {total:.4f}")
            labels = [b.label for b in self.buckets]
            if len(set(labels)) != len(labels):
                raise ValueError(f"bucket names repeat: {labels}")
        return self


class ObjectiveSpec(_Spec):
    """A class of one model's requests (interactive, batch, …), planned with its own SLO and its share of the
    model's rate, so a loose-SLO class may go to cheaper, slower types."""

    name: str = Field(pattern=OBJECTIVE_NAME, description="lower-case letters, digits, '-', '.', '_'; 63 at most")
    demand_share: float = Field(gt=0, le=1, description="share of the model's rate_rps")
    slo: SLO
    best_effort: bool = Field(False, description="served on spare capacity: planned no replicas of its own")


class ModelSpec(_Spec):
    """One model to serve, its load, SLO and placement rules."""

    name: str = Field(min_length=1, description="unique in the cluster file; a bundled model name by default")
    model: str | None = Field(None, description="bundled name or path to a config.json; default: name")
    config: dict[str, Any] | None = Field(None, description="an inline Hugging Face config.json")
    quantization: str | None = Field(None, description="weight dtype, e.g. 'fp8', 'int4'; default: the config's")
    slo: SLO | None = Field(None, description="required unless capacity rows cover the model: their throughputs "
                                              "were measured at an SLO and encode it")
    measured_under: str | None = Field(None, description="the SLO the capacity rows were measured at, in words, "
                                                         "when slo is absent; the plan's notes repeat it")
    workload: WorkloadSpec
    min_replicas: StrictInt = Field(1, ge=0)
    spread_across_nodes: bool = Field(False, description="replicas on at least two nodes")
    allowed_accelerators: list[str] | None = None
    allowed_pools: list[str] | None = None
    disaggregation: Disaggregation = Disaggregation.UNIFIED
    max_tp: StrictInt = Field(8, ge=1)
    attention_backend: str | None = Field(None, pattern=ATTENTION_BACKEND, description=(
        "the engines' attention backend as vLLM names it (FLASH_ATTN, FLASHINFER, ...): a step-model correction "
        "learned under it is the one its capacities use; none: the one learned with no backend named"))
    objectives: list[ObjectiveSpec] = Field(default_factory=list, description=(
        "classes of the model's requests, each planned as its own demand (replicas named model/class); their "
        "demand shares add up to 1"))

    @model_validator(mode="after")
    def _objectives_split_the_rate(self) -> ModelSpec:
        if not self.objectives:
            return self
        names = [o.name for o in self.objectives]
        if len(names) != len(set(names)):
            raise ValueError("objectives: an objective name appears twice")
        total = sum(o.demand_share for o in self.objectives)
        if abs(total - 1.0) > 1e-3:
            raise ValueError(f"objectives: the demand shares must add up to 1, they add up to {total:.4f}")
        return self

    @property
    def source(self) -> str:
        return self.model or self.name

    def roles(self) -> tuple[Role, ...]:
        """The roles of the model's replicas; ``auto`` has none until the optimizer resolves it to a mode."""
        if self.disaggregation is Disaggregation.AUTO:
            raise ValueError(f"{self.name}: disaggregation auto is resolved to unified or prefill_decode first")
        if self.disaggregation is Disaggregation.PREFILL_DECODE:
            return (Role.PREFILL, Role.DECODE)
        return (Role.UNIFIED,)


class CapacityEntry(_Spec):
    """Measured or computed SLO capacity of one replica: requests/s it sustains for one bucket."""

    model: str
    device: str = Field(description="accelerator id or '<id>:<profile>', e.g. 'a100-80gb:3g.40gb'")
    pool: str | None = Field(None, description="the one pool the row holds for (e.g. spot GPUs that serve less); "
                                               "None = every pool of the device; a pool's row wins")
    tp: StrictInt = Field(1, ge=1)
    role: Role = Role.UNIFIED
    bucket: str | None = Field(None, description="bucket label; None = every bucket of the model")
    requests_per_s: float = Field(ge=0)


class SolverSettings(_Spec):
    """HiGHS limits and the weights of the objective."""

    time_limit_s: float = Field(10.0, gt=0)
    mip_gap: float | None = Field(
        None, ge=0, lt=1, description="relative gap at which the solve may stop; default: the proven optimum of a "
                                      "small MILP (one model, or at most 100 integer columns) when HiGHS finds it "
                                      "within half the time limit, else 0.01")
    headroom: float = Field(0.1, ge=0, lt=10, description="replicas cover demand × (1 + headroom)")
    churn_weight: float = Field(0.0, ge=0, description="$/hour charged per replica added or removed vs --current")
    max_inventory_gpus: StrictInt = Field(
        100_000, ge=1, description="the most GPUs (nodes × GPUs per node) the pools may hold together: a plan lays "
                                   "out every node and GPU of a pool it uses")
    max_variables: StrictInt = Field(
        1_000_000, ge=1, description="the most MILP columns (replica counts and bucket shares) a plan may take; "
                                     "the 10,000-GPU, 200-model benchmark takes about 68,000")


class ClusterSpec(_Spec):
    """Everything one solve needs besides the current plan."""

    name: str = "plan"
    pools: list[PoolSpec] = Field(min_length=1)
    models: list[ModelSpec] = Field(min_length=1)
    capacities: list[CapacityEntry] | None = Field(
        None, description="capacities given directly; models without entries are computed by the capacity search")
    accelerators: list[OpaqueAccelerator] = Field(
        default_factory=list, description="accelerator types the catalog lacks, served by capacity rows only")
    solver: SolverSettings = SolverSettings()

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSpec:
        for kind, names in (("pool", [p.name for p in self.pools]), ("model", [m.name for m in self.models]),
                            ("accelerator", [a.id for a in self.accelerators])):
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"{kind} names repeat: {repeated}")
        split = {m.name for m in self.models if m.objectives}
        measured = sorted({row.model for row in self.capacities or () if row.model in split})
        if measured:
            raise ValueError(f"models {measured} have objectives and capacity rows: rows are measured at one SLO, "
                             "each objective is planned at its own (drop the rows or the objectives)")
        return self

    def model(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)


def split_objectives(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` with each model that has objectives replaced by one model per objective, ``model/objective``:
    its SLO, its share of the rate, at most one replica of the model's minimum (best-effort objectives: none,
    they ride on the others' spare capacity)."""
    if not any(m.objectives for m in spec.models):
        return spec
    models: list[ModelSpec] = []
    for m in spec.models:
        if not m.objectives:
            models.append(m)
            continue
        for o in m.objectives:
            if o.best_effort:
                continue
            workload = m.workload.model_copy(update={"rate_rps": m.workload.rate_rps * o.demand_share})
            models.append(m.model_copy(update={"name": f"{m.name}/{o.name}", "model": m.source, "slo": o.slo,
                                               "workload": workload, "min_replicas": min(m.min_replicas, 1),
                                               "objectives": []}))
    return spec.model_copy(update={"models": models})
