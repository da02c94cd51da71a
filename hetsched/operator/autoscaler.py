"""The autoscaling loop inside the operator: engine pods' metrics → a decision → the reconcile pass's replica counts.

A kopf timer (in :mod:`hetsched.operator.handlers`) calls
:meth:`ClusterAutoscaler.step` every ``interval_s``; the decision reaches the
reconcile pass through :class:`~hetsched.operator.scaling.DecisionAdjuster`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from hetsched.autoscale.fleet import Fleet, build_fleet
from hetsched.autoscale.loop import Autoscaler, EngineScraper, Replica, placement_of
from hetsched.autoscale.policy import Decision
from hetsched.catalog import Catalog
from hetsched.errors import HetschedError
from hetsched.operator.kube import KubeClient
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.replicas import MANAGED, replicas_in_cluster
from hetsched.operator.scaling import DecisionAdjuster, ObservedApplier, ReadyOnly
from hetsched.optimizer.build import CapacitySource
from hetsched.optimizer.spec import ClusterSpec, Disaggregation
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import API_VERSION, OptionKey

log = logging.getLogger(__name__)


class ClusterAutoscaler:
    """The autoscaling loop inside the operator: engine pods' metrics → a decision → the reconcile's replica counts.

    A thin shell around :class:`~hetsched.autoscale.loop.Autoscaler`: it
    builds the fleet from the spec the last reconcile pass planned (unified
    models, ``auto`` ones by the plan in force; the others keep their planned replicas), lists hetsched's
    Deployments and pods, runs one step off the event loop and publishes the
    decision to :attr:`adjuster`, which the reconcile pass consults. Capacities
    come from ``capacity_source``, as the optimizer's do.
    """

    def __init__(self, client: KubeClient, settings: AutoscaleSettings, *, catalog: Catalog,
                 capacity_source: CapacitySource, namespace: str) -> None:
        self.client = client
        self.settings = settings
        self.catalog = catalog
        self.capacity_source = capacity_source
        self.namespace = namespace
        self.adjuster = DecisionAdjuster()
        self._planned: tuple[ClusterSpec, Mapping[str, ModelDeploymentRef]] | None = None
        self._fleet_for: ClusterSpec | None = None
        self._scaler: Autoscaler | None = None
        self._observed: list[Replica] = []
        self._wanted: dict[str, dict[OptionKey, int]] = {}

    def follow(self, spec: ClusterSpec | None, models: Mapping[str, ModelDeploymentRef]) -> None:
        """What the last reconcile pass planned: the models (and bounds) to scale from the next round on."""
        self._planned = (spec, dict(models)) if spec is not None else None

    async def step(self) -> bool:
        """One round; True when the replicas wanted changed (the caller reconciles)."""
        if self._planned is None:
            return False
        spec, models = self._planned
        scaler = await self._scaler_for(spec, models)
        if scaler is None:
            return False
        keys = [o.key for o in scaler.fleet.options]
        deployments = await self.client.list("Deployment", labels=MANAGED)
        pods = await self.client.list("Pod", labels=MANAGED)
        self._observed = replicas_in_cluster(deployments, pods, keys)
        placement = placement_of(self._observed)
        decision = await asyncio.to_thread(scaler.step)
        self.adjuster.publish(decision)
        wanted, before = _wanted(decision), self._wanted
        self._wanted = wanted
        moving = {key.model for key in decision.changes(placement)}
        for name, replicas in wanted.items():
            model = models.get(name)
            if model is not None and name in moving and replicas != before.get(name):
                await self.client.post_event(_involved(model), type="Normal", reason="Autoscaled",
                                             message=decision.model(name).message, namespace=self.namespace)
        return wanted != before

    async def _scaler_for(self, spec: ClusterSpec, models: Mapping[str, ModelDeploymentRef]) -> Autoscaler | None:
        """The autoscaler for ``spec``, rebuilt (in a worker thread: capacities may be searched) when it changed."""
        if spec == self._fleet_for:
            return self._scaler
        self._fleet_for, self._scaler = spec, None
        unified = [m for m in spec.models if m.disaggregation is Disaggregation.UNIFIED]
        if not unified:
            return None
        bounds = {m.name: bound for m in unified if m.name in models
                  and (bound := models[m.name].spec.scaling.max_replicas) is not None}
        try:
            fleet: Fleet = await asyncio.to_thread(build_fleet, spec.model_copy(update={"models": unified}),
                                                   self.catalog, max_replicas=bounds,
                                                   capacity_source=self.capacity_source)
        except HetschedError as exc:
            log.warning("autoscaling paused until the ModelDeployments change: %s", exc)
            return None
        self._scaler = Autoscaler(fleet, self.settings, ObservedApplier(lambda: list(self._observed)),
                                  ReadyOnly(EngineScraper(time.monotonic)))
        return self._scaler


def _wanted(decision: Decision) -> dict[str, dict[OptionKey, int]]:
    """Replicas per option of each model the decision acts on (no-signal models hold what they run)."""
    return {m.model: dict(m.desired) for m in decision.models}


def _involved(model: ModelDeploymentRef) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ModelDeployment",
            "metadata": {"name": model.name, "namespace": model.namespace, "uid": model.uid}}
