"""The gRPC front: an Endpoint Picker (EPP) for the Gateway API Inference Extension.

A conformant gateway (Envoy, Istio, GKE, kgateway, NGINX Gateway Fabric, …) asks the EPP over Envoy's
``ExternalProcessor`` stream, one stream per HTTP request, which endpoint of an InferencePool serves it (the
inference extension's protocol 004, v1.0.0). Bodies arrive in ``FULL_DUPLEX_STREAMED`` mode: in any number of
chunks, each answered in order, headers before body. Per request:

1. ``request_headers``: kept; the answer waits for the body (the pick depends on it).
2. ``request_body`` chunks until ``end_of_stream``: then the :class:`~hetsched.router.picker.Picker` decides, and
   the EPP answers the headers with ``x-gateway-destination-endpoint: ip:port[,ip:port…]`` (the policy's ranking:
   first choice, then fallbacks), the same value under the ``envoy.lb`` dynamic metadata, and hands the body back
   (rewritten when ``x-gateway-model-name-rewrite`` names another model, with its new ``content-length``).
3. ``response_headers`` / ``response_body``: passed back unchanged while their tokens and timing feed the same
   metrics and in-flight accounting as ``hetsched route``. The endpoint the gateway reports as having served the
   request (``envoy.lb`` / ``x-gateway-destination-endpoint-served``) is the one charged.

The request leaves the in-flight count when the response ends, when the gateway cancels the stream, or on error.
Answers the picker gives itself are ``ImmediateResponse``s with ``hetsched route``'s OpenAI error bodies.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (ExternalProcessorServicer,
                                                                   add_ExternalProcessorServicer_to_server)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from hetsched.router.answers import AnswerTail, StreamStats
from hetsched.router.openai import API_PATHS, ErrorType
from hetsched.router.picker import Picker, Refused
from hetsched.router.signals import fresh
from hetsched.router.state import Ticket
from hetsched.router.types import Endpoint, RouteRequest
from hetsched.router.upstream import Upstream
from hetsched.router.watch import Discovery, EndpointWatch

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE)
BODY_CHUNK_BYTES = 62_000
"""Largest body chunk handed back in one message (under Envoy's default 64 KiB buffer per ext_proc message)."""


def host_port(endpoint: Endpoint) -> str:
    """An endpoint as the gateway names it: ``ip:port`` of its URL."""
    return endpoint.url.split("://", 1)[-1].split("/", 1)[0]


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-case names to values; Envoy sends ``raw_value`` (bytes), older ones ``value``."""
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in headers.headers.headers}


def _metadata(request: pb.ProcessingRequest, namespace: str, key: str) -> Any:
    """A value of the request's filter metadata, as plain Python (a list, a string), or None."""
    if not request.HasField("metadata_context"):
        return None
    spaces = request.metadata_context.filter_metadata
    if namespace not in spaces or key not in spaces[namespace].fields:
        return None
    value = spaces[namespace].fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    return None


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows (``ip:port``), from a list or a comma string; None when it sets none."""
    value = _metadata(request, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    return [item.strip() for item in items if item.strip()]


def _set_headers(pairs: Iterable[tuple[str, str]]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()))
                                          for k, v in pairs])


def immediate(refused: Refused) -> pb.ProcessingResponse:
    """The gateway answers the client itself, with the same OpenAI error body ``hetsched route`` gives."""
    headers = [("content-type", "application/json"), *((k.lower(), v) for k, v in refused.headers.items())]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=refused.status), headers=_set_headers(headers), body=refused.body(),
        details=f"hetsched_epp_{refused.code or refused.type}"))


def _picked(destination: str, body: bytes | None, *, changed: bool) -> list[pb.ProcessingResponse]:
    """The answers that carry a pick: the headers (and metadata), then the body handed back in chunks, with its
    new length when it ``changed``."""
    headers = [(DESTINATION_HEADER, destination)]
    if body is not None and changed:
        headers.append(("content-length", str(len(body))))
    metadata = Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    answers = [pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=_set_headers(headers),
                                                                       clear_route_cache=True)),
        dynamic_metadata=metadata)]
    if body is not None:
        chunks = [body[i:i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
        answers += [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=chunk, end_of_stream=i == len(chunks) - 1))))) for i, chunk in enumerate(chunks)]
    return answers


def _rewrite_model(body: bytes, model: str) -> bytes:
    """The body with its ``model`` replaced (the gateway's model-name rewrite); a non-object is left for the
    picker to refuse."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict):
        return body
    payload["model"] = model
    return json.dumps(payload, separators=(",", ":")).encode()


class _OutOfOrder(Exception):
    """A message the protocol does not allow here (a body before headers): the stream ends with INVALID_ARGUMENT."""


class _Phase(enum.Enum):
    HEADERS = "waiting for request_headers"
    BODY = "reading the request body"
    PICKED = "waiting for the response"
    RESPONSE = "passing the response"
    DONE = "done"


class _Exchange:
    """One request's stream: what was read of it, the pick, and the books kept until the response ends."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.phase = _Phase.HEADERS
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        """The gateway's subset hint, from whichever request message carried it."""
        self.body = bytearray()
        self.body_read = False
        """The body's last chunk came (a request without one is picked by load)."""
        self.route: RouteRequest | None = None
        self.endpoint: Endpoint | None = None
        self.ticket: Ticket | None = None
        self.started = 0.0
        self.status = 0
        self.streaming = False
        self.stats = StreamStats()
        self.tail = AnswerTail()

    def charge(self, endpoint: Endpoint, route: RouteRequest) -> None:
        self.release()
        self.endpoint, self.ticket = endpoint, self.picker.start(endpoint, route)

    def release(self) -> None:
        if self.ticket is not None and self.endpoint is not None:
            self.picker.finish(self.ticket, self.endpoint)
        self.ticket = None


class ExtProcServicer(ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a :class:`Picker`."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self._by_host: dict[str, Endpoint] = {}
        self._endpoints_seen: object = None

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 - gRPC's name
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self.picker)
        try:
            async for request in request_iterator:
                try:
                    stepped = self._step(exchange, request)
                    answers = stepped if stepped is not None else await self._pick(
                        exchange, bytes(exchange.body) if exchange.body_read else None)
                except Refused as refused:
                    yield immediate(refused)
                    exchange.phase = _Phase.DONE
                    return
                except _OutOfOrder as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                for answer in answers:
                    yield answer
                if exchange.phase is _Phase.DONE:
                    return
        finally:
            self._close(exchange)

    def _endpoint(self, address: str) -> Endpoint | None:
        """The endpoint a gateway names by ``ip:port``, from an index rebuilt when the endpoint set changes."""
        endpoints = self.picker.state.endpoints()
        if endpoints != self._endpoints_seen:
            self._by_host = {host_port(e): e for e in endpoints}
            self._endpoints_seen = endpoints
        return self._by_host.get(address)

    def _step(self, exchange: _Exchange, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        """The answers to one message; None when the request is read whole and the pick is due."""
        kind = request.WhichOneof("request")
        if kind in ("request_headers", "request_body") and (hint := subset_hint(request)) is not None:
            exchange.subset = hint
        if kind == "request_headers":
            if exchange.phase is not _Phase.HEADERS:
                raise _OutOfOrder(f"request_headers while {exchange.phase.value}")
            exchange.headers = _header_map(request.request_headers)
            exchange.started = self.picker.clock()
            exchange.phase = _Phase.BODY
            if request.request_headers.end_of_stream:
                return None
            return []
        if kind == "request_body":
            if exchange.phase is not _Phase.BODY:
                raise _OutOfOrder(f"request_body while {exchange.phase.value}")
            exchange.body += request.request_body.body
            limit = self.picker.config.max_body_bytes
            if len(exchange.body) > limit:
                raise Refused(413, f"request body over the limit of {limit} bytes", type=ErrorType.INVALID_REQUEST,
                              code="body_too_large")
            if request.request_body.end_of_stream:
                exchange.body_read = True
                return None
            return []
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            if exchange.phase is not _Phase.PICKED:
                raise _OutOfOrder(f"response_headers while {exchange.phase.value}")
            self._served(exchange, request)
            headers = _header_map(request.response_headers)
            exchange.status = int(headers.get(":status", "0") or 0)
            exchange.streaming = headers.get("content-type", "").startswith("text/event-stream")
            exchange.phase = _Phase.RESPONSE
            if request.response_headers.end_of_stream:
                self._ended(exchange)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if kind == "response_body":
            if exchange.phase is not _Phase.RESPONSE:
                raise _OutOfOrder(f"response_body while {exchange.phase.value}")
            self._served(exchange, request)
            chunk, end = request.response_body.body, request.response_body.end_of_stream
            if exchange.streaming:
                exchange.stats.observe(chunk, self.picker.clock())
            else:
                exchange.tail.observe(chunk)
            if end:
                self._ended(exchange)
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk,
                                                                                         end_of_stream=end)))))]
        if kind == "response_trailers":
            self._ended(exchange)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        raise _OutOfOrder(f"a message without a request or response part ({kind})")

    async def _pick(self, exchange: _Exchange, body: bytes | None) -> list[pb.ProcessingResponse]:
        hint = exchange.subset
        allowed: frozenset[str] | None = None
        if hint is not None:
            known = {e.url for address in hint if (e := self._endpoint(address)) is not None}
            if not known:
                shown = ", ".join(hint[:5]) + (", …" if len(hint) > 5 else "") if hint else "an empty list"
                raise Refused(503, f"the gateway's subset hint names no endpoint this picker knows ({shown})",
                              type=ErrorType.UNAVAILABLE, code="no_endpoint")
            allowed = frozenset(known)
        path = exchange.headers.get(":path", "").split("?", 1)[0]
        api = API_PATHS.get(path)
        changed = False
        if body is None or api is None:
            endpoint = self.picker.by_load(allowed)
            route = RouteRequest(endpoint.model, 0, 0)
            ranked = [endpoint]
        else:
            rewrite = exchange.headers.get(MODEL_REWRITE_HEADER)
            if rewrite:
                rewritten = _rewrite_model(body, rewrite)
                body, changed = rewritten, rewritten != body
            route = self.picker.route_request(body, api, exchange.headers)
            ranked = await self.picker.place(route, allowed=allowed, size_bytes=len(body))
        exchange.route = route
        exchange.charge(ranked[0], route)
        exchange.phase = _Phase.PICKED
        if route.objective or route.fairness_id:
            log.debug("%s: objective %s, fairness id %s", host_port(ranked[0]), route.objective, route.fairness_id)
        return _picked(",".join(host_port(e) for e in ranked), body, changed=changed)

    def _served(self, exchange: _Exchange, request: pb.ProcessingRequest) -> None:
        """Charge the request to the endpoint the gateway says served it (a retry moves it down the list)."""
        served = _metadata(request, LB_NAMESPACE, SERVED_KEY)
        if not isinstance(served, str) or exchange.endpoint is None or exchange.route is None:
            return
        if served == host_port(exchange.endpoint):
            return
        endpoint = self._endpoint(served)
        if endpoint is None:
            log.debug("the gateway reports %s served a request; this picker does not know it", served)
            return
        self.picker.failure(exchange.endpoint)
        self.picker.metrics.retried(exchange.route.model, "gateway").inc()
        exchange.charge(endpoint, exchange.route)

    def _ended(self, exchange: _Exchange) -> None:
        """The response ended: count it, and free its place."""
        endpoint = exchange.endpoint
        exchange.phase = _Phase.DONE
        ticket = exchange.ticket
        if endpoint is None or ticket is None:
            return
        exchange.release()
        if exchange.status >= 500:
            self.picker.failure(endpoint)
        elif exchange.status:
            self.picker.success(endpoint)
        self.picker.answered(endpoint, str(exchange.status or "unknown"), started=exchange.started,
                             stats=exchange.stats, generated=exchange.tail.completion_tokens, route=exchange.route,
                             ticket=ticket)

    def _close(self, exchange: _Exchange) -> None:
        """The stream is over: a request whose response never ended (cancelled, broken off) leaves the books."""
        if exchange.ticket is not None and exchange.endpoint is not None:
            exchange.release()
            self.picker.cancelled(exchange.endpoint, started=exchange.started, tokens=exchange.stats.tokens)


