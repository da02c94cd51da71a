"""The root settings object: one section per component, each a small group with defaults.

The environment is read here and nowhere else (:meth:`Settings.from_env`); a command's flags then override
the section they concern. The router is configured by its own file (:mod:`hetsched.router.config`).

===============================  =========================================
variable                         setting
===============================  =========================================
HETSCHED_DATABASE_URL            ``store.database_url``, ``operator.database_url``
HETSCHED_WEB_TOKEN, _SOLVE_...   ``web.*`` (see :class:`WebSettings`)
HETSCHED_PRICES                  ``web.prices``
HETSCHED_NAMESPACE               ``operator.namespace``
HETSCHED_AUTOSCALE               ``operator.autoscale`` on (default) or off
===============================  =========================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from hetsched.autoscale.settings import AutoscaleSettings
from hetsched.errors import InputError
from hetsched.operator.config import OperatorConfig
from hetsched.server.limits import ServerLimits

if TYPE_CHECKING:
    from hetsched.store import Store


@dataclass(frozen=True)
class StoreSettings:
    database_url: str = ""
    """SQLAlchemy URL; empty means a SQLite file in the user data directory (HETSCHED_DATABASE_URL)."""

    def resolved_url(self) -> str:
        if self.database_url:
            return self.database_url
        path = Path(platformdirs.user_data_dir("hetsched")) / "hetsched.sqlite"
        return f"sqlite:///{path}"

    def open(self) -> Store:
        """The store these settings name, migrated to the current schema (the default file's folder is created)."""
        from hetsched.store import open_store  # SQLAlchemy and Alembic load only for commands that use the store

        if not self.database_url:
            Path(platformdirs.user_data_dir("hetsched")).mkdir(parents=True, exist_ok=True)
        return open_store(self.resolved_url())


@dataclass(frozen=True)
class WebSettings:
    host: str = "127.0.0.1"
    """Interface ``hetsched web`` listens on."""
    port: int = 8080
    """TCP port of ``hetsched web``."""
    token: str = ""
    """Bearer token every API route but /api/info requires; empty means no auth (HETSCHED_WEB_TOKEN)."""
    solve_timeout_s: float = 60.0
    """A solve still running after this long is answered with a timeout (HETSCHED_WEB_SOLVE_TIMEOUT_S)."""
    max_body_bytes: int = 2_000_000
    """Request bodies larger than this are refused with 413 (HETSCHED_WEB_MAX_BODY_BYTES)."""
    body_timeout_s: float = ServerLimits.body_timeout_s
    """A request body must arrive within this long, else 408 (HETSCHED_WEB_BODY_TIMEOUT_S)."""
    header_timeout_s: float = ServerLimits.header_timeout_s
    """A connection must send a request head within this long, else it is closed (HETSCHED_WEB_HEADER_TIMEOUT_S)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names accepted besides loopback ones; empty: any, unless the request came over loopback
    (HETSCHED_WEB_ALLOWED_HOSTS="planner.example,*.corp.example")."""
    prices: dict[str, float] = field(default_factory=dict)
    """Catalog price overrides per accelerator id, $/GPU-hour (HETSCHED_PRICES="h100-sxm=3.1,a10g=0.9")."""

    def limits(self) -> ServerLimits:
        return ServerLimits(max_body_bytes=self.max_body_bytes, body_timeout_s=self.body_timeout_s,
                            header_timeout_s=self.header_timeout_s, allowed_hosts=self.allowed_hosts)


@dataclass(frozen=True)
class Settings:
    store: StoreSettings = field(default_factory=StoreSettings)
    web: WebSettings = field(default_factory=WebSettings)
    operator: OperatorConfig = field(default_factory=OperatorConfig)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)
    """How the autoscaler moves, where no config file says otherwise (the operator's autoscaler starts from it)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        database_url = env.get("HETSCHED_DATABASE_URL", "")
        autoscale = AutoscaleSettings()
        operator = OperatorConfig(namespace=env.get("HETSCHED_NAMESPACE") or OperatorConfig.namespace,
                                  database_url=database_url or None,
                                  autoscale=autoscale if _flag(env, "HETSCHED_AUTOSCALE", True) else None)
        web = WebSettings(
            token=env.get("HETSCHED_WEB_TOKEN", ""),
            solve_timeout_s=_number(env, "HETSCHED_WEB_SOLVE_TIMEOUT_S", WebSettings.solve_timeout_s),
            max_body_bytes=int(_number(env, "HETSCHED_WEB_MAX_BODY_BYTES", WebSettings.max_body_bytes)),
            body_timeout_s=_number(env, "HETSCHED_WEB_BODY_TIMEOUT_S", WebSettings.body_timeout_s),
            header_timeout_s=_number(env, "HETSCHED_WEB_HEADER_TIMEOUT_S", WebSettings.header_timeout_s),
            allowed_hosts=tuple(h.strip() for h in env.get("HETSCHED_WEB_ALLOWED_HOSTS", "").split(",") if h.strip()),
            prices=_prices(env.get("HETSCHED_PRICES", "")),
        )
        return cls(store=StoreSettings(database_url=database_url), web=web, operator=operator, autoscale=autoscale)


_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A yes/no variable, spelt as command-line flags' values are (true/false, yes/no, on/off, 1/0); empty: unset."""
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text not in _TRUE | _FALSE:
        raise InputError(f"expected true or false (yes/no, on/off, 1/0), got {env[name]!r}", field=name)
    return text in _TRUE


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"expected a positive number, got {text!r}", field=name) from None
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"expected a finite positive number, got {text!r}", field=name)
    return value


def _prices(text: str) -> dict[str, float]:
    """``id=price`` pairs separated by commas."""
    prices: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        accelerator, _, price = item.partition("=")
        try:
            value = float(price)
        except ValueError:
            raise InputError(f"expected 'accelerator=price' pairs, got {item!r}", field="HETSCHED_PRICES") from None
        if not math.isfinite(value) or value < 0 or not accelerator.strip():
            raise InputError(f"expected 'accelerator=price' with a finite price >= 0, got {item!r}",
                             field="HETSCHED_PRICES")
        prices[accelerator.strip()] = value
    return prices
