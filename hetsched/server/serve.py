"""uvicorn with a server's limits: keep-alive, head size, and a timeout on the request head uvicorn lacks; and
several server processes on one port.

The HTTP parser is httptools (C, llhttp) on uvloop where both are installed, else h11 (pure Python, about a
third of a small proxied request's CPU); each gets the same head timeout, and httptools, which uvicorn does not
bound, a head size limit.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, ClassVar

import uvicorn
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # the protocol after this mixin has it
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # the protocol after this mixin has it
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]  # the protocol after this mixin has it

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


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve_processes(make_app: Callable[[], Any], *, host: str, port: int, workers: int,
                    options: dict[str, Any]) -> int:
    """Serve ``make_app()`` from ``workers`` processes on one port; returns the exit status.

    Each process builds its own app (its own event loop, connections and state) and listens on its own
    SO_REUSEPORT socket, so the kernel spreads new connections over them by a hash of the address pair; none
    passes requests to another. The parent holds the port (port 0: the one the kernel picks for it), stops every
    process on SIGINT or SIGTERM, and stops the others when one exits.
    """
    holder = reuseport_socket(host, port)  # bound, never listening: it takes no connections
    port = holder.getsockname()[1]
    context = multiprocessing.get_context("fork")  # the app's factory is a closure; each child builds its app
    children = [context.Process(target=_serve_child, args=(make_app, host, port, options), name=f"worker-{i}")
                for i in range(workers)]
    for child in children:
        child.start()

    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.is_alive() and child.pid is not None:  # a started process has its pid
                os.kill(child.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        wait([child.sentinel for child in children])
        failed = not stopping  # a process ended before anyone asked: stop the rest and say so
        stop(signal.SIGTERM, None)
        for child in children:
            child.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        holder.close()
    return 1 if failed else 0


def _serve_child(make_app: Callable[[], Any], host: str, port: int, options: dict[str, Any]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn installs its own, for a graceful stop
        signal.signal(sig, signal.SIG_DFL)
    sock = reuseport_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(make_app(), **options))
    server.run(sockets=[sock])
    sys.exit(0 if server.started else 1)
