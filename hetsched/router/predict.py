"""Predicted TTFT and TPOT of one request on one endpoint, from its step-latency model and live load.

With ``n`` requests already at the endpoint (average prompt ``p̄``, average
output ``ō`` from the router's own bookkeeping), the new request decodes in a
batch of ``b = min(n + 1, max_num_seqs)`` at mean context ``p̄ + ō/2``. In
steady state each sequence's prompt is prefilled in ``k = ⌈p̄ / (budget − b)⌉``
chunks over its ``ō`` decode steps, so a share ``f = min(b·k/ō, 1)`` of the
steps carries a chunk ``c = min(p̄, budget − b)`` and the rest decode alone
(a step's time is convex in its tokens: the mean of both is longer than one
step at the mean shape)::

    TPOT = (1 − f) · step(decode b at p̄ + ō/2) + f · step(decode b, prefill c)
    TTFT = E[S²] / 2E[S] over that mix of steps     (the rest of the step running, while others run)
         + (waiting + 1) · ō · TPOT / b             (only when seqs or KV are full)
         + ⌈(waiting·p̄ + p + j) / (budget − b)⌉ · step(prefill chunk, decode b)

where ``j`` is the others' prompt tokens that share its first chunk: those that came since the running step
began or come before it ends, ``j = r · E[S²]/E[S]`` at the rate ``r`` of prompt tokens the router has lately
sent there (a router sends in runs: to the endpoint that looks best until its own load turns it elsewhere);
without that count, the steady state's ``f·p̄`` (as many prompts come as sequences finish).

A prediction meets the SLO when both times stay within ``headroom`` × the
targets and the engine keeps ``1 − headroom`` of its sequence slots and KV
cache free: queueing tails at the slot or KV limit are what a mean-value
prediction misses.

Cost per token prices the endpoint's capacity, not its present batch: the
replica's price per second times one step at the full batch ``B = headroom ·
max_num_seqs``, shared by the ``B`` tokens that step produces. (Priced at the
present batch, a loaded endpoint looks cheaper than an idle twin and takes
every request.) Step times are cached on a coarse grid of shapes so a
decision over a thousand endpoints stays cheap.

A prompt whose leading ``c`` tokens the endpoint holds in its prefix cache
(the router's prefix index says so) prefills only ``p − c`` of them (at least
one: the engine recomputes the last token to sample the first).

The stages of a disaggregated model keep the notation:

- a *decode* instance computes no prompts (each arrives as KV): ``TPOT =
  step(decode b at p̄ + ō/2)`` and its TTFT, from the KV's arrival, is the
  same wait for a slot or KV plus one step;
- a *prefill* instance holds prompts only, drained ``budget`` tokens a step:
  ``TTFT = ⌈(queued + p − c) / budget⌉ · step(prefill chunk)`` (half a step more
  while busy), plus what comes before the client's first token after it: the
  KV transfer (``p`` × KV bytes per token over the slower network) and the
  decode instance's TTFT (:class:`~hetsched.router.types.Handoff`). It has no
  TPOT, and its cost is per prompt token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hetsched.perf.correction import IDENTITY, Parts, StepCorrection, step_parts
from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.router.types import EndpointView, Handoff, Prediction, RouteRequest
from hetsched.sim.roles import Role
from hetsched.specs.workload import SLO


@dataclass(frozen=True)
class EndpointProfile:
    """What the predictor knows about an endpoint's hardware: step model, limits, KV capacity, price."""

    step_model: StepLatencyModel
    kv_capacity_tokens: int
    price_per_hour: float
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    network_gbs: float = 0.0
    """The device's network share, which a prefill's KV cache leaves over (catalog ``network_gbs``)."""
    kv_bytes_per_token: float = 0.0
    """The whole model's KV cache per prompt token: what a prefill instance ships."""
    correction: StepCorrection = IDENTITY
    """What the fleet's own timings taught of this hardware (:mod:`hetsched.router.learning`), over the model."""
    _cache: dict[tuple[int, int, int], Parts] = field(default_factory=dict, compare=False, repr=False)
    """Base step times as parts, shared by every correction of the same hardware."""

    def step_parts(self, *, decode_seqs: int, context: float, prefill_tokens: int) -> Parts:
        """One step of ``decode_seqs`` decodes at ``context`` plus one prefill chunk, as the base model's parts,
        on a cached grid."""
        key = (decode_seqs, _coarse(int(context)), _coarse(prefill_tokens))
        cached = self._cache.get(key)
        if cached is None:
            ctx, chunk = key[1], key[2]
            shape = StepShape(
                prefill_tokens=chunk, prefill_seqs=1 if chunk else 0,
                prefill_attention_pairs=chunk * (chunk + 1) / 2, prefill_kv_tokens=chunk,
                decode_seqs=decode_seqs, decode_kv_tokens=decode_seqs * ctx,
            )
            cached = self._cache[key] = step_parts(self.step_model, shape)
        return cached

    def step_time(self, *, decode_seqs: int, context: float, prefill_tokens: int) -> float:
        """Corrected step seconds for ``decode_seqs`` decodes at ``context`` plus one prefill chunk."""
        return self.correction.seconds(self.step_parts(decode_seqs=decode_seqs, context=context,
                                                       prefill_tokens=prefill_tokens))


