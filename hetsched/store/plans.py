"""Plans in the store: one transactional write per solved plan, with the spec that produced it."""

from __future__ import annotations

from hetsched.errors import InputError
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.spec import ClusterSpec
from hetsched.store.db import Store
from hetsched.store.tables import NAME_LENGTH, PlanRow


def save_plan(store: Store, spec: ClusterSpec | None, plan: Plan, *, origin: str, note: str = "") -> PlanRow:
    """Store ``plan`` with its input (empty when unknown); returns the stored row. All or nothing."""
    if len(plan.name) > NAME_LENGTH:  # PostgreSQL refuses a longer one, SQLite would keep it: refuse on both
        raise InputError(f"a stored plan's name takes at most {NAME_LENGTH} characters, got {len(plan.name)}",
                         field="name")
    with store.transaction() as session:
        row = PlanRow(name=plan.name, origin=origin, status=plan.status.value,
                      cost_per_hour=None if plan.status is PlanStatus.INFEASIBLE else plan.cost_per_hour,
                      spec=spec.model_dump(mode="json") if spec else {}, plan=plan.model_dump(mode="json"), note=note)
        session.add(row)
        session.flush()
        return row

