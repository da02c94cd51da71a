"""Open a store: create the engine, bring the schema up to date, hand out sessions."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from hetsched.errors import BackendUnavailableError, InputError


@dataclass(frozen=True)
class Store:
    """An engine and a session factory over an up-to-date schema."""

    engine: Engine
    sessions: sessionmaker[Session]

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One unit of work: committed on success, rolled back entirely on any error."""
        with self.sessions.begin() as session:
            yield session


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("hetsched.store") / "migrations"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def open_store(url: str, *, migrate: bool = True) -> Store:
    """Connect to ``url`` and apply pending migrations (a new SQLite file is created, in a folder that exists)."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        folder = Path(url.removeprefix("sqlite:///").partition("?")[0]).parent
        if not folder.is_dir():
            raise InputError(f"the folder {folder} of the SQLite file does not exist; create it or name a file in a "
                             "folder that does", field="database_url")
    try:
        engine = create_engine(url, future=True)
    except (ArgumentError, ImportError) as exc:
        raise InputError(f"expected an SQLAlchemy URL such as sqlite:///plans.sqlite or "
                         f"postgresql+psycopg://user@host/db, got {url!r} ({exc})", field="database_url") from exc
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_foreign_keys)
    try:
        if migrate:
            with engine.begin() as connection:
                config = alembic_config(url)
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
    except OperationalError as exc:
        raise BackendUnavailableError(f"cannot open the database at {engine.url!r}: {exc.orig}") from exc
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"database error at {engine.url!r}: {exc}") from exc
    return Store(engine=engine, sessions=sessionmaker(engine, expire_on_commit=False))


def _sqlite_foreign_keys(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
