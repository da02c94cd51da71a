"""The router's HTTP client alone: CPU per proxied request through httpx, httpcore with an O(1) pool, aiohttp and
the router's own client.

A fixed answer (a 4-event SSE stream, sent in two pieces) from uvicorn with httptools and uvloop in one
process; in another, pinned to one core, 32 concurrent streamed POSTs at a time for ``--requests`` requests
through one client, on uvloop as the router runs. The client process's CPU time per request is what the router
pays for its side of the upstream exchange; the clients run one after another, twice, in one run.

- ``httpx``: ``httpx.AsyncClient`` as the router used it (its pool: httpcore's, which walks every pooled
  connection on each checkout and release);
- ``httpcore-deque``: httpx's API over httpcore connections kept in a deque per origin (checkout O(1)): the pool
  walk's share;
- ``aiohttp``: what the router used before its own client (a deque per host, a C response parser);
- ``h1``: what the router uses now (``hetsched.router.h1``: a deque per host, the request in one write, the
  response parsed by httptools into raw header pairs and body chunks).

Run: ``.venv/bin/python benchmarks/router_clients.py`` (about a minute; ``--quick``, one pass of a few hundred
requests per client, is a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

import report
from hetsched.simworker.launch import free_port

UPSTREAM = textwrap.dedent("""
    import sys, uvicorn
    BODY = b'data: {"choices":[{"text":"x"}]}\\n\\n' * 4 + b"data: [DONE]\\n\\n"
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": BODY[:40], "more_body": True})
        await send({"type": "http.response.body", "body": BODY[40:]})
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", http="httptools",
                loop="uvloop", access_log=False)
""")
BODY = b'{"model":"m","prompt":"hello world","max_tokens":4,"stream":true}'
CONCURRENCY = 32
CLIENTS = ("httpx", "httpcore-deque", "aiohttp", "h1")
REQUESTS, QUICK_REQUESTS = 3000, 100
PASSES, QUICK_PASSES = 2, 1


class _DequePool(httpx.AsyncBaseTransport):
    """httpcore connections in a deque per origin: the newest idle one is taken, checked, and given back."""

    def __init__(self) -> None:
        import httpcore

        self._httpcore = httpcore
        self._idle: dict[tuple[bytes, bytes, int | None], collections.deque[Any]] = collections.defaultdict(
            collections.deque)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        httpcore = self._httpcore
        url = request.url
        idle = self._idle[(url.raw_scheme, url.raw_host, url.port)]
        connection = None
        while idle and connection is None:
            candidate = idle.pop()
            if candidate.is_available() and not candidate.has_expired():
                connection = candidate
            else:
                await candidate.aclose()
        if connection is None:
            connection = httpcore.AsyncHTTPConnection(httpcore.Origin(url.raw_scheme, url.raw_host, url.port or 80),
                                                      keepalive_expiry=30)
        response = await connection.handle_async_request(httpcore.Request(
            method=request.method, url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                                                    target=url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions))

        class _Body(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for part in response.stream:
                    yield part

            async def aclose(self) -> None:
                await response.aclose()
                if connection.is_idle():
                    idle.append(connection)

        return httpx.Response(response.status, headers=response.headers, stream=_Body(),
                              extensions=response.extensions)


async def _drive(one: Any, requests: int) -> tuple[float, float]:
    left = requests

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    for _ in range(min(200, requests)):  # warm-up
        await one()
    left = requests
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    return time.process_time() - cpu0, time.monotonic() - t0


async def _httpx(url: str, requests: int, transport: httpx.AsyncBaseTransport | None) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    async with httpx.AsyncClient(transport=transport, limits=limits) as client:
        async def one() -> None:
            request = client.build_request("POST", url, content=BODY, headers=[(b"content-type", b"application/json")])
            response = await client.send(request, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()
        return await _drive(one, requests)


async def _aiohttp(url: str, requests: int) -> tuple[float, float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        async def one() -> None:
            async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as response:
                async for _ in response.content.iter_any():
                    pass
        return await _drive(one, requests)


async def _h1(url: str, requests: int) -> tuple[float, float]:
    from hetsched.router.h1 import H1Upstream
    client = H1Upstream(connect_timeout_s=5, keepalive_s=30)

    async def one() -> None:
        response = await client.send("POST", url, body=BODY, headers=[(b"content-type", b"application/json")])
        while await response.next_chunk():
            pass
        await response.aclose()
    try:
        return await _drive(one, requests)
    finally:
        await client.aclose()


def client_run(kind: str, url: str, requests: int) -> None:
    """One client's run (in its own process): prints CPU seconds and wall seconds."""
    import uvloop

    runs = {"httpx": lambda: _httpx(url, requests, None), "httpcore-deque": lambda: _httpx(url, requests, _DequePool()),
            "aiohttp": lambda: _aiohttp(url, requests), "h1": lambda: _h1(url, requests)}
    cpu, wall = uvloop.run(runs[kind]())
    print(f"{cpu} {wall}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help=f"requests per client (default {REQUESTS}; --quick "
                                                         f"{QUICK_REQUESTS})")
    parser.add_argument("--quick", action="store_true", help="one pass of a few hundred requests: a smoke run")
    parser.add_argument("--client", choices=CLIENTS, help=argparse.SUPPRESS)  # one client's run, in a child
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    if args.client:
        client_run(args.client, args.url, requests)
        return
    port = free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)])
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.post(url, content=BODY, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        passes = QUICK_PASSES if args.quick else PASSES
        print(f"{requests} streamed requests per client, {CONCURRENCY} at a time, client pinned to CPU 0; "
              f"load average {os.getloadavg()[0]:.1f} at the start")
        print(f"{'client':16} {'CPU µs / request':>17} {'requests/s':>11}")
        cost: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(passes):
            for kind in CLIENTS:
                out = subprocess.run([sys.executable, __file__, "--client", kind, "--url", url, "--requests",
                                      str(requests)], check=True, capture_output=True, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {0})).stdout.split()
                cpu, wall = float(out[0]), float(out[1])
                cost[kind].append(cpu / requests)
                print(f"{kind:16} {cpu / requests * 1e6:>17.0f} {requests / wall:>11.0f}", flush=True)
        best = {kind: min(values) for kind, values in cost.items()}
        print(f"CPU per request against the router's client, h1 (best of {passes}): "
              + ", ".join(f"{kind} {best[kind] / best['h1']:.1f}x" for kind in CLIENTS))
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        upstream.terminate()
        upstream.wait(10)


if __name__ == "__main__":
    report.main(main, section="router_clients")
