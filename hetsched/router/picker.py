"""The picker: the one place both fronts ask which endpoint serves a request, and tell how it went.

``hetsched route`` (the HTTP front, :mod:`hetsched.router.app`) proxies the request to the endpoint it picks;
``hetsched epp`` (the gRPC front, :mod:`hetsched.router.epp`) tells a gateway where to send it. Either way the
decision runs here: the same policies, predictions, prefix index, health and ejection state, and the same
``hetsched_router_*`` series (their ``front`` label says which front took the request). Answers the picker gives
itself (bad request, unknown model, all saturated, no endpoint) are :class:`Refused`, which each front renders in
its own way with the same OpenAI error body.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from hetsched.catalog.host import HostInfo
from hetsched.catalog.perf import PerfConstants
from hetsched.errors import InputError
from hetsched.engine_metrics.parse import BEST_EFFORT_REASON
from hetsched.perf.online import Metric
from hetsched.router.answers import StreamStats
from hetsched.router.config import ApiKeyConfig, RouterConfig
from hetsched.router.flow import FlowLimits, FlowQueue, Shed, ShedReason, Waiting
from hetsched.router.metrics import EndpointSeries, RouterMetrics
from hetsched.router.openai import ApiKind, ErrorType, error_body, max_tokens, parse_request, prompt_text, prompt_tokens
from hetsched.router.policy import least_request
from hetsched.router.kv import PrefixSource
from hetsched.router.prefix import prefix_hashes
from hetsched.router.state import KV_EVENT_AWARE, PREFIX_AWARE, RouterState, Ticket
from hetsched.router.tokenize import PromptTokenizer, TokenizeError, prompt_token_ids
from hetsched.router.types import (DEFAULT_CLASS, DecisionReason, Endpoint, Front, Handoff, Policy, Prediction,
                                   RequestClass, RouteRequest, RoutingDecision)
from hetsched.sim.roles import Role
from hetsched.specs.workload import SLO

log = logging.getLogger(__name__)

SLO_TTFT_HEADER, SLO_TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
AUTHORIZATION_HEADER = "authorization"
MAX_TENANT_BYTES = 256
CANCELLED_CODE = "499"
ERROR_RATIO_EVERY = 32
"""Answered requests between updates of the prediction-error gauges (a median over a window each time)."""
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


def tenant_from_headers(headers: Mapping[str, str], holder: ApiKeyConfig | None) -> str:
    """The tenant a request is fair-shared as: its ``x-gateway-inference-fairness-id``, else its API key's, else
    none (""). An id over 256 bytes or with control characters is a 400."""
    raw = headers.get(FAIRNESS_HEADER)
    if raw is None:
        return holder.tenant if holder is not None else ""
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_TENANT_BYTES:
        raise InputError(f"expected a tenant id of at most {MAX_TENANT_BYTES} bytes, got {size}", field=FAIRNESS_HEADER)
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise InputError("expected a tenant id without control characters", field=FAIRNESS_HEADER)
    return raw


def _bearer(headers: Mapping[str, str]) -> str | None:
    scheme, _, credentials = (headers.get(AUTHORIZATION_HEADER) or "").strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def _fallback_key(prediction: Prediction, url: str) -> tuple[bool, float, str]:
    """A fallback's place: meeting the SLO first, cheapest first among those, least violating among the rest."""
    meets = prediction.meets_slo
    return (not meets, prediction.cost_per_token if meets else prediction.violation, url)


def _met(slo: SLO, arrived: float, ended: float, stats: StreamStats | None, generated: int) -> bool:
    """Whether an answer met ``slo`` as its client saw it from ``arrived``: a stream by its first token and mean
    gap after it, a whole answer by its latency against the TTFT plus a TPOT per token after the first."""
    if stats is not None and stats.first is not None:
        tpot_ok = stats.tokens < 2 or (stats.last - stats.first) / (stats.tokens - 1) * 1000 <= slo.tpot_ms
        return (stats.first - arrived) * 1000 <= slo.ttft_ms and tpot_ok
    tokens = max(generated, 1)
    return (ended - arrived) * 1000 <= slo.ttft_ms + slo.tpot_ms * (tokens - 1)


