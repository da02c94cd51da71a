"""Where a server listens: loopback or beyond, the refusal to expose one without a token, and the banner's address."""

from __future__ import annotations

import functools
import ipaddress

from hetsched.errors import InputError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
"""Names of this machine only (as are any ``*.localhost`` and 127.0.0.0/8 address)."""
WILDCARDS = {"": "every interface", "0.0.0.0": "every IPv4 interface", "::": "every interface"}


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a Host header's name) is this machine only (cached: the guard asks
    it twice per request, of the few names a server sees)."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, *, has_token: bool, insecure: bool, exposes: str, token_hint: str) -> str | None:
    """None when listening on ``host`` is safe: loopback, or a token guards the server.

    Beyond loopback without a token: InputError, or with ``insecure`` the warning to print. ``exposes`` says
    what a stranger could then do, ``token_hint`` how to set a token.
    """
    if is_loopback(host) or has_token:
        return None
    where = f"{bind_address(host)}, beyond this machine,"
    if not insecure:
        raise InputError(f"refusing to listen on {where} without a token: anyone who reaches the port could "
                         f"{exposes}; {token_hint}, listen on 127.0.0.1, or pass --insecure", field="--host")
    return f"WARNING: listening on {where} without a token (--insecure): anyone who reaches the port can {exposes}"


def bind_address(host: str, port: int | None = None) -> str:
    """``host:port`` as the server binds it, naming a wildcard: ``0.0.0.0:8080 (every IPv4 interface)``."""
    shown = f"[{host}]" if ":" in host else host or "*"
    if port is not None:
        shown += f":{port}"
    return f"{shown} ({WILDCARDS[host]})" if host in WILDCARDS else shown
