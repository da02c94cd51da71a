"""The ASGI guard in front of every hetsched server: what a request must be before the app sees it.

Checks, in order, each answered in the server's own error shape (``render``):

1. Host     400 when the Host header names no allowed host (DNS rebinding; see ``ServerLimits.allowed_hosts``)
2. token    401 unless ``Authorization: Bearer <token>``: the scheme in any case, the token compared in constant time
3. type     415 when a POST, PUT or PATCH to a route that takes one is not JSON, so a web page cannot send one
            with a plain form or without a CORS preflight (a method no route takes is the app's 404 or 405)
4. length   413 at once when Content-Length passes the limit (400 when it is not a number)
5. body     413 when a body without a length passes the limit, 408 when the whole body has not arrived within
            ``ServerLimits.body_timeout_s`` of the request head

Every refusal closes the connection, so the rest of a refused body is never read. ``/health`` skips 1 and 2;
``public`` paths skip 2.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hetsched.server.bind import is_loopback
from hetsched.server.refusals import Refusal, RefusalCode
from hetsched.settings.server import ServerLimits

HEALTH_PATH = "/health"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


Render = Callable[[Refusal], bytes]
"""A refusal as the server's JSON error body."""


def health_is_public(path: str) -> bool:
    """The default ``public``: only ``/health`` answers without the token."""
    return path == HEALTH_PATH


class _Refused(Exception):
    pass


class Guard:
    """ASGI middleware applying the checks above; ``token`` None means no authentication, several tokens that any
    of them is accepted (the router's own and its API keys)."""

    def __init__(self, app: ASGIApp, *, limits: ServerLimits, render: Render, token: str | Sequence[str] | None = None,
                 public: Callable[[str], bool] = health_is_public,
                 routed: Callable[[Scope], bool] | None = None) -> None:
        """``routed``: whether a request's method and path name one of the app's routes (None: every one does)."""
        self.app, self.limits, self.render, self.public = app, limits, render, public
        self.tokens: tuple[bytes, ...] | None = None if token is None else tuple(
            t.encode() for t in ((token,) if isinstance(token, str) else token))
        self.routed = routed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check_head(scope)
        if refusal is not None:
            await self._answer(send, refusal)
            return
        limit = self.limits.max_body_bytes
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        received, body_done, started = 0, False, False
        refused: Refusal | None = None

        async def guarded_receive() -> Message:
            nonlocal received, body_done, refused
            if body_done:  # after the body the app only waits for a disconnect: that wait has no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refused = Refusal(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                                  RefusalCode.REQUEST_TIMEOUT)
                raise _Refused() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = Refusal(413, f"request body larger than {limit} bytes", RefusalCode.REQUEST_TOO_LARGE)
                    raise _Refused()
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused is not None:  # the app's own answer to a cut-off body (a 400, a 500) is replaced
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if refused is None:
                raise
        if refused is not None and not started:
            await self._answer(send, refused)

    def check_head(self, scope: Scope) -> Refusal | None:
        """The refusal steps 1 to 4 give a request head, or None when it passes."""
        headers = _checked_headers(scope)
        path: str = scope["path"]
        host = headers.get("host")
        if path != HEALTH_PATH and not self._host_allowed(scope, host):
            return Refusal(400, f"Host {host!r} is not a name this server answers to; add it to "
                                "the server's allowed hosts", RefusalCode.INVALID_HOST, "host")
        if self.tokens is not None and not self.public(path) and not self._authorized(headers.get("authorization")):
            return Refusal(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
                                "server's token", RefusalCode.INVALID_API_KEY, "authorization")
        if scope["method"] in BODY_METHODS:
            content_type = headers.get("content-type")
            media = (content_type or "").partition(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json") and (
                    self.routed is None or self.routed(scope)):
                got = repr(content_type) if content_type else "none"
                return Refusal(415, f"expected Content-Type: application/json, got {got}",
                               RefusalCode.UNSUPPORTED_MEDIA_TYPE, "content-type")
        declared = headers.get("content-length")
        if declared is not None:
            if not re.fullmatch(r"[0-9]+", declared.strip()):
                return Refusal(400, f"Content-Length {declared!r} is not a number of bytes",
                               RefusalCode.INVALID_CONTENT_LENGTH, "content-length")
            if int(declared) > self.limits.max_body_bytes:
                return Refusal(413, f"request body larger than {self.limits.max_body_bytes} bytes",
                               RefusalCode.REQUEST_TOO_LARGE, "content-length")
        return None

    def _host_allowed(self, scope: Scope, host: str | None) -> bool:
        allowed = self.limits.allowed_hosts
        server = scope.get("server")
        on_loopback = server is not None and is_loopback(str(server[0]))
        if host is None or not (allowed or on_loopback):
            return True
        name = _host_name(host)
        return is_loopback(name) or any(_matches(name, pattern.lower()) for pattern in allowed)

    def _authorized(self, header: str | None) -> bool:
        assert self.tokens is not None
        scheme, _, credentials = (header or "").strip().partition(" ")
        given = credentials.strip().encode()
        matches = [hmac.compare_digest(given, token) for token in self.tokens]  # every one compared: constant time
        return scheme.lower() == "bearer" and any(matches)

    async def _answer(self, send: Send, refusal: Refusal) -> None:
        body = self.render(refusal)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if refusal.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


CHECKED_HEADERS = frozenset({b"host", b"authorization", b"content-type", b"content-length"})


def _checked_headers(scope: Scope) -> dict[str, str]:
    """The headers the checks read, in one pass over the request's (ASGI names them in lower case); the first
    of a repeated one, as Starlette's ``Headers.get`` gives."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in CHECKED_HEADERS:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


def _matches(name: str, pattern: str) -> bool:
    """``name`` is ``pattern``, or under a ``*.`` pattern's domain, or the pattern is ``*``."""
    return pattern in ("*", name) or (pattern.startswith("*.") and name.endswith(pattern[1:]))


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: ``[::1]:80`` → ``::1``, ``a.b:8080`` → ``a.b``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host
