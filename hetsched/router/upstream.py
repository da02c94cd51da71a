"""HTTP to the engines behind one narrow interface: :mod:`hetsched.router.h1` in production, any httpx transport
as a fake.

The router's own HTTP/1.1 client keeps each host's idle connections in a deque (checkout and release are O(1))
and parses responses with httptools (C). httpx's pool (httpcore) walks every pooled connection on each checkout
and release, polling each socket, and builds its request and response objects in Python; aiohttp's pool is a
deque too, but each request builds header multidicts, URL, timer and trace objects. On one core, streamed
requests at 32 in flight cost about 70 µs of client CPU each through the router's client, 270 µs through
aiohttp, 1.4 ms through httpcore with an O(1) pool of its own and 3.3 ms through httpx's
(``benchmarks/router_clients.py``). Tests hand the router an httpx transport (``httpx.MockTransport``) and it
speaks through :class:`HttpxUpstream` instead.

Every failure to reach an engine, or a connection it breaks, comes out as :class:`UpstreamError`, whichever
client is underneath.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Protocol

import httpx

Headers = Iterable[tuple[bytes, bytes]]
KEEPALIVE_S = 4.0
"""How long an idle connection to an engine is kept: under the 5 s after which uvicorn (vLLM's server, SGLang's)
closes it, so the router does not send a request down a connection the engine is closing."""


class UpstreamError(Exception):
    """The engine could not be reached, or broke the connection before its answer was complete."""


class UpstreamResponse(Protocol):
    """An engine's answer whose head has arrived; its body is read or streamed once, then closed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    """Raw header pairs as the engine sent them."""

    async def next_chunk(self) -> bytes:
        """What of the body has arrived since the last call, waiting for some (transfer coding removed, content
        coding kept); ``b""`` at its end; raises UpstreamError."""
        ...

    async def read(self) -> bytes:
        """The whole body; raises UpstreamError."""
        ...

    async def aclose(self) -> None:
        """Give the connection back when the body was read to its end, else close it."""
        ...


class Upstream(Protocol):
    """Sends requests to engines (any of them) over pooled keep-alive connections."""

    async def send(self, method: str, url: str, *, headers: Headers = (), body: bytes | None = None,
                   timeout: float | None = None) -> UpstreamResponse:
        """The response head of one request (``timeout``: for the whole exchange); raises UpstreamError."""
        ...

    async def aclose(self) -> None:
        ...


async def fetch(upstream: Upstream, url: str, *, timeout: float) -> tuple[int, bytes]:
    """GET ``url``: status and body (health checks, metrics, model lists)."""
    response = await upstream.send("GET", url, timeout=timeout)
    try:
        return response.status, await response.read()
    finally:
        await response.aclose()


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = list(response.headers.raw)
        self._chunks: AsyncIterator[bytes] | None = None

    async def next_chunk(self) -> bytes:
        if self._chunks is None:
            self._chunks = self._response.aiter_raw()
        try:
            return await anext(self._chunks, b"")
        except httpx.TransportError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TransportError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """Requests through an httpx transport: what tests hand the router (a mock or an ASGI transport)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, *, connect_timeout_s: float,
                 request_timeout_s: float) -> None:
        self._client = httpx.AsyncClient(transport=transport,
                                          timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s))

    async def send(self, method: str, url: str, *, headers: Headers = (), body: bytes | None = None,
                   timeout: float | None = None) -> _HttpxResponse:
        request = self._client.build_request(method, url, content=body, headers=list(headers),
                                             timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except httpx.TransportError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._client.aclose()
