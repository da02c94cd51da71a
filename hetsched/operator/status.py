"""Statuses and conditions of ModelDeployments and PlacementPlans from what reconcile concluded (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from hetsched.operator.objects import ModelOutcome, PartitionNode
from hetsched.operator.planning import Rejected
from hetsched.operator.resources import (
    Condition,
    ConditionStatus,
    ConditionType,
    MigNodeStatus,
    ModelDeploymentStatus,
    PlacementEntry,
    PlacementPlanStatus,
    PlanPhase,
    RoleReplicas,
    set_condition,
)
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.spec import Role
from hetsched.partition.phases import PartitionPhase

TRUE, FALSE = ConditionStatus.TRUE, ConditionStatus.FALSE


@dataclass(frozen=True)
class PlanState:
    """The newest solved plan and the one in force."""

    proposed: Plan | None
    proposal_problem: str | None
    awaiting_approval: bool


def is_settling(outcomes: Sequence[ModelOutcome], *, pending_changes: int) -> bool:
    """Work is still in flight: changes were sent, or replicas are retiring, waiting for MIG or not yet Ready."""
    return bool(pending_changes) or any(o.retiring or o.waiting_partition or o.ready_replicas < o.planned_replicas
                                        for o in outcomes)


def _infeasible_message(plan: Plan) -> str:
    reasons = plan.explanation.infeasible or [plan.solver.message]
    return "no feasible plan: " + "; ".join(reasons)


def _pool_gone_message(pools: Sequence[str]) -> str:
    return (f"the plan in force places replicas on AcceleratorPool {', '.join(pools)}, which no longer exists; the "
            "running Deployments keep serving until a plan that serves the model elsewhere is applied")


def role_replicas(placement: Sequence[PlacementEntry]) -> list[RoleReplicas]:
    """Replicas per role of a disaggregated model (prefill first), every accelerator config together; none for a
    unified one."""
    roles = [r for r in (Role.PREFILL, Role.DECODE) if any(p.role == r for p in placement)]
    return [RoleReplicas(role=r.value, replicas=sum(p.replicas for p in placement if p.role == r),
                         ready_replicas=sum(p.ready_replicas for p in placement if p.role == r)) for r in roles]


def model_status(key: str, *, outcome: ModelOutcome | None, rejected: Rejected | None, state: PlanState,
                 old: ModelDeploymentStatus, generation: int | None, now: datetime | None = None,
                 write_errors: Sequence[str] = (), correction: str | None = None) -> ModelDeploymentStatus:
    """The status of one ModelDeployment, conditions moving only when their status flips; ``write_errors`` are the
    API server's refusals of this pass's writes for the model, which leave it not Applied but Degraded;
    ``correction`` says the step-model correction that last moved its plan (the ``Calibrated`` condition)."""
    conditions = list(old.conditions)

    def put(kind: ConditionType, status: ConditionStatus, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = set_condition(conditions, type=kind, status=status, reason=reason, message=message,
                                   generation=generation, now=now)

    if correction is not None:
        put(ConditionType.CALIBRATED, TRUE, "StepModelCorrected", correction)
    proposed = state.proposed
    placed = proposed is not None and any(m.name == key and m.replicas for m in proposed.models)
    if rejected is not None:
        put(ConditionType.PLANNED, FALSE, rejected.reason, rejected.message)
    elif proposed is None:
        put(ConditionType.PLANNED, FALSE, "NotPlanned", state.proposal_problem or "no plan yet")
    elif proposed.status is PlanStatus.INFEASIBLE:
        put(ConditionType.PLANNED, FALSE, "Infeasible", _infeasible_message(proposed))
    elif not placed:
        put(ConditionType.PLANNED, TRUE, "NoReplicasNeeded", "the plan places no replica (no demand, minReplicas 0)")
    else:
        cost = proposed.cost_by_model.get(key, 0.0)
        put(ConditionType.PLANNED, TRUE, "Solved", f"placed at ${cost:.2f}/h ({proposed.status.value})")

    out = outcome
    if state.awaiting_approval:
        put(ConditionType.APPLIED, FALSE, "AwaitingApproval",
            "a new PlacementPlan waits for approval: set spec.approved=true on it")
    elif out is None:
        put(ConditionType.APPLIED, FALSE, "NotApplied", "no plan in force for this model")
    elif write_errors:
        put(ConditionType.APPLIED, FALSE, "WriteFailed", "; ".join(write_errors))
    elif out.missing_pools:
        put(ConditionType.APPLIED, FALSE, "PoolGone", _pool_gone_message(out.missing_pools))
    elif out.failed_partition:
        put(ConditionType.APPLIED, FALSE, "MigConfigFailed", f"re-partitioning failed on {', '.join(out.failed_partition)}")
    elif out.waiting_partition:
        put(ConditionType.APPLIED, FALSE, "WaitingForMig",
            f"re-partitioning {'; '.join(out.waiting_reasons or out.waiting_partition)}")
    elif out.retiring:
        put(ConditionType.APPLIED, FALSE, "RollingOut",
            f"old Deployments {', '.join(out.retiring)} serve until the new replicas are Ready")
    else:
        put(ConditionType.APPLIED, TRUE, "Applied", out.summary or "no replicas")

    if out is None:
        put(ConditionType.READY, FALSE, "NotApplied", "nothing runs for this model yet")
    elif out.planned_replicas == 0:
        put(ConditionType.READY, TRUE, "NoReplicasNeeded", "the plan runs no replica")
    elif out.ready_replicas >= out.planned_replicas and not out.retiring:
        put(ConditionType.READY, TRUE, "AllReplicasReady", f"{out.ready_replicas}/{out.planned_replicas} ready")
    else:
        put(ConditionType.READY, FALSE, "ReplicasNotReady",
            f"{min(out.ready_replicas, out.planned_replicas)}/{out.planned_replicas} of the planned replicas ready")

    if rejected is not None:
        put(ConditionType.DEGRADED, TRUE, rejected.reason,
            "the spec cannot be planned; what already runs keeps serving: " + rejected.message)
    elif write_errors:
        put(ConditionType.DEGRADED, TRUE, "WriteFailed", "; ".join(write_errors))
    elif out is not None and out.missing_pools:
        put(ConditionType.DEGRADED, TRUE, "PoolGone", _pool_gone_message(out.missing_pools))
    elif out is not None and out.failed_partition:
        put(ConditionType.DEGRADED, TRUE, "MigConfigFailed",
            f"re-partitioning (MIG or AMD partitions) failed on {', '.join(out.failed_partition)}; the old placement keeps serving")
    elif proposed is not None and proposed.status is PlanStatus.INFEASIBLE:
        put(ConditionType.DEGRADED, TRUE, "Infeasible", "the new plan is infeasible; the plan in force keeps serving")
    elif out is not None and out.gateway_problem:
        put(ConditionType.DEGRADED, TRUE, "InferencePoolCRDMissing", out.gateway_problem)
    else:
        put(ConditionType.DEGRADED, FALSE, "AsExpected", "")

    if out is None:
        return old.model_copy(update={"conditions": conditions, "observed_generation": generation})
    return old.model_copy(update={
        "replicas": out.desired_replicas, "ready_replicas": out.ready_replicas, "roles": role_replicas(out.placement),
        "cost_per_hour": out.cost_per_hour,
        "summary": out.summary, "placement": out.placement, "scaling_reasons": out.scaling_reasons,
        "observed_rps": None if out.observed_rps is None else round(out.observed_rps, 3),
        "slo_attainment": None if out.slo_attainment is None else round(out.slo_attainment, 4),
        "conditions": conditions, "observed_generation": generation})


def plan_status(*, state: PlanState, applied: Plan | None, applied_hash: str, outcomes: Sequence[ModelOutcome],
                partition_nodes: Sequence[PartitionNode], pending_changes: int, old: PlacementPlanStatus,
                generation: int | None, now: datetime | None = None) -> PlacementPlanStatus:
    """The PlacementPlan's phase: Proposed (awaiting approval), Applying, Applied, or Failed (MIG failed)."""
    failed = [m for m in partition_nodes if m.phase is PartitionPhase.FAILED]
    if failed:
        phase, reason = PlanPhase.FAILED, "MigConfigFailed"
        message = "; ".join(f"{m.node}: {m.message}" for m in failed)
    elif state.awaiting_approval:
        phase, reason, message = PlanPhase.PROPOSED, "AwaitingApproval", "set spec.approved=true to apply this plan"
    elif applied is None:
        phase, reason, message = PlanPhase.PROPOSED, "NotApplied", state.proposal_problem or "nothing to apply"
    elif is_settling(outcomes, pending_changes=pending_changes):
        phase, reason = PlanPhase.APPLYING, "Applying"
        message = f"{pending_changes} changes sent; waiting for replicas and GPU partitioning"
    else:
        phase, reason, message = PlanPhase.APPLIED, "Applied", "every replica is Ready"
    conditions: list[Condition] = set_condition(
        list(old.conditions), type=ConditionType.APPLIED, status=TRUE if phase is PlanPhase.APPLIED else FALSE,
        reason=reason, message=message, generation=generation, now=now)
    return old.model_copy(update={
        "phase": phase, "applied_hash": applied_hash, "message": message,
        "cost_per_hour": round(applied.cost_per_hour, 4) if applied else None,
        "replicas": sum(o.desired_replicas for o in outcomes), "models": len(outcomes),
        "mig": [MigNodeStatus(node=m.node, config=m.config, state=m.phase.value) for m in partition_nodes],
        "conditions": conditions, "observed_generation": generation})
