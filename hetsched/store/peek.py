"""Reads made without opening the store: rows taken from its SQLite file with the standard library's sqlite3.

Opening the store imports SQLAlchemy and brings the schema up to date through Alembic, which takes longer than a
command a script calls once per shape (``estimate``, ``capacity`` on a cached answer) may take in all. Such a
command reads the few rows it needs here instead, from a SQLite file at the schema this code's migrations end at;
a file not there yet holds nothing, and is not created for a read. Any other store (PostgreSQL, a file at another
revision, one that cannot be read now) is not peeked at: the command opens it as usual, and the rows come from
there.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetsched.store.db import Store

Rows = list[tuple[Any, ...]]

_MIGRATION_FILE = re.compile(r"(?P<revision>[0-9]{4})_\w+\.py")
"""A migration is named ``<revision>_<what it does>.py``, each revision one more than the one it follows (a test
holds Alembic's head to it)."""


def schema_head() -> str:
    """The revision the shipped migrations end at."""
    names = (p.name for p in (resources.files("hetsched.store") / "migrations" / "versions").iterdir())
    return max(m["revision"] for name in names if (m := _MIGRATION_FILE.fullmatch(name)))


def sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite:///`` URL names; None for any other store, an in-memory one or one with options."""
    if not url.startswith("sqlite:///") or url == "sqlite:///:memory:" or "?" in url:
        return None
    return Path(url.removeprefix("sqlite:///"))


def peek(url: str, query: str, params: Sequence[object] = ()) -> Rows | None:
    """The rows ``query`` selects from the store at ``url`` without opening it; none from a SQLite file not there
    yet (in a folder that is); None when only the opened store can answer."""
    path = sqlite_file(url)
    if path is None:
        return None
    if not path.exists():
        return [] if path.parent.is_dir() else None  # opening says what is wrong with the folder
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as connection:
            revision = connection.execute("SELECT version_num FROM alembic_version").fetchone()
            if revision is None or revision[0] != schema_head():
                return None
            return connection.execute(query, tuple(params)).fetchall()
    except sqlite3.Error:  # not a database, locked by a writer, a table missing: the opened store will say
        return None


@dataclass
class StoreOnDemand:
    """The store at ``url``, read through :func:`peek` where it answers, and opened by ``open`` (once) when a read
    cannot be made so or something is to be written."""

    url: str
    open: Callable[[], Store]
    _opened: Store | None = field(default=None, init=False, repr=False)

    def peek(self, query: str, params: Sequence[object] = ()) -> Rows | None:
        return peek(self.url, query, params) if self._opened is None else None

    def opened(self) -> Store:
        if self._opened is None:
            self._opened = self.open()
        return self._opened
