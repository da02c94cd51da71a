"""Shared fixtures: stores on SQLite always, and on PostgreSQL when HETSCHED_TEST_DATABASE_URL is set."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from hetsched.store import Store, open_store

_BACKENDS = ["sqlite"] + (["postgresql"] if os.environ.get("HETSCHED_TEST_DATABASE_URL") else [])


@pytest.fixture(params=_BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A URL to an empty database: a SQLite file, or a fresh PostgreSQL database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hetsched.sqlite'}"
        return
    server = make_url(os.environ["HETSCHED_TEST_DATABASE_URL"])
    name = f"hetsched_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    opened = open_store(database_url)
    yield opened
    opened.engine.dispose()
