"""Routing policies: pure functions from candidate views to one endpoint.

``decide`` filters out saturated endpoints (all saturated: a 429 decision),
then applies the policy. Round-robin's turn, power-of-two's random source,
each endpoint's cached prompt tokens and endpoint profiles come in as arguments, so every choice
is a function of its inputs (and of a seeded RNG's state). Each stage of a disaggregated model's request is
one decision among the endpoints of that role; only ``slo`` predicts by role.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from hetsched.router.predict import EndpointProfile, predict
from hetsched.router.prefix import prefix_key, rendezvous
from hetsched.router.types import (DecisionReason, EndpointView, Handoff, Policy, Prediction, RouteRequest,
                                   RoutingDecision)
from hetsched.sim.roles import Role
from hetsched.specs.workload import SLO

PREFIX_BALANCE = 1.25
"""Bounded load for prefix affinity: an endpoint takes a request only below 1.25 × the mean load (+1)."""


def _load_key(view: EndpointView) -> tuple[int, int, str]:
    return (view.load, view.in_flight, view.url)


def round_robin(views: Sequence[EndpointView], turn: int) -> EndpointView:
    ordered = sorted(views, key=lambda v: v.url)
    return ordered[turn % len(ordered)]


def least_request(views: Sequence[EndpointView]) -> EndpointView:
    return min(views, key=_load_key)


def power_of_two(views: Sequence[EndpointView], rng: random.Random) -> EndpointView:
    if len(views) == 1:
        return views[0]
    a, b = rng.sample(list(views), 2)
    return min((a, b), key=_load_key)


def least_kv(views: Sequence[EndpointView]) -> EndpointView:
    """Lowest KV usage; unknown usage ranks after every known one."""
    return min(views, key=lambda v: (v.kv_usage is None, v.kv_usage or 0.0, *_load_key(v)))


def prefix_affinity(views: Sequence[EndpointView], request: RouteRequest,
                    cached: Mapping[str, int]) -> tuple[EndpointView, bool]:
    """The prompt's owner by consistent hashing of its prefix key, or the next in its order under the load bound.

    Consistent hashing with bounded loads: every replica of the router sends a prefix to the same endpoint (its
    load is the engine's own count), and a hot prefix spills along its own order of endpoints, which the
    replicas share too. Returns the view and whether this router saw it serve the prompt's leading blocks.
    """
    key = prefix_key(request.prefix_hashes)
    if key is None:
        return least_request(views), False
    bound = PREFIX_BALANCE * (sum(v.load for v in views) + 1) / len(views)
    by_url = {v.url: v for v in views}
    order = [by_url[url] for url in rendezvous(key, list(by_url))]
    best = next((v for v in order if v.load < bound + 1), order[0])
    return best, cached.get(best.url, 0) > 0


KV_HIT_SHARE = 0.5
"""A cached prefix binds a request to the endpoint holding it only from this share of the prompt up: a shorter one
(the system prompt every conversation shares) is worth less than a less loaded endpoint, so a conversation's
first turn goes to the least loaded and the fleet's caches fill evenly (sglang-router's ``cache_threshold``)."""


def kv_aware(views: Sequence[EndpointView], cached: Mapping[str, int],
             prompt_tokens: int) -> tuple[EndpointView, bool]:
    """The endpoint holding most of the prompt in its KV cache, among those under the load bound
    (``PREFIX_BALANCE`` × the mean load + 1); equals, and a prompt nobody holds ``KV_HIT_SHARE`` of, go to the
    least loaded. Returns the view and whether it holds any of the prompt."""
    bound = PREFIX_BALANCE * (sum(v.load for v in views) + 1) / len(views)
    within = [v for v in views if v.load < bound + 1] or list(views)
    binding = {url: tokens for url, tokens in cached.items() if tokens >= KV_HIT_SHARE * prompt_tokens}
    best = min(within, key=lambda v: (-binding.get(v.url, 0), *_load_key(v)))
    return best, cached.get(best.url, 0) > 0


SPREAD_ALPHA = 1.0
"""Weight of predicted latency against price: score = cost per token × (1 + α · latency share of the SLO)."""
SPREAD_EPSILON = 0.02
"""Scores within 2 % of the best are equals: the least loaded of them takes the request, ties by the RNG."""
HEADROOM_SHARE = 0.75
"""The share of an endpoint's predicted SLO headroom it fills before requests spill to endpoints with more left:
each keeps a reserve, which is where a failed endpoint's requests go."""


def _latency_share(prediction: Prediction, slo: SLO, headroom: float) -> float:
    """Mean of TTFT and TPOT as shares of what the headroom allows: each term moves the score, not only the worse."""
    return (prediction.ttft_s * 1e3 / slo.ttft_ms + prediction.tpot_s * 1e3 / slo.tpot_ms) / (2 * headroom)


def _least_loaded(views: Sequence[EndpointView], profiles: Mapping[str, EndpointProfile],
                  rng: random.Random) -> EndpointView:
    """Among equals, the lowest load per sequence slot; the RNG breaks exact ties (URL order would pack)."""
    fill = {v.url: v.load / profiles[v.url].max_num_seqs for v in views}
    lowest = min(fill.values())
    ties = sorted((v for v in views if fill[v.url] == lowest), key=lambda v: v.url)
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def _spread(views: Sequence[EndpointView], score: Mapping[str, float], profiles: Mapping[str, EndpointProfile],
            rng: random.Random) -> EndpointView:
    best = min(score[v.url] for v in views)
    return _least_loaded([v for v in views if score[v.url] <= best * (1 + SPREAD_EPSILON)], profiles, rng)


