"""The store: migrations on SQLite and PostgreSQL, all-or-nothing writes, clear connection errors."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, select

from hetsched.errors import BackendUnavailableError
from hetsched.store import Store, open_store
from hetsched.store.tables import PlanRow


def test_migrations_create_every_table(store: Store) -> None:
    tables = set(inspect(store.engine).get_table_names())
    assert {"models", "accelerators_seen", "profiles", "capacities", "plans", "alembic_version"} <= tables


def test_reopening_is_idempotent(database_url: str) -> None:
    open_store(database_url).engine.dispose()
    again = open_store(database_url)
    with again.transaction() as session:
        assert session.scalars(select(PlanRow)).all() == []
    again.engine.dispose()


def test_a_failed_transaction_leaves_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError):
        with store.transaction() as session:
            session.add(PlanRow(name="half", origin="cli", status="solved", spec={}, plan={}))
            session.flush()
            raise RuntimeError("interrupted")
    with store.transaction() as session:
        assert session.scalars(select(PlanRow)).all() == []


def test_unreachable_database_is_a_clear_error() -> None:
    with pytest.raises(BackendUnavailableError, match="cannot open the database"):
        open_store("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=1")


def test_malformed_url_names_the_field() -> None:
    from hetsched.errors import InputError

    with pytest.raises(InputError, match="^database_url: expected an SQLAlchemy URL"):
        open_store("not a url")
