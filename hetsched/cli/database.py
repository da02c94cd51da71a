"""The store every command but ``operator`` uses: the one ``HETSCHED_DATABASE_URL`` names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetsched.errors import InputError
from hetsched.settings import Settings

if TYPE_CHECKING:
    from hetsched.store import Store
    from hetsched.store.peek import StoreOnDemand

DATABASE_URL_VARIABLE = "HETSCHED_DATABASE_URL"


def store_from_env() -> Store:
    """The store the environment names; a bad URL is reported against the variable the user set, not a field."""
    from hetsched.store import open_configured_store  # SQLAlchemy and Alembic load only for commands that use it

    try:
        return open_configured_store(Settings.from_env().store)
    except InputError as exc:
        if exc.field != "database_url":
            raise
        raise InputError(str(exc).removeprefix(f"{exc.field}: "), field=DATABASE_URL_VARIABLE) from exc


def store_on_demand() -> StoreOnDemand:
    """The store the environment names, read from its file where that answers and opened (as
    :func:`store_from_env` opens it) only when something cannot be: a command that reads a cached answer or the
    calibrations loads no SQLAlchemy."""
    from hetsched.store.peek import StoreOnDemand

    return StoreOnDemand(url=Settings.from_env().store.resolved_url(), open=store_from_env)