@dataclass(frozen=True)
class _ClassRules:
    """What flow control derives from one model's classes."""

    protected_ttft_ms: dict[str, float]
    """Per class, the tightest TTFT (ms) of the classes of higher priority, where one has an SLO."""
    top_priority: int


def _class_rules(classes: Mapping[str, RequestClass]) -> _ClassRules:
    protected: dict[str, float] = {}
    for name, request_class in classes.items():
        above = [c.slo.ttft_ms for c in classes.values() if c.priority > request_class.priority and c.slo is not None]
        if above:
            protected[name] = min(above)
    return _ClassRules(protected, max(c.priority for c in classes.values()))


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
        self._learned = 0
        self.classes = {name: model.classes() for name, model in config.models.items()}
        self._rules = {name: _class_rules(classes) for name, classes in self.classes.items()}
        self.key_holders = config.api_key_holders()
        self.tokenizers = {name: PromptTokenizer.load(model.kv_cache.tokenizer, field=f"models.{name}.kv_cache.tokenizer")
                           for name, model in config.models.items() if model.kv_cache.tokenizer}
        """Each model's own tokenizer, where the router file names one: prompts are hashed from its tokens."""
        self.flows: dict[str, _ModelFlow] = {}
        """Each model's queue: of its unified requests, or of a two-stage model's requests for a decode place."""
        self.prefill_flows: dict[str, _ModelFlow] = {}
        """A two-stage model's queue for a prefill place, of requests that hold their decode place: a queue of its
        own, so they never wait behind requests that wait for the decode places they hold."""
        if config.flow.enabled:
            self.flows = {name: self._new_flow(name) for name in config.models}
        for model in config.models:
            self.state.set_endpoints(model, [e for e in config.static_endpoints() if e.model == model])
        self.sync_gauges()

    # --- endpoints ------------------------------------------------------------------
    def set_policies(self, found: dict[str, Policy]) -> None:
        """Replace the policies discovery found per model (discovery calls this on every listing)."""
        self.state.discovered_policies = found

    def set_objectives(self, found: dict[str, list[RequestClass]]) -> None:
        """The request classes discovery read from ModelDeployments, for each model whose router file declares
        none (the file's own win; a model's default class stays the file's)."""
        for model, classes in found.items():
            config = self.config.models.get(model)
            if config is None or config.objectives:
                continue
            self.classes[model] = {**{c.name: c for c in classes}, DEFAULT_CLASS: self.classes[model][DEFAULT_CLASS]}
            self._rules[model] = _class_rules(self.classes[model])

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
            profile = self.state.get(endpoint.url).profile
            if profile is not None and self.state.learner is not None:
                correction = profile.correction
                for phase, scale in (("prefill", correction.prefill_scale), ("decode", correction.decode_scale)):
                    self.metrics.step_model_scale.labels(endpoint.model, endpoint.accelerator, phase).set(scale)

    def sync_kv_gauges(self) -> None:
        """The KV indexes' size, each endpoint's prefix source, and the KV-event problems since the last call."""
        now = self.clock()
        errors, self.state.kv_errors = self.state.kv_errors, []
        for model, url, reason in errors:
            self.metrics.kv_event_errors.labels(model, url, reason).inc()
        for model in self.config.models:
            kv = self.state.kv(model)
            self.metrics.kv_index_entries.labels(model).set(kv.index.entries)
            self.metrics.kv_index_bytes.labels(model).set(kv.index.nbytes)
            for url in kv.attached():
                events = kv.source(url, now) is PrefixSource.EVENTS
                self.metrics.kv_source.labels(model, url).set(1 if events else 0)

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
            key = _bearer(headers)
            holder = self.key_holders.get(key) if key is not None and self.key_holders else None
            tenant = tenant_from_headers(headers, holder)
        except InputError as exc:
            not_found = exc.http_status == 404
            raise Refused(404 if not_found else 400, str(exc), type=ErrorType.NOT_FOUND if not_found
                          else ErrorType.INVALID_REQUEST, code="model_not_found" if not_found else None,
                          param="model" if not_found else exc.field) from exc
        request_class = self.request_class(request.model, headers.get(OBJECTIVE_HEADER)
                                           or (holder.objective if holder is not None else None))
        try:
            slo = slo_from_headers(headers, request_class.slo)
        except InputError as exc:
            raise Refused(400, str(exc), type=ErrorType.INVALID_REQUEST, param=exc.field) from exc
        tokens = prompt_tokens(request)
        policy = self.state.policy_for(request.model)
        hashes = prefix_hashes(prompt_text(request)) if policy in PREFIX_AWARE else ()
        kv_hashes: tuple[int, ...] = ()
        kv = self.state.kv(request.model)
        if policy in KV_EVENT_AWARE and kv.attached():
            try:
                token_ids = prompt_token_ids(request, self.tokenizers.get(request.model))
                kv_hashes, tokens = kv.block_hashes(token_ids), len(token_ids)
            except TokenizeError as exc:
                self.metrics.kv_tokenize_errors.labels(request.model, self.front).inc()
                log.info("%s: the tokenizer failed on a prompt (%s); its cached prefix is approximated",
                         request.model, exc)
        self.metrics.model(request.model).prompt_tokens.inc(tokens)
        return RouteRequest(request.model, tokens, max_tokens(request), hashes, slo, objective=request_class.name,
                            fairness_id=tenant, arrived=self.clock(), kv_hashes=kv_hashes)

    def _class_of(self, route: RouteRequest) -> RequestClass:
        """``route``'s class as it is now (discovery may have dropped it since: then the default)."""
        classes = self.classes[route.model]
        return classes.get(route.objective) or classes[DEFAULT_CLASS]

    def request_class(self, model: str, name: str | None) -> RequestClass:
        """The class ``name`` of ``model``; an unknown name is served as the default class and counted."""
        classes = self.classes[model]
        if name is None:
            return classes[DEFAULT_CLASS]
        found = classes.get(name)
        if found is None:
            self.metrics.unknown_objective.labels(model, self.front).inc()
            log.debug("%s: objective %r is not one of %s; served as %s", model, name, ", ".join(classes),
                      DEFAULT_CLASS)
            return classes[DEFAULT_CLASS]
        return found

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

    async def place(self, route: RouteRequest, *, allowed: frozenset[str] | None = None,
                    size_bytes: int = 0) -> list[Endpoint]:
        """The endpoints to try in order, up to ``max_attempts``, once flow control lets the request go (see
        :meth:`admit`): the policy's choice first. The ``slo`` policy ranks the rest by its own predictions of
        this request (those that meet the SLO, cheapest first, then the least violating), from the one pass that
        chose the first; other policies choose again without the ones ranked. ``allowed`` (URLs) confines the
        choice; none eligible is a 503."""
        excluded = set()
        if allowed is not None:
            excluded = {e.url for e in self.state.endpoints(route.model)} - allowed
        first = await self.admit(route, exclude=frozenset(excluded), size_bytes=size_bytes,
                                 detail="" if allowed is None else " among the gateway's subset hint")
        assert first.endpoint is not None
        ranked = [first.endpoint]
        if first.predictions:
            rest = sorted((url for url in first.predictions if url != first.endpoint.url),
                          key=lambda url: _fallback_key(first.predictions[url], url))
            ranked += [self.state.get(url).endpoint for url in rest[:self.config.max_attempts - 1]]
            return ranked
        excluded.add(first.endpoint.url)
        for _ in range(self.config.max_attempts - 1):
            decision = self.state.decide(route, now=self.clock(), exclude=frozenset(excluded))
            if decision.endpoint is None:  # the rest are saturated or gone: the fallbacks end here
                break
            ranked.append(decision.endpoint)
            excluded.add(decision.endpoint.url)
        return ranked

    # --- flow control -------------------------------------------------------------------
    async def admit(self, route: RouteRequest, *, role: Role = Role.UNIFIED, handoff: Handoff | None = None,
                    exclude: frozenset[str] = frozenset(), size_bytes: int = 0, detail: str = "") -> RoutingDecision:
        """The first decision for a request's ``role`` (a unified request, or one stage of a two-stage one),
        through flow control (:mod:`hetsched.router.flow`): now, while the model has room for it and nobody
        waits; else once its turn comes in the model's queue, or a 429 when it cannot make its deadline (a
        two-stage request's stages share its deadline: both count from its arrival). Without flow control a
        saturated model is a 429 at once. No endpoint left is a 503 (``detail`` says among what)."""
        flow = self._flow(route.model, role)
        if flow is None:
            decision = self.decide(route, role, exclude, handoff)
            if decision.endpoint is None:
                self.no_endpoint(route, role, detail)
            return decision
        if flow.idle:
            now_decision = self._open_decision(route, exclude, waited_s=0.0, detail=detail, role=role,
                                               handoff=handoff)
            if now_decision is not None:
                flow.queue.counted_dispatch(self.clock())
                self._flow_series(self.metrics.flow_dispatched, route).inc()
                return now_decision
        return await self._wait(flow, route, exclude, size_bytes, detail, role=role, handoff=handoff)

    def _open_decision(self, route: RouteRequest, exclude: frozenset[str], *, waited_s: float, detail: str,
                       role: Role = Role.UNIFIED, handoff: Handoff | None = None) -> RoutingDecision | None:
        """The policy's choice, or None while the model is saturated for this request: every endpoint at a
        limit, or every busy one predicted past its TTFT limit (:meth:`_ttft_limit_ms`, after ``waited_s``). A
        choice past the limit gives way to the policy's choice among the endpoints within it; an idle endpoint
        that would miss serves the request anyway when no other is at its limit (then waiting cannot help)."""
        slo = route.slo
        if slo is not None and waited_s > 0:
            route = replace(route, slo=slo.model_copy(update={"ttft_ms": max(1e-3, slo.ttft_ms - waited_s * 1000)}))
        decision = self.state.decide(route, now=self.clock(), exclude=exclude, role=role, handoff=handoff)
        if decision.endpoint is None:
            if decision.reason is DecisionReason.ALL_SATURATED:
                return None
            self.metrics.model(route.model).decisions(decision.policy, decision.reason).inc()
            self.no_endpoint(route, role, detail)
        assert decision.endpoint is not None
        if self._class_of(route).priority < self._rules[route.model].top_priority and \
                decision.endpoint.url in (held := self._reserved(route, role)):
            decision = self.state.decide(route, now=self.clock(), exclude=exclude | held, role=role,
                                         handoff=handoff)  # the rest, or wait
            if decision.endpoint is None:
                return None
        assert decision.endpoint is not None
        limit_ms = self._ttft_limit_ms(route)
        if limit_ms is not None and decision.predictions and \
                decision.predictions[decision.endpoint.url].ttft_s * 1000 > limit_ms:
            # an idle endpoint past the limit may serve it (waiting cannot make it faster) unless another is at
            # its limit now: one of those frees up soon
            others_full = len(decision.predictions) < len(self.state.views(route.model, now=self.clock(), role=role))
            past = {url for url, p in decision.predictions.items()
                    if p.ttft_s * 1000 > limit_ms and (others_full or self.state.get(url).in_flight > 0)}
            if decision.endpoint.url in past:  # the choice is past the limit: among the others, or wait
                if past >= decision.predictions.keys():
                    return None
                decision = self.state.decide(route, now=self.clock(), exclude=exclude | past, role=role,
                                             handoff=handoff)
                if decision.endpoint is None:
                    return None
        self.metrics.model(route.model).decisions(decision.policy, decision.reason).inc()
        return decision

    def _reserved(self, route: RouteRequest, role: Role) -> frozenset[str]:
        """The ``role`` endpoints a request below its model's highest priority may not take: those full past the
        room ``flow.reserved_share`` does not keep for that priority."""
        share = 1 - self.config.flow.reserved_share
        return frozenset(e.url for e in self.state.endpoints(route.model) if e.role is role
                         and self.state.get(e.url).in_flight >= max(1, math.floor(e.max_concurrency * share)))

    def _ttft_limit_ms(self, route: RouteRequest) -> float | None:
        """The predicted TTFT (step-model time) past which ``route`` is held: what is left of its own, or, when
        a class of higher priority has a tighter one, that class's within the headroom, so requests of lower
        priority never fill the endpoints past where a more urgent one would still meet its SLO."""
        own = self.state.hardware_slo(route.slo)
        protected = self._rules[route.model].protected_ttft_ms.get(route.objective)
        limits = [own.ttft_ms] if own is not None else []
        if protected is not None:
            limits.append(protected * self.config.time_scale * self.config.slo_headroom)
        return min(limits) if limits else None

    async def _wait(self, flow: _ModelFlow, route: RouteRequest, exclude: frozenset[str], size_bytes: int,
                    detail: str, *, role: Role, handoff: Handoff | None) -> RoutingDecision:
        request_class = self._class_of(route)
        now = self.clock()
        wait_s = route.slo.ttft_ms / 1000 if route.slo is not None else flow.queue.limits.max_wait_s
        entry = Waiting(route, request_class, route.fairness_id, size_bytes, arrived=route.arrived,
                        deadline=route.arrived + wait_s)
        try:
            evicted = flow.queue.push(entry, now)
        except Shed as shed:
            raise self._shed(route, shed) from None
        for victim in evicted:
            flow.evict(victim, self._shed(victim.route, Shed(ShedReason.EVICTED, flow.queue.retry_after(now))))
        expected = flow.queue.expected_wait(entry, now)
        if expected is not None and now + expected > entry.deadline:
            flow.queue.remove(entry)
            raise self._shed(route, Shed(ShedReason.CANNOT_MEET_DEADLINE, flow.queue.retry_after(now)))
        queued = self._flow_series(self.metrics.flow_queued, route)
        queued.inc()
        backlog = None if request_class.best_effort else self.metrics.flow_queued_demand.labels(route.model,
                                                                                                  self.front)
        if backlog is not None:
            backlog.inc()
        loop = asyncio.get_running_loop()
        entry.handle = loop.create_future()
        flow.follow(loop)
        flow.kick()
        decision: RoutingDecision | None = None
        try:
            while decision is None:
                remaining = entry.deadline - self.clock()
                if remaining <= 0:
                    raise self._shed(route, Shed(ShedReason.DEADLINE, flow.queue.retry_after(self.clock())))
                woken, _ = await asyncio.wait((entry.handle,), timeout=remaining)  # no cancellation to race
                if not woken:
                    continue
                entry.handle.result()  # an eviction's refusal raises here (the future read again: see evict)
                flow.woke(entry)
                decision = self._open_decision(route, exclude, waited_s=self.clock() - route.arrived, detail=detail,
                                               role=role, handoff=handoff)
                if decision is None:
                    entry.handle = loop.create_future()
        finally:
            queued.dec()
            if backlog is not None:
                backlog.dec()
            flow.woke(entry)
            if decision is None:
                flow.queue.remove(entry)
            else:
                flow.queue.dispatched(entry, self.clock())
                self._flow_series(self.metrics.flow_wait, route).observe(self.clock() - now)
                self._flow_series(self.metrics.flow_dispatched, route).inc()
            loop.call_soon(flow.kick)  # the next in line: after this request's caller has charged its endpoint
        return decision

    def _shed(self, route: RouteRequest, shed: Shed) -> Refused:
        self.metrics.flow_shed.labels(route.model, route.objective, route.fairness_id, shed.reason,
                                      self.front).inc()
        best_effort = self._class_of(route).best_effort
        self.metrics.rejected_requests(route.model, BEST_EFFORT_REASON if best_effort else "saturated").inc()
        message = {
            ShedReason.QUEUE_FULL: f"{route.model} is saturated and its queue is full",
            ShedReason.EVICTED: f"{route.model} is saturated and a request of higher priority took this one's place",
            ShedReason.DEADLINE: f"{route.model} stayed saturated past this request's time to first token",
            ShedReason.CANNOT_MEET_DEADLINE: f"{route.model} is saturated and the requests ahead would outlast "
                                             "this one's time to first token",
            ShedReason.TENANTS: f"{route.model} is saturated and tracks as many waiting tenants as it can",
        }[shed.reason]
        return Refused(429, f"{message}; retry later", type=ErrorType.RATE_LIMIT, code="saturated",
                       headers={"Retry-After": str(max(shed.retry_after_s, self.config.retry_after_s))})

    def _flow_series(self, metric: Any, route: RouteRequest) -> Any:
        return metric.labels(route.model, route.objective, route.fairness_id, self.front)

    def _new_flow(self, model: str) -> _ModelFlow:
        flow = self.config.flow
        limits = FlowLimits(max_requests=flow.max_queued_requests, max_bytes=flow.max_queued_bytes,
                            max_tenants=flow.max_tenants, max_wait_s=flow.max_wait_s)
        return _ModelFlow(FlowQueue(limits, on_forget=self._forgetter(model)), flow.recheck_interval_s)

    def _flow(self, model: str, role: Role) -> _ModelFlow | None:
        """The queue ``role``'s requests of ``model`` wait in (None without flow control)."""
        if not self.flows:
            return None
        if role is Role.PREFILL:
            if model not in self.prefill_flows:
                self.prefill_flows[model] = self._new_flow(model)
            return self.prefill_flows[model]
        return self.flows.get(model)

    def _forgetter(self, model: str) -> Callable[[str], None]:
        classes, reasons = list(self.classes[model]), [r.value for r in ShedReason]
        return lambda tenant: self.metrics.forget_tenant(model, tenant, classes, reasons)

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
        ticket = self.state.start(endpoint.url, route, now=self.clock())
        if self.state.learning_cpu_s:  # it predicted the request to learn from it
            self.metrics.learning_cpu.inc(self.state.learning_cpu_s)
            self.state.learning_cpu_s = 0.0
        self.series(endpoint).in_flight.inc()
        flow = self._flow(endpoint.model, endpoint.role)
        if flow is not None:
            flow.queue.started(route.objective)
        return ticket

    def finish(self, ticket: Ticket, endpoint: Endpoint) -> None:
        self.state.finish(ticket, now=self.clock())
        self.series(endpoint).in_flight.dec()
        flow = self._flow(endpoint.model, endpoint.role)
        if flow is not None:
            flow.queue.finished(ticket.objective)
            flow.kick()  # room, perhaps, for the next in line

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
                 generated: int = 0, route: RouteRequest | None = None, ticket: Ticket | None = None) -> None:
        """Count an answer that ended (``code``: its status, ``stream-error``, ``timeout`` or 499) with its
        latency from ``started``, and a stream's TTFT and TPOT; with ``route``, whether it met its class's SLO;
        with ``ticket``, a successful stream's times teach its endpoint's step-model correction."""
        if route is not None and route.slo is not None and self.flows:
            met = code.startswith("2") and _met(route.slo, route.arrived, self.clock(), stats, generated)
            self.metrics.flow_slo.labels(route.model, route.objective, route.fairness_id, "true" if met else "false",
                                         self.front).inc()
        series = self.series(endpoint)
        series.requests(code).inc()
        series.e2e.observe(self.clock() - started)
        tokens = stats.tokens if stats is not None and stats.tokens else generated
        if tokens:
            self.metrics.model(endpoint.model).generation_tokens.inc(tokens)
        if stats is not None and stats.first is not None:
            ttft = stats.first - started
            tpot = (stats.last - stats.first) / (stats.tokens - 1) if stats.tokens > 1 else None
            series.ttft.observe(ttft)
            if tpot is not None:
                series.tpot.observe(tpot)
            if ticket is not None and code.startswith("2"):
                self._learn(ticket, ttft, tpot)

    def _learn(self, ticket: Ticket, ttft: float, tpot: float | None) -> None:
        """One answered request for the online correction; the gauges follow what is in force and how far off
        the predictions run."""
        learner = self.state.learner
        if learner is None or ticket.prediction is None or ticket.url not in self.state:
            return
        began = time.thread_time()
        endpoint = self.state.get(ticket.url).endpoint
        changed = self.state.learn(ticket, ttft_s=ttft, tpot_s=tpot, now=self.clock())
        if changed is not None:
            self.sync_gauges()
        self._learned += 1
        if self._learned % ERROR_RATIO_EVERY == 0 or changed is not None:
            key = self.state.get(ticket.url).key
            for metric in Metric:
                ratio = learner.error_ratio(key, metric)
                if ratio is not None:
                    self.metrics.prediction_error_ratio.labels(endpoint.model, endpoint.accelerator,
                                                               metric.value).set(ratio)
        self.metrics.learning_cpu.inc(time.thread_time() - began)

    def cancelled(self, endpoint: Endpoint, *, started: float, tokens: int = 0) -> None:
        """A request its client (or the gateway) abandoned: counted under :data:`CANCELLED_CODE`."""
        series = self.series(endpoint)
        series.requests(CANCELLED_CODE).inc()
        series.e2e.observe(self.clock() - started)
        if tokens:
            self.metrics.model(endpoint.model).generation_tokens.inc(tokens)


