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

The same scrapes teach each hardware's step-model correction
(:mod:`hetsched.operator.calibration`). When one moves past its threshold,
it is stored (the capacities the optimizer and this autoscaler search then
use it), an Event and a ``Calibrated`` condition say so on the
ModelDeployments it concerns, the fleet is rebuilt and the next pass plans
again.
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
from hetsched.autoscale.signals import PodSample
from hetsched.autoscale.step import ScaleMemory, placement_of, scale_step
from hetsched.catalog import Catalog
from hetsched.errors import HetschedError
from hetsched.operator.calibration import CorrectionMoved, FleetCalibration, correction_keys
from hetsched.operator.kube import KubeClient
from hetsched.operator.objects import Observed
from hetsched.operator.planning import ModelDeploymentRef
from hetsched.operator.replicas import replicas_in_cluster
from hetsched.operator.scaling import DecisionAdjuster, ReadyOnly
from hetsched.optimizer.build import CapacitySource
from hetsched.optimizer.spec import ClusterSpec, Disaggregation
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey
from hetsched.router.predict import EndpointProfile
from hetsched.router.profiles import arch_profile
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.model import ModelArch
from hetsched.specs.wire import API_VERSION, OptionKey
from hetsched.store import Store

log = logging.getLogger(__name__)


class ClusterAutoscaler:
    """The autoscaling round of the reconcile pass, and what it keeps between rounds.

    The fleet is built from the spec the pass plans (unified models, ``auto``
    ones by the plan in force; the others keep their planned replicas), with
    capacities from ``capacity_source``, as the optimizer's are; a new spec
    starts the windows and the policy's state afresh.
    """

    def __init__(self, client: KubeClient, settings: AutoscaleSettings, *, catalog: Catalog,
                 capacity_source: CapacitySource, namespace: str, store: Store | None = None) -> None:
        self.client = client
        self.settings = settings
        self.catalog = catalog
        self.capacity_source = capacity_source
        self.namespace = namespace
        self.store = store
        self.source = ReadyOnly(EngineScraper(time.monotonic))
        self.calibration = FleetCalibration(profile=self._profile, in_force=_stored_corrections(store),
                                            threshold=settings.correction_threshold)
        self.corrections: dict[str, str] = {}
        """Per model (``namespace/name``): the last correction that moved its plan, in words (its condition)."""
        self.corrections_moved = 0
        """How many times a correction moved: a new count is a new planning input."""
        self._archs: dict[CorrectionKey, ModelArch] = {}
        self._profiles: dict[CorrectionKey, EndpointProfile | None] = {}
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
        if self.settings.learn_corrections:
            await self._learn(spec, fleet, samples, models, now=now)
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

    async def _learn(self, spec: ClusterSpec, fleet: Fleet, samples: list[PodSample],
                     models: Mapping[str, ModelDeploymentRef], *, now: float) -> None:
        """Feed the round's scrapes to the calibration; act on every correction that moved."""
        keys = correction_keys(spec, fleet, {name: backend for name, model in models.items()
                                             if (backend := model.spec.engine.attention_backend)})
        self._archs.update({key: arch for key, arch in keys.values()})
        for change in self.calibration.observe(samples, {option: key for option, (key, _a) in keys.items()}, now=now):
            await self._moved(change, models)

    async def _moved(self, change: CorrectionMoved, models: Mapping[str, ModelDeploymentRef]) -> None:
        log.warning("%s", change.message)
        if self.store is not None:
            from hetsched.store.corrections import save_correction

            try:
                await asyncio.to_thread(save_correction, self.store, change.estimate,
                                        origin=f"hetsched operator, from the engine pods of {', '.join(change.models)}")
            except HetschedError as exc:
                log.warning("the correction of %s is used but not stored: %s", change.key.label, exc)
        self.corrections_moved += 1
        self._fleet_for = None  # capacities change with the step model: rebuild the fleet next round
        for name in change.models:
            self.corrections[name] = change.message
            model = models.get(name)
            if model is not None:
                await self.client.post_event(_involved(model), type="Normal", reason="StepModelCorrected",
                                             message=change.message, namespace=self.namespace)

    def _profile(self, key: CorrectionKey) -> EndpointProfile | None:
        """The step model ``key`` is predicted with (the operator's catalog, calibrated constants included)."""
        if key not in self._profiles:
            arch = self._archs.get(key)
            try:
                device = self.catalog.device(key.accelerator)
                perf = device.accelerator.perf
                self._profiles[key] = None if arch is None else arch_profile(
                    arch, key.accelerator, key.tp, perf=((device.accelerator.id, perf),) if perf else ())
            except HetschedError as exc:
                log.warning("no step model for %s, so no correction is learned for it: %s", key.label, exc)
                self._profiles[key] = None
        return self._profiles[key]

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


def _stored_corrections(store: Store | None) -> dict[CorrectionKey, StepCorrection]:
    """The corrections in force in the store, which the operator's estimates start from."""
    if store is None:
        return {}
    from hetsched.store.corrections import corrections_in_force

    try:
        return {key: stored.correction for key, stored in corrections_in_force(store).items()}
    except HetschedError as exc:
        log.warning("the stored corrections cannot be read, learning from the catalog's step model: %s", exc)
        return {}


def _wanted(decision: Decision) -> dict[str, dict[OptionKey, int]]:
    """Replicas per option of each model the decision acts on (no-signal models hold what they run)."""
    return {m.model: dict(m.desired) for m in decision.models}


def _involved(model: ModelDeploymentRef) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ModelDeployment",
            "metadata": {"name": model.name, "namespace": model.namespace, "uid": model.uid}}
