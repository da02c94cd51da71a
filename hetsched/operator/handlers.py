"""The kopf shell: watch, debounce, gather the observed state, call the pure functions, apply the difference.

Every watched change (Nodes, AcceleratorPools, ModelDeployments,
PlacementPlans, hetsched's Deployments, the InferencePool CRD) only *pokes*
one reconcile loop; after ``debounce_s`` of quiet it runs one pass over the
whole cluster:

    inventory → plan (solve) → PlacementPlan → autoscaling round (when due) → reconcile → changes → statuses

With autoscaling on, a timer asks for a round every ``interval_s`` and pokes
the loop; the pass runs the round on the Deployments and pods it listed
(:class:`ClusterAutoscaler`: scrape the Ready engine pods, decide) and
reconciles with the replicas it decided.

Leader election is kopf peering: every replica announces a distinct
priority in the peering object, all but the highest pause, and a paused
replica receives no watch events and runs no timers, so it neither
reconciles nor autoscales. When the leader's keep-alives stop, the next one resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import BaseModel, ValidationError

from hetsched.catalog import Catalog, load_catalog
from hetsched.catalog.types import Vendor
from hetsched.errors import HetschedError, InputError
from hetsched.operator.autoscaler import ClusterAutoscaler
from hetsched.operator.diff import changes
from hetsched.operator.inventory import PoolInventory, pool_condition, pool_inventory
from hetsched.operator.kube import ApiError, Connection, KubeClient
from hetsched.operator.objects import Action, Change, Observed, ReplicaAdjuster, keep_planned, key_of, labels_of
from hetsched.optimizer.objectives import join_objectives, objective_models
from hetsched.operator.planning import Solver, as_planned, bind_nodes, plan_hash, planning_input, spec_problems
from hetsched.operator.recorder import PlanRecorder
from hetsched.operator.reconcile import reconcile
from hetsched.operator.replicas import MANAGED
from hetsched.operator.resources import (
    AcceleratorPoolSpec,
    AcceleratorPoolStatus,
    Approval,
    ConditionStatus,
    ConditionType,
    ModelDeploymentStatus,
    PlacementPlanSpec,
    PlacementPlanStatus,
    set_condition,
)
from hetsched.operator.status import PlanState, is_settling, model_status, plan_status
from hetsched.optimizer.build import CapacitySource
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.spec import ClusterSpec
from hetsched.settings import Settings
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.settings.operator import OperatorSettings
from hetsched.specs.gateway import INFERENCE_GROUP, INFERENCE_POOL_PLURAL
from hetsched.specs.wire import (ACCELERATOR_POOL_PLURAL, API_VERSION, GROUP, MODEL_DEPLOYMENT_PLURAL,
                                 PLACEMENT_PLAN_PLURAL, VERSION, Label)
from hetsched.store import Store, open_store

log = logging.getLogger(__name__)

INFERENCE_POOL_CRD = f"{INFERENCE_POOL_PLURAL}.{INFERENCE_GROUP}"


def default_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
    """The placement optimizer, with the plan in force for the churn penalty."""
    from hetsched.optimizer.optimize import optimize

    return optimize(spec, current=current)


def default_capacity_source(store: Store | None) -> CapacitySource:
    """SLO capacities by simulation, cached in the store when the operator has one."""
    from hetsched.optimizer.capacity import SimulatedCapacity

    if store is None:
        return SimulatedCapacity()
    from hetsched.store.cache import cached_capacity_source

    return cached_capacity_source(store)


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def _plan_json(plan: Plan) -> dict[str, Any]:
    """A Plan as stored in a CR: without nulls, which a merge patch would turn into deletions."""
    return plan.model_dump(mode="json", exclude_none=True)


def _parse_plan(raw: Mapping[str, Any]) -> Plan | None:
    """The plan in force from a PlacementPlan's status; one that no longer parses is dropped, not fatal."""
    if not raw:
        return None
    try:
        return Plan.model_validate(raw)
    except ValidationError as exc:
        log.warning("ignoring an unreadable applied plan: %s", exc)
        return None


def _parse(model: type[BaseModel], raw: Mapping[str, Any] | None) -> Any:
    try:
        return model.model_validate(raw or {})
    except ValidationError:
        return model()


