"""What-if: the same cluster spec with changed prices, demand or inventory, and the plan's difference.

Pure functions over the optimizer's boundary types; the web app calls them
around a solve, and nothing here touches the store or the network.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, computed_field, model_validator

from hetsched.errors import InputError
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.spec import ClusterSpec, ModelSpec, PoolSpec, Role, former_name


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WhatIfChanges(_Frozen):
    """Changes to a stored plan's spec; every key names a pool or a model of that spec (numbers finite)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    prices: dict[str, float] = Field(default_factory=dict, description="pool name → $/GPU-hour")
    demand: dict[str, float] = Field(default_factory=dict, description="model name → requests/s")
    nodes: dict[str, StrictInt] = Field(default_factory=dict, description="pool name → nodes; 0 removes the pool")
    partition_allowed: dict[str, bool] = Field(
        default_factory=dict, description="pool name → may its GPUs be partitioned (former name: mig_allowed)")

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        return former_name(data, "mig_allowed", "partition_allowed")

    def is_empty(self) -> bool:
        return not (self.prices or self.demand or self.nodes or self.partition_allowed)

    def summary(self) -> str:
        """A short line for the plan's note, e.g. ``price h100=3.5; demand llama=60``."""
        parts = [f"price {k}={v:g}" for k, v in self.prices.items()]
        parts += [f"demand {k}={v:g}" for k, v in self.demand.items()]
        parts += [f"nodes {k}={v}" for k, v in self.nodes.items()]
        parts += [f"mig {k}={'on' if v else 'off'}" for k, v in self.partition_allowed.items()]
        return "; ".join(parts)


def apply_changes(spec: ClusterSpec, changes: WhatIfChanges) -> ClusterSpec:
    """``spec`` with the changes applied; an unknown name or a bad value names its field."""
    pool_names = [p.name for p in spec.pools]
    model_names = [m.name for m in spec.models]
    for field, keys, known in (("prices", changes.prices, pool_names), ("demand", changes.demand, model_names),
                               ("nodes", changes.nodes, pool_names),
                               ("partition_allowed", changes.partition_allowed, pool_names)):
        for key in keys:
            if key not in known:
                raise InputError(f"no {'model' if field == 'demand' else 'pool'} {key!r} in the plan; "
                                 f"it has {sorted(known)}", field=f"{field}.{key}")
    for field, values in (("prices", changes.prices), ("demand", changes.demand), ("nodes", changes.nodes)):
        for key, value in values.items():
            if value < 0:
                raise InputError(f"expected a value >= 0, got {value}", field=f"{field}.{key}")
    removed = {name for name, n in changes.nodes.items() if n == 0}
    if len(removed) == len(pool_names):
        raise InputError("the what-if removes every pool; keep at least one", field="nodes")
    pools = [_pool(p, changes) for p in spec.pools if p.name not in removed]
    models = [_model(m, changes, removed) for m in spec.models]
    return spec.model_copy(update={"pools": pools, "models": models})


_CHANGED_BY = {("pools", "price_per_hour"): "prices", ("pools", "nodes"): "nodes",
               ("pools", "gpus_per_node"): "nodes", ("pools", "partition_allowed"): "partition_allowed",
               ("models", "workload"): "demand"}
"""The what-if change behind a field of the changed spec: a pool's price, node count (its GPUs too) or
partitioning, a model's load."""


def change_field(spec: ClusterSpec, changes: WhatIfChanges, field: str | None) -> str | None:
    """The what-if field an error about ``field`` of the changed ``spec`` (a path such as ``pools[1].nodes``)
    comes from, e.g. ``partition_allowed.l40s``; None when the what-if did not change it."""
    match = re.match(r"(pools|models)\[(\d+)\]\.(\w+)", field or "")
    if match is None:
        return None
    kind, index, attribute = match.group(1), int(match.group(2)), match.group(3)
    named = spec.pools if kind == "pools" else spec.models
    change = _CHANGED_BY.get((kind, attribute))
    if change is None or index >= len(named):
        return None
    name = named[index].name
    return f"{change}.{name}" if name in getattr(changes, change) else None


def _pool(pool: PoolSpec, changes: WhatIfChanges) -> PoolSpec:
    update: dict[str, object] = {}
    if pool.name in changes.prices:
        update["price_per_hour"] = changes.prices[pool.name]
    if pool.name in changes.nodes:
        update["nodes"] = changes.nodes[pool.name]
    if pool.name in changes.partition_allowed:
        update["partition_allowed"] = changes.partition_allowed[pool.name]
    return pool.model_copy(update=update)


def _model(model: ModelSpec, changes: WhatIfChanges, removed: set[str]) -> ModelSpec:
    update: dict[str, object] = {}
    if model.name in changes.demand:
        update["workload"] = model.workload.model_copy(update={"rate_rps": changes.demand[model.name]})
    if model.allowed_pools is not None and removed & set(model.allowed_pools):
        update["allowed_pools"] = [p for p in model.allowed_pools if p not in removed]
    return model.model_copy(update=update)


class CostChange(_Frozen):
    """Cost per hour of one pool or model before and after."""

    name: str
    before: float
    after: float

    @computed_field  # type: ignore[prop-decorator]  # mypy types no decorator over @property
    @property
    def delta(self) -> float:
        return self.after - self.before


class ReplicaChange(_Frozen):
    """Replicas of one (model, pool, device, TP, role) before and after; only differences are listed."""

    model: str
    pool: str
    device: str
    tp: int
    role: Role
    before: int
    after: int


class PlanDiff(_Frozen):
    """What changes from one plan to another: status, cost in total, by pool and by model, and replicas."""

    status_before: PlanStatus
    status_after: PlanStatus
    cost_before: float
    cost_after: float
    gpus_before: int
    gpus_after: int
    pools: list[CostChange]
    models: list[CostChange]
    replicas: list[ReplicaChange]

    @computed_field  # type: ignore[prop-decorator]  # mypy types no decorator over @property
    @property
    def cost_delta(self) -> float:
        return self.cost_after - self.cost_before

    @computed_field(  # type: ignore[prop-decorator]  # mypy types no decorator over @property
        description="replicas added plus replicas removed")
    @property
    def replicas_moved(self) -> int:
        return sum(abs(c.after - c.before) for c in self.replicas)


def plan_diff(before: Plan, after: Plan) -> PlanDiff:
    """The difference between two plans, keyed so that one row lines up with one replica group."""
    old, new = before.replica_counts(), after.replica_counts()
    changes = [ReplicaChange(model=k.model, pool=k.pool, device=k.device, tp=k.tp, role=k.role,
                             before=old.get(k, 0), after=new.get(k, 0))
               for k in sorted(set(old) | set(new))
               if old.get(k, 0) != new.get(k, 0)]
    return PlanDiff(
        status_before=before.status, status_after=after.status,
        cost_before=before.cost_per_hour, cost_after=after.cost_per_hour,
        gpus_before=sum(p.gpus_used for p in before.pools), gpus_after=sum(p.gpus_used for p in after.pools),
        pools=_cost_changes({p.pool: p.cost_per_hour for p in before.pools},
                            {p.pool: p.cost_per_hour for p in after.pools}),
        models=_cost_changes(before.cost_by_model, after.cost_by_model),
        replicas=changes,
    )


def _cost_changes(before: dict[str, float], after: dict[str, float]) -> list[CostChange]:
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, cost in before.items():
        merged[name][0] = cost
    for name, cost in after.items():
        merged[name][1] = cost
    return [CostChange(name=name, before=b, after=a) for name, (b, a) in merged.items()]
