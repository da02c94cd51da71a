"""The root settings object: one section per component, each a small group with defaults in its own module.

The package is a leaf: it imports no component, so reading a database URL loads nothing else, and every
component may read its section. The environment is read here and nowhere else (:meth:`Settings.from_env`); a
command's flags, when given, replace the fields they name. The router is configured by its own file
(:mod:`hetsched.router.config`), with :class:`~hetsched.settings.server.ServerLimits` as its limits' defaults.

===============================  =========================================
variable                         setting
===============================  =========================================
HETSCHED_DATABASE_URL            ``store.database_url``
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

from hetsched.errors import InputError
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.settings.operator import OperatorSettings
from hetsched.settings.store import StoreSettings
from hetsched.settings.web import WebSettings

__all__ = ["AutoscaleSettings", "OperatorSettings", "Settings", "StoreSettings", "WebSettings"]


@dataclass(frozen=True)
class Settings:
    store: StoreSettings = field(default_factory=StoreSettings)
    web: WebSettings = field(default_factory=WebSettings)
    operator: OperatorSettings = field(default_factory=OperatorSettings)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)
    """How the autoscaler moves, where no config file says otherwise (the operator's autoscaler runs on it)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        operator = OperatorSettings(namespace=env.get("HETSCHED_NAMESPACE") or OperatorSettings.namespace,
                                    autoscale=_flag(env, "HETSCHED_AUTOSCALE", OperatorSettings.autoscale))
        web = WebSettings(
            token=env.get("HETSCHED_WEB_TOKEN", ""),
            solve_timeout_s=_number(env, "HETSCHED_WEB_SOLVE_TIMEOUT_S", WebSettings.solve_timeout_s),
            max_body_bytes=int(_number(env, "HETSCHED_WEB_MAX_BODY_BYTES", WebSettings.max_body_bytes)),
            body_timeout_s=_number(env, "HETSCHED_WEB_BODY_TIMEOUT_S", WebSettings.body_timeout_s),
            header_timeout_s=_number(env, "HETSCHED_WEB_HEADER_TIMEOUT_S", WebSettings.header_timeout_s),
            allowed_hosts=tuple(h.strip() for h in env.get("HETSCHED_WEB_ALLOWED_HOSTS", "").split(",") if h.strip()),
            prices=_prices(env.get("HETSCHED_PRICES", "")),
        )
        return cls(store=StoreSettings(database_url=env.get("HETSCHED_DATABASE_URL", "")), web=web, operator=operator)


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
