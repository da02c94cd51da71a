"""The servers' section of the settings: how much and how long a server reads from one client, and which names
it answers to. The router, the web planner and the simulated worker each hold one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """Limits one server puts on each connection and request."""

    max_body_bytes: int = 4 * 1024 * 1024
    """A request body larger than this is answered 413: at once when Content-Length says so, else at the limit."""
    body_timeout_s: float = 30.0
    """The whole body must arrive within this long after the request head; a slower client gets 408 and is cut off."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a whole request head this long after opening, or after its last response,
    is closed."""
    keep_alive_s: int = 5
    """An idle keep-alive connection is closed after this long (uvicorn's ``timeout_keep_alive``)."""
    max_header_bytes: int = 64 * 1024
    """A request head larger than this is refused (uvicorn's ``h11_max_incomplete_event_size``)."""
    allowed_hosts: tuple[str, ...] = ()
    """Names the Host header may carry besides the loopback ones (DNS-rebinding guard). Empty: a request that
    arrived on a loopback address must name a loopback host, others may name any; set: every request must name
    one of these or a loopback host. ``*.example.com`` names its subdomains, ``*`` any host."""
