"""The router's HTTP front: an OpenAI-compatible reverse proxy around the :class:`~hetsched.router.picker.Picker`.

In front of it a :class:`~hetsched.server.guard.Guard` checks the Host
header, the bearer token (every route but ``/health``), the JSON content type
and the body's size and arrival time. Per request: read the body, validate just
enough to route (model, prompt, max tokens, SLO headers), ask the picker for
an endpoint, and pass the upstream response through chunk by chunk. Connect
errors and 5xx answers before the first byte move the request to another
endpoint; a client that goes away cancels the upstream request.

A disaggregated model's request runs in two stages (:mod:`hetsched.router.stages`):
choose a decode instance, then a prefill instance (the ``slo`` policy counts the
KV transfer to that decode instance in the prefill's TTFT), prefill, and pass the
decode instance's answer through. Each stage moves to another instance of its
role once when it fails before the client has a byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import httpx
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from hetsched.catalog.host import HostInfo, read_host
from hetsched.catalog.perf import PerfConstants
from hetsched.perf.correction import StepCorrection
from hetsched.router.answers import ERROR_DETAIL_BYTES, AnswerTail, StreamStats, error_detail
from hetsched.router.config import RouterConfig
from hetsched.router.h1 import H1Upstream
from hetsched.router.openai import API_PATHS, ApiKind, ErrorType, error_body, refusal_body, sse_event
from hetsched.router.kv import PrefixSource
from hetsched.router.picker import Picker, Refused, stage
from hetsched.router.stages import decode_body, handed_params, prefill_body
from hetsched.router.state import Ticket
from hetsched.router.types import Endpoint, Front, Handoff, RouteRequest, RoutingDecision
from hetsched.router.upstream import HttpxUpstream, Upstream, UpstreamError, UpstreamResponse, fetch
from hetsched.router.watch import EndpointWatch
from hetsched.server.guard import Guard
from hetsched.sim.roles import Role

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})
"""Headers that stay on their own leg (``expect``: the router holds the whole body before it sends it on)."""
ENDPOINT_HEADER = "x-hetsched-endpoint"
STAGE_ATTEMPTS = 2
"""Instances a stage of a two-stage request tries: a failed prefill or decode moves to another once."""
REQUEST_ID_HEADER = b"x-request-id"
"""Both stages carry one request id, as vLLM's proxy sends them (some KV connectors pair the stages by it)."""
T = TypeVar("T")


class _Upstream5xx(Exception):
    def __init__(self, status: int, detail: str, retry_after: str | None = None) -> None:
        super().__init__(f"answered HTTP {status}" + (f": {detail}" if detail else ""))
        self.status, self.retry_after = status, retry_after


async def _upstream_5xx(response: UpstreamResponse) -> _Upstream5xx:
    """The retryable failure a 5xx is, with the start of what the engine said."""
    body = b""
    with contextlib.suppress(UpstreamError):
        while len(body) < ERROR_DETAIL_BYTES and (chunk := await response.next_chunk()):
            body += chunk
    return _Upstream5xx(response.status, error_detail(body), _retry_after(response.headers))


def _retry_after(headers: list[tuple[bytes, bytes]]) -> str | None:
    """An engine's ``Retry-After`` (a 503 from one that is overloaded or starting says when to come back)."""
    return next((v.decode("latin-1") for k, v in headers if k.lower() == b"retry-after"), None)


