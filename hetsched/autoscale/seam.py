"""The operator's autoscaler seam: the latest decision as a ``ReplicaAdjuster`` over the plan's groups.

The operator reconciles one Deployment per planned (model, pool, device, TP,
role) group and asks a :data:`~hetsched.operator.reconcile.ReplicaAdjuster`
how many replicas each should run. :class:`DecisionAdjuster` answers from the
autoscaler's latest :class:`~hetsched.autoscale.policy.Decision` (published
by the loop that scrapes the pods); groups it has no word on keep their
planned count. Replicas it wants on a config the plan has no Deployment for
are named in the reasons: the next re-solve brings that config into the plan.

Wiring, in the operator's process::

    adjuster = DecisionAdjuster()
    scaler = Autoscaler(fleet, settings, ObservedApplier(lambda: replicas_from_pods(pods(), keys)),
                        EngineScraper(time.monotonic))
    # every settings.interval_s: adjuster.publish(scaler.step())
    operate(connection, config, adjust=adjuster)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetsched.autoscale.loop import Replica
from hetsched.autoscale.policy import Decision
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.reconcile import ReplicaTarget, ScalingDecision


def scaling_for(decision: Decision | None, model: str, targets: Sequence[ReplicaTarget]) -> ScalingDecision:
    """Replicas per Deployment of ``model`` (its ClusterSpec/Plan name) as ``decision`` wants them."""
    if decision is None or all(m.model != model for m in decision.models):
        return ScalingDecision()
    verdict = decision.model(model)
    planned = {(t.pool, t.device, t.tp, t.role): t for t in targets}
    replicas = {}
    reasons = [verdict.message]
    for (name, pool, device, tp, role), count in sorted(verdict.desired.items()):
        target = planned.get((pool, device, tp, role))
        if target is not None:
            replicas[target.deployment] = count
        elif count > 0:
            reasons.append(f"wants {count} on {pool}/{device} TP={tp}, which the plan has no Deployment for")
    return ScalingDecision(replicas=replicas, reasons=tuple(reasons))


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