def _owner_of(change: Change, observed: Observed) -> str | None:
    """The ModelDeployment (``namespace/name``) a Deployment, Service, budget or InferencePool change is for; None:
    no model's."""
    labels = ((change.body or {}).get("metadata") or {}).get("labels") or {}
    if Label.MODEL not in labels:
        existing = [*observed.deployments, *observed.services, *observed.disruption_budgets,
                    *(observed.inference_pools or ())]
        labels = next((labels_of(o) for o in existing if key_of(o) == (change.namespace, change.name)), {})
    model = labels.get(Label.MODEL)
    return f"{change.namespace}/{model}" if model and change.namespace else None


@dataclass
class PassResult:
    """What one reconcile pass did."""

    applied: list[Change] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    settling: bool = False


class Operator:
    """State the handlers share: the client, the solver, and the debounced reconcile loop.

    ``store``, opened and migrated by the process at start-up, keeps the applied
    plans and caches the capacities; None: neither. ``autoscale`` says how the
    replicas follow the demand; None: they are what the plan says.
    """

    def __init__(self, client: KubeClient, config: OperatorSettings, *, solver: Solver = default_solver,
                 adjust: ReplicaAdjuster = keep_planned, catalog: Catalog | None = None,
                 capacity_source: CapacitySource | None = None, store: Store | None = None,
                 autoscale: AutoscaleSettings | None = None) -> None:
        self.client = client
        self.config = config
        self.solver = solver
        self.catalog = catalog or load_catalog()
        self.autoscaler: ClusterAutoscaler | None = None
        if autoscale is not None:
            if adjust is not keep_planned:
                raise InputError("give either a replica adjuster or autoscale settings, not both", field="adjust")
            self.autoscaler = ClusterAutoscaler(client, autoscale, catalog=self.catalog,
                                                capacity_source=capacity_source or default_capacity_source(store),
                                                namespace=config.namespace, store=store)
        self.adjust = adjust
        """The replicas of each planned group when the operator does not autoscale."""
        self.recorder = PlanRecorder(store) if store is not None else None
        self._poked = asyncio.Event()
        self.settling = False
        """The last pass left work in flight (rollouts, MIG configs, failed calls): re-check on the timer."""
        self.passes = 0
        self._last_solve: tuple[tuple[ClusterSpec, str, int], Plan] | None = None
        self._splitting = {vendor for vendor, where in ((Vendor.NVIDIA, config.mig_configmap),
                                                        (Vendor.AMD, config.dcm_configmap)) if where is not None}
        """Vendors whose GPUs may be split: those whose partitioning manager the operator has a ConfigMap for."""

    def poke(self) -> None:
        self._poked.set()

    async def run(self) -> None:
        """Forever: wait for a poke, let changes settle, run one pass."""
        while True:
            await self._poked.wait()
            await asyncio.sleep(self.config.debounce_s)
            self._poked.clear()
            try:
                result = await self.reconcile_once()
            except HetschedError as exc:
                log.warning("reconcile pass failed, retrying: %s", exc)
                result = PassResult(settling=True)
            except Exception:  # the loop must outlive any one bad pass
                log.exception("reconcile pass crashed, retrying")
                result = PassResult(settling=True)
            self.settling = result.settling or bool(result.failed)

    async def reconcile_once(self) -> PassResult:
        """One pass over the whole cluster (see the module docstring)."""
        self.passes += 1
        c, cfg = self.client, self.config
        nodes = await c.list("Node")
        pool_objs = await c.list("AcceleratorPool")
        md_objs = await c.list("ModelDeployment")
        plan_obj = await c.get("PlacementPlan", cfg.plan_name)
        observed = Observed(
            nodes=nodes, deployments=await c.list("Deployment", labels=MANAGED),
            services=await c.list("Service", labels=MANAGED),
            disruption_budgets=await c.list("PodDisruptionBudget", labels=MANAGED),
            pods=await c.list("Pod", labels=MANAGED),
            mig_configmap=await self._configmap(cfg.mig_configmap), dcm_configmap=await self._configmap(cfg.dcm_configmap),
            inference_pools=await self._inference_pools())

        pools = await self._inventory(pool_objs, nodes)
        planning = planning_input(md_objs, pools, name=cfg.plan_name, namespaces=cfg.serve_namespaces)
        spec = _parse(PlacementPlanSpec, (plan_obj or {}).get("spec")) if plan_obj else \
            PlacementPlanSpec(approval=cfg.default_approval)
        old_plan_status = _parse(PlacementPlanStatus, (plan_obj or {}).get("status"))
        applied = _parse_plan(old_plan_status.applied_plan)

        proposed, problem = None, planning.problem
        if planning.spec is not None:
            try:
                proposed = bind_nodes(await self._solve(planning.spec, applied, old_plan_status.applied_hash), pools)
            except HetschedError as exc:
                problem = f"the solve failed: {exc}"
        feasible = proposed is not None and proposed.status is not PlanStatus.INFEASIBLE
        new_hash = plan_hash(proposed) if feasible and proposed is not None else ""
        plan_obj = await self._write_proposal(plan_obj, spec, proposed, new_hash)
        spec = _parse(PlacementPlanSpec, plan_obj.get("spec"))
        approved = feasible and spec.approves(new_hash)
        target = proposed if approved else applied
        target_hash = new_hash if approved else old_plan_status.applied_hash
        state = PlanState(proposed=proposed, proposal_problem=problem,
                          awaiting_approval=feasible and not approved and new_hash != old_plan_status.applied_hash)

        if approved and proposed is not None and new_hash != old_plan_status.applied_hash and self.recorder:
            await self.recorder.record(cfg.plan_name, proposed, spec=planning.spec, digest=new_hash)

        adjust = self.adjust
        if self.autoscaler is not None:
            adjust = await self.autoscaler.adjuster(
                as_planned(planning.spec, target) if planning.spec is not None else None, planning.models, observed)
        desired = reconcile(target, observed, models=planning.models, pools=pools, catalog=self.catalog,
                            adjust=adjust, untouched={(r.namespace, r.name) for r in planning.rejected},
                            now=time.time(), epp_service=cfg.epp_service)
        todo = changes(desired, observed, mig_configmap=cfg.mig_configmap, dcm_configmap=cfg.dcm_configmap)
        result = PassResult()
        write_errors: dict[str, list[str]] = defaultdict(list)
        for change in todo:
            try:
                await self._apply(change)
                result.applied.append(change)
            except HetschedError as exc:
                problem = f"could not {change.action} {change.kind} {change.name}: {exc}"
                result.failed.append(problem)
                log.warning("%s", problem)
                owner = _owner_of(change, observed)
                if owner is not None:
                    write_errors[owner].append(problem)
        await self._events_for_changes(result.applied, md_objs, plan_obj)

        rejected = {r.key: r for r in planning.rejected}
        for obj in md_objs:
            meta = obj["metadata"]
            key = f"{meta.get('namespace')}/{meta['name']}"
            old = _parse(ModelDeploymentStatus, obj.get("status"))
            new = model_status(key, outcome=desired.models.get(key), rejected=rejected.get(key), state=state, old=old,
                               generation=meta.get("generation"), write_errors=write_errors.get(key, ()),
                               correction=self.autoscaler.corrections.get(key) if self.autoscaler else None)
            await self._write_status("ModelDeployment", obj, old, new)
        outcomes = list(desired.models.values())
        new_plan_status = plan_status(state=state, applied=target, applied_hash=target_hash, outcomes=outcomes,
                                      partition_nodes=desired.partition_nodes, pending_changes=len(todo), old=old_plan_status,
                                      generation=(plan_obj.get("metadata") or {}).get("generation"))
        if target is not None:
            new_plan_status = new_plan_status.model_copy(update={"applied_plan": _plan_json(target)})
        await self._write_status("PlacementPlan", plan_obj, old_plan_status, new_plan_status)
        result.settling = is_settling(outcomes, pending_changes=len(todo))
        return result

    async def _solve(self, spec: ClusterSpec, applied: Plan | None, applied_hash: str) -> Plan:
        """Solve in a worker thread (watches and peering keep-alives go on); the same input is solved once (a
        step-model correction that moved is a new input: the capacities changed). A model planned one class at a
        time comes back as one model (:func:`~hetsched.optimizer.objectives.join_objectives`)."""
        key = (spec, applied_hash, self.autoscaler.corrections_moved if self.autoscaler is not None else 0)
        if self._last_solve is not None and self._last_solve[0] == key:
            return self._last_solve[1]
        plan = join_objectives(await asyncio.to_thread(self.solver, spec, applied), objective_models(spec))
        self._last_solve = (key, plan)
        return plan

    async def _configmap(self, where: tuple[str, str] | None) -> dict[str, Any] | None:
        return None if where is None else await self.client.get("ConfigMap", where[1], namespace=where[0])

    async def _inference_pools(self) -> list[dict[str, Any]] | None:
        """hetsched's InferencePools; None where the API server has no such kind (a 404: the inference-extension
        CRDs are not installed), which only the models that ask for a pool notice."""
        try:
            return await self.client.list("InferencePool", labels=MANAGED)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def _inventory(self, pool_objs: Sequence[Mapping[str, Any]], nodes: Sequence[Mapping[str, Any]]) -> list[PoolInventory]:
        pools = []
        for obj in pool_objs:
            meta = obj["metadata"]
            old = _parse(AcceleratorPoolStatus, obj.get("status"))
            try:
                spec = AcceleratorPoolSpec.model_validate(obj.get("spec") or {})
            except ValidationError as exc:
                new = old.model_copy(update={"conditions": set_condition(
                    old.conditions, type=ConditionType.READY, status=ConditionStatus.FALSE, reason="InvalidSpec",
                    message=spec_problems(exc), generation=meta.get("generation"))})
                await self._write_status("AcceleratorPool", obj, old, new)
                continue
            pool = pool_inventory(meta["name"], spec, nodes, self.catalog, generation=meta.get("generation"),
                                  splitting=self._splitting)
            status, reason, message = pool_condition(pool)
            new = pool.status.model_copy(update={"conditions": set_condition(
                old.conditions, type=ConditionType.READY, status=status, reason=reason, message=message,
                generation=meta.get("generation"))})
            await self._write_status("AcceleratorPool", obj, old, new)
            pools.append(pool)
        return pools

    async def _write_proposal(self, plan_obj: dict[str, Any] | None, spec: PlacementPlanSpec, proposed: Plan | None,
                              new_hash: str) -> dict[str, Any]:
        """Create the PlacementPlan, or put a new feasible plan in it (manual approval starts over)."""
        name = self.config.plan_name
        if plan_obj is None:
            body = PlacementPlanSpec(approval=spec.approval)
            if new_hash and proposed is not None:
                body = body.model_copy(update={"plan": _plan_json(proposed), "plan_hash": new_hash})
            created = await self.client.create("PlacementPlan", adopt=MANAGED, body={
                "apiVersion": API_VERSION, "kind": "PlacementPlan",
                "metadata": {"name": name, "labels": MANAGED}, "spec": _dump(body)})
            return created or {"metadata": {"name": name}, "spec": _dump(body)}
        if new_hash and proposed is not None and new_hash != spec.plan_hash:
            update = {"plan": _plan_json(proposed), "planHash": new_hash, "approved": False}
            patched = await self.client.patch("PlacementPlan", name, {"spec": update})
            await self.client.post_event(plan_obj, type="Normal", reason="Planned",
                                         message=f"new plan {new_hash}: ${proposed.cost_per_hour:.2f}/h"
                                                 + (", waiting for approval" if spec.approval is Approval.MANUAL else ""),
                                         namespace=self.config.namespace)
            return patched or plan_obj
        return plan_obj

    async def _apply(self, change: Change) -> None:
        c = self.client
        if change.action is Action.CREATE and change.body is not None:
            await c.create(change.kind, change.body, namespace=change.namespace, adopt=MANAGED)
        elif change.action is Action.PATCH and change.body is not None:
            await c.patch(change.kind, change.name, change.body, namespace=change.namespace)
        elif change.action is Action.DELETE:
            await c.delete(change.kind, change.name, namespace=change.namespace)

    async def _write_status(self, kind: str, obj: Mapping[str, Any], old: BaseModel, new: BaseModel) -> None:
        if _dump(old) == _dump(new):
            return
        meta = obj.get("metadata") or {}
        await self.client.patch(kind, meta["name"], {"status": _dump(new)}, namespace=meta.get("namespace"),
                                subresource="status")
        await self._condition_events(obj, old, new)

    async def _condition_events(self, obj: Mapping[str, Any], old: BaseModel, new: BaseModel) -> None:
        before = {c.type: (c.status, c.reason) for c in getattr(old, "conditions", [])}
        for condition in getattr(new, "conditions", []):
            if before.get(condition.type) != (condition.status, condition.reason) and condition.message:
                bad = (condition.type == ConditionType.DEGRADED) == (condition.status == ConditionStatus.TRUE)
                await self.client.post_event(
                    obj, type="Warning" if bad and condition.status != ConditionStatus.UNKNOWN else "Normal",
                    reason=condition.reason, message=f"{condition.type}={condition.status.value}: {condition.message}",
                    namespace=self.config.namespace)

    async def _events_for_changes(self, applied: Sequence[Change], md_objs: Sequence[Mapping[str, Any]],
                                  plan_obj: Mapping[str, Any]) -> None:
        owners = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in md_objs}
        for change in applied:
            labels = ((change.body or {}).get("metadata") or {}).get("labels") or {}
            owner = owners.get((change.namespace, labels.get(Label.MODEL)), plan_obj)
            verb = change.action.past
            detail = ""
            if change.kind == "Deployment" and change.body and "replicas" in change.body.get("spec", {}):
                detail = f" ({change.body['spec']['replicas']} replicas)"
            if change.kind == "Node":
                detail = f" (MIG config {((change.body or {}).get('metadata') or {}).get('labels')})"
            await self.client.post_event(owner, type="Normal", reason=f"{verb}{change.kind}",
                                         message=f"{verb.lower()} {change.kind} {change.name}{detail}",
                                         namespace=self.config.namespace)