_ZERO: Parts = (0.0, 0.0, 0.0, 0.0)
REQUEST: Parts = (0.0, 0.0, 0.0, 1.0)
"""A request's own share of its TTFT: the front end's time before its first step."""


def _sum(k: float, a: Parts, m: float, b: Parts) -> Parts:
    """``k·a + m·b``."""
    return (k * a[0] + m * b[0], k * a[1] + m * b[1], k * a[2] + m * b[2], k * a[3] + m * b[3])


def _coarse(value: int) -> int:
    """Round to 3 significant bits (±6 %): keeps the cache small and the error far below the SLO margins."""
    if value < 16:
        return value
    shift = value.bit_length() - 3
    return ((value + (1 << (shift - 1))) >> shift) << shift


def _mix(profile: EndpointProfile, b: int, p_bar: float, o_bar: float, *,
         prefill: bool) -> tuple[Parts, Parts, float]:
    """A step that decodes ``b`` sequences alone, one that also prefills a prompt chunk, and the share of the
    latter (see the module docstring)."""
    context = p_bar + o_bar / 2
    alone = profile.step_parts(decode_seqs=b, context=context, prefill_tokens=0)
    room = max(profile.max_num_batched_tokens - b, 1)
    if not prefill or p_bar < 1:
        return alone, alone, 0.0
    chunk = min(int(p_bar), room)
    share = min(b * math.ceil(p_bar / room) / o_bar, 1.0)
    return alone, profile.step_parts(decode_seqs=b, context=context, prefill_tokens=chunk), share


def decode_step(profile: EndpointProfile, b: int, p_bar: float, o_bar: float, *, prefill: bool = True) -> Parts:
    """The mean step ``b`` decoding sequences take, as parts: prompts of ``p̄`` tokens prefilled in chunks among
    steps that decode alone (see the module docstring); ``prefill`` False: a decode instance computes no prompts."""
    alone, chunked, share = _mix(profile, b, p_bar, o_bar, prefill=prefill)
    return _sum(1.0 - share, alone, share, chunked)


def life_step(profile: EndpointProfile, batch: float, *, requests: int, prompt_tokens: int, max_tokens: int,
              decode_steps: float, arrivals: int, arrival_prompt_tokens: int) -> Parts:
    """The mean step a request decoded in, as parts: ``batch`` sequences (the endpoint's mean load over the
    request's life) at the mean context of the ``requests`` in flight with it (``prompt_tokens`` and
    ``max_tokens`` their totals, the request's own among them), over its ``decode_steps``, among which the
    ``arrivals`` sent to the endpoint during its life prefilled their ``arrival_prompt_tokens``.

    What arrived is counted, not inferred from the requests in flight: those are the long ones (a request is in
    flight for as long as it decodes), so in-flight means put too few prompts in a request's life, and through a
    rising load more came than left."""
    held = max(requests, 1)
    b = min(max(round(batch), 1), profile.max_num_seqs)
    context = (prompt_tokens + max_tokens / 2) / held
    alone = profile.step_parts(decode_seqs=b, context=context, prefill_tokens=0)
    steps = max(decode_steps, 1.0)
    if arrivals <= 0 or arrival_prompt_tokens <= 0:
        return alone
    room = max(profile.max_num_batched_tokens - b, 1)
    chunked = min(max(arrivals, math.ceil(arrival_prompt_tokens / room)), steps)
    chunk = min(round(arrival_prompt_tokens / chunked), room)
    with_chunk = profile.step_parts(decode_seqs=b, context=context, prefill_tokens=chunk)
    return _sum(1.0 - chunked / steps, alone, chunked / steps, with_chunk)


