"""The router's HTTP/1.1 client against a scripted server: framing, keep-alive, breaks and time limits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from hetsched.router.h1 import H1Upstream
from hetsched.router.upstream import UpstreamError, fetch

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by its Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


def _run(handler: Handler, scenario: Callable[[H1Upstream, str, list[int]], Awaitable[None]]) -> list[int]:
    """Serve ``handler`` on a free loopback port and run ``scenario`` against it; returns the connection log."""
    connections: list[int] = []

    async def main() -> None:
        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(len(connections))
            try:
                await handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(counted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = H1Upstream(connect_timeout_s=2)
        try:
            await scenario(client, f"http://127.0.0.1:{port}", connections)
        finally:
            await client.aclose()
            server.close()

    asyncio.run(main())
    return connections


def test_keep_alive_reuses_one_connection_and_passes_bytes_through() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await _read_request(reader)
            seen.append((head, body))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Odd: A b\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        for body in (b'{"a": 1}', b'{"b": 2}'):
            response = await client.send("POST", f"{url}/v1/completions?x=1", body=body,
                                         headers=[(b"content-type", b"application/json")])
            assert response.status == 200 and (b"X-Odd", b"A b") in response.headers
            assert await response.read() == body
            await response.aclose()

    assert _run(handler, scenario) == [0]  # both requests on one connection
    head, body = seen[0]
    assert head.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n") and b"content-type: application/json" in head
    assert body == b'{"a": 1}'


def test_chunked_stream_arrives_piece_by_piece_and_ends_with_empty_bytes() -> None:
    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        gate = asyncio.Event()  # the rest of the stream waits for the first piece to have reached the client

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
            await writer.drain()
            await gate.wait()
            writer.write(b"3\r\nx\n\n\r\n0\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        response = await client.send("POST", f"http://127.0.0.1:{port}/", body=b"{}")
        assert await response.next_chunk() == b"data: "
        gate.set()
        assert await response.next_chunk() == b"x\n\n"
        assert await response.next_chunk() == b""
        await response.aclose()
        server.close()

    async def unused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return None

    _run(unused, scenario)


def test_a_body_without_length_ends_at_close_and_its_connection_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        for _attempt in range(2):
            assert await fetch(client, f"{url}/health", timeout=2) == (200, b"all of it")

    assert _run(handler, scenario) == [0, 1]


def test_a_connection_broken_mid_body_is_an_upstream_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        response = await client.send("POST", url, body=b"{}")
        assert await response.next_chunk() == b"hello"
        with pytest.raises(UpstreamError, match="before the response was complete"):
            await response.next_chunk()
        await response.aclose()

    _run(handler, scenario)


def test_no_answer_within_the_time_limit_and_a_refused_connection_are_upstream_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        with pytest.raises(UpstreamError, match="time limit"):
            await fetch(client, f"{url}/metrics", timeout=0.2)
        with pytest.raises(UpstreamError, match="cannot connect"):
            await client.send("GET", "http://127.0.0.1:1/health")

    _run(silent, scenario)


def test_an_informational_answer_is_skipped_for_the_real_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(1)

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        assert await fetch(client, url, timeout=2) == (201, b"ok")

    _run(handler, scenario)


def test_an_https_endpoint_is_reached_over_tls() -> None:
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)  # a TLS client hello, which a plain server cannot answer
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        with pytest.raises(UpstreamError, match="cannot connect.*SSL"):
            await fetch(client, url.replace("http://", "https://") + "/health", timeout=2)

    _run(plain, scenario)


def test_a_malformed_answer_is_an_upstream_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def scenario(client: H1Upstream, url: str, _: list[int]) -> None:
        with pytest.raises(UpstreamError, match="malformed"):
            await client.send("GET", url)

    _run(handler, scenario)