class _ModelFlow:
    """One model's queue and its waiters' wake-ups: one waiter is woken at a time (the queue's head), tries for
    an endpoint, and either goes (waking the next once its caller has charged its endpoint) or waits again for a
    request to end or the next recheck."""

    def __init__(self, queue: FlowQueue, recheck_interval_s: float) -> None:
        self.queue = queue
        self.recheck_interval_s = recheck_interval_s
        self._woken: Waiting | None = None
        self._ticker: asyncio.Task[None] | None = None

    @property
    def idle(self) -> bool:
        """Nobody waits: a request may go straight to an endpoint."""
        return self.queue.length == 0 and self._woken is None

    def kick(self) -> None:
        """Wake the head, unless a woken one has not yet had its turn."""
        if self._woken is not None or self.queue.length == 0:
            return
        head = self.queue.head()
        if head is None or head.handle is None or head.handle.done():
            return
        self._woken = head
        head.handle.set_result(None)

    def woke(self, entry: Waiting) -> None:
        if self._woken is entry:
            self._woken = None

    def evict(self, victim: Waiting, refusal: Refused) -> None:
        """Refuse ``victim``: through its future, or, when its turn came but it has not run yet, through a new one
        that it reads on waking."""
        self.woke(victim)
        if victim.handle is None:
            return
        if victim.handle.done():
            victim.handle = victim.handle.get_loop().create_future()
        victim.handle.set_exception(refusal)

    def follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Recheck the head every ``recheck_interval_s`` while anyone waits (engine signals change between the
        requests that end)."""
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._recheck())

    async def _recheck(self) -> None:
        while self.queue.length:
            await asyncio.sleep(self.recheck_interval_s)
            self.kick()
