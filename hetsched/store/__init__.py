"""Persistence: profiles, capacities and plans in SQL (SQLite by default, PostgreSQL shared).

The names below load :mod:`hetsched.store.db`, and SQLAlchemy with it, when first used, not with the package:
:mod:`hetsched.store.peek` reads a store's file without either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetsched.store.db import Store, open_configured_store, open_store

__all__ = ["Store", "open_configured_store", "open_store"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hetsched.store import db

        return getattr(db, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
