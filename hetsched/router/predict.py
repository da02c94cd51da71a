"""Predicted TTFT and TPOT of one request on one endpoint, from its step-latency model and live load.

With ``n`` requests already at the endpoint (average prompt ``p̄``, average
output ``ō`` from the router's own bookkeeping), the new request decodes in a
batch of ``b = min(n + 1, max_num_seqs)`` at mean context ``p̄ + ō/2``. In
steady state each sequence brings ``p̄`` prefill tokens over ``ō`` decode
steps, so a step also carries ``b·p̄/ō`` chunked-prefill tokens::

    TPOT = step(decode b at p̄ + ō/2, prefill min(b·p̄/ō, budget − b))
    TTFT = TPOT/2                                   (wait for the step boundary)
         + (waiting + 1) · ō · TPOT / b             (only when seqs or KV are full)
         + ⌈(waiting·p̄ + p) / (budget − b)⌉ · step(prefill chunk, decode b)

A prediction meets the SLO when both times stay within ``headroom`` × the
targets and the engine keeps ``1 − headroom`` of its sequence slots and KV
cache free: queueing tails at the slot or KV limit are what a mean-value
prediction misses.

Cost per token is the replica's price per second times one step, shared by
the ``b`` tokens that step produces. Step times are cached on a coarse grid
of shapes so a decision over a thousand endpoints stays cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.router.types import EndpointView, Prediction, RouteRequest
from hetsched.specs.workload import SLO


@dataclass(frozen=True)
class EndpointProfile:
    """What the predictor knows about an endpoint's hardware: step model, limits, KV capacity, price."""

    step_model: StepLatencyModel
    kv_capacity_tokens: int
    price_per_hour: float
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    _cache: dict[tuple[int, int, int], float] = field(default_factory=dict, compare=False, repr=False)

    def step_time(self, *, decode_seqs: int, context: float, prefill_tokens: int) -> float:
        """Step seconds for ``decode_seqs`` decodes at ``context`` plus one prefill chunk, on a cached grid."""
        key = (decode_seqs, _coarse(int(context)), _coarse(prefill_tokens))
        cached = self._cache.get(key)
        if cached is None:
            ctx, chunk = key[1], key[2]
            shape = StepShape(
                prefill_tokens=chunk, prefill_seqs=1 if chunk else 0,
                prefill_attention_pairs=chunk * (chunk + 1) / 2, prefill_kv_tokens=chunk,
                decode_seqs=decode_seqs, decode_kv_tokens=decode_seqs * ctx,
            )
            cached = self._cache[key] = self.step_model.step_time(shape)
        return cached


def _coarse(value: int) -> int:
    """Round to 3 significant bits (±6 %): keeps the cache small and the error far below the SLO margins."""
    if value < 16:
        return value
    shift = value.bit_length() - 3
    return ((value + (1 << (shift - 1))) >> shift) << shift


def predict(profile: EndpointProfile, view: EndpointView, request: RouteRequest, *,
            slo: SLO | None, headroom: float = 1.0) -> Prediction:
    """TTFT, TPOT and cost per token of ``request`` on the endpoint ``view`` describes."""
    p, o = request.prompt_tokens, max(request.max_tokens, 1)
    n = view.load
    if view.in_flight:
        p_bar = view.in_flight_prompt_tokens / view.in_flight
        o_bar = max(view.in_flight_max_tokens / view.in_flight, 1.0)
    else:
        p_bar, o_bar = float(p), float(o)
    seqs, budget = profile.max_num_seqs, profile.max_num_batched_tokens
    b = min(n + 1, seqs)
    room = max(budget - b, 1)
    steady_prefill = min(int(b * p_bar / o_bar), room)
    tpot = profile.step_time(decode_seqs=b, context=p_bar + o_bar / 2, prefill_tokens=steady_prefill)

    waiting = max(view.waiting or 0, n - seqs)  # the router's own count is fresher than a scrape
    running = n - waiting
    kv_used = (view.kv_usage * profile.kv_capacity_tokens if view.kv_usage is not None
               else running * (p_bar + o_bar / 2))
    kv_free = profile.kv_capacity_tokens - kv_used
    full = running >= seqs or kv_free < p + waiting * p_bar
    wait = (waiting + 1) * o_bar * tpot / b if full else 0.0
    prefill_work = waiting * p_bar + p
    chunk = min(int(prefill_work), room)
    prefill_step = profile.step_time(decode_seqs=max(b - 1, 0), context=p_bar + o_bar / 2, prefill_tokens=chunk)
    ttft = tpot / 2 + wait + math.ceil(prefill_work / room) * prefill_step

    cost = profile.price_per_hour / 3600.0 * tpot / b
    if slo is None:
        return Prediction(ttft, tpot, cost, meets_slo=True, violation=0.0)
    violation = max(ttft * 1e3 / slo.ttft_ms, tpot * 1e3 / slo.tpot_ms)
    within_engine = b <= headroom * seqs and kv_used + p + o <= headroom * profile.kv_capacity_tokens
    return Prediction(ttft, tpot, cost, meets_slo=violation <= headroom and within_engine, violation=violation)
