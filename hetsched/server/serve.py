"""uvicorn with a server's limits: keep-alive, head size, and a timeout on the request head uvicorn lacks."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from hetsched.server.limits import ServerLimits


class HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete in time.

    uvicorn disarms its keep-alive timer on any byte received, so a client that sends a head one byte at a time
    holds a connection for ever; this timer runs from the connection's start, and again from each response's
    end, until a new request head is complete.
    """

    head_timeout_s: ClassVar[float] = ServerLimits.header_timeout_s
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired, self.cycle)

    def _head_expired(self, cycle: RequestResponseCycle | None) -> None:
        """Close unless a request began since the timer started (or the one then running still runs)."""
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(limits: ServerLimits) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` and ``uvicorn.Config`` that apply ``limits`` to connections."""
    protocol = type("HeadTimeoutH11", (HeadTimeoutH11,), {"head_timeout_s": limits.header_timeout_s})
    return {"http": protocol, "timeout_keep_alive": limits.keep_alive_s,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
