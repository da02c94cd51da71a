"""Open a store: create the engine, bring the schema up to date, hand out sessions."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from hetsched.errors import BackendUnavailableError, InputError
from hetsched.settings.store import StoreSettings, default_database_file

UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeoutError)
"""What a database that cannot be reached or used raises: down, its connection dropped, locked, or out of
connections. A store error, not a fault in hetsched: try again later."""


@dataclass(frozen=True)
class Store:
    """An engine and a session factory over an up-to-date schema."""

    engine: Engine
    sessions: sessionmaker[Session]

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One unit of work: committed on success, rolled back entirely on any error.

        A database that cannot be reached or used is a BackendUnavailableError saying so, not a driver error
        quoting the SQL that met it."""
        try:
            with self.sessions.begin() as session:
                yield session
        except UNAVAILABLE as exc:
            raise BackendUnavailableError(f"the store at {self.engine.url!r} is unavailable ({reason(exc)}); "
                                          "try again when the database answers") from exc


def reason(exc: SQLAlchemyError) -> str:
    """What went wrong in the database's own words, first line only: never the statement or its parameters."""
    message = str(exc.orig) if isinstance(exc, DBAPIError) else str(exc)
    return message.strip().splitlines()[0] if message.strip() else type(exc).__name__


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("hetsched.store") / "migrations"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def shown_url(url: str) -> str:
    """``url`` with its password as ``***``, for messages and logs; also when it is not a URL SQLAlchemy parses."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"(://[^/@:]*:)[^@/]*@", r"\1***@", url)


def open_store(url: str, *, migrate: bool = True) -> Store:
    """Connect to ``url`` and apply pending migrations (a new SQLite file is created, in a folder that exists)."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        folder = Path(url.removeprefix("sqlite:///").partition("?")[0]).parent
        if not folder.is_dir():
            raise InputError(f"the folder {folder} of the SQLite file does not exist; create it or name a file in a "
                             "folder that does", field="database_url")
    try:
        engine = create_engine(url, future=True, pool_pre_ping=True)  # a connection dropped while idle is replaced
    except (ArgumentError, ImportError) as exc:
        raise InputError(f"expected an SQLAlchemy URL such as sqlite:///plans.sqlite or "
                         f"postgresql+psycopg://user@host/db, got {shown_url(url)!r} ({exc})", field="database_url") from exc
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_foreign_keys)
    try:
        if migrate:
            with engine.begin() as connection:
                _lock_for_migration(connection)
                config = alembic_config(url)
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
    except OperationalError as exc:
        raise BackendUnavailableError(f"cannot open the database at {engine.url!r}: {reason(exc)}") from exc
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"database error at {engine.url!r}: {reason(exc)}") from exc
    return Store(engine=engine, sessions=sessionmaker(engine, expire_on_commit=False))


def open_configured_store(settings: StoreSettings) -> Store:
    """The store the settings name, migrated; the folder of the default SQLite file is created for it."""
    if not settings.database_url:
        default_database_file().parent.mkdir(parents=True, exist_ok=True)
    return open_store(settings.resolved_url())


MIGRATION_LOCK_KEY = 0x6865747363686564
"""PostgreSQL advisory lock key ("hetsched") held while a process brings the schema up to date."""


def _lock_for_migration(connection: Connection) -> None:
    """Hold the database's write lock until this transaction ends, so processes that open a new database at
    once (the web planner and the operator starting together) migrate it one after another: the later ones
    find it up to date. On SQLite this also makes the migration's DDL one transaction."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
    elif connection.dialect.name == "sqlite":
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _sqlite_foreign_keys(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
