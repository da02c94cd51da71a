"""Routing policies: pure functions from candidate views to one endpoint.

``decide`` filters out saturated endpoints (all saturated: a 429 decision),
then applies the policy. Round-robin's turn, power-of-two's random source,
prefix matches and endpoint profiles come in as arguments, so every choice
is a function of its inputs. Each stage of a disaggregated model's request is
one decision among the endpoints of that role; only ``slo`` predicts by role.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence

from hetsched.router.predict import EndpointProfile, predict
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
                    matches: Mapping[str, int]) -> tuple[EndpointView, bool]:
    """Longest served prefix among endpoints under the load bound; a miss hashes the first block.

    Returns the view and whether it was a prefix hit.
    """
    if not request.prefix_hashes:
        return least_request(views), False
    bound = PREFIX_BALANCE * (sum(v.load for v in views) + 1) / len(views)
    allowed = [v for v in views if v.load < bound + 1] or list(views)
    best = max(allowed, key=lambda v: (matches.get(v.url, 0), -v.load))
    if matches.get(best.url, 0) > 0:
        return best, True
    first = request.prefix_hashes[0].to_bytes(8, "big")
    return max(allowed, key=lambda v: hashlib.blake2b(first + v.url.encode(), digest_size=8).digest()), False


def slo_choice(views: Sequence[EndpointView], request: RouteRequest, profiles: Mapping[str, EndpointProfile], *,
               slo: SLO | None, headroom: float, role: Role = Role.UNIFIED,
               handoff: Handoff | None = None) -> tuple[EndpointView, Prediction, dict[str, Prediction], bool]:
    """Cheapest per token among endpoints predicted to meet the SLO, else the least-violating.

    Endpoints whose engine signals are unknown are trusted to meet the SLO only
    when no endpoint with fresh signals does. Without any SLO: lowest predicted
    end-to-end latency.
    """
    predictions = {v.url: predict(profiles[v.url], v, request, slo=slo, headroom=headroom, role=role,
                                  handoff=handoff) for v in views}
    if slo is None:
        best = min(views, key=lambda v: (predictions[v.url].ttft_s + request.max_tokens * predictions[v.url].tpot_s,
                                         v.url))
        return best, predictions[best.url], predictions, True
    for trusted in (True, False):
        meeting = [v for v in views if predictions[v.url].meets_slo and (v.running is not None) == trusted]
        if meeting:
            best = min(meeting, key=lambda v: (predictions[v.url].cost_per_token, predictions[v.url].violation, v.url))
            return best, predictions[best.url], predictions, True
    best = min(views, key=lambda v: (predictions[v.url].violation, v.url))
    return best, predictions[best.url], predictions, False


def decide(policy: Policy, request: RouteRequest, views: Sequence[EndpointView], *,
           turn: int = 0, rng: random.Random | None = None, matches: Mapping[str, int] | None = None,
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
            chosen, hit = prefix_affinity(open_views, request, matches or {})
            reason = DecisionReason.PREFIX_HIT if hit else DecisionReason.CHOSEN
            return RoutingDecision(chosen.endpoint, policy, reason, candidates=n)
        case Policy.SLO:
            if profiles is None:
                raise ValueError("the slo policy needs endpoint profiles")
            chosen, prediction, predictions, met = slo_choice(open_views, request, profiles, slo=slo,
                                                              headroom=headroom, role=role, handoff=handoff)
            reason = DecisionReason.SLO_MET if met else DecisionReason.SLO_FALLBACK
            return RoutingDecision(chosen.endpoint, policy, reason, prediction=prediction, candidates=n,
                                   predictions=predictions)