def step_remainder(profile: EndpointProfile, b: int, p_bar: float, o_bar: float, *, prefill: bool = True) -> Parts:
    """What is left of the step running when a request arrives, as parts: ``E[S²] / 2E[S]`` over the mix of
    steps, not half the mean step, since an arrival more likely falls into a long step (one prefilling a chunk)
    than a short one. Its weights are the steps' times under the profile's correction."""
    alone, chunked, share = _mix(profile, b, p_bar, o_bar, prefill=prefill)
    short, long_ = profile.correction.seconds(alone), profile.correction.seconds(chunked)
    mean = (1.0 - share) * short + share * long_
    if mean <= 0:
        return _sum(0.5, alone, 0.0, alone)
    return _sum((1.0 - share) * short / (2 * mean), alone, share * long_ / (2 * mean), chunked)


def transfer_seconds(profile: EndpointProfile, handoff: Handoff, prompt_tokens: int) -> float:
    """Moving the prompt's KV cache from this (prefill) endpoint over the slower of the two links; inf without one."""
    link = profile.network_gbs if handoff.network_gbs is None else min(profile.network_gbs, handoff.network_gbs)
    return prompt_tokens * profile.kv_bytes_per_token / (link * 1e9) if link > 0 else math.inf


def _cost_per_token(profile: EndpointProfile, p: int, o: int, computed: int, *, headroom: float) -> float:
    """What a token of this request costs on the endpoint's hardware: its price over a full batch of requests
    like it (``p`` prompt tokens of which ``computed`` are prefilled here, ``o`` out), each step decoding the
    batch and prefilling its share of their prompts. The request's own shape, not the endpoint's current mix: a
    cached prefix makes it cheaper where it is held, and equal hardware prices it equally."""
    seqs, budget = profile.max_num_seqs, profile.max_num_batched_tokens
    full_b = max(int(headroom * seqs), 1)
    full_prefill = min(int(full_b * computed / o), max(budget - full_b, 1))
    return profile.price_per_hour / 3600.0 / full_b * profile.step_time(
        decode_seqs=full_b, context=p + o / 2, prefill_tokens=full_prefill)


