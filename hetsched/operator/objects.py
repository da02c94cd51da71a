"""What reconcile reads and returns: the objects the cluster shows, the objects it should hold with each model's
outcome, and the API calls that close the gap. Plain data; the labels it puts on what it creates are the wire
contract's (:mod:`hetsched.specs.wire`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.resources import PlacementEntry
from hetsched.optimizer.spec import Role
from hetsched.partition.phases import PartitionPhase


class Annotation:
    PLAN_HASH = "hetsched.io/plan-hash"
    MODEL_NAME = "hetsched.io/served-model"


@dataclass(frozen=True)
class Observed:
    """What the cluster shows: raw objects as the API returns them (only hetsched's, except nodes)."""

    nodes: Sequence[Mapping[str, Any]] = ()
    deployments: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    disruption_budgets: Sequence[Mapping[str, Any]] = ()
    pods: Sequence[Mapping[str, Any]] = ()
    mig_configmap: Mapping[str, Any] | None = None
    dcm_configmap: Mapping[str, Any] | None = None
    inference_pools: Sequence[Mapping[str, Any]] | None = ()
    """None: the API has no InferencePool kind (the inference-extension CRDs are not installed)."""


@dataclass(frozen=True)
class ReplicaTarget:
    """One Deployment's replica count as the plan has it: what the autoscaler may adjust."""

    deployment: str
    pool: str
    device: str
    tp: int
    role: Role
    planned: int


@dataclass(frozen=True)
class ScalingDecision:
    """Replicas by Deployment name (missing = as planned) and the reasons, recorded in status and events, with what
    the autoscaler saw of the model's live traffic (None: nothing seen)."""

    replicas: Mapping[str, int] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    observed_rps: float | None = None
    slo_attainment: float | None = None


ReplicaAdjuster = Callable[[ModelDeploymentRef, Sequence[ReplicaTarget]], ScalingDecision]
"""The autoscaler seam: given a model and its planned groups, the replicas to run and why."""


def keep_planned(model: ModelDeploymentRef, targets: Sequence[ReplicaTarget]) -> ScalingDecision:
    """The default adjuster: run what the plan says."""
    return ScalingDecision()


@dataclass(frozen=True)
class PartitionNode:
    """One planned node on its way to its MIG config or AMD partition profile."""

    node: str
    config: str
    phase: PartitionPhase
    message: str


@dataclass(frozen=True)
class ModelOutcome:
    """What reconcile concluded for one ModelDeployment; the shell writes it to status."""

    planned_replicas: int
    desired_replicas: int
    ready_replicas: int
    cost_per_hour: float
    placement: list[PlacementEntry]
    scaling_reasons: list[str]
    retiring: list[str]
    waiting_partition: list[str]
    failed_partition: list[str]
    observed_rps: float | None = None
    slo_attainment: float | None = None
    missing_pools: list[str] = field(default_factory=list)
    """AcceleratorPools the plan in force places the model on that no longer exist: what runs keeps running."""
    waiting_reasons: list[str] = field(default_factory=list)
    """Per node in ``waiting_partition``, what its re-partitioning waits for (on a drain, the pods still there)."""
    gateway_problem: str | None = None
    """Why the model's InferencePool cannot be made (the inference-extension CRDs are missing); the engines serve."""

    @property
    def summary(self) -> str:
        return ", ".join(f"{p.replicas}×{p.accelerator}{':' + p.profile if p.profile else ''}"
                         f"{'/tp' + str(p.tp) if p.tp > 1 else ''}{'/' + p.role if p.role != Role.UNIFIED else ''}"
                         for p in self.placement)


@dataclass(frozen=True)
class Desired:
    """The objects the cluster should hold, node label and taint changes, and per-model outcomes."""

    deployments: list[dict[str, Any]]
    services: list[dict[str, Any]]
    disruption_budgets: list[dict[str, Any]]
    node_labels: dict[str, dict[str, str | None]]
    """Per node, labels to set (None: remove)."""
    mig_configmap: dict[str, Any] | None
    partition_nodes: list[PartitionNode]
    models: dict[str, ModelOutcome]
    dcm_configmap: dict[str, Any] | None = None
    node_taints: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per node, its whole taint list where it must change."""
    inference_pools: list[dict[str, Any]] = field(default_factory=list)


class Action(StrEnum):
    CREATE = "create"
    PATCH = "patch"
    """A merge patch."""
    DELETE = "delete"

    @property
    def past(self) -> str:
        """The verb of the event that reports it: Created, Updated, Deleted."""
        return {Action.CREATE: "Created", Action.PATCH: "Updated", Action.DELETE: "Deleted"}[self]


@dataclass(frozen=True)
class Change:
    """One API call: create, patch (merge) or delete an object."""

    action: Action
    kind: str
    namespace: str | None
    name: str
    body: dict[str, Any] | None = None


def labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def key_of(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object."""
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


def ready_replicas(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def spec_replicas(deployment: Mapping[str, Any] | None) -> int:
    return int(((deployment or {}).get("spec") or {}).get("replicas") or 0)


def taints_of(node: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((node or {}).get("spec") or {}).get("taints") or [])
