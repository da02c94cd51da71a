"""The operator's autoscaler seam: the latest decision as a ``ReplicaAdjuster`` over the plan's groups.

The operator reconciles one Deployment per planned (model, pool, device, TP,
role) group and asks a :data:`~hetsched.operator.objects.ReplicaAdjuster`
how many replicas each should run. :class:`DecisionAdjuster` answers from the
autoscaler's latest :class:`~hetsched.autoscale.policy.Decision` (published
by the loop that scrapes the pods); groups it has no word on keep their
planned count. Replicas it wants on a config the plan has no Deployment for
are named in the reasons: the next re-solve brings that config into the plan.

Wiring, in the operator's process (:class:`hetsched.operator.autoscaler.ClusterAutoscaler`)::

    adjuster = DecisionAdjuster()
    scaler = Autoscaler(fleet, settings,
                        ObservedApplier(lambda: replicas_in_cluster(deployments(), pods(), keys)),
                        ReadyOnly(EngineScraper(time.monotonic)))
    # every settings.interval_s: adjuster.publish(scaler.step()), and reconcile when it changed
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetsched.autoscale.loop import MetricsSource, Replica
from hetsched.autoscale.policy import Decision, Reason
from hetsched.autoscale.signals import PodSample
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


class DecisionAdjuster:
    """A ReplicaAdjuster backed by the most recent decision the autoscaling loop published."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decision: Decision | None = None

    def publish(self, decision: Decision) -> None:
        with self._lock:
            self._decision = decision

    def __call__(self, model: ModelDeploymentRef, targets: Sequence[ReplicaTarget]) -> ScalingDecision:
        with self._lock:
            decision = self._decision
        return scaling_for(decision, model.key, targets)


@dataclass
class ObservedApplier:
    """The loop's applier beside the operator: replicas are the pods it sees; changes go through the seam."""

    observe: Callable[[], list[Replica]]

    def replicas(self) -> list[Replica]:
        return self.observe()

    def start(self, key: object, count: int) -> None:
        """Nothing to do here: reconcile scales the Deployment when it next asks the adjuster."""

    def stop(self, key: object, count: int) -> None:
        """Nothing to do here: reconcile scales the Deployment when it next asks the adjuster."""


@dataclass
class ReadyOnly:
    """Scrapes Ready replicas only: a starting pod serves nothing yet, and a placeholder has no address."""

    source: MetricsSource

    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        ready = [r for r in replicas if r.ready]
        waiting = [PodSample(pod=r.name, key=r.key, ready=False, scraped_at=0.0, metrics=None)
                   for r in replicas if not r.ready]
        return self.source.collect(ready, now=now) + waiting