class _Answered(Exception):
    """An upstream's own refusal (a prefill's 4xx) that goes to the client as it came."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.headers, self.body = status, headers, body


async def _send_answer(send: Send, answered: _Answered) -> None:
    headers = [(k, v) for k, v in answered.headers if k.lower() not in HOP_BY_HOP]
    headers.append((b"content-length", str(len(answered.body)).encode()))
    await send({"type": "http.response.start", "status": answered.status, "headers": headers})
    await send({"type": "http.response.body", "body": answered.body})


async def _send_error(send: Send, refused: Refused) -> None:
    body = refused.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in refused.headers.items()]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes | None:
    """The request body (the guard bounds its size and time), or None when the client went away."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class Router:
    """The HTTP front: passes each request's bytes to the endpoint its :class:`Picker` chooses, and the answer back.

    ``transport``: an httpx transport to reach the engines through (a fake); default, :class:`H1Upstream`'s pool.
    """

    def __init__(self, config: RouterConfig, *, host: HostInfo, perf: Mapping[str, PerfConstants] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.picker = Picker(config, front=Front.HTTP, host=host, perf=perf, clock=clock)
        self.config, self.clock = config, clock
        self.state, self.metrics = self.picker.state, self.picker.metrics
        self.token = config.auth_token()
        self._transport = transport
        self.upstream: Upstream | None = None

    def tokens(self) -> tuple[str, ...] | None:
        """The bearer tokens the guard accepts: with ``auth_token_env`` set, the router's own and every API key's;
        without it, none is asked for (API keys then only name tenants and classes)."""
        if self.token is None:
            return None
        return (self.token, *self.picker.key_holders)

    # --- lifecycle --------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        if self._transport is None:
            self.upstream = H1Upstream(connect_timeout_s=self.config.connect_timeout_s)
        else:
            self.upstream = HttpxUpstream(self._transport, connect_timeout_s=self.config.connect_timeout_s,
                                          request_timeout_s=self.config.request_timeout_s)
        watch = EndpointWatch(self.picker, self.upstream)
        watch.start()
        try:
            yield
        finally:
            await watch.aclose()
            await self.upstream.aclose()

    def set_endpoints(self, found: dict[str, list[Endpoint]]) -> None:
        """Replace the endpoints of the models in ``found`` (see :meth:`Picker.set_endpoints`)."""
        self.picker.set_endpoints(found)

    # --- the proxy -------------------------------------------------------------------
    async def proxy(self, scope: Scope, receive: Receive, send: Send, kind: ApiKind) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        finished = False
        gone = False

        async def watch_disconnect() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                gone = True
                handler.cancel()

        headers = Headers(scope=scope)
        watcher: asyncio.Task[None] | None = None
        try:
            body = await _read_body(receive)
            if body is None:
                return
            watcher = asyncio.create_task(watch_disconnect())
            route = self.picker.route_request(body, kind, headers)
            if self.state.disaggregated(route.model):
                await self._two_stage(scope, send, body, route)
            else:
                forward = self._forward_headers(scope)
                first = await self.picker.admit(route, size_bytes=len(body))
                await self._try_endpoints(route, Role.UNIFIED, lambda endpoint, ticket: self._exchange(
                    scope, send, body, endpoint, route, forward, ticket=ticket), chosen=first)
            finished = True
        except Refused as refused:
            finished = True
            await _send_error(send, refused)
        except _Answered as answered:
            finished = True
            await _send_answer(send, answered)
        except asyncio.CancelledError:
            if not gone:
                raise
            handler.uncancel()
        finally:
            finished = True
            if watcher is not None:
                watcher.cancel()

    def _forward_headers(self, scope: Scope, *, request_id: bool = False) -> list[tuple[bytes, bytes]]:
        """The client's headers an upstream gets: no hop-by-hop ones, nor the router's own token, nor
        ``accept-encoding`` (the router reads the answers' token counts, so engines answer uncompressed); with
        ``request_id``, an ``x-request-id`` (the client's, else a new one) for both stages of a request."""
        forward = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != b"accept-encoding"
                   and not (self.token is not None and k == b"authorization")]
        if request_id and all(k != REQUEST_ID_HEADER for k, _ in forward):
            forward.append((REQUEST_ID_HEADER, uuid.uuid4().hex.encode()))
        return forward

    async def _try_endpoints(self, route: RouteRequest, role: Role, exchange: Callable[[Endpoint, Ticket], Awaitable[T]], *,
                             handoff: Handoff | None = None, chosen: RoutingDecision | None = None) -> T:
        """``exchange`` with one endpoint of ``role`` (and its request's ticket) after another until one answers.

        A connection failure or a 5xx (before anything reached the client: ``exchange`` raises them only then)
        moves to the next endpoint, up to ``max_attempts`` (a stage of a two-stage request: two). ``chosen`` is
        the first decision when the caller made it already.
        """
        tried: set[str] = set()
        last_error, retry_after = "", None
        attempts = self.config.max_attempts if role is Role.UNIFIED else min(self.config.max_attempts, STAGE_ATTEMPTS)
        for _attempt in range(attempts):
            decision = chosen or self.picker.decide(route, role, tried, handoff)
            chosen = None
            endpoint = decision.endpoint
            if endpoint is None:
                break
            tried.add(endpoint.url)
            ticket = self.picker.start(endpoint, route)
            try:
                return await exchange(endpoint, ticket)
            except (_Upstream5xx, UpstreamError) as exc:
                last_error = f"{endpoint.url} {exc}" if isinstance(exc, _Upstream5xx) else f"{endpoint.url}: {exc}"
                retry_after = exc.retry_after if isinstance(exc, _Upstream5xx) and exc.status == 503 else None
                self.picker.failure(endpoint)
                self.metrics.retried(route.model, "5xx" if isinstance(exc, _Upstream5xx) else "connection").inc()
            finally:
                self.picker.finish(ticket, endpoint)
        if not tried:
            self.picker.no_endpoint(route, role)
        self.metrics.rejected_requests(route.model, "upstream-failed").inc()
        if retry_after is not None:  # the last engine is busy and said when to come back: so does the answer
            raise Refused(503, f"{len(tried)} {stage(role)}endpoint(s) unavailable; last: {last_error}",
                           type=ErrorType.UNAVAILABLE, code="upstream_unavailable", headers={"Retry-After": retry_after})
        raise Refused(502, f"{len(tried)} {stage(role)}endpoint(s) failed before answering; last: {last_error}",
                       type=ErrorType.UPSTREAM, code="upstream_failed")

    async def _two_stage(self, scope: Scope, send: Send, body: bytes, route: RouteRequest) -> None:
        """Prefill on one instance, then pass a decode instance's answer through (see the module docstring).

        The decode instance is chosen first so the prefill's choice can count the KV's way to it, and its place
        is held while the prefill runs (else a burst would all pick the one that looks idle). Each stage is
        admitted by flow control: while every endpoint of a stage is saturated the request waits in its model's
        queue, by its class and tenant, within its TTFT deadline. The client's TTFT and latency run from here to
        the decode's first token and last byte.
        """
        started = self.clock()
        payload = json.loads(body)  # parse_request checked it: an object within the limits
        decode = await self.picker.admit(route, role=Role.DECODE, size_bytes=len(body))
        assert decode.endpoint is not None
        forward = self._forward_headers(scope, request_id=True)
        prefill = prefill_body(payload)
        held = self.state.start(decode.endpoint.url, route)
        try:
            prefill_route, handoff = replace(route, max_tokens=1), self.state.handoff(decode)
            params = await self._try_endpoints(
                prefill_route, Role.PREFILL,
                lambda endpoint, _ticket: self._prefill(scope, prefill, endpoint, forward), handoff=handoff,
                chosen=await self.picker.admit(prefill_route, role=Role.PREFILL, handoff=handoff,
                                               size_bytes=len(body)))
        finally:
            self.state.finish(held)
        decode_request = decode_body(payload, params)
        await self._try_endpoints(route, Role.DECODE, lambda endpoint, ticket: self._exchange(
            scope, send, decode_request, endpoint, route, forward, since=started, ticket=ticket), chosen=decode)

    async def _prefill(self, scope: Scope, body: bytes, endpoint: Endpoint,
                       forward: list[tuple[bytes, bytes]]) -> dict[str, Any] | None:
        """One prefill attempt: the engine computes the prompt and one token, and says where the KV cache waits.

        A 4xx goes to the client as it came (the decode would refuse the same request); a 5xx or a connection
        failure is for :meth:`_try_endpoints` to retry.
        """
        assert self.upstream is not None
        started = self.clock()
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                response = await self.upstream.send("POST", endpoint.url + scope["path"], headers=forward, body=body)
                try:
                    content = await response.read()
                finally:
                    await response.aclose()
        except TimeoutError:
            raise Refused(504, f"prefill {endpoint.url} did not answer within {self.config.request_timeout_s} s",
                           type=ErrorType.TIMEOUT) from None
        except asyncio.CancelledError:
            self.picker.cancelled(endpoint, started=started)
            raise
        if response.status >= 500:
            raise _Upstream5xx(response.status, error_detail(content), _retry_after(response.headers))
        self.picker.answered(endpoint, str(response.status), started=started)
        if response.status >= 400:
            raise _Answered(response.status, response.headers, content)
        self.picker.success(endpoint)
        params = handed_params(content)
        if params is None:
            log.warning("prefill %s answered without kv_transfer_params: the decode computes the prompt itself",
                        endpoint.url)
        return params

    async def _exchange(self, scope: Scope, send: Send, body: bytes, endpoint: Endpoint, route: RouteRequest,
                        forward: list[tuple[bytes, bytes]], *, since: float | None = None,
                        ticket: Ticket | None = None) -> None:
        """One attempt; raises a retryable error only before anything reached the client.

        The response head is held back until the upstream's first body byte, so
        an engine that dies after accepting a request but before its first token
        still counts as "before the first byte" and the request moves elsewhere.
        ``since`` is when the client's request came, when that was before this
        attempt (a decode stage): its TTFT, latency and time limit count from then.
        """
        started = self.clock() if since is None else since
        stats = StreamStats()
        try:
            await self._pass_through(send, endpoint.url + scope["path"], body, forward, endpoint, started, stats,
                                     route, ticket)
        except asyncio.CancelledError:  # the client went away: still a request, with its own code
            self.picker.cancelled(endpoint, started=started, tokens=stats.tokens)
            raise

    async def _pass_through(self, send: Send, url: str, body: bytes, forward: list[tuple[bytes, bytes]],
                            endpoint: Endpoint, started: float, stats: StreamStats, route: RouteRequest,
                            ticket: Ticket | None = None) -> None:
        """POST ``body`` to ``url`` and pass the answer to the client; ``stats`` fills as a stream passes.

        One time limit runs from ``started`` over the whole exchange (a timer costs as much as the rest of a
        short request's bookkeeping); ``phase`` says what a timeout before the first byte reached the client is.
        An answer cut short after it began ends a stream with an error event; any other answer is left without
        its end, so the client's HTTP library reports an incomplete body rather than a whole one. Only an
        engine that broke off counts as its failure: the router's own time limit running out does not.
        """
        assert self.upstream is not None
        limit = self.config.request_timeout_s
        upstream: UpstreamResponse | None = None
        phase = "did not answer"
        code, streaming = "", False
        cut: str | None = None
        tail = AnswerTail()
        try:
            async with asyncio.timeout(limit - (self.clock() - started)):
                upstream = await self.upstream.send("POST", url, headers=forward, body=body)
                phase = "sent no data"
                if upstream.status >= 500:
                    raise await _upstream_5xx(upstream)
                streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in upstream.headers)
                kept = HOP_BY_HOP if streaming else HOP_BY_HOP - {b"content-length"}
                out_headers = [(k, v) for k, v in upstream.headers if k.lower() not in kept]
                out_headers.append((ENDPOINT_HEADER.encode(), endpoint.url.encode()))
                # nothing reaches the client before the first body byte: until then a failure is retried
                chunk = await upstream.next_chunk()
                await send({"type": "http.response.start", "status": upstream.status, "headers": out_headers})
                phase, code = "", str(upstream.status)
                try:
                    while chunk:
                        if streaming:
                            stats.observe(chunk, self.clock())
                        else:
                            tail.observe(chunk)
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        chunk = await upstream.next_chunk()
                except UpstreamError as exc:
                    code, cut = "stream-error", f"upstream {endpoint.url} failed mid-answer: {exc}"
                    self.picker.failure(endpoint)
        except TimeoutError:
            if phase:
                raise Refused(504, f"{endpoint.url} {phase} within {limit} s", type=ErrorType.TIMEOUT) from None
            code, cut = "timeout", f"the answer did not end within the router's request_timeout_s ({limit:g} s)"
        finally:
            if upstream is not None:
                await upstream.aclose()
        assert upstream is not None  # the time limit or a failure before the answer raised above
        if cut is not None:
            log.warning("%s; the client's answer from %s is cut short", cut, endpoint.url)
        if cut is None or streaming:
            if cut is not None:
                kind = ErrorType.UPSTREAM if code == "stream-error" else ErrorType.TIMEOUT
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse_event({"error": {"message": cut, "type": str(kind)}})})
            await send({"type": "http.response.body", "body": b""})
        if cut is None and upstream.status < 400:
            self.picker.success(endpoint)
        self.picker.answered(endpoint, code, started=started, stats=stats, generated=tail.completion_tokens,
                             route=route, ticket=ticket)

    # --- small endpoints -------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        """Each model as one of its engines describes it (``max_model_len``, ``root``, …), under the router's name."""
        entries = await asyncio.gather(*(self._model_entry(name) for name in self.config.models))
        return JSONResponse({"object": "list", "data": entries})

    async def _model_entry(self, name: str) -> dict[str, Any]:
        """The first available endpoint's ``/v1/models`` entry for ``name``; a bare entry when none answers."""
        assert self.upstream is not None
        entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "hetsched"}
        now = self.clock()
        for endpoint in self.state.endpoints(name):
            if not self.state.get(endpoint.url).health.available(now):
                continue
            try:
                status, text = await fetch(self.upstream, f"{endpoint.url}/v1/models",
                                           timeout=self.config.health.check_timeout_s)
                data = json.loads(text)["data"] if status == 200 else []
            except (UpstreamError, ValueError, KeyError, TypeError):
                continue
            found = [d for d in data if isinstance(d, dict)]
            named = [d for d in found if d.get("id") == name] or found[:1]  # an engine may serve it as another id
            if named:
                return {**named[0], "id": name}
        return entry

    async def endpoints(self, request: Request) -> Response:
        """The router's view of every endpoint (for people and scripts; not an OpenAI route)."""
        now = self.clock()
        rows = []
        for endpoint in self.state.endpoints():
            state = self.state.get(endpoint.url)
            signals = state.signals
            rows.append({
                "url": endpoint.url, "model": endpoint.model, "accelerator": endpoint.accelerator, "tp": endpoint.tp,
                "healthy": state.health.available(now), "in_flight": state.in_flight,
                "consecutive_failures": state.health.consecutive_failures,
                "signals_age_s": None if signals is None else round(now - signals.scraped_at, 3),
                "running": signals.running if signals else None, "waiting": signals.waiting if signals else None,
                "kv_usage": signals.kv_usage if signals else None,
                "step_correction": _correction_entry(state.profile.correction) if state.profile else None,
                "prefix_cache": self._prefix_entry(endpoint, now),
            })
        return JSONResponse({"endpoints": rows})

    def _prefix_entry(self, endpoint: Endpoint, now: float) -> dict[str, object]:
        """Where the endpoint's cached-prefix figures come from, and why the approximation when it stands in."""
        kv = self.state.kv(endpoint.model)
        source = kv.source(endpoint.url, now)
        entry: dict[str, object] = {"source": str(source)}
        if source is PrefixSource.EVENTS:
            entry["blocks"] = kv.index.blocks(endpoint.url)
        else:
            entry["reason"] = kv.why_approximated(endpoint.url, now)
        return entry

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _correction_entry(correction: StepCorrection) -> dict[str, float]:
    """The correction the endpoint's predictions use (all ones and zeros: none learned, or none trusted yet)."""
    return {"prefill_scale": round(correction.prefill_scale, 4), "decode_scale": round(correction.decode_scale, 4),
            "step_overhead_ms": round(correction.step_overhead_s * 1e3, 3),
            "request_overhead_ms": round(correction.request_overhead_s * 1e3, 3)}