def build_registry(operator: Operator, connection: Connection) -> kopf.OperatorRegistry:
    """The kopf handlers: log in, start/stop the loop, and poke it on every watched change."""
    registry = kopf.OperatorRegistry()
    tasks: list[asyncio.Task[None]] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=connection.server, token=connection.token, scheme="Bearer" if connection.token else None,
                                   ca_path=connection.ca_path, insecure=connection.insecure,
                                   certificate_path=connection.certificate_path,
                                   private_key_path=connection.private_key_path,
                                   default_namespace=operator.config.namespace)

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = operator.config.retry.timeout_s * 3
        tasks.append(asyncio.create_task(operator.run(), name="hetsched reconcile loop"))
        operator.poke()

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await operator.client.aclose()

    def poke(**_: Any) -> None:
        operator.poke()

    @kopf.timer(GROUP, VERSION, PLACEMENT_PLAN_PLURAL, id="requeue", interval=operator.config.requeue_s,
                registry=registry)
    def requeue(**_: Any) -> None:
        """While work is in flight, re-check; a timer, so a paused (non-leader) replica does not."""
        if operator.settling:
            operator.poke()

    if operator.autoscaler is not None:
        autoscaler = operator.autoscaler

        @kopf.timer(GROUP, VERSION, PLACEMENT_PLAN_PLURAL, id="autoscale", interval=autoscaler.settings.interval_s,
                    when=lambda name, **_: name == operator.config.plan_name, registry=registry)
        async def autoscale(**_: Any) -> None:
            """Asks the next reconcile pass for an autoscaling round; a timer, so only the leader scales."""
            autoscaler.request_round()
            operator.poke()

    @kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", id="poke-inference-pool-crd",
                   when=lambda name, **_: name == INFERENCE_POOL_CRD, registry=registry)
    def inference_pool_crd(**_: Any) -> None:
        """The inference-extension CRDs installed (or removed): models that asked for a pool get it now."""
        operator.poke()

    for group, version, plural, labels in (("", "v1", "nodes", None),
                                           (GROUP, VERSION, ACCELERATOR_POOL_PLURAL, None),
                                           (GROUP, VERSION, MODEL_DEPLOYMENT_PLURAL, None),
                                           (GROUP, VERSION, PLACEMENT_PLAN_PLURAL, None),
                                           ("apps", "v1", "deployments", MANAGED)):
        kopf.on.event(group, version, plural, id=f"poke-{plural}", labels=labels, registry=registry)(poke)
    return registry


