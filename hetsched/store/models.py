"""Uploaded model configs in the store: one write that inserts or replaces, safe when uploads of a name race."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import Executable, select
from sqlalchemy.dialects import postgresql, sqlite

from hetsched.errors import BackendUnavailableError
from hetsched.store.db import Store
from hetsched.store.tables import ModelRow


def save_model(store: Store, name: str, config: dict[str, Any], *, source: str) -> datetime:
    """Store ``config`` under ``name``, replacing an upload of that name; returns when the name was first stored.

    One statement, not a look-up then an insert: two uploads of a new name at once both succeed and the later
    one's config is kept, where a look-up would let both insert and one fail on the duplicate name.
    """
    statement = _upsert(store.engine.dialect.name, name=name, config=config, source=source)
    with store.transaction() as session:
        session.execute(statement)
        return session.scalars(select(ModelRow.created_at).where(ModelRow.name == name)).one()


INSERTS: dict[str, Callable[[type[ModelRow]], postgresql.Insert | sqlite.Insert]] = {
    "postgresql": postgresql.insert, "sqlite": sqlite.insert}
"""Each backend's INSERT with ON CONFLICT (both spell it alike)."""


def _upsert(dialect: str, **values: Any) -> Executable:
    """The backend's INSERT of a model row that updates the row of the same name instead of failing on it."""
    insert = INSERTS.get(dialect)
    if insert is None:
        raise BackendUnavailableError(f"uploading models needs SQLite or PostgreSQL, not {dialect}")
    statement = insert(ModelRow).values(**values)
    return statement.on_conflict_do_update(index_elements=[ModelRow.name], set_={
        "config": statement.excluded.config, "source": statement.excluded.source})