def predict(profile: EndpointProfile, view: EndpointView, request: RouteRequest, *,
            slo: SLO | None, headroom: float = 1.0, role: Role = Role.UNIFIED,
            handoff: Handoff | None = None, cached_tokens: int = 0) -> Prediction:
    """TTFT, TPOT and cost per token of ``request`` on the endpoint ``view`` describes, serving ``role``.

    ``handoff`` is where a prefill stage's KV goes (default: a decode instance on the same network, ready at once);
    ``cached_tokens`` the prompt's leading tokens the endpoint holds in its prefix cache.
    """
    p, o = request.prompt_tokens, max(request.max_tokens, 1)
    computed = max(p - cached_tokens, 1)
    n = view.load
    if view.in_flight:
        p_bar = view.in_flight_prompt_tokens / view.in_flight
        o_bar = max(view.in_flight_max_tokens / view.in_flight, 1.0)
    else:
        p_bar, o_bar = float(p), float(o)
    seqs, budget = profile.max_num_seqs, profile.max_num_batched_tokens
    b = min(n + 1, seqs)
    if role is Role.PREFILL:
        return _prefill(profile, view, p, p_bar, b, slo=slo, headroom=headroom, handoff=handoff or Handoff(None),
                        computed=computed)
    room = max(budget - b, 1)
    tpot_parts = decode_step(profile, b, p_bar, o_bar, prefill=role is not Role.DECODE)
    correction = profile.correction
    tpot = correction.seconds(tpot_parts)

    waiting = max(view.waiting or 0, n - seqs)  # the router's own count is fresher than a scrape
    running = n - waiting
    kv_used = (view.kv_usage * profile.kv_capacity_tokens if view.kv_usage is not None
               else running * (p_bar + o_bar / 2))
    kv_free = profile.kv_capacity_tokens - kv_used
    full = running >= seqs or kv_free < p + waiting * p_bar
    wait_steps = (waiting + 1) * o_bar / b if full else 0.0
    # the rest of the step running as the request comes (an idle engine starts one at once)
    boundary = step_remainder(profile, b, p_bar, o_bar, prefill=role is not Role.DECODE) if n else _ZERO
    if role is Role.DECODE:  # the prompt's KV is there: one step computes its last token and samples the first
        ttft_parts = _sum(1.0, boundary, wait_steps + 1.0, tpot_parts)
    else:
        # others' prompts that came since the running step began, or come before it ends, share the request's first
        # chunk: each span is E[S²]/2E[S] for a request arriving at a random time, at the rate they are sent here
        if view.prompt_tokens_per_s is not None:
            joining = view.prompt_tokens_per_s * 2.0 * correction.seconds(boundary)
        else:  # the steady state's: as many prompts come as sequences finish
            joining = min(b * math.ceil(p_bar / room) / o_bar, 1.0) * p_bar if n else 0.0
        prefill_work = waiting * p_bar + computed + joining
        chunk = min(int(prefill_work), room)
        first = profile.step_parts(decode_seqs=max(b - 1, 0), context=p_bar + o_bar / 2, prefill_tokens=chunk)
        ttft_parts = _sum(1.0, boundary, wait_steps, tpot_parts)
        ttft_parts = _sum(1.0, ttft_parts, math.ceil(prefill_work / room), first)
        ttft_parts = _sum(1.0, ttft_parts, 1.0, REQUEST)
    ttft = correction.seconds(ttft_parts)
    queue_wait = wait_steps * tpot

    cost = _cost_per_token(profile, p, o, 0 if role is Role.DECODE else computed, headroom=headroom)
    if slo is None:
        return Prediction(ttft, tpot, cost, meets_slo=True, violation=0.0, ttft_parts=ttft_parts,
                          tpot_parts=tpot_parts, queue_wait_s=queue_wait)
    violation = max(ttft * 1e3 / slo.ttft_ms, tpot * 1e3 / slo.tpot_ms)
    within_engine = b <= headroom * seqs and kv_used + p + o <= headroom * profile.kv_capacity_tokens
    return Prediction(ttft, tpot, cost, meets_slo=violation <= headroom and within_engine, violation=violation,
                      ttft_parts=ttft_parts, tpot_parts=tpot_parts, queue_wait_s=queue_wait)


def _prefill(profile: EndpointProfile, view: EndpointView, p: int, p_bar: float, b: int, *, slo: SLO | None,
             headroom: float, handoff: Handoff, computed: int) -> Prediction:
    """A prefill instance drains the prompts in flight ``budget`` tokens a step; the client's first token comes
    after the KV transfer and the decode's first step. Cost is per prompt token of a full chunk, for the share of
    the prompt computed here (a cached prefix is not)."""
    budget = profile.max_num_batched_tokens
    queued = max(float(view.in_flight_prompt_tokens), view.load * p_bar)  # the engine may hold others' prompts
    work = queued + computed
    chunk = min(int(work), budget)
    step = profile.step_time(decode_seqs=0, context=0, prefill_tokens=chunk)
    ttft = (0.5 if view.load else 0.0) * step + math.ceil(work / budget) * step \
        + transfer_seconds(profile, handoff, p) + handoff.ttft_s
    cost = profile.price_per_hour / 3600.0 * profile.step_time(decode_seqs=0, context=0,
                                                               prefill_tokens=budget) / budget * computed / p
    if slo is None:
        return Prediction(ttft, 0.0, cost, meets_slo=True, violation=0.0)
    violation = ttft * 1e3 / slo.ttft_ms
    kv_used = view.kv_usage * profile.kv_capacity_tokens if view.kv_usage is not None else queued
    within_engine = b <= headroom * profile.max_num_seqs and kv_used + p <= headroom * profile.kv_capacity_tokens
    return Prediction(ttft, 0.0, cost, meets_slo=violation <= headroom and within_engine, violation=violation)


def quiet(profile: EndpointProfile, view: EndpointView) -> bool:
    """The endpoint runs below saturation: no request waiting in its engine at the last reading, and no more in
    flight than it has sequence slots. What a request does there follows the step model; what it does in a queue
    follows the scheduler, which the mean-value prediction only guesses."""
    return not view.waiting and view.load <= profile.max_num_seqs