async def operate(connection: Connection, config: OperatorSettings, *, solver: Solver = default_solver,
                  adjust: ReplicaAdjuster = keep_planned, capacity_source: CapacitySource | None = None,
                  store: Store | None = None, peering: str | None = "hetsched", liveness: str | None = None,
                  autoscale: AutoscaleSettings | None = None, stop_flag: asyncio.Event | None = None,
                  ready_flag: asyncio.Event | None = None) -> None:
    """Run the operator until ``stop_flag`` is set (or a signal arrives); ``store`` comes open and migrated."""
    operator = Operator(KubeClient(connection, retry=config.retry), config, solver=solver, adjust=adjust,
                        capacity_source=capacity_source, store=store, autoscale=autoscale)
    await kopf.operator(registry=build_registry(operator, connection), clusterwide=True,
                        standalone=peering is None, peering_name=peering, priority=config.priority,
                        liveness_endpoint=liveness,
                        stop_flag=stop_flag, ready_flag=ready_flag)


def run_operator(connection: Connection, settings: Settings, *, peering: str | None, liveness: str | None) -> None:
    """Blocking entry of ``hetsched operator``: the store, when a URL names one, is opened (and migrated) here,
    once, before the loop starts."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = settings.store.database_url
    store = open_store(url) if url else None
    asyncio.run(operate(connection, settings.operator, store=store, peering=peering, liveness=liveness,
                        autoscale=settings.autoscale if settings.operator.autoscale else None))