class PoolGauges(Collector):
    """The pool gauges gateways and autoscalers read from an EPP, computed from the picker's view when scraped."""

    def __init__(self, picker: Picker, pool: str) -> None:
        self.picker, self.pool = picker, pool

    def collect(self) -> Iterable[GaugeMetricFamily]:
        picker, now = self.picker, self.picker.clock()
        ready = GaugeMetricFamily("inference_pool_ready_pods", "Endpoints of the pool taking traffic", labels=["name"])
        queue = GaugeMetricFamily("inference_pool_average_queue_size",
                                  "Mean engine waiting queue over the pool's endpoints with fresh metrics",
                                  labels=["name"])
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization",
                               "Mean KV-cache use (0..1) over the pool's endpoints with fresh metrics", labels=["name"])
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size", "Engine waiting queue of each endpoint",
                                    labels=["name", "model_server_pod"])
        healthy, waits, kv_uses = 0, [], []
        for endpoint in picker.state.endpoints():
            state = picker.state.get(endpoint.url)
            healthy += state.health.available(now)
            signals = fresh(state.signals, now=now, stale_after_s=picker.config.metrics_stale_after_s)
            if signals is None:
                continue
            if signals.waiting is not None:
                waits.append(signals.waiting)
                per_pod.add_metric([self.pool, host_port(endpoint)], signals.waiting)
            if signals.kv_usage is not None:
                kv_uses.append(signals.kv_usage)
        ready.add_metric([self.pool], healthy)
        queue.add_metric([self.pool], sum(waits) / len(waits) if waits else 0.0)
        kv.add_metric([self.pool], sum(kv_uses) / len(kv_uses) if kv_uses else 0.0)
        return [ready, queue, kv, per_pod]


