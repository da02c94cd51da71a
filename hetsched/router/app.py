"""The router's ASGI shell: an OpenAI-compatible reverse proxy around :class:`RouterState`.

In front of it a :class:`~hetsched.server.guard.Guard` checks the Host
header, the bearer token (every route but ``/health``), the JSON content type
and the body's size and arrival time. Per request: read the body, validate just
enough to route (model, prompt, max tokens, SLO headers), ask the policy for
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
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

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
from hetsched.errors import InputError
from hetsched.router.config import DiscoveryKind, RouterConfig
from hetsched.router.discovery import PodWatcher
from hetsched.router.metrics import EndpointSeries, RouterMetrics
from hetsched.router.openai import (ApiKind, ErrorType, error_body, max_tokens, parse_request, prompt_text,
                                    prompt_tokens, refusal_body, sse_event)
from hetsched.router.prefix import prefix_hashes
from hetsched.router.signals import parse_engine_metrics
from hetsched.router.stages import decode_body, handed_params, prefill_body
from hetsched.router.state import PREFIX_AWARE, RouterState, Ticket
from hetsched.router.types import DecisionReason, Endpoint, Handoff, Policy, RouteRequest, RoutingDecision
from hetsched.router.h1 import H1Upstream
from hetsched.router.upstream import HttpxUpstream, Upstream, UpstreamError, UpstreamResponse, fetch
from hetsched.server.guard import Guard
from hetsched.sim.roles import Role
from hetsched.specs.workload import SLO

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})
"""Headers that stay on their own leg (``expect``: the router holds the whole body before it sends it on)."""
SLO_TTFT_HEADER, SLO_TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
ENDPOINT_HEADER = "x-hetsched-endpoint"
STAGE_ATTEMPTS = 2
"""Instances a stage of a two-stage request tries: a failed prefill or decode moves to another once."""
CANCELLED_CODE = "499"
"""The code a request its client abandoned is counted under (nginx's "client closed request")."""
REQUEST_ID_HEADER = b"x-request-id"
"""Both stages carry one request id, as vLLM's proxy sends them (some KV connectors pair the stages by it)."""
T = TypeVar("T")


class _Refused(Exception):
    """An answer the router gives itself, before or instead of an upstream response."""

    def __init__(self, status: int, message: str, *, type: ErrorType, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param, self.headers = status, type, code, param, headers or {}


class _Upstream5xx(Exception):
    def __init__(self, status: int, detail: str, retry_after: str | None = None) -> None:
        super().__init__(f"answered HTTP {status}" + (f": {detail}" if detail else ""))
        self.status, self.retry_after = status, retry_after


ERROR_DETAIL_BYTES = 4096
"""How much of an engine's 5xx body is read for the message a client gets when no endpoint answers."""


def _error_detail(body: bytes) -> str:
    """What an engine's error body says: its OpenAI error's message, else its text, on one short line."""
    text = body[:ERROR_DETAIL_BYTES].decode(errors="replace")
    with contextlib.suppress(ValueError, TypeError, KeyError):
        text = str(json.loads(text)["error"]["message"])
    return " ".join(text.split())[:300]


async def _upstream_5xx(response: UpstreamResponse) -> _Upstream5xx:
    """The retryable failure a 5xx is, with the start of what the engine said."""
    body = b""
    with contextlib.suppress(UpstreamError):
        while len(body) < ERROR_DETAIL_BYTES and (chunk := await response.next_chunk()):
            body += chunk
    return _Upstream5xx(response.status, _error_detail(body), _retry_after(response.headers))


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


async def _send_error(send: Send, refused: _Refused) -> None:
    body = error_body(str(refused), type=refused.type, code=refused.code, param=refused.param)
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


def slo_from_headers(headers: Headers, default: SLO | None) -> SLO | None:
    """Per-request SLO from ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``, each falling back to the model's."""
    ttft, tpot = headers.get(SLO_TTFT_HEADER), headers.get(SLO_TPOT_HEADER)
    if ttft is None and tpot is None:
        return default
    values: dict[str, float] = {}
    for name, raw in ((SLO_TTFT_HEADER, ttft), (SLO_TPOT_HEADER, tpot)):
        if raw is None:
            continue
        try:
            values[name] = float(raw)
        except ValueError:
            values[name] = -1.0
        if not (values[name] > 0 and math.isfinite(values[name])):
            raise InputError(f"expected a positive, finite number of milliseconds, got {raw!r}", field=name)
    big = 1e9  # a header that sets one threshold leaves the other as the model's, or unbounded
    return SLO(ttft_ms=values.get(SLO_TTFT_HEADER, default.ttft_ms if default else big),
               tpot_ms=values.get(SLO_TPOT_HEADER, default.tpot_ms if default else big))


_CONTENT = re.compile(rb'"(?:content|text|reasoning_content|reasoning)":\s*"[^"]|"tool_calls":\s*\[\s*\{')
"""A streamed choice that carries output: non-empty text or reasoning, or a tool call."""
USAGE_TAIL_BYTES = 1 << 20
"""The end of a whole (not streamed) answer kept to find its ``usage``, which engines put after the choices."""
MAX_SSE_LINE = 1 << 20
"""Longest unfinished SSE line kept across chunks; past it the line is dropped, not buffered without end."""


class _StreamStats:
    """Generated tokens and their timing in a streamed OpenAI response.

    Not every SSE event is a token: vLLM's first chat chunk carries only the role, its last may carry only the
    finish reason, and with ``include_usage`` a chunk without choices carries the counts. Tokens are that chunk's
    ``usage.completion_tokens`` when the stream has one, else one per chunk with content; the first and last
    content chunks bound TTFT and TPOT. This runs on every chunk: only lines naming ``usage`` are parsed as JSON,
    the others take one regular-expression search.
    """

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.content_chunks = 0
        self.usage_tokens: int | None = None
        self._partial = b""

    @property
    def tokens(self) -> int:
        """The engine's own count when the stream carries one: a token need not show as text (a stop token)."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    def observe(self, chunk: bytes, now: float) -> None:
        lines = (self._partial + chunk if self._partial else chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_SSE_LINE:
            self._partial = b""
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:], now)

    def _event(self, data: bytes, now: float) -> None:
        if b'"usage"' in data:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                self.usage_tokens = int(json.loads(data)["usage"]["completion_tokens"])
        if _CONTENT.search(data) is not None:
            if self.first is None:
                self.first = now
            self.last = now
            self.content_chunks += 1


class Router:
    """Holds the state, the pooled HTTP client and the metrics of one router process.

    ``transport``: an httpx transport to reach the engines through (a fake); default, :class:`H1Upstream`'s pool.
    """

    def __init__(self, config: RouterConfig, *, host: HostInfo, perf: Mapping[str, PerfConstants] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.clock = clock
        self.state = RouterState(config, host=host, perf=perf)
        self.metrics = RouterMetrics()
        self.token = config.auth_token()
        self._transport = transport
        self.upstream: Upstream | None = None
        for model in config.models:
            self.state.set_endpoints(model, [e for e in config.static_endpoints() if e.model == model])
        self._sync_gauges()

    # --- lifecycle --------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        if self._transport is None:
            self.upstream = H1Upstream(connect_timeout_s=self.config.connect_timeout_s)
        else:
            self.upstream = HttpxUpstream(self._transport, connect_timeout_s=self.config.connect_timeout_s,
                                          request_timeout_s=self.config.request_timeout_s)
        watcher = None
        if self.config.discovery.kind is DiscoveryKind.KUBERNETES:
            watcher = PodWatcher(models=list(self.config.models), namespace=self.config.discovery.namespace,
                                 label_selector=self.config.discovery.label_selector,
                                 default_port=self.config.discovery.port, on_change=self.set_endpoints,
                                 on_policies=self.set_policies)
            watcher.start(asyncio.get_running_loop())
        tasks = [asyncio.create_task(self._poll_metrics()), asyncio.create_task(self._check_health())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if watcher is not None:
                watcher.stop()
            await self.upstream.aclose()

    def set_policies(self, found: dict[str, Policy]) -> None:
        """Replace the policies discovery found per model (discovery calls this on every listing)."""
        self.state.discovered_policies = found

    def set_endpoints(self, found: dict[str, list[Endpoint]]) -> None:
        """Replace the endpoints of the models in ``found`` (discovery calls this on every change)."""
        before = set(self.state.endpoints())
        for model, endpoints in found.items():
            self.state.set_endpoints(model, endpoints)
        after = set(self.state.endpoints())
        for gone in before - after:
            self.metrics.forget(self._labels(gone))
        self._sync_gauges()

    def _labels(self, endpoint: Endpoint) -> tuple[str, str, str, str]:
        return endpoint.model, endpoint.url, endpoint.accelerator, endpoint.role

    def _series(self, endpoint: Endpoint) -> EndpointSeries:
        return self.metrics.endpoint((endpoint.model, endpoint.url, endpoint.accelerator, endpoint.role))

    def _sync_gauges(self) -> None:
        for endpoint in self.state.endpoints():
            self._sync_health(endpoint)

    def _sync_health(self, endpoint: Endpoint) -> None:
        available = self.state.get(endpoint.url).health.available(self.clock())
        self.metrics.healthy.labels(*self._labels(endpoint)).set(1 if available else 0)

    # --- background loops ----------------------------------------------------------
    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(e) for e in self.state.endpoints()))
            await asyncio.sleep(self.config.metrics_interval_s)

    async def _scrape(self, endpoint: Endpoint) -> None:
        assert self.upstream is not None
        fresh = 0
        try:
            status, text = await fetch(self.upstream, f"{endpoint.url}/metrics",
                                       timeout=self.config.health.check_timeout_s)
            if status == 200:
                self.state.record_signals(endpoint.url, parse_engine_metrics(text.decode(errors="replace"),
                                                                             scraped_at=self.clock()))
                fresh = 1
        except (UpstreamError, InputError) as exc:
            log.debug("metrics of %s unreadable: %s", endpoint.url, exc)
        self.metrics.signals_fresh.labels(*self._labels(endpoint)).set(fresh)

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.state.endpoints()))
            await asyncio.sleep(self.config.health.check_interval_s)

    async def _probe(self, endpoint: Endpoint) -> None:
        assert self.upstream is not None
        try:
            status, _ = await fetch(self.upstream, f"{endpoint.url}/health", timeout=self.config.health.check_timeout_s)
            ok = status == 200
        except UpstreamError:
            ok = False
        if ok:
            if self.state.record_success(endpoint.url, now=self.clock(), active=True):
                log.info("endpoint %s recovered", endpoint.url)
        else:
            self._failure(endpoint)
        if endpoint.url in self.state:  # discovery may have removed it meanwhile
            self._sync_health(endpoint)

    def _failure(self, endpoint: Endpoint) -> None:
        if self.state.record_failure(endpoint.url, now=self.clock()):
            log.warning("endpoint %s ejected after consecutive failures", endpoint.url)
            self.metrics.ejections.labels(*self._labels(endpoint)).inc()
            self._sync_health(endpoint)

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
            route = self._route_request(body, kind, headers)
            if self.state.disaggregated(route.model):
                await self._two_stage(scope, send, body, route)
            else:
                forward = self._forward_headers(scope)
                await self._try_endpoints(route, Role.UNIFIED, lambda endpoint: self._exchange(
                    scope, send, body, endpoint, route, forward))
            finished = True
        except _Refused as refused:
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

    def _route_request(self, body: bytes, kind: ApiKind, headers: Headers) -> RouteRequest:
        try:
            request = parse_request(body, kind)
            if request.model not in self.config.models:
                self.config.model(request.model)  # raises NotFoundError with close matches
            slo = slo_from_headers(headers, self.config.models[request.model].slo)
        except InputError as exc:
            not_found = exc.http_status == 404
            raise _Refused(404 if not_found else 400, str(exc), type=ErrorType.NOT_FOUND if not_found
                           else ErrorType.INVALID_REQUEST, code="model_not_found" if not_found else None,
                           param="model" if not_found else exc.field) from exc
        tokens = prompt_tokens(request)
        self.metrics.model(request.model).prompt_tokens.inc(tokens)
        hashes = prefix_hashes(prompt_text(request)) \
            if self.state.policy_for(request.model) in PREFIX_AWARE else ()
        return RouteRequest(request.model, tokens, max_tokens(request), hashes, slo)

    def _forward_headers(self, scope: Scope, *, request_id: bool = False) -> list[tuple[bytes, bytes]]:
        """The client's headers an upstream gets: no hop-by-hop ones, nor the router's own token, nor
        ``accept-encoding`` (the router reads the answers' token counts, so engines answer uncompressed); with
        ``request_id``, an ``x-request-id`` (the client's, else a new one) for both stages of a request."""
        forward = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != b"accept-encoding"
                   and not (self.token is not None and k == b"authorization")]
        if request_id and all(k != REQUEST_ID_HEADER for k, _ in forward):
            forward.append((REQUEST_ID_HEADER, uuid.uuid4().hex.encode()))
        return forward

    def _decide(self, route: RouteRequest, role: Role, tried: set[str],
                handoff: Handoff | None = None) -> RoutingDecision:
        """The policy's choice among ``role``'s endpoints not yet tried; every one saturated is a 429."""
        decision = self.state.decide(route, now=self.clock(), exclude=frozenset(tried), role=role, handoff=handoff)
        self.metrics.model(route.model).decisions(decision.policy, decision.reason).inc()
        if decision.endpoint is None and decision.reason is DecisionReason.ALL_SATURATED:
            self.metrics.rejected.labels(route.model, "saturated").inc()
            raise _Refused(429, f"every {_stage(role)}endpoint of {route.model} is at its limit; retry later",
                           type=ErrorType.RATE_LIMIT, code="saturated",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        return decision

    async def _try_endpoints(self, route: RouteRequest, role: Role, exchange: Callable[[Endpoint], Awaitable[T]], *,
                             handoff: Handoff | None = None, chosen: RoutingDecision | None = None) -> T:
        """``exchange`` with one endpoint of ``role`` after another until one answers.

        A connection failure or a 5xx (before anything reached the client: ``exchange`` raises them only then)
        moves to the next endpoint, up to ``max_attempts`` (a stage of a two-stage request: two). ``chosen`` is
        the first decision when the caller made it already.
        """
        tried: set[str] = set()
        last_error, retry_after = "", None
        attempts = self.config.max_attempts if role is Role.UNIFIED else min(self.config.max_attempts, STAGE_ATTEMPTS)
        for _attempt in range(attempts):
            decision = chosen or self._decide(route, role, tried, handoff)
            chosen = None
            endpoint = decision.endpoint
            if endpoint is None:
                break
            tried.add(endpoint.url)
            ticket = self.state.start(endpoint.url, route)
            self._series(endpoint).in_flight.inc()
            try:
                return await exchange(endpoint)
            except (_Upstream5xx, UpstreamError) as exc:
                last_error = f"{endpoint.url} {exc}" if isinstance(exc, _Upstream5xx) else f"{endpoint.url}: {exc}"
                retry_after = exc.retry_after if isinstance(exc, _Upstream5xx) and exc.status == 503 else None
                self._failure(endpoint)
                self.metrics.retries.labels(route.model, "5xx" if isinstance(exc, _Upstream5xx) else "connection").inc()
            finally:
                self._finish(ticket, endpoint)
        if not tried:
            self._no_endpoint(route, role)
        self.metrics.rejected.labels(route.model, "upstream-failed").inc()
        if retry_after is not None:  # the last engine is busy and said when to come back: so does the answer
            raise _Refused(503, f"{len(tried)} {_stage(role)}endpoint(s) unavailable; last: {last_error}",
                           type=ErrorType.UNAVAILABLE, code="upstream_unavailable", headers={"Retry-After": retry_after})
        raise _Refused(502, f"{len(tried)} {_stage(role)}endpoint(s) failed before answering; last: {last_error}",
                       type=ErrorType.UPSTREAM, code="upstream_failed")

    def _no_endpoint(self, route: RouteRequest, role: Role) -> NoReturn:
        self.metrics.rejected.labels(route.model, "no-endpoint").inc()
        raise _Refused(503, f"no healthy {_stage(role)}endpoint serves {route.model}", type=ErrorType.UNAVAILABLE,
                       code="no_endpoint", headers={"Retry-After": str(self.config.retry_after_s)})

    async def _two_stage(self, scope: Scope, send: Send, body: bytes, route: RouteRequest) -> None:
        """Prefill on one instance, then pass a decode instance's answer through (see the module docstring).

        The decode instance is chosen first so the prefill's choice can count the KV's way to it, and its place
        is held while the prefill runs (else a burst would all pick the one that looks idle). The client's TTFT
        and latency run from here to the decode's first token and last byte.
        """
        started = self.clock()
        payload = json.loads(body)  # parse_request checked it: an object within the limits
        decode = self._decide(route, Role.DECODE, set())
        if decode.endpoint is None:
            self._no_endpoint(route, Role.DECODE)
        forward = self._forward_headers(scope, request_id=True)
        prefill = prefill_body(payload)
        held = self.state.start(decode.endpoint.url, route)
        try:
            params = await self._try_endpoints(
                replace(route, max_tokens=1), Role.PREFILL,
                lambda endpoint: self._prefill(scope, prefill, endpoint, forward), handoff=self.state.handoff(decode))
        finally:
            self.state.finish(held)
        decode_request = decode_body(payload, params)
        await self._try_endpoints(route, Role.DECODE, lambda endpoint: self._exchange(
            scope, send, decode_request, endpoint, route, forward, since=started), chosen=decode)

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
            raise _Refused(504, f"prefill {endpoint.url} did not answer within {self.config.request_timeout_s} s",
                           type=ErrorType.TIMEOUT) from None
        except asyncio.CancelledError:
            series = self._series(endpoint)
            series.requests(CANCELLED_CODE).inc()
            series.e2e.observe(self.clock() - started)
            raise
        if response.status >= 500:
            raise _Upstream5xx(response.status, _error_detail(content), _retry_after(response.headers))
        series = self._series(endpoint)
        series.requests(str(response.status)).inc()
        series.e2e.observe(self.clock() - started)
        if response.status >= 400:
            raise _Answered(response.status, response.headers, content)
        if self.state.record_success(endpoint.url, now=self.clock()):
            self._sync_health(endpoint)
        params = handed_params(content)
        if params is None:
            log.warning("prefill %s answered without kv_transfer_params: the decode computes the prompt itself",
                        endpoint.url)
        return params

    def _finish(self, ticket: Ticket, endpoint: Endpoint) -> None:
        self.state.finish(ticket)
        self._series(endpoint).in_flight.dec()

    async def _exchange(self, scope: Scope, send: Send, body: bytes, endpoint: Endpoint, route: RouteRequest,
                        forward: list[tuple[bytes, bytes]], *, since: float | None = None) -> None:
        """One attempt; raises a retryable error only before anything reached the client.

        The response head is held back until the upstream's first body byte, so
        an engine that dies after accepting a request but before its first token
        still counts as "before the first byte" and the request moves elsewhere.
        ``since`` is when the client's request came, when that was before this
        attempt (a decode stage): its TTFT, latency and time limit count from then.
        """
        started = self.clock() if since is None else since
        stats = _StreamStats()
        try:
            await self._pass_through(send, endpoint.url + scope["path"], body, forward, endpoint, started, stats)
        except asyncio.CancelledError:  # the client went away: still a request, with its own code
            series = self._series(endpoint)
            series.requests(CANCELLED_CODE).inc()
            series.e2e.observe(self.clock() - started)
            if stats.tokens:
                self.metrics.model(route.model).generation_tokens.inc(stats.tokens)
            raise

    async def _pass_through(self, send: Send, url: str, body: bytes, forward: list[tuple[bytes, bytes]],
                            endpoint: Endpoint, started: float, stats: _StreamStats) -> None:
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
        tail = bytearray()
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
                            tail += chunk
                            if len(tail) > 2 * USAGE_TAIL_BYTES:
                                del tail[:-USAGE_TAIL_BYTES]
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        chunk = await upstream.next_chunk()
                except UpstreamError as exc:
                    code, cut = "stream-error", f"upstream {endpoint.url} failed mid-answer: {exc}"
                    self._failure(endpoint)
        except TimeoutError:
            if phase:
                raise _Refused(504, f"{endpoint.url} {phase} within {limit} s", type=ErrorType.TIMEOUT) from None
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
        now = self.clock()
        series = self._series(endpoint)
        series.requests(code).inc()
        series.e2e.observe(now - started)
        if cut is None and upstream.status < 400:
            if self.state.record_success(endpoint.url, now=now):
                self._sync_health(endpoint)
        generated = stats.tokens or (_completion_tokens(bytes(tail)) if tail else 0)
        if generated:
            self.metrics.model(endpoint.model).generation_tokens.inc(generated)
        if stats.first is not None:
            series.ttft.observe(stats.first - started)
            if stats.tokens > 1:
                series.tpot.observe((stats.last - stats.first) / (stats.tokens - 1))

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
            })
        return JSONResponse({"endpoints": rows})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _stage(role: Role) -> str:
    """``prefill `` or ``decode `` for messages about one stage's endpoints; nothing for a unified model's."""
    return "" if role is Role.UNIFIED else f"{role} "


_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def _completion_tokens(body: bytes) -> int:
    """``usage.completion_tokens`` of a whole answer, 0 without one; found, not parsed (a JSON pass over a long
    answer costs more than the rest of its proxying): engines put ``usage`` after the choices, and a quote in
    generated text is escaped, so the last ``"usage": {`` opens the object that holds the count."""
    at = body.rfind(b'"usage"')
    if at < 0 or _USAGE.match(body, at) is None:
        return 0
    found = _COMPLETION_TOKENS.search(body, at)
    return int(found.group(1)) if found else 0


async def _no_route(request: Request, exc: Exception) -> Response:
    """A path or method the router does not serve (Starlette's 404 and 405), answered in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    served = ", ".join([*(f"POST {path}" for path in PROXY_PATHS), "GET /v1/models"])
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
        self._proxied = {(path, "POST"): guard(_ProxyRoute(router, kind)) for path, kind in PROXY_PATHS.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        proxied = self._proxied.get((scope["path"], scope["method"])) if scope["type"] == "http" else None
        await (proxied or self.routes)(scope, receive, send)


PROXY_PATHS = {"/v1/completions": ApiKind.COMPLETIONS, "/v1/chat/completions": ApiKind.CHAT}


def create_router_app(config: RouterConfig, *, clock: Callable[[], float] = time.monotonic,
                      transport: httpx.AsyncBaseTransport | None = None, host: HostInfo | None = None,
                      perf: Mapping[str, PerfConstants] | None = None) -> RouterApp:
    """The router as an ASGI app; ``app.state.router`` is the :class:`Router`.

    ``host`` is the machine ``cpu`` endpoints are predicted as (default: this one); ``perf`` holds
    calibrated step-model constants by accelerator id (default: the catalog's).
    """
    router = Router(config, host=host or read_host(), perf=perf, clock=clock, transport=transport)

    def guard(app: ASGIApp) -> ASGIApp:
        return Guard(app, limits=config.limits(), render=refusal_body, token=router.token)

    routes = Starlette(routes=[
        *(Route(path, _ProxyRoute(router, kind), methods=["POST"]) for path, kind in PROXY_PATHS.items()),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/router/endpoints", router.endpoints, methods=["GET"]),
        Route("/metrics", router.metrics_endpoint, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
    ], middleware=[Middleware(Guard, limits=config.limits(), render=refusal_body, token=router.token)],
        exception_handlers={HTTPException: _no_route}, lifespan=router.lifespan)
    routes.state.router = router
    return RouterApp(router, routes, guard)
