"""The router's live state: endpoints per model, in-flight requests, engine signals, health.

Everything here is plain bookkeeping over a clock the caller passes in; the
ASGI shell and the poller call it, tests drive it with a fake clock.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hetsched.catalog.host import HostInfo
from hetsched.catalog.perf import PerfConstants
from hetsched.errors import HetschedError
from hetsched.router.config import RouterConfig
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, EstimatorSettings
from hetsched.router.health import HealthTracker
from hetsched.kvcache.hashing import BlockHashing
from hetsched.router.kv import ModelKV, PrefixSource
from hetsched.router.learning import FleetLearner, correction_key
from hetsched.router.policy import decide
from hetsched.router.predict import EndpointProfile, decodes_as_modelled, life_step, prefill_span, sent_prediction
from hetsched.router.prefix import PREFIX_BLOCK_TOKENS, PrefixIndex
from hetsched.router.profiles import endpoint_profile
from hetsched.router.signals import fresh
from hetsched.router.types import (DEFAULT_CLASS, Endpoint, EndpointView, EngineSignals, Handoff, Policy,
                                   Prediction, RouteRequest, RoutingDecision)
from hetsched.sim.roles import Role
from hetsched.specs.engine import EngineConfig
from hetsched.specs.workload import SLO

log = logging.getLogger(__name__)


PREFIX_AWARE = frozenset({Policy.PREFIX, Policy.KV_AWARE, Policy.SLO})
"""Policies that read what endpoints cache: ``prefix`` for affinity (the approximation's), ``kv-aware`` for the
most cached blocks, ``slo`` for the cached share of a prompt (those two from KV events where an endpoint has them)."""
KV_EVENT_AWARE = frozenset({Policy.KV_AWARE, Policy.SLO})
FOLLOWED = 256
"""Requests taken to learn from whose follower's time an endpoint keeps (a request that never reports drops out)."""


SENT_RATE_S = 0.3
"""Time constant, in the step model's seconds, of the rate of prompt tokens sent to an endpoint
(:class:`DecayingRate`): several requests at the loads where prompts wait for each other, and short enough to
follow a run of sends to one endpoint that looks best until its own load turns the router elsewhere."""


@dataclass
class DecayingRate:
    """Amounts per second, each weighing ``exp(-age / tau_s)``: a rate that follows a change within ``tau_s``."""

    tau_s: float = SENT_RATE_S
    value: float = 0.0
    at: float = -math.inf

    def add(self, amount: float, now: float) -> None:
        self.value = self.read(now) + amount / self.tau_s
        self.at = now

    def read(self, now: float) -> float:
        return self.value * math.exp(-(now - self.at) / self.tau_s) if now > self.at else self.value


@dataclass
class EndpointState:
    endpoint: Endpoint
    health: HealthTracker
    profile: EndpointProfile | None
    key: CorrectionKey
    """What its timings teach (:mod:`hetsched.router.learning`): shared with its model's endpoints on the same
    hardware and engine."""
    signals: EngineSignals | None = None
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    in_flight_max_tokens: int = 0
    since_signals: int = 0
    """Requests in flight sent after the last signals (which cannot count them yet)."""
    readings: int = 0
    """Signals recorded so far: a ticket from an earlier reading is in the engine's counts."""
    load_seconds: float = 0.0
    """The time integral of ``in_flight`` up to ``load_at``: a request's mean batch is its growth over its life."""
    load_at: float = 0.0
    sampled_at: float = -math.inf
    """When a request last sent here was taken to learn from (``calibration.samples_per_s`` bounds them)."""
    sampled_index: int = -1
    """The ``sent`` index of that request."""
    sent: int = 0
    """Requests sent here so far, and ..."""
    sent_prompt_tokens: int = 0
    """... their prompt tokens: what was prefilled through a request's life."""
    last_sent_at: float = -math.inf
    last_sent_prompt: int = 0
    followed: dict[int, float] = field(default_factory=dict)
    """When the next request came, by the ``sent`` index of a request taken to learn from (at most
    :data:`FOLLOWED` kept): a TTFT is learned from only if no other prompt came before its first token."""
    sent_prompts: DecayingRate = field(default_factory=DecayingRate)
    """Prompt tokens sent here per second of the step model, lately: what shares a new request's first chunk."""

    def advance(self, now: float) -> float:
        """``load_seconds`` up to ``now``."""
        if now > self.load_at:
            self.load_seconds += self.in_flight * (now - self.load_at)
            self.load_at = now
        return self.load_seconds


@dataclass(frozen=True)
class Ticket:
    """One request in flight at one endpoint; hand it back to :meth:`RouterState.finish`."""

    url: str
    prompt_tokens: int
    max_tokens: int
    reading: int = 0
    """The endpoint's ``readings`` when the request started."""
    objective: str = DEFAULT_CLASS
    """The request's class (flow control counts each class's requests in flight)."""
    prediction: Prediction | None = None
    """What the step model predicted for the request as it was sent, to learn from when it is answered."""
    sent_at: float = 0.0
    load_seconds: float = 0.0
    """The endpoint's load integral when the request was sent (its mean load over its life follows)."""
    index: int = 0
    """The endpoint's ``sent`` before it; the requests and prompt tokens sent after it follow from ..."""
    sent_prompt_tokens: int = 0
    """... the endpoint's ``sent_prompt_tokens`` with it."""


@dataclass
class _ModelPool:
    kv: ModelKV
    """What the engines' KV events say they cache (:mod:`hetsched.router.kv`)."""
    endpoints: dict[str, EndpointState] = field(default_factory=dict)
    turns: dict[Role, int] = field(default_factory=dict)
    """Round-robin's turn per role: each stage of a request takes one."""
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    """The approximation, where an endpoint's events are not in force: what this router sent where."""


class RouterState:
    """Endpoints of every model and what the router knows about each."""

    def __init__(self, config: RouterConfig, *, host: HostInfo | None = None,
                 perf: Mapping[str, PerfConstants] | None = None, rng: random.Random | None = None) -> None:
        self.config = config
        self.host = host
        """The machine a ``cpu`` endpoint is predicted as (the shell reads it); None: ``cpu`` has no profile."""
        self.perf = tuple(sorted((perf or {}).items()))
        """Calibrated step-model constants by accelerator id (the shell reads them from the store)."""
        self._rng = rng or random.Random()
        self._pools: dict[str, _ModelPool] = {name: _ModelPool(self._model_kv(name)) for name in config.models}
        self._by_url: dict[str, EndpointState] = {}
        self.kv_errors: list[tuple[str, str, str]] = []
        """(model, endpoint URL, reason) of each KV-event problem since the shell last took them (it counts them)."""
        self.discovered_policies: dict[str, Policy] = {}
        """Policies discovery found per model (a ModelDeployment's ``spec.routing.policy``)."""
        calibration = config.calibration
        self.learner = FleetLearner(time_scale=config.time_scale, settings=EstimatorSettings(
            trusted_observations=calibration.trusted_observations, trusted_sd=calibration.trusted_sd)
        ) if calibration.online else None
        self.learning_cpu_s = 0.0
        """CPU seconds spent predicting the requests learned from as they were sent, not yet exported: the shell
        moves them to its counter as each request starts (every request, streamed or not)."""

    def _model_kv(self, model: str) -> ModelKV:
        kv = self.config.models[model].kv_cache
        return ModelKV(BlockHashing(kv.block_size, kv.hash_algorithm, kv.hash_seed), max_blocks=kv.max_blocks,
                       resync_s=kv.resync_s, max_blocks_per_s=kv.max_blocks_per_s,
                       on_error=lambda url, reason: self.kv_errors.append((model, url, reason)))

    def kv(self, model: str) -> ModelKV:
        return self._pools[model].kv

    def policy_for(self, model: str) -> Policy:
        """The model's policy: the router file's for that model, else the discovered one, else the file's default."""
        return self.config.models[model].policy or self.discovered_policies.get(model) or self.config.policy

    # --- membership -------------------------------------------------------
    def set_endpoints(self, model: str, endpoints: list[Endpoint]) -> None:
        """Replace a model's endpoints; state of URLs that stay is kept."""
        pool = self._pools[model]
        wanted = {e.url: e for e in endpoints}
        for url in set(pool.endpoints) - set(wanted):
            gone = pool.endpoints.pop(url)
            self._by_url.pop(url, None)
            pool.prefix.forget(url)
            pool.kv.detach(url)
            if self.learner is not None:
                self.learner.forget(gone.key, url)
        for url, endpoint in wanted.items():
            current = pool.endpoints.get(url)
            if current is not None and current.endpoint == endpoint:
                continue
            key = correction_key(endpoint, self.config.models[model].arch or model)
            state = EndpointState(endpoint, HealthTracker(self.config.health.settings()), self._profile(endpoint, key),
                                  key)
            if current is not None:
                state.in_flight, state.signals = current.in_flight, current.signals
                state.in_flight_prompt_tokens = current.in_flight_prompt_tokens
                state.in_flight_max_tokens = current.in_flight_max_tokens
                state.since_signals, state.readings = current.since_signals, current.readings
                state.sent, state.sent_prompt_tokens = current.sent, current.sent_prompt_tokens
                state.last_sent_at, state.last_sent_prompt = current.last_sent_at, current.last_sent_prompt
            pool.endpoints[url] = state
            self._by_url[url] = state
            if endpoint.kv_events:
                pool.kv.attach(url)
            else:
                pool.kv.detach(url)

    def _profile(self, endpoint: Endpoint, key: CorrectionKey) -> EndpointProfile | None:
        model = self.config.models[endpoint.model]
        try:
            profile = endpoint_profile(endpoint, arch=model.arch or endpoint.model, engine=EngineConfig(),
                                       max_model_len=model.max_model_len, host=self.host, perf=self.perf)
        except HetschedError as exc:
            log.warning("no latency profile for %s (%s): the slo policy skips it", endpoint.url, exc)
            return None
        if self.learner is None:
            return profile
        return replace(profile, correction=self.learner.in_force(key))

    def endpoints(self, model: str | None = None) -> list[Endpoint]:
        states = self._pools[model].endpoints.values() if model else self._by_url.values()
        return [s.endpoint for s in states]

    def disaggregated(self, model: str) -> bool:
        """Served in two stages: the model has prefill and decode endpoints (unified ones then take no traffic)."""
        roles = {s.endpoint.role for s in self._pools[model].endpoints.values()}
        return Role.PREFILL in roles and Role.DECODE in roles

    def __contains__(self, url: object) -> bool:
        return url in self._by_url

    def get(self, url: str) -> EndpointState:
        return self._by_url[url]

    # --- decisions ----------------------------------------------------------
    def views(self, model: str, *, now: float, exclude: frozenset[str] = frozenset(),
              role: Role = Role.UNIFIED) -> list[EndpointView]:
        """Healthy endpoints of ``model`` serving ``role`` not in ``exclude``, with fresh signals or unknowns."""
        stale_after = self.config.metrics_stale_after_s
        config = self.config.models[model]
        max_queue, max_kv = config.max_queue, config.max_kv_usage
        return [self._view(state, now=now, stale_after_s=stale_after, max_queue=max_queue, max_kv=max_kv)
                for url, state in self._pools[model].endpoints.items()
                if url not in exclude and state.endpoint.role is role and state.health.available(now)]

    def _view(self, state: EndpointState, *, now: float, stale_after_s: float, max_queue: int,
              max_kv: float) -> EndpointView:
        signals = fresh(state.signals, now=now, stale_after_s=stale_after_s)
        if signals is None:  # stale or missing: unknown, never idle
            running = waiting = kv_usage = None
        else:
            running, waiting, kv_usage = signals.running, signals.waiting, signals.kv_usage
        return EndpointView(state.endpoint, state.in_flight, state.in_flight_prompt_tokens,
                            state.in_flight_max_tokens, running, waiting, kv_usage, max_queue,
                            state.since_signals, max_kv,
                            prompt_tokens_per_s=state.sent_prompts.read(now * self.config.time_scale))

    def decide(self, request: RouteRequest, *, now: float, exclude: frozenset[str] = frozenset(),
               role: Role = Role.UNIFIED, handoff: Handoff | None = None) -> RoutingDecision:
        """Choose an endpoint serving ``role`` for ``request`` under its model's policy (``handoff``: see
        :func:`~hetsched.router.policy.decide`)."""
        pool = self._pools[request.model]
        model = self.config.models[request.model]
        policy = self.policy_for(request.model)
        views = self.views(request.model, now=now, exclude=exclude, role=role)
        profiles = None
        if policy is Policy.SLO:
            profiles = {v.url: p for v in views if (p := pool.endpoints[v.url].profile) is not None}
            if len(profiles) < len(views):
                views = [v for v in views if v.url in profiles] or views
                if not profiles:
                    policy = Policy.LEAST_REQUEST
        cached = self.cached_tokens(request, [v.url for v in views], now=now, policy=policy) \
            if policy in PREFIX_AWARE else None
        decision = decide(policy, request, views, turn=pool.turns.get(role, 0), rng=self._rng, cached=cached,
                          profiles=profiles, slo=self.hardware_slo(request.slo or model.slo),
                          headroom=self.config.slo_headroom,
                          role=role, handoff=handoff)
        if decision.endpoint is not None:
            pool.turns[role] = pool.turns.get(role, 0) + 1
        return decision

    def cached_tokens(self, request: RouteRequest, urls: list[str], *, now: float,
                      policy: Policy = Policy.SLO) -> dict[str, int]:
        """Leading prompt tokens each of ``urls`` holds in its prefix cache: from its engine's KV events where they
        are in force (``kv-aware`` and ``slo``), else what this router sent there (the approximation)."""
        pool = self._pools[request.model]
        exact = pool.kv.cached_tokens(request.kv_hashes, urls, now) \
            if policy in KV_EVENT_AWARE and request.kv_hashes else {}
        rest = [url for url in urls if url not in exact]
        if rest and request.prefix_hashes:
            for url, blocks in pool.prefix.matches(request.prefix_hashes, rest).items():
                exact[url] = blocks * PREFIX_BLOCK_TOKENS
        return exact

    def prefix_source(self, url: str, *, now: float) -> PrefixSource:
        """Whether the endpoint's cached-prefix figures come from its KV events or the approximation."""
        state = self._by_url[url]
        return self._pools[state.endpoint.model].kv.source(url, now)

    def hardware_slo(self, slo: SLO | None) -> SLO | None:
        """``slo`` (as clients see it) in the time of the step model's predictions: the same, unless the endpoints
        are twins run at a ``time_scale``."""
        scale = self.config.time_scale
        if slo is None or scale == 1.0:
            return slo
        return slo.model_copy(update={"ttft_ms": slo.ttft_ms * scale, "tpot_ms": slo.tpot_ms * scale})

    def handoff(self, decode: RoutingDecision) -> Handoff:
        """What the prefill stage's choice needs of the decode instance ``decode`` chose."""
        state = self._by_url.get(decode.endpoint.url) if decode.endpoint is not None else None
        profile = state.profile if state is not None else None
        return Handoff(network_gbs=profile.network_gbs if profile is not None else None,
                       ttft_s=decode.prediction.ttft_s if decode.prediction is not None else 0.0)

    # --- request lifecycle ----------------------------------------------------
    def start(self, url: str, request: RouteRequest, *, now: float = 0.0) -> Ticket:
        state = self._by_url[url]
        prediction = None
        if self.learner is not None:
            if state.sampled_index == state.sent - 1 >= 0:
                state.followed[state.sampled_index] = now
                if len(state.followed) > FOLLOWED:
                    del state.followed[min(state.followed)]
            if now - state.sampled_at >= 1.0 / self.config.calibration.samples_per_s:
                began = time.thread_time()
                prediction = self._sent(state, request, now=now)
                self.learning_cpu_s += time.thread_time() - began
                state.sampled_at = now
                state.sampled_index = state.sent
        area = state.advance(now)
        ticket = Ticket(url, request.prompt_tokens, request.max_tokens, state.readings, request.objective, prediction,
                        now, area, state.sent, state.sent_prompt_tokens + request.prompt_tokens)
        state.in_flight += 1
        state.in_flight_prompt_tokens += request.prompt_tokens
        state.in_flight_max_tokens += request.max_tokens
        state.since_signals += 1
        state.sent += 1
        state.sent_prompt_tokens += request.prompt_tokens
        state.last_sent_at, state.last_sent_prompt = now, request.prompt_tokens
        state.sent_prompts.add(request.prompt_tokens, now * self.config.time_scale)
        if request.prefix_hashes:
            self._pools[state.endpoint.model].prefix.record(request.prefix_hashes, url)
        return ticket

    def _sent(self, state: EndpointState, request: RouteRequest, *, now: float) -> Prediction | None:
        """What the step model predicts for ``request`` at ``state``'s endpoint as it is sent there (a unified
        endpoint with a profile; stages are not learned from)."""
        if state.profile is None or state.endpoint.role is not Role.UNIFIED:
            return None
        config = self.config.models[state.endpoint.model]
        view = self._view(state, now=now, stale_after_s=self.config.metrics_stale_after_s,
                          max_queue=config.max_queue, max_kv=config.max_kv_usage)
        cached = self.cached_tokens(request, [state.endpoint.url], now=now)
        alone = (now - state.last_sent_at) * self.config.time_scale >= prefill_span(state.profile, view,
                                                                                     state.last_sent_prompt)
        return sent_prediction(state.profile, view, request, cached_tokens=cached.get(state.endpoint.url, 0),
                               alone=alone)

    def learn(self, ticket: Ticket, *, ttft_s: float | None, tpot_s: float | None,
              now: float) -> tuple[CorrectionKey, StepCorrection] | None:
        """Learn from an answered request's wall TTFT and TPOT; when its key's correction in force changes, every
        endpoint of that key predicts with the new one, and the key and correction are returned.

        The TTFT is learned beside the prediction made as the request was sent, when no other prompt was in the
        engine from then to its first token. The TPOT beside the mean step over the request's life: the
        endpoint's mean load through it, not the load it was sent at (a request lives longest through busy
        spells, and learning its steps against the load it found on arrival would read a flatter step model than
        the hardware has), capped at its sequence slots, with the prompts sent there meanwhile prefilled among its
        steps; only when it ended with nothing there waiting for KV memory
        (:func:`~hetsched.router.predict.decodes_as_modelled`). A request sent to an endpoint that was not
        :func:`~hetsched.router.predict.quiet` teaches no TTFT."""
        state = self._by_url.get(ticket.url)
        if self.learner is None or ticket.prediction is None or state is None or state.profile is None:
            return None
        next_sent = state.followed.pop(ticket.index, None)
        alone = ttft_s is not None and (next_sent - ticket.sent_at >= ttft_s if next_sent is not None
                                        else state.sent == ticket.index + 1)
        tpot_parts = None
        config = self.config.models[state.endpoint.model]
        ended = self._view(state, now=now, stale_after_s=self.config.metrics_stale_after_s,
                           max_queue=config.max_queue, max_kv=config.max_kv_usage)
        if not decodes_as_modelled(state.profile, ended):
            tpot_s = None  # it may have decoded in a batch that KV memory held below the load
        elif tpot_s is not None and tpot_s > 0 and now > ticket.sent_at:
            batch = (state.advance(now) - ticket.load_seconds) / (now - ticket.sent_at)
            decoding = now - ticket.sent_at - (ttft_s if ttft_s is not None else 0.0)
            tpot_parts = life_step(state.profile, batch, requests=state.in_flight,
                                   prompt_tokens=state.in_flight_prompt_tokens,
                                   max_tokens=state.in_flight_max_tokens, decode_steps=decoding / tpot_s,
                                   arrivals=max(state.sent - ticket.index - 1, 0),
                                   arrival_prompt_tokens=max(state.sent_prompt_tokens - ticket.sent_prompt_tokens, 0))
        # a TTFT is learned from only if no other prompt came before its first token (or when is no longer known)
        changed = self.learner.observe(state.key, ticket.url, ticket.prediction, ttft_s=ttft_s if alone else None,
                                       tpot_s=tpot_s, tpot_parts=tpot_parts, at=now)
        if changed is None:
            return None
        for other in self._pools[state.endpoint.model].endpoints.values():
            if other.key == state.key and other.profile is not None:
                other.profile = replace(other.profile, correction=changed)
        return state.key, changed

    def finish(self, ticket: Ticket, *, now: float | None = None) -> None:
        state = self._by_url.get(ticket.url)
        if state is None:  # removed by discovery while the request ran
            return
        if now is not None:
            state.advance(now)
        state.in_flight -= 1
        state.in_flight_prompt_tokens -= ticket.prompt_tokens
        state.in_flight_max_tokens -= ticket.max_tokens
        if ticket.reading == state.readings:
            state.since_signals -= 1

    # --- signals and health --------------------------------------------------
    def record_signals(self, url: str, signals: EngineSignals) -> None:
        """The engine's latest counts, which hold every request sent before them (this router's and others')."""
        state = self._by_url.get(url)
        if state is not None:
            state.signals, state.since_signals = signals, 0
            state.readings += 1

    def record_success(self, url: str, *, now: float, active: bool = False) -> bool:
        """Returns True when this recovers an ejected endpoint."""
        state = self._by_url.get(url)
        return state is not None and state.health.record_success(now, active=active)

    def record_failure(self, url: str, *, now: float) -> bool:
        """Returns True when this ejects the endpoint."""
        state = self._by_url.get(url)
        return state is not None and state.health.record_failure(now)