class Health:
    """gRPC health checking: ``liveness`` while the process answers; ``readiness`` and the ext_proc service once
    endpoints are discovered and their signals read."""

    def __init__(self, watch: EndpointWatch) -> None:
        self.watch = watch
        self.servicer = health_aio.HealthServicer()
        self._ready: bool | None = None

    async def start(self) -> None:
        await self.servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.update()

    async def update(self) -> None:
        ready = self.watch.ready
        if ready == self._ready:
            return
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("readiness", EXT_PROC_SERVICE, ""):
            await self.servicer.set(service, status)
        self._ready = ready


class EppServer:
    """The EPP's servers: ext_proc on ``port``, gRPC health on ``health_port`` (a port 0 takes a free one; the
    bound ports are set after :meth:`start`). ``discovery`` builds the endpoint watcher (see
    :class:`EndpointWatch`); ``upstream`` reads engines' ``/metrics`` and ``/health``."""

    def __init__(self, picker: Picker, *, upstream: Upstream, host: str, port: int, health_port: int,
                 discovery: Callable[[EndpointWatch], Discovery | None] | None = None,
                 readiness_interval_s: float = 0.5) -> None:
        self.picker, self.upstream = picker, upstream
        self.host, self.port, self.health_port = host, port, health_port
        self.watch = EndpointWatch(picker, upstream, discovery=discovery)
        self.health = Health(self.watch)
        self.servicer = ExtProcServicer(picker)
        self._interval = readiness_interval_s
        self._servers: list[grpc.aio.Server] = []
        self._readiness: asyncio.Task[None] | None = None

    async def start(self) -> None:
        address = f"[{self.host}]" if ":" in self.host else self.host
        ext_proc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_ExternalProcessorServicer_to_server(self.servicer, ext_proc)
        self.port = ext_proc.add_insecure_port(f"{address}:{self.port}")
        health = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, health)
        self.health_port = health.add_insecure_port(f"{address}:{self.health_port}")
        self._servers = [ext_proc, health]
        self.watch.start()
        await self.health.start()
        for server in self._servers:
            await server.start()
        self._readiness = asyncio.create_task(self._follow_readiness())

    async def _follow_readiness(self) -> None:
        while True:
            await self.health.update()
            await asyncio.sleep(self._interval)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new streams, let open ones finish for up to ``grace_s``, then stop watching."""
        if self._readiness is not None:
            self._readiness.cancel()
        await asyncio.gather(*(server.stop(grace_s) for server in self._servers))
        await self.watch.aclose()
        await self.upstream.aclose()
