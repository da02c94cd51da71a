"""The scaling decision: ``decide(signals, placement, fleet, settings, now, state) → (Decision, state')``.

A pure function of its arguments. Per model, in order:

1. *Demand*: the stable-window rate, or in panic (the short-window rate is
   ``panic_threshold`` × what the current replicas are sized for, and three
   Poisson standard deviations above it, so noise does not panic) the larger
   of both, held for one stable window; optionally the Holt-Winters forecast;
   plus the queue to drain. Stale pods never block: their last known rate
   carries on (see :mod:`hetsched.autoscale.window`).
2. *Needed capacity* = demand × (1 + headroom), in requests/s at the SLO for
   the observed length mix; each option's capacity is derated by a
   correction that drops when observed SLO attainment is below target
   although the estimate said enough and nothing is queued (a backlog is
   the queue term's business, not a wrong estimate), down to half, and goes
   back to 1 over two stabilization windows while that option meets the SLO.
   Only the options whose own replicas miss are derated when the others
   meet the SLO: behind a router that does not balance by capacity (least
   request), a replica much smaller than its peers gets more than its share
   and misses while the pooled estimate says enough; derated, it costs more
   per unit, so new capacity goes elsewhere and it is the first to go.
3. *Up, fast*: add replicas on the lowest cost per unit of capacity with free
   inventory, then the next cheapest; cost per unit counts whole replicas
   (closing a 1.5-replica gap costs two), so a small gap goes to a small
   config. What cannot be placed is reported as unmet demand.
4. *Down, slowly*: only to the largest need over the stabilization window,
   not within one window of the last scale-up (nor of the first round),
   never in panic, at most ``max_scale_down_fraction`` of the replicas per
   step, highest cost per unit first.
5. *Move*: with a re-solved target (see :mod:`hetsched.autoscale.replan`),
   add the target's replicas first and remove old ones only while the Ready
   capacity left still covers the need (make-before-break).
6. Bounds: never below ``min_replicas`` nor above ``max_replicas``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from hetsched.autoscale.fleet import Fleet, ModelBounds, ScaleOption, capacity_for_mix, observed_shares
from hetsched.autoscale.forecast import HoltWinters
from hetsched.autoscale.window import ModelSignals
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey

EPS = 1e-9
MIN_CORRECTION = 0.5
"""Capacity estimates are never derated below half their value: misses beyond that are not a capacity problem."""


class Reason(StrEnum):
    """Why a model's replicas are what they are after this round."""

    STEADY = "steady"
    SCALE_UP = "scale-up"
    PANIC = "panic"
    SLO_MISS = "slo-miss"
    SCALE_DOWN = "scale-down"
    MOVE = "move-to-plan"
    MIN_REPLICAS = "min-replicas"
    MAX_REPLICAS = "max-replicas"
    NO_SIGNALS = "no-signals"


@dataclass(frozen=True)
class ReplicaCount:
    """Replicas of one option: asked for, and Ready among them."""

    desired: int
    ready: int = 0


@dataclass(frozen=True)
class ModelDecision:
    model: str
    desired: Mapping[OptionKey, int]
    """Replicas per option of this model (options at 0 included when they had replicas)."""
    reason: Reason
    message: str
    """One line for events and status: what was seen and what changes."""
    demand_rps: float
    needed_rps: float
    capacity_rps: float
    """What the desired replicas hold at the SLO for the observed mix."""
    unmet_rps: float
    """Needed capacity that no free inventory (or ``max_replicas``) allows."""
    attainment: float | None
    """Observed share of requests meeting the SLO over the SLO window (None: too few requests)."""
    correction: Mapping[OptionKey, float]
    """Factor on each option's capacity estimate learnt from SLO misses (options at 1 left out)."""
    observed_ttft_ms: float | None
    """TTFT at the SLO's percentile over the SLO window."""
    observed_tpot_ms: float | None
    panic: bool
    stale_pods: int
    shares: Mapping[str, float]
    """Observed share of each request-size bucket."""


