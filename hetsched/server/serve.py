"""uvicorn with a server's limits: keep-alive, head size, a timeout on the request head uvicorn lacks, and a
lingering close; and several server processes on one port.

The HTTP parser is httptools (C, llhttp) on uvloop where both are installed, else h11 (pure Python, about a
third of a small proxied request's CPU); each gets the same head timeout and lingering close, and httptools,
which uvicorn does not bound, a head size limit.
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
from typing import Any, ClassVar, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from hetsched.settings.server import ServerLimits

FAST_STACK = all(importlib.util.find_spec(name) is not None for name in ("httptools", "uvloop"))
"""httptools and uvloop are installed: serve with them."""


LINGER_S = 2.0
"""How long a connection closed with the client still sending goes on reading, to drop what it sends."""


class _LingeringTransport:
    """A transport whose ``close`` ends the output (a TCP half-close) and goes on reading until the client closes
    too, or ``LINGER_S`` has passed, before it closes the socket.

    A socket closed with input unread sends a reset, which can reach the client before it has read the answer:
    a 413 for a body too large, a 408 for a slow one. Reading on lets the client see the answer and the end of
    it. Everything else is the wrapped transport's.
    """

    write: Callable[[bytes], None]
    pause_reading: Callable[[], None]
    resume_reading: Callable[[], None]
    get_extra_info: Callable[..., Any]
    """The wrapped transport's own, bound once: the server calls them on every request and every chunk."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self.lingering = False
        self.write, self.get_extra_info = transport.write, transport.get_extra_info
        self.pause_reading, self.resume_reading = transport.pause_reading, transport.resume_reading

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        """Half-close and linger; a second close (a server shutting down) closes at once."""
        if self.lingering or not self._transport.can_write_eof():
            self._transport.close()
            return
        if self._transport.is_closing():
            return
        self.lingering = True
        self._transport.write_eof()
        self._transport.resume_reading()
        self._loop.call_later(LINGER_S, self._transport.close)


class _ConnectionLimits:
    """A timeout on the request head uvicorn lacks, and a lingering close, for a uvicorn HTTP protocol class
    (mixed in before it).

    uvicorn disarms its keep-alive timer on any byte received, so a client that sends a head one byte at a time
    holds a connection for ever; this timer runs from the connection's start, and again from each response's
    end, until a new request head is complete. Bytes that arrive on a closing connection are dropped unparsed.
    """

    head_timeout_s: ClassVar[float] = ServerLimits.header_timeout_s
    _head_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    cycle: Any
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's streams have its methods without subclassing it
        lingering = _LingeringTransport(stream, self.loop)
        super().connection_made(lingering)  # type: ignore[misc]  # the protocol after this mixin has it
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if not self.transport.is_closing() and self._head_fits(data):
            super().data_received(data)  # type: ignore[misc]  # the protocol after this mixin has it

    def _head_fits(self, data: bytes) -> bool:
        """Whether the request head, with what ``data`` adds to it, is within bounds (else it is refused)."""
        return True

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


class LimitedH11(_ConnectionLimits, H11Protocol):
    """uvicorn's h11 protocol with the head timeout and the lingering close."""


def _httptools_protocol(limits: ServerLimits) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpTools(_ConnectionLimits, HttpToolsProtocol):
        """uvicorn's httptools protocol with the head timeout, the lingering close, and a head of more than
        ``max_header_bytes`` refused with a 400 as h11's incomplete-event limit does."""

        head_timeout_s: ClassVar[float] = limits.header_timeout_s
        max_head_bytes: ClassVar[int] = limits.max_header_bytes
        _head_bytes: int | None = 0
        """Bytes of the request head so far; None from its end to the end of its request's body."""
        _head_tail: bytes = b""
        """The last bytes received of an incomplete head, where its closing blank line may have begun."""

        def _head_fits(self, data: bytes) -> bool:
            """Counts the bytes up to the head's closing blank line only: the body often arrives in the same
            read, and is bounded by the guard's body limit, not this one."""
            if self._head_bytes is None:
                return True
            seen = self._head_tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4 - len(self._head_tail)
            self._head_tail = seen[-3:]
            if self._head_bytes > self.max_head_bytes:
                self.send_400_response("Request head too large.")
                return False
            return True

        def on_headers_complete(self) -> None:
            self._head_bytes = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            """The next head begins after this request's body, which may still arrive after its response (a 404
            to a large POST): counting restarts here, not when the response ends."""
            self._head_bytes, self._head_tail = 0, b""
            super().on_message_complete()

    return LimitedHttpTools


def uvicorn_options(limits: ServerLimits) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` and ``uvicorn.Config`` that apply ``limits`` to connections."""
    if FAST_STACK:
        return {"http": _httptools_protocol(limits), "loop": "uvloop", "timeout_keep_alive": limits.keep_alive_s}
    protocol = type("LimitedH11", (LimitedH11,), {"head_timeout_s": limits.header_timeout_s})
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
