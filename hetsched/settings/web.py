"""The web planner's section of the settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetsched.settings.server import ServerLimits


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
