"""The guard and connection limits every server shares: on a real socket, where slow clients live."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from hetsched.errors import InputError
from hetsched.server import guard, serve
from hetsched.server.bind import bind_address, check_exposure, is_loopback
from hetsched.server.guard import Guard
from hetsched.server.refusals import Refusal
from hetsched.settings.server import ServerLimits
from hetsched.simworker import ThreadServer, serve_in_thread

LIMITS = ServerLimits(max_body_bytes=1000, body_timeout_s=0.3, header_timeout_s=0.3, keep_alive_s=5,
                      max_header_bytes=600)


def _render(refusal: Refusal) -> bytes:
    return json.dumps({"status": refusal.status, "code": refusal.code, "header": refusal.header}).encode()


async def _echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/json")


async def _slow_stream(request: Request) -> Response:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(6):
            yield b"tick\n"
            await asyncio.sleep(0.1)
    return StreamingResponse(chunks())


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[ThreadServer]:
    """The guarded app on each HTTP stack a server may run: httptools where it is installed, else h11."""
    app = Starlette(routes=[Route("/echo", _echo, methods=["POST"]), Route("/stream", _slow_stream),
                            Route("/health", _echo, methods=["GET"])],
                    middleware=[Middleware(Guard, limits=LIMITS, render=_render, token="s3cret")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve, "FAST_STACK", request.param == "httptools")
        running = serve_in_thread(app, limits=LIMITS)
    with running:
        yield running


def _connect(server: ThreadServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=3)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _cut_off_while_trickling(sock: socket.socket, *, count: int) -> bool:
    """Whether the server closes ``sock`` before ``count`` more bytes, one every 50 ms, have gone: the tests trickle
    too few bytes to complete anything, so only a timeout closes it in time, however slow the machine."""
    sock.settimeout(0.05)
    for _ in range(count):
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def test_a_request_head_sent_byte_by_byte_is_cut_off(server: ThreadServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        assert _cut_off_while_trickling(sock, count=400)  # 20 s, and the head stays under its 600-byte limit


def test_an_idle_keep_alive_connection_that_trickles_is_cut_off(server: ThreadServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        assert _cut_off_while_trickling(sock, count=400)


def test_a_body_sent_slowly_gets_408_within_the_body_timeout(server: ThreadServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{")
        seen = b""
        sock.settimeout(0.05)
        for _ in range(400):  # a byte every 50 ms, 401 of the 500 declared: each one arriving does not put it off
            try:
                seen = sock.recv(65536)
                break
            except TimeoutError:
                sock.sendall(b" ")
        assert seen.startswith(b"HTTP/1.1 408") and b"connection: close" in seen.lower()


def test_a_huge_content_length_is_refused_at_once_and_the_connection_closed(server: ThreadServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 999999999999\r\n\r\n{")
        answer = _read_all(sock)  # a 413, not the body timeout's 408: the head alone was enough
        assert answer.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in answer


def test_a_chunked_body_is_cut_at_the_limit_and_the_client_reads_the_413_to_a_clean_end(
        server: ThreadServer) -> None:
    chunk = b"200\r\n" + b" " * 512 + b"\r\n"
    for _ in range(20):  # a server that closed with the client's chunks unread would reset some of these
        with _connect(server) as sock:
            # the head and two chunks past the limit in one write, so that the server has them together: the limit,
            # not the body timeout, answers, however late the server reads; the chunks after come once it may have
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                         b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2)
            for _ in range(2):
                sock.sendall(chunk)
            answer = _read_all(sock)
            assert answer.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in answer


def test_a_body_sent_after_a_413_for_its_length_does_not_reset_the_answer(server: ThreadServer) -> None:
    for _ in range(20):
        with _connect(server) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n")
            for _ in range(10):
                sock.sendall(b" " * 500)
            answer = _read_all(sock)
            assert answer.startswith(b"HTTP/1.1 413") and b'"content-length"' in answer


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_larger_than_the_head_limit_arriving_with_the_head_is_served(server: ThreadServer,
                                                                            framing: str) -> None:
    body = b'"' + b"x" * (LIMITS.max_header_bytes + 200) + b'"'
    assert len(body) <= LIMITS.max_body_bytes
    framed = (b"Content-Length: %d\r\n\r\n" % len(body) + body if framing == "length"
              else b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n" + framed)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(body)


def test_a_body_left_unread_by_an_answer_is_not_counted_as_the_next_head(server: ThreadServer) -> None:
    """A 404 answers before its request's body arrives; that body, larger than the head limit, comes after it on
    the same keep-alive connection, and the request after the body is served."""
    with _connect(server) as sock:
        sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 900\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 404")
        sock.sendall(b" " * 900 + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 200")


def test_an_oversized_head_is_refused(server: ThreadServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (LIMITS.max_header_bytes + 10))
        assert _read_all(sock).startswith(b"HTTP/1.1 400")


def test_a_response_longer_than_the_head_timeout_is_not_cut(server: ThreadServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                     b"Connection: close\r\n\r\n")
        assert _read_all(sock).count(b"tick") == 6


@pytest.mark.parametrize(("header", "ok"), [("Bearer s3cret", True), ("bearer s3cret", True), ("BEARER  s3cret", True),
                                            ("Bearer s3cre", False), ("Basic s3cret", False), ("s3cret", False),
                                            ("Bearer s3cret2", False), ("Bearer ", False)])
def test_the_bearer_scheme_is_case_insensitive_and_the_token_compared_in_constant_time(
        header: str, ok: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []

    def digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(guard.hmac, "compare_digest", digest)
    checker = Guard(_echo, limits=LIMITS, render=_render, token="s3cret")
    scope = {"type": "http", "method": "GET", "path": "/echo", "server": ("10.0.0.1", 80),
             "headers": [(b"authorization", header.encode())]}
    refusal = checker.check_head(scope)
    assert (refusal is None) is ok
    if header.lower().startswith("bearer"):
        assert compared and compared[-1][1] == b"s3cret"


def test_loopback_binds_are_free_and_others_need_a_token_or_insecure() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host)
        assert check_exposure(host, has_token=False, insecure=False, exposes="x", token_hint="y") is None
    for host in ("0.0.0.0", "::", "10.0.0.5", "planner.internal"):
        assert not is_loopback(host)
        assert check_exposure(host, has_token=True, insecure=False, exposes="x", token_hint="y") is None
        with pytest.raises(InputError) as refused:
            check_exposure(host, has_token=False, insecure=False, exposes="read plans", token_hint="set T")
        assert refused.value.field == "--host" and "--insecure" in str(refused.value) and "set T" in str(refused.value)
        warning = check_exposure(host, has_token=False, insecure=True, exposes="read plans", token_hint="set T")
        assert warning is not None and warning.startswith("WARNING") and "read plans" in warning
    assert bind_address("0.0.0.0", 8080) == "0.0.0.0:8080 (every IPv4 interface)"
    assert bind_address("::", 80) == "[::]:80 (every interface)"
    assert bind_address("10.0.0.5", 8000) == "10.0.0.5:8000"


@pytest.mark.parametrize("length", ["12a", "-1", "\u00b2", "1e3", ""])
def test_a_content_length_that_is_not_a_number_is_a_400(length: str) -> None:
    checker = Guard(_echo, limits=LIMITS, render=_render)
    scope = {"type": "http", "method": "POST", "path": "/echo", "server": ("10.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", length.encode())]}
    refusal = checker.check_head(scope)
    assert refusal is not None and (refusal.status, refusal.header) == (400, "content-length")