def decodes_as_modelled(profile: EndpointProfile, view: EndpointView) -> bool:
    """A request ending at the endpoint ``view`` describes decoded in the step model's steps at the endpoint's load,
    capped at its sequence slots: the endpoint is :func:`quiet`, or what waits there waits for a slot or the next
    step, not for KV memory (which would run fewer sequences than the load): its free KV, as last read, holds every
    waiting prompt."""
    if quiet(profile, view):
        return True
    if view.kv_usage is None or view.waiting is None or not view.in_flight:
        return False
    free = (1.0 - view.kv_usage) * profile.kv_capacity_tokens
    return free >= view.waiting * view.in_flight_prompt_tokens / view.in_flight


def _held_context(view: EndpointView, prompt_tokens: int, max_tokens: int) -> float:
    """The mean context of the sequences decoding at the endpoint: their prompts and half their outputs (with none
    in flight, the request's own)."""
    if not view.in_flight:
        return prompt_tokens + max_tokens / 2
    return (view.in_flight_prompt_tokens + view.in_flight_max_tokens / 2) / view.in_flight


def _alone_steps(profile: EndpointProfile, view: EndpointView, prompt_tokens: int, max_tokens: int,
                 computed: int) -> tuple[Parts, int, Parts]:
    """A prompt meeting no other in the engine ``view`` describes, as parts: the step running there (decodes only),
    how many chunks its ``computed`` tokens take, and one of them beside those decodes."""
    n = min(view.load, profile.max_num_seqs)
    room = max(profile.max_num_batched_tokens - n - 1, 1)
    context = _held_context(view, prompt_tokens, max_tokens)
    running = profile.step_parts(decode_seqs=n, context=context, prefill_tokens=0) if n else _ZERO
    chunk = profile.step_parts(decode_seqs=n, context=context, prefill_tokens=min(computed, room))
    return running, math.ceil(computed / room), chunk


def prefill_span(profile: EndpointProfile, view: EndpointView, prompt_tokens: int) -> float:
    """Corrected seconds an engine keeps prefilling a prompt sent to the endpoint ``view`` describes: the rest of
    the step running and the prompt's chunks beside the decodes there."""
    running, chunks, chunk = _alone_steps(profile, view, prompt_tokens, 1, max(prompt_tokens, 1))
    return profile.correction.seconds(_sum(1.0, running, chunks, chunk))


def alone_ttft(profile: EndpointProfile, view: EndpointView, request: RouteRequest, *,
               cached_tokens: int = 0) -> Parts:
    """The TTFT of a request that meets no other prompt in the engine, as parts: half a decode step of the
    sequences there (it arrives anywhere in one), its own prompt's chunks beside their decodes, and the front
    end's time. No mean-value guess of others' prompts is in it: the step model alone."""
    running, chunks, chunk = _alone_steps(profile, view, request.prompt_tokens, request.max_tokens,
                                          max(request.prompt_tokens - cached_tokens, 1))
    return _sum(1.0, _sum(0.5, running, chunks, chunk), 1.0, REQUEST)


def sent_prediction(profile: EndpointProfile, view: EndpointView, request: RouteRequest, *,
                    cached_tokens: int = 0, alone: bool = False) -> Prediction:
    """What a request is learned against (:mod:`hetsched.router.learning`), predicted as it is sent to the endpoint
    ``view`` describes: nothing to learn from (no parts) unless it starts :func:`quiet` with no wait predicted.
    Fitted to queued requests, the step model would follow the queue, not the hardware.

    Its TTFT is learned from only when it is sent ``alone`` (no other prompt is still in the engine), against
    :func:`alone_ttft`: a TTFT among others' prompts depends on where they fall, which the prediction can only
    take as a mean, and the mean of a skewed wait is not what most requests see. ``ttft_s`` stays what the
    router predicted."""
    prediction = predict(profile, view, request, slo=None, cached_tokens=cached_tokens)
    if not quiet(profile, view) or prediction.queue_wait_s > 0:
        return replace(prediction, ttft_parts=None, tpot_parts=None)
    ttft_parts = alone_ttft(profile, view, request, cached_tokens=cached_tokens) if alone else None
    return replace(prediction, ttft_parts=ttft_parts)
