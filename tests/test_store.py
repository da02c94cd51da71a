"""The store: migrations on SQLite and PostgreSQL, all-or-nothing writes, clear connection errors."""

from __future__ import annotations

import multiprocessing
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, select, text

from hetsched.catalog import load_catalog
from hetsched.errors import BackendUnavailableError
from hetsched.store import Store, open_store
from hetsched.store.calibrations import list_calibrations
from hetsched.store.db import alembic_config
from hetsched.store.tables import CalibrationRow, PlanRow


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


def _open_when_released(url: str, start: Any, answers: Any) -> None:
    start.wait()
    try:
        open_store(url).engine.dispose()
        answers.put("ok")
    except Exception as exc:  # the parent reports what each process met
        answers.put(f"{type(exc).__name__}: {exc}")


def test_processes_opening_a_new_database_at_once_all_open_it(database_url: str) -> None:
    """The web planner and the operator starting together on an empty database: one migrates, the others wait
    and find it up to date."""
    context = multiprocessing.get_context("spawn")
    start, answers = context.Barrier(4), context.Queue()
    openers = [context.Process(target=_open_when_released, args=(database_url, start, answers)) for _ in range(4)]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join(60)
    assert [answers.get(timeout=5) for _ in openers] == ["ok"] * 4
    store = open_store(database_url)
    with store.engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    store.engine.dispose()


@pytest.mark.parametrize("url", ["postgresql+nodriver://alice:s3cret@db.example/plans",
                                 "postgresql+psycopg://alice:s3cret@127.0.0.1:1/plans?connect_timeout=1"])
def test_a_database_password_never_reaches_an_error_message(url: str) -> None:
    from hetsched.errors import HetschedError

    with pytest.raises(HetschedError) as caught:
        open_store(url)
    assert "s3cret" not in str(caught.value) and "alice:***@" in str(caught.value)


def test_a_calibration_stored_before_the_prefix_rate_reads_back_with_its_one_rate(database_url: str) -> None:
    old = load_catalog().get("a100-80gb").perf.to_dict()  # type: ignore[union-attr]
    del old["prefill_attention"]["prefix_efficiency"]
    command.upgrade(alembic_config(database_url), "0002")
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(CalibrationRow.__table__.insert().values(
            accelerator="a100-80gb", constants=old, residuals={}, profile_ids=[], trusted=True,
            created_at=datetime.now(timezone.utc)))
    engine.dispose()
    store = open_store(database_url)
    (stored,) = list_calibrations(store)
    prefill = stored.constants.prefill_attention
    assert prefill.prefix_efficiency == prefill.efficiency == old["prefill_attention"]["efficiency"]
    store.engine.dispose()
    command.downgrade(alembic_config(database_url), "0002")
    engine = create_engine(database_url)
    with engine.connect() as connection:
        (constants,) = connection.execute(select(CalibrationRow.__table__.c.constants)).scalars()
    engine.dispose()
    assert constants == old


def test_a_connection_dropped_while_idle_is_replaced(store: Store) -> None:
    """A database restart or an idle timeout closes pooled connections; the next transaction still succeeds."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no server to drop a connection")
    with store.transaction() as session:
        assert session.scalars(select(PlanRow)).all() == []
    admin = create_engine(store.engine.url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        dropped = connection.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                          "WHERE datname = :name"), {"name": store.engine.url.database}).scalar()
    admin.dispose()
    assert dropped == 1
    with store.transaction() as session:
        assert session.scalars(select(PlanRow)).all() == []


def test_a_locked_database_is_unavailable_without_the_sql(tmp_path: Path) -> None:
    path = tmp_path / "locked.sqlite"
    store = open_store(f"sqlite:///{path}?timeout=0.1")
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(BackendUnavailableError) as caught:
            with store.transaction() as session:
                session.add(PlanRow(name="p", origin="cli", status="solved", spec={}, plan={}))
        assert str(caught.value).endswith("is unavailable (database is locked); try again when the database answers")
        assert "INSERT" not in str(caught.value)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        store.engine.dispose()


def test_times_read_back_as_the_same_instant_in_utc(store: Store) -> None:
    """SQLite keeps no zone: without care a time reads back naive, or at another instant."""
    noon_in_paris = datetime(2024, 6, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    with store.transaction() as session:
        session.add_all([PlanRow(name="given", origin="cli", status="optimal", spec={}, plan={},
                                 created_at=noon_in_paris),
                         PlanRow(name="now", origin="cli", status="optimal", spec={}, plan={})])
    with store.transaction() as session:
        given, now = session.scalars(select(PlanRow.created_at).order_by(PlanRow.id)).all()
    assert given == noon_in_paris and given.tzinfo is timezone.utc and given.hour == 10
    assert now.tzinfo is timezone.utc and abs(datetime.now(timezone.utc) - now) < timedelta(minutes=1)
