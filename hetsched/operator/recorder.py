"""The applied plans' history: each plan the operator applies goes to the shared store, beside the CLI's and web's."""

from __future__ import annotations

import asyncio
import logging

from hetsched.errors import BackendUnavailableError
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec
from hetsched.store import Store
from hetsched.store.plans import save_plan

log = logging.getLogger(__name__)


class PlanRecorder:
    """Keeps each applied plan in the shared store, off the event loop; a database outage only logs.

    The store comes open and migrated: the process opens it once at start-up.
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    async def record(self, name: str, plan: Plan, *, spec: ClusterSpec | None, digest: str) -> None:
        named = plan if plan.name == name else plan.model_copy(update={"name": name})
        try:
            await asyncio.to_thread(save_plan, self._store, spec, named, origin="operator",
                                    note=f"applied by the operator; plan hash {digest}")
        except BackendUnavailableError as exc:
            log.warning("could not store applied plan %s: %s", digest, exc)
