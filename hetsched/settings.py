"""The root settings object: small groups with defaults, read from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs


@dataclass(frozen=True)
class StoreSettings:
    database_url: str = ""
    """SQLAlchemy URL; empty means a SQLite file in the user data directory (HETSCHED_DATABASE_URL)."""

    def resolved_url(self) -> str:
        if self.database_url:
            return self.database_url
        path = Path(platformdirs.user_data_dir("hetsched")) / "hetsched.sqlite"
        return f"sqlite:///{path}"


@dataclass(frozen=True)
class Settings:
    store: StoreSettings = field(default_factory=StoreSettings)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        return cls(store=StoreSettings(database_url=env.get("HETSCHED_DATABASE_URL", "")))