def slo_choice(views: Sequence[EndpointView], request: RouteRequest, profiles: Mapping[str, EndpointProfile], *,
               slo: SLO | None, headroom: float, rng: random.Random, role: Role = Role.UNIFIED,
               handoff: Handoff | None = None, cached: Mapping[str, int] | None = None,
               ) -> tuple[EndpointView, Prediction, dict[str, Prediction], bool]:
    """The best-scored endpoint predicted to meet the SLO, else the least-violating.

    1. Predict each endpoint; the prompt tokens it holds in its prefix cache (``cached``) shorten its prefill.
    2. Among those meeting the SLO, keep those within ``HEADROOM_SHARE`` of their headroom (all if none is).
    3. Score = cost per token × (1 + ``SPREAD_ALPHA`` · latency share): cheaper capacity first, and among
       equals (within ``SPREAD_EPSILON``) the least loaded, so identical endpoints share the load.

    Endpoints whose engine signals are unknown are trusted to meet the SLO only
    when no endpoint with fresh signals does. Without any SLO: lowest predicted
    end-to-end latency, spread among equals the same way.
    """
    predictions = {v.url: predict(profiles[v.url], v, request, slo=slo, headroom=headroom, role=role,
                                  handoff=handoff, cached_tokens=(cached or {}).get(v.url, 0))
                   for v in views}
    if slo is None:
        e2e = {url: p.ttft_s + request.max_tokens * p.tpot_s for url, p in predictions.items()}
        best = _spread(views, e2e, profiles, rng)
        return best, predictions[best.url], predictions, True
    for trusted in (True, False):
        meeting = [v for v in views if predictions[v.url].meets_slo and (v.running is not None) == trusted]
        if meeting:
            roomy = [v for v in meeting if predictions[v.url].violation <= HEADROOM_SHARE * headroom] or meeting
            score = {v.url: predictions[v.url].cost_per_token
                     * (1 + SPREAD_ALPHA * _latency_share(predictions[v.url], slo, headroom)) for v in roomy}
            best = _spread(roomy, score, profiles, rng)
            return best, predictions[best.url], predictions, True
    best = min(views, key=lambda v: (predictions[v.url].violation, v.url))
    return best, predictions[best.url], predictions, False


def decide(policy: Policy, request: RouteRequest, views: Sequence[EndpointView], *,
           turn: int = 0, rng: random.Random | None = None, cached: Mapping[str, int] | None = None,
           profiles: Mapping[str, EndpointProfile] | None = None, slo: SLO | None = None,
           headroom: float = 1.0, role: Role = Role.UNIFIED, handoff: Handoff | None = None) -> RoutingDecision:
    """Pick one of ``views`` (the healthy endpoints of the request's model serving ``role``) under ``policy``.

    ``handoff`` is where a prefill stage's KV goes (``slo`` counts the transfer and the decode in its TTFT).
    """
    if not views:
        return RoutingDecision(None, policy, DecisionReason.NO_ENDPOINT)
    open_views = [v for v in views if not v.saturated]
    if not open_views:
        return RoutingDecision(None, policy, DecisionReason.ALL_SATURATED, candidates=len(views))
    n = len(open_views)
    match policy:
        case Policy.ROUND_ROBIN:
            return RoutingDecision(round_robin(open_views, turn).endpoint, policy, DecisionReason.CHOSEN, candidates=n)
        case Policy.LEAST_REQUEST:
            return RoutingDecision(least_request(open_views).endpoint, policy, DecisionReason.CHOSEN, candidates=n)
        case Policy.POWER_OF_TWO:
            chosen = power_of_two(open_views, rng or random.Random())
            return RoutingDecision(chosen.endpoint, policy, DecisionReason.CHOSEN, candidates=n)
        case Policy.LEAST_KV:
            return RoutingDecision(least_kv(open_views).endpoint, policy, DecisionReason.CHOSEN, candidates=n)
        case Policy.PREFIX:
            chosen, hit = prefix_affinity(open_views, request, cached or {})
            reason = DecisionReason.PREFIX_HIT if hit else DecisionReason.CHOSEN
            return RoutingDecision(chosen.endpoint, policy, reason, candidates=n)
        case Policy.KV_AWARE:
            chosen, hit = kv_aware(open_views, cached or {}, request.prompt_tokens)
            reason = DecisionReason.PREFIX_HIT if hit else DecisionReason.CHOSEN
            return RoutingDecision(chosen.endpoint, policy, reason, candidates=n)
        case Policy.SLO:
            if profiles is None:
                raise ValueError("the slo policy needs endpoint profiles")
            chosen, prediction, predictions, met = slo_choice(
                open_views, request, profiles, slo=slo, headroom=headroom, rng=rng or random.Random(), role=role,
                handoff=handoff, cached=cached)
            reason = DecisionReason.SLO_MET if met else DecisionReason.SLO_FALLBACK
            return RoutingDecision(chosen.endpoint, policy, reason, prediction=prediction, candidates=n,
                                   predictions=predictions)
