"""The picker: the one place both fronts ask which endpoint serves a request, and tell how it went.

``hetsched route`` (the HTTP front, :mod:`hetsched.router.app`) proxies the request to the endpoint it picks;
``hetsched epp`` (the gRPC front, :mod:`hetsched.router.epp`) tells a gateway where to send it. Either way the
decision runs here: the same policies, predictions, prefix index, health and ejection state, and the same
``hetsched_router_*`` series (their ``front`` label says which front took the request). Answers the picker gives
itself (bad request, unknown model, all saturated, no endpoint) are :class:`Refused`, which each front renders in
its own way with the same OpenAI error body.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import NoReturn

from hetsched.catalog.host import HostInfo
from hetsched.catalog.perf import PerfConstants
from hetsched.errors import InputError
from hetsched.router.answers import StreamStats
from hetsched.router.config import RouterConfig
from hetsched.router.metrics import EndpointSeries, RouterMetrics
from hetsched.router.openai import ApiKind, ErrorType, error_body, max_tokens, parse_request, prompt_text, prompt_tokens
from hetsched.router.policy import least_request
from hetsched.router.prefix import prefix_hashes
from hetsched.router.state import PREFIX_AWARE, RouterState, Ticket
from hetsched.router.types import (DecisionReason, Endpoint, Front, Handoff, Policy, Prediction, RouteRequest,
                                   RoutingDecision)
from hetsched.sim.roles import Role
from hetsched.specs.workload import SLO

log = logging.getLogger(__name__)

SLO_TTFT_HEADER, SLO_TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
CANCELLED_CODE = "499"
"""The code a request its client abandoned is counted under (nginx's "client closed request")."""


class Refused(Exception):
    """An answer the picker or a front gives itself, before or instead of an engine's."""

    def __init__(self, status: int, message: str, *, type: ErrorType, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param, self.headers = status, type, code, param, headers or {}

    def body(self) -> bytes:
        """The OpenAI error body both fronts answer with."""
        return error_body(str(self), type=self.type, code=self.code, param=self.param)


def slo_from_headers(headers: Mapping[str, str], default: SLO | None) -> SLO | None:
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


def _fallback_key(prediction: Prediction, url: str) -> tuple[bool, float, str]:
    """A fallback's place: meeting the SLO first, cheapest first among those, least violating among the rest."""
    meets = prediction.meets_slo
    return (not meets, prediction.cost_per_token if meets else prediction.violation, url)


def stage(role: Role) -> str:
    """``prefill `` or ``decode `` for messages about one stage's endpoints; nothing for a unified model's."""
    return "" if role is Role.UNIFIED else f"{role} "


class Picker:
    """Decides where each request goes and keeps the books both fronts share.

    ``front`` labels the request series of this process; ``host`` is the machine ``cpu`` endpoints are predicted
    as; ``perf`` holds calibrated step-model constants by accelerator id (default: the catalog's).
    """

    def __init__(self, config: RouterConfig, *, front: Front, host: HostInfo,
                 perf: Mapping[str, PerfConstants] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.front = front
        self.clock = clock
        self.state = RouterState(config, host=host, perf=perf)
        self.metrics = RouterMetrics(front)
        for model in config.models:
            self.state.set_endpoints(model, [e for e in config.static_endpoints() if e.model == model])
        self.sync_gauges()

    # --- endpoints ------------------------------------------------------------------
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
            self.metrics.forget(self.labels(gone))
        self.sync_gauges()

    @staticmethod
    def labels(endpoint: Endpoint) -> tuple[str, str, str, str]:
        return endpoint.model, endpoint.url, endpoint.accelerator, endpoint.role

    def series(self, endpoint: Endpoint) -> EndpointSeries:
        return self.metrics.endpoint(self.labels(endpoint))

    def sync_gauges(self) -> None:
        for endpoint in self.state.endpoints():
            self.sync_health(endpoint)

    def sync_health(self, endpoint: Endpoint) -> None:
        available = self.state.get(endpoint.url).health.available(self.clock())
        self.metrics.healthy.labels(*self.labels(endpoint)).set(1 if available else 0)

    # --- deciding -------------------------------------------------------------------
    def route_request(self, body: bytes, kind: ApiKind, headers: Mapping[str, str]) -> RouteRequest:
        """What the decision needs of a request body and its headers; a bad one is a 400, an unknown model a 404."""
        try:
            request = parse_request(body, kind)
            if request.model not in self.config.models:
                self.config.model(request.model)  # raises NotFoundError with close matches
            slo = slo_from_headers(headers, self.config.models[request.model].slo)
        except InputError as exc:
            not_found = exc.http_status == 404
            raise Refused(404 if not_found else 400, str(exc), type=ErrorType.NOT_FOUND if not_found
                          else ErrorType.INVALID_REQUEST, code="model_not_found" if not_found else None,
                          param="model" if not_found else exc.field) from exc
        tokens = prompt_tokens(request)
        self.metrics.model(request.model).prompt_tokens.inc(tokens)
        hashes = prefix_hashes(prompt_text(request)) \
            if self.state.policy_for(request.model) in PREFIX_AWARE else ()
        return RouteRequest(request.model, tokens, max_tokens(request), hashes, slo,
                            objective=headers.get(OBJECTIVE_HEADER), fairness_id=headers.get(FAIRNESS_HEADER))

    def decide(self, route: RouteRequest, role: Role, tried: set[str] | frozenset[str],
               handoff: Handoff | None = None) -> RoutingDecision:
        """The policy's choice among ``role``'s endpoints not in ``tried``; every one saturated is a 429."""
        decision = self.state.decide(route, now=self.clock(), exclude=frozenset(tried), role=role, handoff=handoff)
        self.metrics.model(route.model).decisions(decision.policy, decision.reason).inc()
        if decision.endpoint is None and decision.reason is DecisionReason.ALL_SATURATED:
            self.metrics.rejected_requests(route.model, "saturated").inc()
            raise Refused(429, f"every {stage(role)}endpoint of {route.model} is at its limit; retry later",
                          type=ErrorType.RATE_LIMIT, code="saturated",
                          headers={"Retry-After": str(self.config.retry_after_s)})
        return decision

    def rank(self, route: RouteRequest, *, allowed: frozenset[str] | None = None) -> list[Endpoint]:
        """The endpoints to try in order, up to ``max_attempts``: the policy's choice first. The ``slo`` policy
        ranks the rest by its own predictions of this request (those that meet the SLO, cheapest first, then the
        least violating), from the one pass that chose the first; other policies choose again without the ones
        ranked. ``allowed`` (URLs) confines the choice; none eligible is a 503, all saturated a 429."""
        excluded = set()
        if allowed is not None:
            excluded = {e.url for e in self.state.endpoints(route.model)} - allowed
        first = self.decide(route, Role.UNIFIED, excluded)
        if first.endpoint is None:
            self.no_endpoint(route, Role.UNIFIED, "" if allowed is None else " among the gateway's subset hint")
        ranked = [first.endpoint]
        if first.predictions:
            rest = sorted((url for url in first.predictions if url != first.endpoint.url),
                          key=lambda url: _fallback_key(first.predictions[url], url))
            ranked += [self.state.get(url).endpoint for url in rest[:self.config.max_attempts - 1]]
            return ranked
        excluded.add(first.endpoint.url)
        for _ in range(self.config.max_attempts - 1):
            try:
                decision = self.decide(route, Role.UNIFIED, excluded)
            except Refused:  # the rest are saturated: the fallbacks end here
                break
            if decision.endpoint is None:
                break
            ranked.append(decision.endpoint)
            excluded.add(decision.endpoint.url)
        return ranked

    def by_load(self, allowed: frozenset[str] | None = None) -> Endpoint:
        """For a request the picker cannot read (no body, a path it does not route): the least-loaded healthy
        endpoint of any model, within ``allowed`` (URLs) when given; none is a 503."""
        now = self.clock()
        views = [v for model in self.config.models for v in self.state.views(model, now=now)
                 if allowed is None or v.url in allowed]
        open_views = [v for v in views if not v.saturated] or views
        if not open_views:
            raise Refused(503, "no healthy endpoint", type=ErrorType.UNAVAILABLE, code="no_endpoint",
                          headers={"Retry-After": str(self.config.retry_after_s)})
        return least_request(open_views).endpoint

    def no_endpoint(self, route: RouteRequest, role: Role, detail: str = "") -> NoReturn:
        self.metrics.rejected_requests(route.model, "no-endpoint").inc()
        raise Refused(503, f"no healthy {stage(role)}endpoint serves {route.model}{detail}", type=ErrorType.UNAVAILABLE,
                      code="no_endpoint", headers={"Retry-After": str(self.config.retry_after_s)})

    # --- accounting -----------------------------------------------------------------
    def start(self, endpoint: Endpoint, route: RouteRequest) -> Ticket:
        """One request in flight at ``endpoint`` until :meth:`finish`."""
        ticket = self.state.start(endpoint.url, route)
        self.series(endpoint).in_flight.inc()
        return ticket

    def finish(self, ticket: Ticket, endpoint: Endpoint) -> None:
        self.state.finish(ticket)
        self.series(endpoint).in_flight.dec()

    def failure(self, endpoint: Endpoint) -> None:
        """A connection failure, a 5xx or an answer broken off: enough in a row eject the endpoint."""
        if self.state.record_failure(endpoint.url, now=self.clock()):
            log.warning("endpoint %s ejected after consecutive failures", endpoint.url)
            self.metrics.ejections.labels(*self.labels(endpoint)).inc()
            self.sync_health(endpoint)

    def success(self, endpoint: Endpoint, *, active: bool = False) -> None:
        if self.state.record_success(endpoint.url, now=self.clock(), active=active):
            if active:
                log.info("endpoint %s recovered", endpoint.url)
            self.sync_health(endpoint)

    def answered(self, endpoint: Endpoint, code: str, *, started: float, stats: StreamStats | None = None,
                 generated: int = 0) -> None:
        """Count an answer that ended (``code``: its status, ``stream-error``, ``timeout`` or 499) with its
        latency from ``started``, and a stream's TTFT and TPOT."""
        series = self.series(endpoint)
        series.requests(code).inc()
        series.e2e.observe(self.clock() - started)
        tokens = stats.tokens if stats is not None and stats.tokens else generated
        if tokens:
            self.metrics.model(endpoint.model).generation_tokens.inc(tokens)
        if stats is not None and stats.first is not None:
            series.ttft.observe(stats.first - started)
            if stats.tokens > 1:
                series.tpot.observe((stats.last - stats.first) / (stats.tokens - 1))

    def cancelled(self, endpoint: Endpoint, *, started: float, tokens: int = 0) -> None:
        """A request its client (or the gateway) abandoned: counted under :data:`CANCELLED_CODE`."""
        series = self.series(endpoint)
        series.requests(CANCELLED_CODE).inc()
        series.e2e.observe(self.clock() - started)
        if tokens:
            self.metrics.model(endpoint.model).generation_tokens.inc(tokens)
