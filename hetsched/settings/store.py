"""The store's section of the settings: which database holds profiles, capacities and plans."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import platformdirs


def default_database_file() -> Path:
    """The SQLite file of a store no URL names, in the user data directory."""
    return Path(platformdirs.user_data_dir("hetsched")) / "hetsched.sqlite"


@dataclass(frozen=True)
class StoreSettings:
    database_url: str = ""
    """SQLAlchemy URL (HETSCHED_DATABASE_URL). Empty: the commands and the web planner use the SQLite file
    :func:`default_database_file`, and the operator records no plans."""

    def resolved_url(self) -> str:
        return self.database_url or f"sqlite:///{default_database_file()}"
