"""uvicorn with a server's limits: keep-alive, head size, and a timeout on the request head uvicorn lacks.

The HTTP parser is httptools (C, llhttp) on uvloop where both are installed, else h11 (pure Python, about a
third of a small proxied request's CPU); each gets the same head timeout, and httptools, which uvicorn does not
bound, a head size limit.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from hetsched.server.limits import ServerLimits

FAST_STACK = all(importlib.util.find_spec(name) is not None for name in ("httptools", "uvloop"))
"""httptools and uvloop are installed: serve with them."""


class _HeadTimer:
    """A timeout on the request head, for a uvicorn HTTP protocol class (mixed in before it).

    uvicorn disarms its keep-alive timer on any byte received, so a client that sends a head one byte at a time
    holds a connection for ever; this timer runs from the connection's start, and again from each response's
    end, until a new request head is complete.
    """

    head_timeout_s: ClassVar[float] = ServerLimits.header_timeout_s
    _head_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    cycle: Any
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired, self.cycle)

    def _head_expired(self, cycle: RequestResponseCycle | None) -> None:
        """Close unless a request began since the timer started (or the one then running still runs)."""
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


class HeadTimeoutH11(_HeadTimer, H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete in time."""


def _httptools_protocol(limits: ServerLimits) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadLimitsHttpTools(_HeadTimer, HttpToolsProtocol):
        """uvicorn's httptools protocol with the head timer, and a head of more than ``max_header_bytes`` refused
        with a 400 as h11's incomplete-event limit does."""

        head_timeout_s: ClassVar[float] = limits.header_timeout_s
        max_head_bytes: ClassVar[int] = limits.max_header_bytes
        _head_bytes: int | None = 0
        """Bytes of the request head so far; None once it is complete."""

        def data_received(self, data: bytes) -> None:
            if self._head_bytes is not None:
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head_bytes:
                    self.send_400_response("Request head too large.")
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._head_bytes = None
            super().on_headers_complete()

        def _await_head(self) -> None:
            self._head_bytes = 0
            super()._await_head()

    return HeadLimitsHttpTools


def uvicorn_options(limits: ServerLimits) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` and ``uvicorn.Config`` that apply ``limits`` to connections."""
    if FAST_STACK:
        return {"http": _httptools_protocol(limits), "loop": "uvloop", "timeout_keep_alive": limits.keep_alive_s}
    protocol = type("HeadTimeoutH11", (HeadTimeoutH11,), {"head_timeout_s": limits.header_timeout_s})
    return {"http": protocol, "timeout_keep_alive": limits.keep_alive_s,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