async def _no_route(request: Request, exc: Exception) -> Response:
    """A path or method the router does not serve (Starlette's 404 and 405), answered in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    served = ", ".join([*(f"POST {path}" for path in API_PATHS), "GET /v1/models"])
    body = error_body(f"{request.method} {request.url.path}: {exc.detail}; the router serves {served}",
                      type=ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST)
    return Response(body, status_code=exc.status_code, headers=exc.headers, media_type="application/json")


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


class _ProxyRoute:
    def __init__(self, router: Router, kind: ApiKind) -> None:
        self.router, self.kind = router, kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router.proxy(scope, receive, send, self.kind)


class RouterApp:
    """The router's ASGI app: a proxied request goes through the guard straight to the proxy, the rest through
    Starlette's routing (the same guard in front).

    Starlette's error and exception middleware, its path matching and the send wrappers each adds cost on
    every request and every streamed chunk that the two proxy routes need none of (the proxy answers its
    own errors in OpenAI's shape); every other path, a trailing slash or a wrong method included, is
    Starlette's as before.
    """

    def __init__(self, router: Router, routes: Starlette, guard: Callable[[ASGIApp], ASGIApp]) -> None:
        self.router, self.routes, self.state = router, routes, routes.state
        self._proxied = {(path, "POST"): guard(_ProxyRoute(router, kind)) for path, kind in API_PATHS.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        proxied = self._proxied.get((scope["path"], scope["method"])) if scope["type"] == "http" else None
        await (proxied or self.routes)(scope, receive, send)




def create_router_app(config: RouterConfig, *, clock: Callable[[], float] = time.monotonic,
                      transport: httpx.AsyncBaseTransport | None = None, host: HostInfo | None = None,
                      perf: Mapping[str, PerfConstants] | None = None) -> RouterApp:
    """The router as an ASGI app; ``app.state.router`` is the :class:`Router`.

    ``host`` is the machine ``cpu`` endpoints are predicted as (default: this one); ``perf`` holds
    calibrated step-model constants by accelerator id (default: the catalog's).
    """
    router = Router(config, host=host or read_host(), perf=perf, clock=clock, transport=transport)

    def guard(app: ASGIApp) -> ASGIApp:
        return Guard(app, limits=config.limits(), render=refusal_body, token=router.tokens())

    routes = Starlette(routes=[
        *(Route(path, _ProxyRoute(router, kind), methods=["POST"]) for path, kind in API_PATHS.items()),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/router/endpoints", router.endpoints, methods=["GET"]),
        Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
    ], middleware=[Middleware(Guard, limits=config.limits(), render=refusal_body, token=router.tokens())],
        exception_handlers={HTTPException: _no_route}, lifespan=router.lifespan)
    routes.state.router = router
    return RouterApp(router, routes, guard)
