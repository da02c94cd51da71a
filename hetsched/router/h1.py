"""A lean HTTP/1.1 client for the router's way to the engines: keep-alive connections in a deque per host, the
request written in one piece, the response parsed by httptools (llhttp, C) straight into raw header pairs and
body chunks.

The router sends one kind of request (a POST or GET, with the body in memory, over TCP or TLS to an engine it
was configured with) and passes the answer through untouched: no redirects, cookies, proxies, content decoding,
header models or per-request timer and trace objects, which is where aiohttp spends the part of its CPU that is
not the socket (``benchmarks/router_clients.py`` times both).

A response is complete at its Content-Length, at its last chunk, or, when it declares neither, when the engine
closes the connection; only a complete response on a connection the engine keeps alive goes back to the pool.
Anything else (a reset, a malformed answer, a cancelled exchange) closes the connection.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from typing import cast
from urllib.parse import urlsplit

import httptools

from hetsched.router.upstream import KEEPALIVE_S, Headers, UpstreamError

HIGH_WATER = 256 * 1024
"""Body bytes buffered before the connection stops reading (a slow client holds the engine back, not memory)."""
BODYLESS = frozenset({204, 304})
Origin = tuple[str, int, bool]
"""Host, port, and whether the connection speaks TLS (an ``https://`` endpoint)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one exchange at a time; the httptools parser calls its ``on_*``."""

    def __init__(self, pool: collections.deque[_Connection]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._start(None)

    def _start(self, head: asyncio.Future[None] | None) -> None:
        """Ready for the next response: a fresh parser and state; ``head`` resolves when its head is complete."""
        self.parser = httptools.HttpResponseParser(self)
        self.head = head
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.framed = False
        """The response declares its length (Content-Length or chunked); else it ends when the connection does."""
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # --- asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one in all but its class

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # nothing asked: an idle connection has no business receiving
            self._close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response: {exc}")
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head is None:  # idle in the pool: forget it
            try:
                self.pool.remove(self)
            except ValueError:
                pass
            return
        if not self.complete:
            if self.status and not self.framed and self.status not in BODYLESS:
                self.on_message_complete()  # its body ran to the connection's end
            else:
                self._fail(f"connection closed before the response was complete{f': {exc}' if exc else ''}")

    # --- httptools callbacks --------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:  # an informational answer (100 Continue): the real one follows it
            return
        self.keep_alive = self.parser.should_keep_alive()  # llhttp answers this while the head is current
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.status, self.framed = 0, False
            self.headers.clear()
            return
        self.complete = True
        self._wake()

    # --- the exchange's side -----------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, message: str) -> None:
        self.error = UpstreamError(message)
        if self.head is not None and not self.head.done():
            self.head.set_exception(self.error)
        self._wake()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None


async def _within(connection: _Connection, future: asyncio.Future[None], deadline: float | None) -> None:
    """Wait for ``future`` until ``deadline`` (loop time; None: no limit); past it the connection is closed."""
    if deadline is None:
        await future
        return
    try:
        async with asyncio.timeout_at(deadline):
            await future
    except TimeoutError:
        connection._close()
        raise UpstreamError("no complete answer within the exchange's time limit") from None


class Response:
    """An engine's answer whose head has arrived (:class:`~hetsched.router.upstream.UpstreamResponse`)."""

    def __init__(self, client: H1Upstream, connection: _Connection, deadline: float | None) -> None:
        self._client, self._connection, self._deadline = client, connection, deadline
        self.status = connection.status
        self.headers = connection.headers
        self._released = False

    async def next_chunk(self) -> bytes:
        c = self._connection
        while not c.chunks:
            if c.complete:
                return b""
            if c.error is not None:
                raise c.error
            c.waiter = asyncio.get_running_loop().create_future()
            await _within(c, c.waiter, self._deadline)
        data = c.chunks[0] if len(c.chunks) == 1 else b"".join(c.chunks)
        c.chunks.clear()
        c.buffered = 0
        if c.paused and c.transport is not None:
            c.paused = False
            c.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._client.release(self._connection)


class H1Upstream:
    """Sends requests to engines over pooled keep-alive HTTP/1.1 connections (:class:`Upstream`)."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._pools: dict[Origin, collections.deque[_Connection]] = {}
        self._targets: dict[str, tuple[Origin, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target(self, url: str) -> tuple[Origin, bytes]:
        """Host, port and the request line's start and Host header for ``url`` (a few URLs, each split once)."""
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamError(f"expected an http(s):// URL with a host, got {url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.netloc.rpartition("@")[2]
            found = ((parts.hostname, port, tls), f" {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1"))
            if len(self._targets) > 4096:  # endpoints come and go under discovery; keep the cache bounded
                self._targets.clear()
            self._targets[url] = found
        return found

    def _tls(self) -> ssl.SSLContext:
        """The system's default verifying TLS context, made on first use (loading the CA store costs)."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def _connection(self, origin: Origin, deadline: float | None) -> _Connection:
        """A pooled connection to ``origin`` idle for less than the keep-alive time, else a new one (its connect
        bounded by the connect timeout and ``deadline``)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = collections.deque()
        now = loop.time()
        while pool:
            connection = pool.pop()
            if not connection.closed and now - connection.idle_since < self._keepalive_s:
                return connection
            connection._close()
        limit = now + self._connect_timeout_s
        try:
            async with asyncio.timeout_at(limit if deadline is None else min(limit, deadline)):
                _, connection = await loop.create_connection(
                    lambda: _Connection(pool), origin[0], origin[1],
                    ssl=self._tls() if origin[2] else None, server_hostname=origin[0] if origin[2] else None)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {origin[0]}:{origin[1]}: {type(exc).__name__} {exc}") from exc
        sock = connection.transport.get_extra_info("socket") if connection.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    async def send(self, method: str, url: str, *, headers: Headers = (), body: bytes | None = None,
                   timeout: float | None = None) -> Response:
        """The response head of one request; ``headers`` without Host, Content-Length or Transfer-Encoding (this
        client writes them); ``timeout`` bounds the whole exchange; raises UpstreamError."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        origin, line = self._target(url)
        connection = await self._connection(origin, deadline)
        head = loop.create_future()
        connection._start(head)
        parts = [method.encode("latin-1"), line]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body is not None:
            parts.append(b"content-length: %d\r\n\r\n" % len(body))
            parts.append(body)
        else:
            parts.append(b"\r\n")
        assert connection.transport is not None
        try:
            connection.transport.write(b"".join(parts))
            await _within(connection, head, deadline)
        except BaseException:
            connection._close()
            raise
        return Response(self, connection, deadline)

    def release(self, connection: _Connection) -> None:
        """Back to its pool when its answer was read to the end on a kept-alive connection, else closed."""
        if connection.reusable():
            connection.head = None
            connection.idle_since = asyncio.get_running_loop().time()
            connection.pool.append(connection)
        else:
            connection._close()

    async def aclose(self) -> None:
        for pool in self._pools.values():
            while pool:
                pool.pop()._close()
