"""The solved placement: what runs where, what it costs, and why.

A ``Plan`` is the boundary value the CLI, the web planner and the operator
share. It is plain pydantic and round-trips through JSON:
``Plan.model_validate(plan.model_dump(mode="json")) == plan``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from hetsched.optimizer.spec import Role
from hetsched.partition.types import MigDeviceGroup, PartitionGroup
from hetsched.specs.wire import OptionKey


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlanStatus(StrEnum):
    """How the solve ended. ``feasible`` = a plan within the time limit, gap not yet proven."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"


class GpuMode(StrEnum):
    """How one physical GPU is used: whole (alone or in a TP group), split, or idle."""

    WHOLE = "whole"
    MIG = "mig"
    PARTITIONED = "partitioned"
    IDLE = "idle"


class ConstraintKind(StrEnum):
    """Families of constraints an explanation can point at."""

    POOL_INVENTORY = "pool_inventory"
    SLO_CAPACITY = "slo_capacity"
    MIN_REPLICAS = "min_replicas"
    SPREAD = "spread"
    MEMORY = "memory"
    ALLOWED = "allowed"
    CHURN = "churn"


class ReplicaGroup(_Frozen):
    """``replicas`` identical replicas of one model on one accelerator config, role and pool."""

    model: str
    pool: str
    accelerator: str
    profile: str | None = Field(None, description="MIG profile or AMD partition; None for whole GPUs")
    device: str = Field(description="device id, e.g. 'h100-sxm' or 'h100-sxm:3g.40gb'")
    tp: int
    role: Role
    replicas: int
    gpus_per_replica: float = Field(description="whole-GPU equivalents one replica occupies (a 3g of 7 = 3/7)")
    capacity_rps: float = Field(description="requests/s all replicas sustain at SLO for the load mix assigned")
    load_rps: float = Field(description="requests/s assigned to this group")
    cost_per_hour: float


class BucketShare(_Frozen):
    """Fraction of one request-size bucket of a model served by one config and role."""

    model: str
    bucket: str
    device: str
    pool: str
    tp: int
    role: Role
    fraction: float
    rate_rps: float


class ModelPlan(_Frozen):
    """Everything planned for one model."""

    name: str
    demand_rps: float
    replicas: list[ReplicaGroup]
    split: list[BucketShare]
    cost_per_hour: float
    headroom: float = Field(description="(capacity − demand) / demand at SLO, the tightest role; 0 when no demand")


class PartitionInstance(_Frozen):
    """One partition of a GPU, a MIG instance or an AMD partition: its profile (MIG profile or AMD mode), where it
    starts (MIG: memory slice; AMD: partition index), and the replica on it (or idle)."""

    profile: str
    start: int
    model: str | None = None
    role: Role | None = None


class GpuPlan(_Frozen):
    """One physical GPU of a node."""

    index: int
    mode: GpuMode
    model: str | None = Field(None, description="model of the whole-GPU replica using it")
    role: Role | None = None
    partition: str | None = Field(None, description="AMD compute_memory mode when partitioned")
    instances: list[PartitionInstance] = Field(default_factory=list, description="MIG instances or AMD partitions")


class ReplicaPlacement(_Frozen):
    """One replica on concrete GPUs (and, for MIG or partitions, a concrete instance)."""

    model: str
    role: Role
    device: str
    tp: int
    gpus: list[int]
    instance_start: int | None = Field(None, description="start memory slice of the MIG instance / partition index")


class NodePlan(_Frozen):
    """One node: its GPUs, the replicas on them and the MIG manager config it needs."""

    name: str
    pool: str
    accelerator: str
    gpus: list[GpuPlan]
    replicas: list[ReplicaPlacement]
    mig_config: str | None = Field(None, description="key into the plan's mig-parted config; None = MIG off")
    partition_profile: str | None = Field(
        None, description="key into the plan's AMD Device Config Manager profiles; None = not an AMD split pool")


class PoolUsage(_Frozen):
    """Use and cost of one pool."""

    pool: str
    accelerator: str
    price_per_hour: float
    gpus_total: int
    gpus_used: int
    gpus_mig: int
    cost_per_hour: float


class SolverStats(_Frozen):
    """What HiGHS reported, and the problem size."""

    status: PlanStatus
    message: str
    objective: float | None
    bound: float | None
    gap: float | None
    time_s: float
    variables: int
    integer_variables: int
    constraints: int


class BindingConstraint(_Frozen):
    """A constraint at (or within a rounding step of) its limit in the solution."""

    kind: ConstraintKind
    subject: str = Field(description="the pool or model it concerns")
    detail: str


class CorrectionUsed(_Frozen):
    """The step-model correction the computed capacities of one replica config (model, device, TP) used."""

    model: str
    device: str
    tp: int
    correction_id: int
    label: str = Field(description="which correction, e.g. 'correction #3 (prefill x1.4, …; 412 observations, …)'")


class Explanation(_Frozen):
    """Why the plan looks the way it does, or why there is none."""

    binding: list[BindingConstraint] = Field(default_factory=list)
    infeasible: list[str] = Field(default_factory=list, description="computed reasons no plan exists")
    notes: list[str] = Field(default_factory=list)
    corrections: list[CorrectionUsed] = Field(
        default_factory=list, description="per replica config whose capacities were computed under a step-model "
                                          "correction, which one; the others used the bare step model (or rows)")


class Plan(_Frozen):
    """A solved placement plan."""

    name: str
    status: PlanStatus
    cost_per_hour: float
    objective: float | None = Field(None, description="cost per hour plus the churn penalty")
    replicas_moved: int = Field(0, description="replicas added or removed against the current plan")
    models: list[ModelPlan]
    nodes: list[NodePlan]
    pools: list[PoolUsage]
    cost_by_model: dict[str, float]
    mig_configs: dict[str, list[MigDeviceGroup]] = Field(
        default_factory=dict, description="mig-parted configs by name, as NodePlan.mig_config refers to them")
    partition_profiles: dict[str, list[PartitionGroup]] = Field(
        default_factory=dict,
        description="AMD Device Config Manager profiles by name, as NodePlan.partition_profile refers to them")
    solver: SolverStats
    explanation: Explanation

    def replica_counts(self) -> dict[OptionKey, int]:
        """Replicas per option: what churn is measured on."""
        return {OptionKey(g.model, g.pool, g.device, g.tp, g.role): g.replicas for m in self.models for g in m.replicas}
