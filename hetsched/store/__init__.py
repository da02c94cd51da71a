"""Persistence: profiles, capacities and plans in SQL (SQLite by default, PostgreSQL shared)."""

from hetsched.store.db import Store, open_configured_store, open_store

__all__ = ["Store", "open_configured_store", "open_store"]
