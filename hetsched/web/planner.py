"""The planner's operations over the store, the catalog and the optimizer; synchronous, no HTTP.

The ASGI app is a thin shell around a ``Planner``: it parses requests, runs
``compute`` in a worker thread under a deadline, and maps errors to statuses.
A solve past its deadline stops between two steps (DeadlineError) and frees its
thread. A solve is computed first and stored after, so a solve that times out
or fails leaves no plan in the store; the capacities it computed before it
stopped are cached whole, each in its own transaction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationError
from sqlalchemy import select

from hetsched.catalog import Accelerator, Catalog
from hetsched.errors import InputError, NotFoundError, SpecError
from hetsched.specs.files import parse_document
from hetsched.optimizer.build import CapacitySource, spec_catalog
from hetsched.optimizer.deadline import Deadline
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec, ModelSpec
from hetsched.specs.dtypes import DType
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import bundled_model_names, load_model, parse_model_json
from hetsched.store import Store
from hetsched.store.models import save_model
from hetsched.store.plans import save_plan
from hetsched.store.tables import CapacityRow, ModelRow, PlanRow, ProfileRow
from hetsched.web.export import dcm_config_json, mig_parted_and_node_labels_yaml, plan_resources, resources_yaml
from hetsched.web.schemas import (
    AcceleratorInfo,
    CapacityInfo,
    CorrectionInfo,
    MigInfo,
    MigProfileInfo,
    ModelInfo,
    ModelSource,
    PlanOrigin,
    PlanSummary,
    ProfileInfo,
    StoredPlan,
)
from hetsched.web.whatif import PlanDiff, WhatIfChanges, apply_changes, change_field, plan_diff

MAX_LIST = 500
"""Most rows one list call returns."""

MAX_GPUS = 4096
"""Most GPUs one web solve may plan over: packing time grows with the inventory, and a web solve must end."""


@dataclass(frozen=True)
class Planner:
    """Reads and acts on one store with one catalog; ``catalog`` has the price overrides applied."""

    store: Store
    catalog: Catalog
    list_prices: dict[str, float]
    """Catalog prices before the overrides, by accelerator id."""
    capacity_source: CapacitySource | None = None

    # --- read ------------------------------------------------------------------------------------------------

    def accelerators(self) -> list[AcceleratorInfo]:
        return [_accelerator_info(a, self.list_prices.get(a.id, a.price_per_hour))
                for a in self.catalog.accelerators.values()]

    def models(self) -> list[ModelInfo]:
        infos = [_model_info(load_model(name), ModelSource.BUNDLED) for name in bundled_model_names()]
        with self.store.transaction() as session:
            rows = session.scalars(select(ModelRow).order_by(ModelRow.name)).all()
            for row in rows:
                arch = parse_model_json(json.dumps(row.config), name=row.name, source=row.source)
                infos.append(_model_info(arch, ModelSource.UPLOADED, created_at=row.created_at))
        return infos

    def profiles(self, *, model: str | None = None, accelerator: str | None = None) -> list[ProfileInfo]:
        query = select(ProfileRow).order_by(ProfileRow.id.desc()).limit(MAX_LIST)
        if model:
            query = query.where(ProfileRow.model == model)
        if accelerator:
            query = query.where(ProfileRow.accelerator == accelerator)
        with self.store.transaction() as session:
            return [ProfileInfo(id=r.id, model=r.model, accelerator=r.accelerator, source=r.source,
                                backend=r.backend, tp=r.tp, created_at=r.created_at)
                    for r in session.scalars(query)]

    def capacities(self, *, model: str | None = None, device: str | None = None) -> list[CapacityInfo]:
        query = select(CapacityRow).order_by(CapacityRow.id.desc()).limit(MAX_LIST)
        if model:
            query = query.where(CapacityRow.model == model)
        if device:
            query = query.where(CapacityRow.device == device)
        with self.store.transaction() as session:
            return [_capacity_info(r) for r in session.scalars(query)]

    def plans(self, *, origin: PlanOrigin | None = None, limit: int = 100) -> list[PlanSummary]:
        query = select(PlanRow).order_by(PlanRow.id.desc()).limit(min(limit, MAX_LIST))
        if origin is not None:
            query = query.where(PlanRow.origin == origin.value)
        with self.store.transaction() as session:
            return [_summary(r) for r in session.scalars(query)]

    def plan(self, plan_id: int) -> StoredPlan:
        with self.store.transaction() as session:
            row = session.get(PlanRow, plan_id)
            if row is None:
                recent = [str(i) for i in session.scalars(select(PlanRow.id).order_by(PlanRow.id.desc()).limit(20))]
                raise NotFoundError("plan", str(plan_id), recent, hint="see GET /api/plans")
            try:
                return StoredPlan(**_summary(row).model_dump(),
                                  spec=ClusterSpec.model_validate(row.spec) if row.spec else None,
                                  plan=Plan.model_validate(row.plan))
            except ValidationError as exc:
                raise SpecError(f"stored plan {plan_id} does not match this version's plan format: "
                                f"{exc.errors()[0]['msg']}", field="plan") from exc

    # --- act -------------------------------------------------------------------------------------------------

    def upload_model(self, name: str, config: dict[str, object]) -> ModelInfo:
        """Validate a Hugging Face config.json and store it under ``name`` (replacing an upload of that name; of
        uploads racing on one name, the last is kept)."""
        if name in bundled_model_names():
            raise InputError(f"{name!r} is a bundled model; upload under another name", field="name")
        arch = parse_model_json(json.dumps(config), name=name, source=f"upload {name}")
        created_at = save_model(self.store, name, dict(config), source=f"upload {name}")
        return _model_info(arch, ModelSource.UPLOADED, created_at=created_at)

    def delete_model(self, name: str) -> None:
        with self.store.transaction() as session:
            row = session.get(ModelRow, name)
            if row is None:
                uploaded = session.scalars(select(ModelRow.name)).all()
                raise NotFoundError("uploaded model", name, uploaded)
            session.delete(row)

    def resolve(self, spec: ClusterSpec, *, deadline_s: float) -> ClusterSpec:
        """``spec`` ready for a web solve: within the size limit, uploaded models' configs inlined (so the stored
        spec re-solves on its own), and the solver's time limit no longer than the request's deadline."""
        try:
            self.check_size(spec)
        except InputError as exc:
            raise field_under("spec", exc) from exc
        if spec.solver.time_limit_s > deadline_s:
            spec = spec.model_copy(update={"solver": spec.solver.model_copy(update={"time_limit_s": deadline_s})})
        bundled = set(bundled_model_names())
        models: list[ModelSpec] = []
        with self.store.transaction() as session:
            for i, model in enumerate(spec.models):
                if model.config is None and model.source not in bundled:
                    row = session.get(ModelRow, model.source)
                    if row is None:
                        uploaded = session.scalars(select(ModelRow.name)).all()
                        raise InputError(str(NotFoundError("model", model.source, [*bundled, *uploaded],
                                                           hint="upload its config.json first")),
                                         field=f"spec.models[{i}].{'model' if model.model else 'name'}")
                    model = model.model_copy(update={"config": row.config})
                models.append(model)
        return spec.model_copy(update={"models": models})

    def check_size(self, spec: ClusterSpec) -> None:
        """Refuse inventories larger than one web solve should plan over; the field is relative to the spec.

        A node holds the pool's ``gpus_per_node``, else its accelerator's: the catalog's, or the spec's own entry
        for an opaque type (a type named nowhere counts one per node; the solve refuses it by name)."""
        accelerators = spec_catalog(spec, self.catalog).accelerators
        total = 0
        for i, pool in enumerate(spec.pools):
            known = accelerators.get(pool.accelerator)
            total += pool.nodes * (pool.gpus_per_node or (known.gpus_per_node if known else 1))
            if total > MAX_GPUS:
                raise InputError(f"the pools hold more than {MAX_GPUS} GPUs, more than one web solve plans over; "
                                 "use 'hetsched plan' for larger inventories", field=f"pools[{i}].nodes")

    def parse_cluster_file(self, text: str, *, filename: str) -> ClusterSpec:
        """A cluster file's text (YAML or JSON; hetsched's format or a Mélange-style profile) as a spec."""
        raw = parse_document(text, name=filename, field="text")
        return parse_cluster(raw, source=filename, catalog=self.catalog)

    def compute(self, spec: ClusterSpec, *, timeout_s: float, current: Plan | None = None) -> Plan:
        """Solve a resolved spec within ``timeout_s`` from now, else DeadlineError. CPU-bound; the app runs it in a
        worker thread."""
        return optimize(spec, catalog=self.catalog, current=current, capacity_source=self.capacity_source,
                        deadline=Deadline.after(timeout_s))

    def save(self, spec: ClusterSpec, plan: Plan, *, note: str) -> StoredPlan:
        row = save_plan(self.store, spec, plan, origin=PlanOrigin.WEB.value, note=note)
        return StoredPlan(**_summary(row).model_dump(), spec=spec, plan=plan)

    def what_if_spec(self, base: StoredPlan, changes: WhatIfChanges) -> ClusterSpec:
        if base.spec is None:
            raise InputError(f"plan {base.id} was stored without its spec, so it cannot be re-solved; "
                             "start from a plan made here or by 'hetsched plan --save'", field="plan_id")
        if changes.is_empty():
            raise InputError("no change given: set a price, a demand, a node count or partition_allowed", field="changes")
        try:
            spec = apply_changes(base.spec, changes)
        except InputError as exc:
            raise field_under("changes", exc) from exc
        try:
            self.check_size(spec)
        except InputError as exc:
            raise InputError(str(exc).removeprefix(f"{exc.field}: "),
                             field=f"changes.{change_field(spec, changes, exc.field) or 'nodes'}") from exc
        return spec

    @staticmethod
    def diff(base: StoredPlan, result: Plan) -> PlanDiff:
        return plan_diff(base.plan, result)

    def export_resources(self, plan_id: int, *, namespace: str, engine_image: str) -> str:
        stored = self.plan(plan_id)
        return resources_yaml(plan_resources(stored.spec, stored.plan, catalog=self.catalog, namespace=namespace,
                                             engine_image=engine_image))

    def export_mig_config(self, plan_id: int) -> str:
        return mig_parted_and_node_labels_yaml(self.plan(plan_id).plan)

    def export_dcm_config(self, plan_id: int) -> str:
        return dcm_config_json(self.plan(plan_id).plan)


def field_under(prefix: str, exc: InputError) -> InputError:
    """``exc`` with its field named inside ``prefix`` (``nodes.h100`` → ``changes.nodes.h100``)."""
    message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
    return InputError(message, field=f"{prefix}.{exc.field}" if exc.field else prefix)


def _capacity_info(row: CapacityRow) -> CapacityInfo:
    """A cached capacity, with the step-model correction its inputs name (none before corrections were kept)."""
    correction = row.inputs.get("correction")
    return CapacityInfo(id=row.id, model=row.model, device=row.device, tp=row.tp, requests_per_s=row.requests_per_s,
                        profile_id=row.profile_id, inputs=row.inputs, created_at=row.created_at,
                        correction=CorrectionInfo.model_validate(correction) if correction else None)


def _summary(row: PlanRow) -> PlanSummary:
    return PlanSummary(id=row.id, name=row.name, origin=row.origin, status=row.status,
                       cost_per_hour=row.cost_per_hour, note=row.note, created_at=row.created_at)


def _accelerator_info(acc: Accelerator, list_price: float) -> AcceleratorInfo:
    mig = None
    if acc.mig is not None:
        mig = MigInfo(compute_slices=acc.mig.compute_slices, memory_slices=acc.mig.memory_slices,
                      profiles=[MigProfileInfo(name=p.name, compute_slices=p.compute_slices,
                                               memory_slices=p.memory_slices, memory_gb=p.memory_gb,
                                               max_count=p.max_count, starts=list(p.starts))
                                for p in acc.mig.profiles])
    modes = acc.amd_partitions.valid_modes() if acc.amd_partitions is not None else []
    return AcceleratorInfo(id=acc.id, name=acc.name, vendor=acc.vendor.value, memory_gb=acc.memory_gb,
                           memory_tbs=acc.memory_tbs, bf16_tflops=acc.peak_tflops(DType.BF16),
                           price_per_hour=acc.price_per_hour, catalog_price_per_hour=list_price,
                           gpus_per_node=acc.gpus_per_node, splittable=mig is not None or bool(modes),
                           mig=mig, partition_modes=modes)


def _model_info(arch: ModelArch, source: ModelSource, *, created_at: datetime | None = None) -> ModelInfo:
    return ModelInfo(name=arch.name, source=source, model_type=arch.model_type, attention=arch.attention.value,
                     layers=arch.num_layers, total_params_b=arch.total_params / 1e9,
                     active_params_b=arch.active_params / 1e9, max_context=arch.max_context,
                     dtype=arch.dtype.value, created_at=created_at)