@dataclass(frozen=True)
class Decision:
    models: tuple[ModelDecision, ...]
    drift: float
    """How much more the placement costs than a from-scratch cover of the same need (0.1 = 10 %)."""
    replan_due: bool
    """A full re-solve is due (periodic, or drift past the threshold); see :func:`replan`."""

    @property
    def desired(self) -> dict[OptionKey, int]:
        return {k: n for m in self.models for k, n in m.desired.items()}

    def model(self, name: str) -> ModelDecision:
        return next(m for m in self.models if m.model == name)

    def changes(self, placement: Mapping[OptionKey, ReplicaCount]) -> dict[OptionKey, tuple[int, int]]:
        """(before, after) desired replicas of each option that changes."""
        keys = set(self.desired) | set(placement)
        out = {}
        for key in keys:
            before = placement[key].desired if key in placement else 0
            after = self.desired.get(key, before)
            if before != after:
                out[key] = (before, after)
        return out


@dataclass(frozen=True)
class ScaleState:
    """What the policy remembers between rounds (returned, never mutated)."""

    needed: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Model → (time, needed req/s) over the stabilization window."""
    panic_until: Mapping[str, float] = field(default_factory=dict)
    slo_scaled_at: Mapping[str, float] = field(default_factory=dict)
    correction: Mapping[OptionKey, float] = field(default_factory=dict)
    """Option → factor on its capacity estimate learnt from SLO misses."""
    forecasts: Mapping[str, HoltWinters] = field(default_factory=dict)
    last_replan: float | None = None
    target: Mapping[OptionKey, int] | None = None
    """A re-solved placement being moved to, make-before-break."""
    settled_since: Mapping[str, float] = field(default_factory=dict)
    """Model → since when all its replicas are Ready."""
    last_up: Mapping[str, float] = field(default_factory=dict)
    """Model → its last scale-up: no scale-down within one stabilization window of it."""
    since: float | None = None
    """First round: nothing is removed before one stabilization window has been watched."""

    def following(self, target: Mapping[OptionKey, int], *, now: float) -> ScaleState:
        """This state, moving towards ``target`` from the next round on."""
        return replace(self, target=dict(target), last_replan=now)


def decide(signals: Mapping[str, ModelSignals], placement: Mapping[OptionKey, ReplicaCount], *, fleet: Fleet,
           settings: AutoscaleSettings, now: float, state: ScaleState) -> tuple[Decision, ScaleState]:
    """Desired replicas per (model, option) with a reason per model, and the state for the next round."""
    used: dict[str, float] = {pool: 0.0 for pool in fleet.pool_gpus}
    gpus = {o.key: o for o in fleet.options}
    for key, count in placement.items():
        if key in gpus:
            used[gpus[key].pool] += count.desired * gpus[key].gpus
    free = {pool: fleet.pool_gpus[pool] - used[pool] for pool in fleet.pool_gpus}
    decisions = []
    memory = _Memory.of(state, now)
    target = dict(state.target) if state.target is not None else None
    for bounds in fleet.models:
        decision = _decide_model(bounds, signals.get(bounds.name), placement, fleet=fleet, settings=settings, now=now,
                                 memory=memory, free=free, target=target)
        decisions.append(decision)
        if target is not None and decision.reason not in (Reason.MOVE, Reason.STEADY):
            target = {k: n for k, n in target.items() if k.model != bounds.name}  # the incremental step overrides
    if target is not None and all(target.get(k, 0) == d.desired.get(k, 0) for d in decisions
                                  for k in set(d.desired) | {k for k in target if k.model == d.model}):
        target = None  # arrived
    drift = _drift(decisions, fleet)
    last = state.last_replan if state.last_replan is not None else now
    replan_due = (settings.resolve_interval_s > 0 and target is None
                  and all(d.reason in (Reason.STEADY, Reason.SCALE_DOWN) for d in decisions)
                  and (now - last >= settings.resolve_interval_s
                       or (drift > settings.drift_threshold and now - last >= settings.scale_down_stabilization_s)))
    new_state = ScaleState(needed=memory.needed, panic_until=memory.panic_until, slo_scaled_at=memory.slo_scaled_at,
                           correction=memory.correction, forecasts=memory.forecasts, last_replan=last,
                           target=target or None, settled_since=memory.settled_since, last_up=memory.last_up,
                           since=memory.since)
    return Decision(models=tuple(decisions), drift=drift, replan_due=replan_due), new_state


@dataclass
class _Memory:
    needed: dict[str, tuple[tuple[float, float], ...]]
    panic_until: dict[str, float]
    slo_scaled_at: dict[str, float]
    correction: dict[OptionKey, float]
    forecasts: dict[str, HoltWinters]
    settled_since: dict[str, float]
    last_up: dict[str, float]
    since: float

    @classmethod
    def of(cls, state: ScaleState, now: float) -> _Memory:
        return cls(dict(state.needed), dict(state.panic_until), dict(state.slo_scaled_at), dict(state.correction),
                   dict(state.forecasts), dict(state.settled_since), dict(state.last_up),
                   state.since if state.since is not None else now)


@dataclass
class _Replicas:
    """One model's options during a decision: capacities for the mix and the counts being built."""

    options: list[ScaleOption]
    capacity: dict[OptionKey, float]
    counts: dict[OptionKey, int]
    ready: dict[OptionKey, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def held(self, *, ready_only: bool = False) -> float:
        counts = {k: min(n, self.ready[k]) for k, n in self.counts.items()} if ready_only else self.counts
        return sum(n * self.capacity[k] for k, n in counts.items())

    def unit_cost(self, option: ScaleOption) -> float:
        cap = self.capacity[option.key]
        return option.price_per_hour / cap if cap > 0 else math.inf


def _decide_model(bounds: ModelBounds, sig: ModelSignals | None, placement: Mapping[OptionKey, ReplicaCount], *,
                  fleet: Fleet, settings: AutoscaleSettings, now: float, memory: _Memory, free: dict[str, float],
                  target: dict[OptionKey, int] | None) -> ModelDecision:
    """One model's round, in the steps of the module docstring; ``memory`` and ``free`` carry over to the next."""
    name = bounds.name
    shares = _shares(bounds, sig)
    correction = {o.key: memory.correction.get(o.key, 1.0) for o in fleet.options_of(name)}
    reps = _replicas(name, fleet.options_of(name), placement, shares, correction)
    before = dict(reps.counts)
    stale = sig.pods.stale if sig else 0
    if sig is None or not _reported(sig, reps):
        reason, bound_notes = _bounds(bounds, reps, free)
        return _result(bounds, reps, before, reason=reason or Reason.NO_SIGNALS,
                       notes=["no pod reported fresh metrics; holding", *bound_notes], demand=0.0, needed=0.0, unmet=0.0,
                       attainment=None, panic=False, stale=stale, shares=shares, correction=correction,
                       latency=(None, None))

    # 1. demand
    held = reps.held()
    panic_until = _panic_until(sig, held, settings, now, memory.panic_until.get(name))
    if panic_until is not None:
        memory.panic_until[name] = panic_until
    panic = now < (panic_until if panic_until is not None else -math.inf)
    demand, forecast = _demand(sig, settings, now, panic=panic, forecast=memory.forecasts.get(name))
    if forecast is not None:
        memory.forecasts[name] = forecast

    # 2. needed capacity, with the capacity estimates corrected by observed SLO attainment
    needed = demand * (1 + settings.headroom)
    settled_since = _settled_since(reps, now, memory.settled_since.get(name))
    if settled_since is None:
        memory.settled_since.pop(name, None)
    else:
        memory.settled_since[name] = settled_since
    slo = _slo_check(sig, bounds, reps, settings)
    notes: list[str] = []
    missing: list[OptionKey] = []
    slo_boost = (slo.miss and needed <= held and not panic
                 and now - (settled_since if settled_since is not None else now) >= settings.slo_window_s
                 and sig.waiting <= reps.total  # a backlog: the queue term already asks for capacity to drain it
                 and now - memory.slo_scaled_at.get(name, -math.inf) >= settings.slo_cooldown_s)
    if slo_boost:
        derate = _missing_options(slo.by_option, settings.slo_target)
        missing = derate if len(derate) < len(slo.by_option) else []  # told apart: new capacity goes elsewhere
        correction = _derated(correction, derate, settings)
        for key in derate:
            reps.capacity[key] /= 1 + settings.slo_step
        memory.slo_scaled_at[name] = now
        needed = max(needed, held + EPS)  # the old capacity, now in derated units: replaces what was derated
        held = reps.held()
        notes.append(f"SLO attainment {slo.attainment:.1%} < {settings.slo_target:.0%}: capacity estimate of "
                     + ", ".join(f"{k.device} TP={k.tp} derated to {correction[k]:.0%}" for k in sorted(derate)))
    elif slo.attainment is not None and not slo.miss:
        correction = _recovered(correction, slo.by_option, settings)
    memory.correction.update(correction)
    memory.needed[name] = _need_window(memory.needed.get(name, ()), now, needed, settings)
    down_to = max(n for _, n in memory.needed[name])

    # 3-5. up fast, move, or down slowly
    unmet = 0.0
    if needed > held + EPS:
        unmet = _scale_up(reps, needed, free, bounds, avoid=missing)
        reason = Reason.SLO_MISS if slo_boost else Reason.PANIC if panic else Reason.SCALE_UP
    elif target is not None and any(k.model == name for k in target):
        reason = _move(reps, target, max(needed, down_to), free)
    elif (not panic and down_to < held - EPS
          and now - memory.last_up.get(name, -math.inf) >= settings.scale_down_stabilization_s
          and now - memory.since >= settings.scale_down_stabilization_s):
        _scale_down(reps, down_to, free, bounds, settings)
        reason = Reason.SCALE_DOWN
    else:
        reason = Reason.STEADY

    # 6. bounds, and the reason the round ends with
    bound_reason, bound_notes = _bounds(bounds, reps, free)
    if reason in (Reason.SCALE_UP, Reason.PANIC, Reason.SLO_MISS) and reps.total > sum(before.values()):
        memory.last_up[name] = now
    reason, closing_notes = _closing_reason(reason, bound_reason, changed=reps.counts != before)
    notes += [*closing_notes, *_round_notes(bounds, stale=stale, unmet=unmet), *bound_notes]
    return _result(bounds, reps, before, reason=reason, notes=notes, demand=demand, needed=needed,
                   unmet=unmet, attainment=slo.attainment, panic=panic, stale=stale, shares=shares,
                   correction=correction, latency=sig.percentile_ms(bounds.slo))


def _shares(bounds: ModelBounds, sig: ModelSignals | None) -> dict[str, float]:
    """The observed share of each request-size bucket (the configured mix where nothing was observed)."""
    return observed_shares(bounds, mean_input=sig.mean_input_tokens if sig else None,
                           mean_output=sig.mean_output_tokens if sig else None,
                           input_hist=sig.input_tokens if sig else None,
                           output_hist=sig.output_tokens if sig else None)


def _replicas(name: str, options: list[ScaleOption], placement: Mapping[OptionKey, ReplicaCount],
              shares: Mapping[str, float], correction: Mapping[OptionKey, float]) -> _Replicas:
    """The model's replicas as placed, each option's capacity for the mix derated by its correction (options no
    longer offered hold nothing)."""
    keys = {o.key for o in options} | {k for k in placement if k.model == name}
    capacity = {o.key: capacity_for_mix(o, shares) * correction[o.key] for o in options}
    for key in keys:
        capacity.setdefault(key, 0.0)
    return _Replicas(options=options, capacity=capacity,
                     counts={k: placement[k].desired if k in placement else 0 for k in keys},
                     ready={k: placement[k].ready if k in placement else 0 for k in keys})


def _reported(sig: ModelSignals, reps: _Replicas) -> bool:
    """Whether the signals speak for the replicas: a model without replicas, or a fresh pod of an option that holds
    capacity."""
    return reps.total == 0 or any(n > 0 and reps.capacity.get(k, 0.0) > 0 for k, n in sig.pods.fresh_by_key.items())


def _panic_until(sig: ModelSignals, held: float, settings: AutoscaleSettings, now: float,
                 until: float | None) -> float | None:
    """When panic ends: one stable window from now when a significant burst exceeds what the replicas are sized
    for by the panic threshold, else as it was."""
    stable, burst = sig.stable_rps, sig.panic_rps
    sized_for = held / (1 + settings.headroom)
    if (burst > stable and burst >= settings.panic_threshold * sized_for
            and _significant(burst, sized_for, settings.panic_window_s)):
        return now + settings.stable_window_s
    return until


def _demand(sig: ModelSignals, settings: AutoscaleSettings, now: float, *, panic: bool,
            forecast: HoltWinters | None) -> tuple[float, HoltWinters | None]:
    """Requests/s to serve: the stable rate (in panic the larger of both windows), at least the forecast when one
    is kept, plus the queue to drain; and the forecast updated with this round's rate."""
    demand = max(sig.stable_rps, sig.panic_rps) if panic else sig.stable_rps
    if settings.forecast:
        forecast = (forecast or HoltWinters(season_s=settings.season_s)).update(now, sig.stable_rps)
        demand = max(demand, forecast.forecast(now, settings.forecast_horizon_s) or 0.0)
    if settings.queue_drain_s > 0:
        demand += sig.waiting / settings.queue_drain_s
    return demand, forecast


def _settled_since(reps: _Replicas, now: float, since: float | None) -> float | None:
    """Since when every replica is Ready; None while one starts (latency is not yet what this placement gives)."""
    if any(reps.ready[k] < n for k, n in reps.counts.items()):
        return None
    return since if since is not None else now


@dataclass(frozen=True)
class _SloCheck:
    attainment: float | None
    """Observed share of requests meeting the SLO (None: too few requests)."""
    miss: bool
    """Even the optimistic reading of the latency histograms misses the target: a certain miss, not bucket blur."""
    by_option: dict[OptionKey, float | None]
    """Optimistic attainment of each option with replicas (None: too few requests)."""


def _slo_check(sig: ModelSignals, bounds: ModelBounds, reps: _Replicas, settings: AutoscaleSettings) -> _SloCheck:
    attainment = sig.attainment(bounds.slo) if sig.latency_requests >= settings.slo_min_requests else None
    at_best = sig.attainment(bounds.slo, optimistic=True) if attainment is not None else None
    by_option = {k: sig.option_attainment(k, bounds.slo, min_requests=settings.slo_min_requests, optimistic=True)
                 for k, n in reps.counts.items() if n > 0}
    return _SloCheck(attainment, at_best is not None and at_best < settings.slo_target, by_option)


def _derated(correction: Mapping[OptionKey, float], keys: Collection[OptionKey],
             settings: AutoscaleSettings) -> dict[OptionKey, float]:
    """The corrections after an SLO miss: those of ``keys`` one ``slo_step`` lower, never below the minimum."""
    return {k: max(MIN_CORRECTION, f / (1 + settings.slo_step)) if k in keys else f for k, f in correction.items()}


def _recovered(correction: Mapping[OptionKey, float], by_option: Mapping[OptionKey, float | None],
               settings: AutoscaleSettings) -> dict[OptionKey, float]:
    """The corrections while the SLO is met: back towards 1 over two stabilization windows for each option whose
    replicas meet it (an option without replicas keeps what was learnt)."""
    step = (1 - MIN_CORRECTION) * settings.interval_s / max(2 * settings.scale_down_stabilization_s,
                                                            settings.interval_s)

    def met(key: OptionKey) -> bool:
        attained = by_option[key]
        return attained is None or attained >= settings.slo_target

    return {k: min(1.0, f + step) if f < 1 and k in by_option and met(k) else f for k, f in correction.items()}


def _need_window(history: tuple[tuple[float, float], ...], now: float, needed: float,
                 settings: AutoscaleSettings) -> tuple[tuple[float, float], ...]:
    """(time, needed) over the stabilization window, this round's last: scale-down goes only to their largest."""
    return (*((t, n) for t, n in history if t > now - settings.scale_down_stabilization_s), (now, needed))


def _closing_reason(reason: Reason, bound_reason: Reason | None, *, changed: bool) -> tuple[Reason, list[str]]:
    """A bound that applied names a steady or scale-down round; a move or scale-down that changed nothing
    (waiting for Ready capacity, or nothing could go) is steady."""
    if bound_reason and reason in (Reason.STEADY, Reason.SCALE_DOWN):
        reason = bound_reason
    if reason in (Reason.SCALE_DOWN, Reason.MOVE) and not changed:
        return Reason.STEADY, (["moving to the re-solved plan: waiting for Ready capacity"]
                               if reason is Reason.MOVE else [])
    return reason, []


def _round_notes(bounds: ModelBounds, *, stale: int, unmet: float) -> list[str]:
    """What a round's message adds about pods left out and demand left unmet."""
    notes = []
    if stale:
        notes.append(f"{stale} pod(s) stale or missing, excluded (their last known rate carried on)")
    if unmet > EPS:
        notes.append(f"unmet {unmet:.1f} req/s: no free inventory on any config"
                     + (f" or max_replicas {bounds.max_replicas} reached" if bounds.max_replicas is not None else ""))
    return notes


def _missing_options(by_option: Mapping[OptionKey, float | None], target: float) -> list[OptionKey]:
    """Options to derate after a model-wide SLO miss: those whose own replicas miss when others meet the
    target; every option when none can be told apart (too few requests, or all miss)."""
    missing = [k for k, a in by_option.items() if a is not None and a < target]
    meeting = [k for k, a in by_option.items() if a is not None and a >= target]
    return missing if missing and meeting else list(by_option)


def _significant(rate: float, expected: float, window_s: float) -> bool:
    """Whether ``rate`` over ``window_s`` is more than three Poisson standard deviations above ``expected``."""
    return (rate - expected) * window_s > 3 * math.sqrt(max(expected * window_s, 1.0))


def _room(reps: _Replicas, option: ScaleOption, free: dict[str, float], bounds: ModelBounds) -> bool:
    below_max = bounds.max_replicas is None or reps.total < bounds.max_replicas
    return below_max and free.get(option.pool, 0.0) >= option.gpus - EPS


def _add(reps: _Replicas, option: ScaleOption, free: dict[str, float], n: int = 1) -> None:
    reps.counts[option.key] = reps.counts.get(option.key, 0) + n
    free[option.pool] -= option.gpus * n


def _scale_up(reps: _Replicas, needed: float, free: dict[str, float], bounds: ModelBounds, *,
              avoid: Collection[OptionKey] = ()) -> float:
    """Add replicas, cheapest per unit of capacity first, until ``needed`` is held; returns what is left unmet.

    Options in ``avoid`` (their replicas miss the SLO) are used only when no other option has room.
    """
    gap = needed - reps.held()
    while gap > EPS:
        open_options = [o for o in reps.options if reps.capacity[o.key] > 0 and _room(reps, o, free, bounds)]
        open_options = [o for o in open_options if o.key not in avoid] or open_options
        if not open_options:
            return gap
        pick = min(open_options, key=lambda o: (_cover_cost(reps, o, gap), reps.unit_cost(o), o.key))
        _add(reps, pick, free)
        gap -= reps.capacity[pick.key]
    return 0.0


def _cover_cost(reps: _Replicas, option: ScaleOption, gap: float) -> float:
    """Cost of closing ``gap`` with this option alone: cost per unit of capacity, rounded up to whole replicas."""
    return math.ceil(gap / reps.capacity[option.key] - EPS) * option.price_per_hour


def _scale_down(reps: _Replicas, down_to: float, free: dict[str, float], bounds: ModelBounds,
                settings: AutoscaleSettings) -> None:
    """Remove replicas, highest cost per unit first, while what stays holds ``down_to``."""
    limit = max(1, math.floor(reps.total * settings.max_scale_down_fraction))
    removed = 0
    by_cost = sorted((o for o in reps.options if reps.counts.get(o.key, 0) > 0),
                     key=lambda o: (-reps.unit_cost(o), o.key))
    held = reps.held()
    for option in by_cost:
        cap = reps.capacity[option.key]
        while (reps.counts[option.key] > 0 and removed < limit and reps.total > bounds.min_replicas
               and held - cap >= down_to - EPS):
            _add(reps, option, free, -1)
            held -= cap
            removed += 1


def _move(reps: _Replicas, target: Mapping[OptionKey, int], needed: float, free: dict[str, float]) -> Reason:
    """One make-before-break step towards ``target``: add what it adds, remove what Ready capacity allows."""
    by_key = {o.key: o for o in reps.options}
    for key, want in sorted(target.items()):
        option = by_key.get(key)
        if option is not None:
            while reps.counts.get(key, 0) < want and free.get(option.pool, 0.0) >= option.gpus - EPS:
                _add(reps, option, free)
    surplus = sorted((o for o in reps.options if reps.counts.get(o.key, 0) > target.get(o.key, 0)),
                     key=lambda o: (-reps.unit_cost(o), o.key))
    for option in surplus:
        while reps.counts[option.key] > target.get(option.key, 0):
            after = dict(reps.counts)
            after[option.key] -= 1
            ready_after = sum(min(n, reps.ready[k]) * reps.capacity[k] for k, n in after.items())
            if ready_after < needed - EPS:
                break
            _add(reps, option, free, -1)
    return Reason.MOVE


def _bounds(bounds: ModelBounds, reps: _Replicas, free: dict[str, float]) -> tuple[Reason | None, list[str]]:
    """Enforce min and max replicas; returns the reason when one applied."""
    reason, notes = None, []
    while reps.total < bounds.min_replicas:
        open_options = [o for o in reps.options if _room(reps, o, free, bounds)]
        if not open_options:
            notes.append(f"min_replicas {bounds.min_replicas} not reachable: no free inventory")
            break
        _add(reps, min(open_options, key=lambda o: (reps.unit_cost(o), o.price_per_hour, o.key)), free)
        reason = Reason.MIN_REPLICAS
    if bounds.max_replicas is not None and reps.total > bounds.max_replicas:
        by_cost = sorted((o for o in reps.options if reps.counts.get(o.key, 0) > 0),
                         key=lambda o: (-reps.unit_cost(o), o.key))
        for option in by_cost:
            while reps.counts[option.key] > 0 and reps.total > bounds.max_replicas:
                _add(reps, option, free, -1)
        reason = Reason.MAX_REPLICAS
    return reason, notes


def _result(bounds: ModelBounds, reps: _Replicas, before: Mapping[OptionKey, int], *, reason: Reason,
            notes: list[str], demand: float, needed: float, unmet: float, attainment: float | None, panic: bool,
            stale: int, shares: Mapping[str, float], correction: Mapping[OptionKey, float],
            latency: tuple[float | None, float | None]) -> ModelDecision:
    changes = []
    for key in sorted(reps.counts):
        delta = reps.counts[key] - before.get(key, 0)
        if delta:
            changes.append(f"{delta:+d} {key.pool}/{key.device}" + (f" tp{key.tp}" if key.tp > 1 else ""))
    capacity = reps.held()
    head = (f"{reason.value}: demand {demand:.2f} req/s, need {needed:.2f}, "
            f"hold {capacity:.2f} on {reps.total} replica(s)")
    message = "; ".join([head, *([", ".join(changes)] if changes else []), *notes])
    return ModelDecision(model=bounds.name, desired={k: n for k, n in reps.counts.items() if n or before.get(k)},
                         reason=reason, message=message, demand_rps=demand, needed_rps=needed,
                         capacity_rps=capacity, unmet_rps=unmet, attainment=attainment,
                         correction={k: c for k, c in correction.items() if c < 1},
                         observed_ttft_ms=latency[0], observed_tpot_ms=latency[1], panic=panic, stale_pods=stale,
                         shares=dict(shares))


def _drift(decisions: list[ModelDecision], fleet: Fleet) -> float:
    """Cost of the decided placement over the cost of covering the same needs from scratch, minus one."""
    price = {o.key: o.price_per_hour for o in fleet.options}
    current = sum(n * price.get(k, 0.0) for d in decisions for k, n in d.desired.items())
    free = dict(fleet.pool_gpus)
    fresh = 0.0
    for d in decisions:
        bounds = fleet.model(d.model)
        options = fleet.options_of(d.model)
        reps = _Replicas(options=options, capacity={o.key: capacity_for_mix(o, d.shares) for o in options},
                         counts={o.key: 0 for o in options}, ready={o.key: 0 for o in options})
        _scale_up(reps, d.needed_rps, free, bounds)
        _bounds(bounds, reps, free)
        fresh += sum(n * price[k] for k, n in reps.counts.items())
    return current / fresh - 1 if fresh > 0 else 0.0
