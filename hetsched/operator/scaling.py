"""The operator's autoscaler seam: a round's decision as a ``ReplicaAdjuster`` over the plan's groups.

The operator reconciles one Deployment per planned (model, pool, device, TP,
role) group and asks a :data:`~hetsched.operator.objects.ReplicaAdjuster`
how many replicas each should run. :class:`DecisionAdjuster` answers from an
autoscaling round's :class:`~hetsched.autoscale.policy.Decision` (the one the
reconcile pass ran, or the last one before it); groups it has no word on
keep their planned count. Replicas it wants on a config the plan has no
Deployment for are named in the reasons: the next re-solve brings that
config into the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetsched.autoscale.policy import Decision, Reason
from hetsched.autoscale.signals import MetricsSource, PodSample, Replica
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.objects import ReplicaTarget, ScalingDecision


def scaling_for(decision: Decision | None, model: str, targets: Sequence[ReplicaTarget]) -> ScalingDecision:
    """Replicas per Deployment of ``model`` (its ClusterSpec/Plan name) as ``decision`` wants them.

    A model no pod reported fresh metrics for keeps the replicas it runs (the
    decision holds the counts it saw): stale metrics say nothing about load, so
    they must not undo a scale-up at once, past stabilization.
    """
    if decision is None or all(m.model != model for m in decision.models):
        return ScalingDecision()
    verdict = decision.model(model)
    planned = {(t.pool, t.device, t.tp, t.role): t for t in targets}
    replicas = {}
    reasons = [verdict.message]
    for key, count in sorted(verdict.desired.items()):
        target = planned.get((key.pool, key.device, key.tp, key.role))
        if target is not None:
            replicas[target.deployment] = count
        elif count > 0:
            reasons.append(f"wants {count} on {key.pool}/{key.device} TP={key.tp}, which the plan has no Deployment "
                           "for")
    seen = verdict.reason is not Reason.NO_SIGNALS
    return ScalingDecision(replicas=replicas, reasons=tuple(reasons), observed_rps=verdict.demand_rps if seen else None,
                           slo_attainment=verdict.attainment if seen else None)


@dataclass(frozen=True)
class DecisionAdjuster:
    """A ReplicaAdjuster that answers from one round's decision; None (no round yet): every group as planned."""

    decision: Decision | None

    def __call__(self, model: ModelDeploymentRef, targets: Sequence[ReplicaTarget]) -> ScalingDecision:
        return scaling_for(self.decision, model.key, targets)


@dataclass
class ReadyOnly:
    """Scrapes Ready replicas only: a starting pod serves nothing yet, and a placeholder has no address."""

    source: MetricsSource

    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        ready = [r for r in replicas if r.ready]
        waiting = [PodSample(pod=r.name, key=r.key, ready=False, scraped_at=0.0, metrics=None)
                   for r in replicas if not r.ready]
        return self.source.collect(ready, now=now) + waiting
