"""Autoscaling in the operator's reconcile pass: the pods the pass listed → scrapes → one pure round → replicas.

A kopf timer (in :mod:`hetsched.operator.handlers`) asks for a round every
``interval_s`` and pokes the reconcile loop; nothing else. The pass that
follows hands :meth:`ClusterAutoscaler.adjuster` the plan it reconciles and
the Deployments and pods it listed. The shell finds the engine replicas
among them, scrapes the Ready ones, runs the pure
:func:`~hetsched.autoscale.step.scale_step` in a worker thread (a due
re-solve solves a MILP) and answers with a
:class:`~hetsched.operator.scaling.DecisionAdjuster` over the decision,
which ``reconcile`` asks for each planned Deployment's replicas. A pass
between two rounds (any other watched change) reuses the last decision, so
rounds keep the settings' cadence whatever else wakes the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from hetsched.autoscale.fleet import Fleet, build_fleet
from hetsched.autoscale.policy import Decision
from hetsched.autoscale.scrape import EngineScraper
from hetsched.autoscale.step import ScaleMemory, placement_of, scale_step
from hetsched.catalog import Catalog
from hetsched.errors import HetschedError
from hetsched.operator.kube import KubeClient
from hetsched.operator.objects import Observed
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.replicas import replicas_in_cluster
from hetsched.operator.scaling import DecisionAdjuster, ReadyOnly
from hetsched.optimizer.build import CapacitySource
from hetsched.optimizer.spec import ClusterSpec, Disaggregation
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import API_VERSION, OptionKey

log = logging.getLogger(__name__)


class ClusterAutoscaler:
    """The autoscaling round of the reconcile pass, and what it keeps between rounds.

    The fleet is built from the spec the pass plans (unified models, ``auto``
    ones by the plan in force; the others keep their planned replicas), with
    capacities from ``capacity_source``, as the optimizer's are; a new spec
    starts the windows and the policy's state afresh.
    """

    def __init__(self, client: KubeClient, settings: AutoscaleSettings, *, catalog: Catalog,
                 capacity_source: CapacitySource, namespace: str) -> None:
        self.client = client
        self.settings = settings
        self.catalog = catalog
        self.capacity_source = capacity_source
        self.namespace = namespace
        self.source = ReadyOnly(EngineScraper(time.monotonic))
        self._due = False
        self._fleet_for: ClusterSpec | None = None
        self._fleet: Fleet | None = None
        self._memory = ScaleMemory()
        self._decision: Decision | None = None
        self._wanted: dict[str, dict[OptionKey, int]] = {}

    def request_round(self) -> None:
        """The timer's tick: the next reconcile pass runs a round."""
        self._due = True

    async def adjuster(self, spec: ClusterSpec | None, models: Mapping[str, ModelDeploymentRef],
                       observed: Observed) -> DecisionAdjuster:
        """The replicas for this pass: a new round's when one is due, else the last round's.

        ``spec`` is what the pass plans (None: nothing to scale); ``observed``
        holds the Deployments and pods the pass listed. A round that fails is
        logged and the pass goes on with the last decision.
        """
        if self._due:
            self._due = False
            if spec is not None:
                try:
                    await self._round(spec, models, observed)
                except HetschedError as exc:
                    log.warning("autoscaling round failed, holding the last decision: %s", exc)
                except Exception:  # a broken round must not hold up the reconcile pass
                    log.exception("autoscaling round crashed, holding the last decision")
        return DecisionAdjuster(self._decision)

    async def _round(self, spec: ClusterSpec, models: Mapping[str, ModelDeploymentRef], observed: Observed) -> None:
        fleet = await self._fleet_of(spec, models)
        if fleet is None:
            return
        now = time.monotonic()
        replicas = replicas_in_cluster(observed.deployments, observed.pods, [o.key for o in fleet.options])
        placement = placement_of(replicas)
        samples = await asyncio.to_thread(self.source.collect, replicas, now=now)
        decision, self._memory = await asyncio.to_thread(scale_step, fleet, samples, placement,
                                                         settings=self.settings, now=now, memory=self._memory)
        self._decision = decision
        wanted, before = _wanted(decision), self._wanted
        self._wanted = wanted
        moving = {key.model for key in decision.changes(placement)}
        for name, replicas_by_option in wanted.items():
            model = models.get(name)
            if model is not None and name in moving and replicas_by_option != before.get(name):
                await self.client.post_event(_involved(model), type="Normal", reason="Autoscaled",
                                             message=decision.model(name).message, namespace=self.namespace)

    async def _fleet_of(self, spec: ClusterSpec, models: Mapping[str, ModelDeploymentRef]) -> Fleet | None:
        """The fleet for ``spec``, rebuilt (in a worker thread: capacities may be searched) when it changed."""
        if spec == self._fleet_for:
            return self._fleet
        self._fleet_for, self._fleet, self._memory = spec, None, ScaleMemory()
        unified = [m for m in spec.models if m.disaggregation is Disaggregation.UNIFIED]
        if not unified:
            return None
        bounds = {m.name: bound for m in unified if m.name in models
                  and (bound := models[m.name].spec.scaling.max_replicas) is not None}
        try:
            self._fleet = await asyncio.to_thread(build_fleet, spec.model_copy(update={"models": unified}),
                                                  self.catalog, max_replicas=bounds,
                                                  capacity_source=self.capacity_source)
        except HetschedError as exc:
            log.warning("autoscaling paused until the ModelDeployments change: %s", exc)
        return self._fleet


def _wanted(decision: Decision) -> dict[str, dict[OptionKey, int]]:
    """Replicas per option of each model the decision acts on (no-signal models hold what they run)."""
    return {m.model: dict(m.desired) for m in decision.models}


def _involved(model: ModelDeploymentRef) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ModelDeployment",
            "metadata": {"name": model.name, "namespace": model.namespace, "uid": model.uid}}
