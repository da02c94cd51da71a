"""Closed loop: a fleet whose catalog is wrong for two of its three types, corrected from the requests it serves.

    .venv/bin/python benchmarks/closed_loop.py            # a few minutes on two cores
    .venv/bin/python benchmarks/closed_loop.py --quick    # a smoke run of every part, seconds

The set-up is the mixed H100/A100/L4 fleet of the router benchmarks (2, 2 and 4 GPUs) serving qwen3-0.6b, on which
the three types are within 1.5× of each other in SLO capacity per dollar, so each is worth planning with (on
llama-3.1-8b an L4 costs 5-11× an H100 per req/s at the SLO and no plan buys it), under 30 simulated minutes of
one diurnal swing with a 3× burst. In truth the H100-SXM runs every step 1.4× slower than the catalog says and the
L4 at 0.75× of it; the A100-80GB runs as the catalog says. hetsched is not told. The catalog ranks the H100 the
cheapest per req/s at the SLO and the L4 the dearest; in truth the A100 and the L4 are the cheapest and the H100 the
dearest, so a plan made on the catalog buys the wrong type, and holds less than it believes.

It is :mod:`autoscale_replay`'s discrete-event replay (simulated time, no wall-clock jitter): each replica is the
shared continuous-batching ``Scheduler``, here timed by the catalog's step model under its type's *true* speed
(``corrected(roofline, StepCorrection(1.4, 1.4))`` on the H100, ``(0.75, 0.75)`` on the L4); every request is routed
by the router's own ``decide`` (the ``slo`` policy by default, which predicts each request's TTFT and TPOT on every
candidate from its profile); the autoscaler is ``hetsched autoscale``'s loop, starting from the static plan for the
trough's rate. Four runs of the same trace:

1. *no loop*: the router's profiles and the autoscaler's capacities come from the catalog, as without issue 28;
2. *loop*: a :class:`~hetsched.router.learning.FleetLearner` learns from answered requests as ``RouterState``
   feeds it: at most ``--samples-per-s`` requests a second per replica (the router's ``calibration.samples_per_s``,
   20), each one's TTFT, when no other prompt reached its replica from just before it was sent to its first token,
   against the step model's time for a request alone there (``sent_prediction``'s ``alone_ttft``), its TPOT against
   the mean step at its replica's mean load over its life with the prompts sent there meanwhile prefilled among its
   steps (``life_step``). When a type's correction in force changes, the router's profiles of that type predict with
   it at once. At each autoscaler round, a type whose correction in force has moved more
   than ``--replan-threshold`` (default the autoscaler's ``correction_threshold``, 10 %) from the one its capacity
   was searched with, and was not re-planned in the last minute, is re-planned: its SLO capacity is searched again
   on the corrected step model, the autoscaler's fleet takes it, what its SLO-miss derating learnt of that type is
   dropped (it corrected the old estimate), and a full re-solve of the placement is due at the next steady round;
3. *true speeds*: what the loop aims at, the router and the autoscaler told the true speeds from the start;
4. *correct catalog*: every type runs as the catalog says, with the loop on; nothing should move.

``--scales-only`` is an experiment: the learner keeps the two overheads at 0 and learns the two scales.

How far a correction is from another is the largest relative difference of the step times they predict over four
reference steps: a prefill of the median prompt, one and 32 decodes at the median context, and the 32 decodes with
that prefill. A type's correction has *settled* once the one in force is within 10 % of the truth and stays there
to the end of the run; it is reported in that type's completed requests and simulated seconds since its first.
Prediction accuracy is the ratio of the p50 predicted (as each request was sent, with the correction in force then)
to the p50 observed, over the requests of a type sent after its 200th completed request.

The demand is sized from the step model: each type's SLO capacity comes from the simulator's search, on the true
speeds and on the catalog's, and the trace's highest rate (the burst's start) is ``--peak-share`` of what the whole
inventory holds at its true speeds. Reports SLO attainment (overall and outside the burst's first minute, which
detection and start-up cost whatever the estimates), cost from replica-seconds × price, when each correction
settled and each re-plan happened, the prediction ratios, the moves on the correct catalog, the cost against the
run told the true speeds and against plans made with hindsight on the true speeds, and the targets met or not.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from _autoscale_trace import (HOUR, PEAK_SHARE, Bursts, Curve, Scenario, arrivals, first_minutes, lower_bound,
                              plan_cost, print_attainment, static_plan, window_peak)
from autoscale_replay import Replay, SimReplica
from hetsched.autoscale.fleet import Fleet, build_fleet
from hetsched.catalog import load_catalog
from hetsched.optimizer.spec import CapacityEntry
from hetsched.perf.correction import IDENTITY, Parts, StepCorrection, step_parts
from hetsched.perf.online import EstimatorSettings
from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.router.config import CalibrationConfig
from hetsched.router.learning import FleetLearner, correction_key
from hetsched.router.predict import EndpointProfile, decodes_as_modelled, life_step, prefill_span, sent_prediction
from hetsched.router.profiles import roofline_profile
from hetsched.router.types import EndpointView, Policy, Prediction, RouteRequest
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.sim.capacity import DEFAULT_SEEDS
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO, LengthDistribution, Workload
import report

PROMPT_P50, OUTPUT_P50 = 512, 128
SCENARIO = Scenario(
    "qwen3-0.6b", SLO(ttft_ms=1000, tpot_ms=50),
    Workload(name="chat", input_len=LengthDistribution.lognormal(p50=PROMPT_P50, p99=2048, max_tokens=4096),
             output_len=LengthDistribution.lognormal(p50=OUTPUT_P50, p99=512, max_tokens=1024)),
    pools=(("h100", "h100-sxm", 2), ("a100", "a100-80gb", 2), ("l4", "l4", 4)))
"""The router benchmarks' pool: 2 H100-SXM, 2 A100-80GB, 4 L4, one node each."""
TRUTH = {"h100-sxm": StepCorrection(1.4, 1.4), "l4": StepCorrection(0.75, 0.75)}
"""How each type really runs against the catalog's step model (a type not named runs as the catalog says)."""
SETTLED = 0.10
"""A correction has settled once it stays this close to the truth (:func:`distance`)."""
ACCURACY_AFTER = 200
"""Completed requests of a type after which its predictions are judged."""
REFERENCE_BATCH = 32


@dataclass(frozen=True)
class Run:
    """What one benchmark run covers: the scenario, the trace (one diurnal swing over ``duration``, the bursts) and
    the seeds of the capacity search."""

    scenario: Scenario
    duration: float
    day_s: float
    bursts: Bursts
    capacity_seeds: tuple[int, ...]


FULL = Run(SCENARIO, 1800.0, 1800.0, ((1200.0, 300.0),), DEFAULT_SEEDS)
QUICK = Run(replace(SCENARIO, pools=(("h100", "h100-sxm", 1), ("a100", "a100-80gb", 1), ("l4", "l4", 2))),
            180.0, 1800.0, ((120.0, 30.0),), (0,))
"""One GPU of the H100 and A100, two L4, the first three simulated minutes of the day with a burst of half a
minute, one seed's searches: every part in seconds."""


# --- how far apart two corrections are ----------------------------------------------------

def reference_shapes() -> tuple[StepShape, ...]:
    """A prefill of the median prompt; one and :data:`REFERENCE_BATCH` decodes at the median context; both."""
    context = PROMPT_P50 + OUTPUT_P50 // 2
    prefill = [(PROMPT_P50, 0)]
    return (StepShape.build(prefill=prefill), StepShape.build(decode_contexts=[context]),
            StepShape.build(decode_contexts=[context] * REFERENCE_BATCH),
            StepShape.build(prefill=prefill, decode_contexts=[context] * REFERENCE_BATCH))


Reference = tuple[Parts, ...]
"""A step model's base times of the reference steps, as parts."""


def reference(model: StepLatencyModel) -> Reference:
    return tuple(step_parts(model, shape) for shape in reference_shapes())


def distance(a: StepCorrection, b: StepCorrection, steps: Reference) -> float:
    """The largest relative difference of the reference steps' times under ``a`` and under ``b``."""
    return max(abs(a.seconds(p) / b.seconds(p) - 1.0) for p in steps)


# --- the autoscaler's capacities, searched again when a correction moves --------------------

@dataclass(frozen=True)
class Replan:
    at: float
    accelerator: str
    correction: StepCorrection
    before_rps: float
    after_rps: float


class Planner:
    """Each type's SLO capacity, searched on the step model under the correction it was last planned with."""

    def __init__(self, scenario: Scenario, entries: Sequence[CapacityEntry], *, seeds: Sequence[int],
                 threshold: float, every_s: float) -> None:
        self.scenario, self.seeds, self.threshold, self.every_s = scenario, tuple(seeds), threshold, every_s
        self.entries = {e.device: e for e in entries}
        self.planned: dict[str, StepCorrection] = {}
        self.last: dict[str, float] = {}
        self.replans: list[Replan] = []

    def fleet(self) -> Fleet:
        return build_fleet(self.scenario.cluster(list(self.entries.values())), load_catalog())

    def consider(self, accelerator: str, correction: StepCorrection, steps: Reference, *,
                 now: float) -> Fleet | None:
        """The fleet with ``accelerator``'s capacity searched again under ``correction`` when that moved past the
        threshold from the one planned with and the type was not re-planned in the last ``every_s``; None when not
        (or the search found nothing)."""
        if now - self.last.get(accelerator, -math.inf) < self.every_s or \
                distance(correction, self.planned.get(accelerator, IDENTITY), steps) <= self.threshold:
            return None
        entry = self.scenario.capacity(accelerator, seeds=self.seeds, speed=correction)
        before = self.entries.get(accelerator)
        if entry is None or before is None:
            return None
        self.planned[accelerator], self.last[accelerator] = correction, now
        self.entries[accelerator] = entry
        self.replans.append(Replan(now, accelerator, correction, before.requests_per_s, entry.requests_per_s))
        return self.fleet()


# --- the replay, with the loop ------------------------------------------------------------------

@dataclass(frozen=True)
class Arrived:
    """What was sent to one replica so far: how many requests, their prompt tokens, when the last came and its
    prompt, and the last request learned from (-1: none)."""

    count: int = 0
    prompt_tokens: int = 0
    last_at: float = -math.inf
    last_prompt: int = 0
    sampled: int = -1


class LoopReplay(Replay):
    """:class:`~autoscale_replay.Replay` whose router predicts with a correction per type (``beliefs``), records
    each request's prediction as it is sent, and, with a learner, learns from each answer and re-plans."""

    def __init__(self, scenario: Scenario, fleet: Fleet, settings: AutoscaleSettings, times: np.ndarray, *,
                 seed: int, startup_s: float, initial: dict[OptionKey, int], policy: Policy,
                 speeds: Mapping[str, StepCorrection], beliefs: Mapping[str, StepCorrection],
                 learner: FleetLearner | None = None, planner: Planner | None = None,
                 samples_per_s: float = CalibrationConfig().samples_per_s) -> None:
        self.types = [acc for _, acc, _ in scenario.pools]
        self.beliefs = {acc: beliefs.get(acc, IDENTITY) for acc in self.types}
        self.learner, self.planner, self.samples_per_s = learner, planner, samples_per_s
        self.sampled_at: dict[str, float] = {}
        """Per replica: when a request sent there was last taken to learn from (at most ``samples_per_s``)."""
        self._profiles: dict[str, EndpointProfile] = {}
        self._steps: dict[str, Reference] = {}
        n = len(times)
        self.kind = np.full(n, -1)
        self.predicted_ttft = np.full(n, np.nan)
        self.predicted_tpot = np.full(n, np.nan)
        self.sent_after = np.zeros(n, dtype=int)
        """Completed requests of the request's type when it was sent."""
        self.sent: dict[int, tuple[Prediction, float, float, bool, Arrived]] = {}
        """Per request in flight: the prediction as it was sent, when, its replica's load integral then, whether
        it is learned from, and what its replica had been sent before it."""
        self.arrived: dict[str, Arrived] = {}
        """Per replica: what was sent to it so far (``RouterState``'s ``EndpointState.sent`` and the rest)."""
        self.followed: dict[int, float] = {}
        """When the next request came to its replica, by request learned from (``EndpointState.followed``)."""
        self.load: dict[str, tuple[float, float]] = {}
        """Per replica: the time integral of its requests in flight, and up to when."""
        self.completed = dict.fromkeys(self.types, 0)
        self.first_done: dict[str, float] = {}
        self.history: dict[str, list[tuple[float, int, StepCorrection]]] = {
            acc: [(0.0, 0, self.beliefs[acc])] for acc in self.types}
        """Per type: (time, its completed requests, the correction in force from then)."""
        super().__init__(scenario, fleet, settings, times, seed=seed, startup_s=startup_s, autoscale=True,
                         initial=initial, policy=policy, speeds=speeds)

    def base(self, accelerator: str, tp: int = 1) -> EndpointProfile:
        return roofline_profile(self.scenario.model, accelerator, tp)

    def steps(self, accelerator: str) -> Reference:
        """The type's reference steps (at TP 1, which every type of the scenario runs)."""
        if accelerator not in self._steps:
            self._steps[accelerator] = reference(self.base(accelerator).step_model)
        return self._steps[accelerator]

    def profile(self, r: SimReplica) -> EndpointProfile:
        found = self._profiles.get(r.endpoint.accelerator)
        if found is None or found.correction != self.beliefs[r.endpoint.accelerator]:
            found = self._profiles[r.endpoint.accelerator] = replace(
                self.base(r.endpoint.accelerator, r.endpoint.tp), correction=self.beliefs[r.endpoint.accelerator])
        return found

    def _advance(self, r: SimReplica) -> float:
        """``r``'s load integral up to now (``RouterState``'s ``EndpointState.advance``)."""
        seconds, at = self.load.get(r.name, (0.0, self.now))
        seconds += r.in_flight * (self.now - at)
        self.load[r.name] = (seconds, self.now)
        return seconds

    def _done(self, r: SimReplica, i: int, *, failed: bool) -> None:
        self._advance(r)
        super()._done(r, i, failed=failed)
        if failed:
            self.sent.pop(i, None)
            self.followed.pop(i, None)

    def dispatched(self, r: SimReplica, request: RouteRequest, view: EndpointView, i: int) -> None:
        before = self.arrived.get(r.name, Arrived())
        if before.sampled in self.sent:
            self.followed.setdefault(before.sampled, self.now)
        alone = self.now - before.last_at >= prefill_span(self.profile(r), view, before.last_prompt)
        prediction = sent_prediction(self.profile(r), view, request, alone=alone)
        accelerator = r.endpoint.accelerator
        self.kind[i] = self.types.index(accelerator)
        self.predicted_ttft[i], self.predicted_tpot[i] = prediction.ttft_s, prediction.tpot_s
        self.sent_after[i] = self.completed[accelerator]
        sampled = self.now - self.sampled_at.get(r.name, -math.inf) >= 1.0 / self.samples_per_s
        if sampled:
            self.sampled_at[r.name] = self.now
        self.arrived[r.name] = Arrived(before.count + 1, before.prompt_tokens + request.prompt_tokens, self.now,
                                       request.prompt_tokens, i if sampled else before.sampled)
        self.sent[i] = (prediction, self.now, self._advance(r), sampled, before)

    def finished(self, r: SimReplica, i: int) -> None:
        accelerator = r.endpoint.accelerator
        self.completed[accelerator] += 1
        self.first_done.setdefault(accelerator, self.now)
        prediction, sent_at, load, sampled, before = self.sent.pop(i)
        next_sent = self.followed.pop(i, math.inf)
        if self.learner is None or not sampled:
            return
        n = int(self.outputs[i])
        ttft = float(self.first[i] - self.arrival[i])
        ended = r.view is not None and decodes_as_modelled(self.profile(r), replace(r.view, in_flight=r.in_flight))
        tpot = float((self.finish[i] - self.first[i]) / (n - 1)) if n > 1 and ended else None
        decoded = self._decoded(r, i, sent_at, load, before) if tpot is not None else None
        changed = self.learner.observe(correction_key(r.endpoint, self.scenario.model), r.name, prediction,
                                       ttft_s=ttft if next_sent - sent_at >= ttft else None, tpot_s=tpot,
                                       at=self.now, tpot_parts=decoded)
        if changed is None:
            return
        self.beliefs[accelerator] = changed
        self.history[accelerator].append((self.now, self.completed[accelerator], changed))

    def _decoded(self, r: SimReplica, i: int, sent_at: float, load: float, before: Arrived) -> Parts | None:
        """The mean step request ``i`` decoded in, as ``RouterState.learn`` has it: the replica's mean load over the
        request's life, the mean context of what it holds (the request counted, as it still is when the router
        learns), and the requests sent to the replica after it."""
        if self.now <= sent_at:
            return None
        batch = (self._advance(r) - load) / (self.now - sent_at)
        now = self.arrived[r.name]
        return life_step(self.profile(r), batch, requests=r.in_flight + 1,
                         prompt_tokens=r.prompt_in_flight + int(self.inputs[i]),
                         max_tokens=r.max_tokens_in_flight + int(self.outputs[i]),
                         decode_steps=int(self.outputs[i]) - 1, arrivals=now.count - before.count - 1,
                         arrival_prompt_tokens=now.prompt_tokens - before.prompt_tokens - int(self.inputs[i]))

    def _on_tick(self, payload: object) -> None:
        """Before each autoscaler round: re-plan the types whose correction in force moved."""
        if self.planner is not None:
            for accelerator in self.types:
                fleet = self.planner.consider(accelerator, self.beliefs[accelerator], self.steps(accelerator),
                                              now=self.now)
                if fleet is not None:
                    self.replan(fleet, accelerator)
        super()._on_tick(payload)

    def replan(self, fleet: Fleet, accelerator: str) -> None:
        """The autoscaler works with ``fleet`` from now on; the SLO-miss derating of ``accelerator``'s options goes
        (it corrected the estimate just replaced) and a full re-solve is due at the next steady round."""
        assert self.autoscaler is not None
        self.autoscaler.fleet = fleet
        self.capacity_of = {o.key: max(o.capacity.values()) for o in fleet.options}
        memory = self.autoscaler.memory
        state = memory.state
        derating = {k: v for k, v in state.correction.items() if k.device != accelerator}
        due = self.now - self.settings.resolve_interval_s
        self.autoscaler.memory = replace(memory, state=replace(state, correction=derating, last_replan=due))

    # --- what it found ------------------------------------------------------------------
    def ratios(self, accelerator: str, *, after: int = ACCURACY_AFTER) -> tuple[float, float, int]:
        """Predicted over observed p50 TTFT and TPOT of the type's requests sent after its ``after``-th answer,
        and how many there were."""
        done = ~np.isnan(self.finish) & ~self.failed
        mine = done & (self.kind == self.types.index(accelerator)) & (self.sent_after >= after)
        if not mine.any():
            return math.nan, math.nan, 0
        ttft = (self.first - self.arrival)[mine]
        ttft_ratio = float(np.median(self.predicted_ttft[mine]) / np.median(ttft))
        decoded = mine & (self.outputs > 1)
        tpot = ((self.finish - self.first) / np.maximum(self.outputs - 1, 1))[decoded]
        tpot_ratio = float(np.median(self.predicted_tpot[decoded]) / np.median(tpot)) if decoded.any() else math.nan
        return ttft_ratio, tpot_ratio, int(mine.sum())

    def settled(self, accelerator: str, truth: StepCorrection) -> tuple[int, float] | None:
        """(completed requests, seconds since the type's first answer) when the correction in force came within
        :data:`SETTLED` of ``truth`` for good; None when the last one is not."""
        steps, history = self.steps(accelerator), self.history[accelerator]
        if distance(history[-1][2], truth, steps) > SETTLED:
            return None
        k = len(history) - 1
        while k > 0 and distance(history[k - 1][2], truth, steps) <= SETTLED:
            k -= 1
        at, count, _ = history[k]
        return count, max(at - self.first_done.get(accelerator, at), 0.0)

    def largest_move(self, accelerator: str) -> tuple[float, float, StepCorrection]:
        """The farthest the correction in force went from the catalog (:func:`distance`), when, and that correction."""
        steps = self.steps(accelerator)
        return max(((distance(c, IDENTITY, steps), at, c) for at, _, c in self.history[accelerator]),
                   key=lambda found: found[0])


# --- the report -------------------------------------------------------------------------------

def scales(c: StepCorrection) -> str:
    text = f"prefill ×{c.prefill_scale:.3f}, decode ×{c.decode_scale:.3f}"
    if c.step_overhead_s or c.request_overhead_s:
        text += f", +{c.step_overhead_s * 1e3:.2f} ms/step, +{c.request_overhead_s * 1e3:.1f} ms/request"
    return text


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_options(believed: Fleet, true: Fleet) -> None:
    """Each type's capacity and cost per req/s at the SLO, on the catalog and in truth."""
    real = {o.key.device: o for o in true.options}
    for o in sorted(believed.options, key=lambda o: o.price_per_hour / max(o.capacity.values())):
        cap, true_cap = max(o.capacity.values()), max(real[o.key.device].capacity.values())
        speed = TRUTH.get(o.key.device, IDENTITY).decode_scale
        print(f"  {o.key.device:>10} TP={o.key.tp} ${o.price_per_hour:5.2f}/h, {int(true.pool_gpus[o.pool] // o.gpus)} "
              f"fit: catalog {cap:6.2f} req/s at SLO (${o.price_per_hour / cap:.4f} per req/s·h); runs ×{speed:g}: "
              f"{true_cap:6.2f} req/s (${o.price_per_hour / true_cap:.4f} per req/s·h)")


def print_run(name: str, replay: LoopReplay, times: np.ndarray, bursts: Bursts, wall: float) -> None:
    met = replay.met()
    print(f"\n{name} ({wall:.0f} s wall): cost ${replay.cost():.2f}")
    print_attainment(times, met, int(replay.failed.sum()), bursts=bursts)
    started: dict[str, int] = {}
    for _, key, n, _ in replay.events:
        if n > 0:
            started[key.device] = started.get(key.device, 0) + n
    print("  replicas started per type (the initial ones included): "
          + ", ".join(f"{acc} {started.get(acc, 0)}" for acc in replay.types)
          + "; requests answered per type: " + ", ".join(f"{acc} {replay.completed[acc]}" for acc in replay.types))


def timed(replay: LoopReplay, duration: float) -> float:
    wall = time.perf_counter()
    replay.run(duration)
    return time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-share", type=float, default=PEAK_SHARE,
                        help="the trace's highest rate as a share of what the inventory holds at its true speeds")
    parser.add_argument("--startup-s", type=float, default=30.0, help="seconds until a new replica is Ready")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", type=Policy, default=Policy.SLO, choices=list(Policy), help="the router's policy")
    parser.add_argument("--replan-threshold", type=float, default=AutoscaleSettings().correction_threshold,
                        help="re-plan a type when its correction moved this far (the largest difference of the step "
                             "times over the reference steps) from the one its capacity was searched with (default: "
                             "the autoscaler's correction_threshold)")
    parser.add_argument("--replan-every-s", type=float, default=60.0,
                        help="... and it was not re-planned in this many seconds")
    parser.add_argument("--samples-per-s", type=float, default=CalibrationConfig().samples_per_s,
                        help="requests a second per replica the loop learns from, at most (the router's "
                             "calibration.samples_per_s)")
    parser.add_argument("--scales-only", action="store_true",
                        help="learn the two scales only (the overheads' prior standard deviation 0), not hetsched's "
                             "default of all four parameters")
    parser.add_argument("--quick", action="store_true",
                        help="one H100, one A100, two L4, three simulated minutes, one seed's searches: a smoke run")
    args = parser.parse_args()
    run = QUICK if args.quick else FULL
    scenario, duration, bursts, seeds = run.scenario, run.duration, run.bursts, run.capacity_seeds
    settings = AutoscaleSettings()
    estimator = EstimatorSettings()
    if args.scales_only:
        estimator = replace(estimator, prior_sd=(estimator.prior_sd[0], estimator.prior_sd[1], 0.0, 0.0))

    believed_entries = scenario.capacities(seeds=seeds)
    true_entries = scenario.capacities(seeds=seeds, speeds=TRUTH)
    believed, true = (build_fleet(scenario.cluster(e), load_catalog()) for e in (believed_entries, true_entries))
    curve = Curve.sized(true, peak_share=args.peak_share, day_s=run.day_s, bursts=bursts)
    times = arrivals(duration, curve, seed=args.seed)
    print(f"trace: {len(times)} requests of {scenario.model} over {duration / 60:.0f} simulated min, diurnal "
          f"{curve.low:.1f}-{curve.high:.1f} req/s, 3x burst at "
          + ", ".join(f"{s / 60:g} min for {n:.0f} s" for s, n in bursts)
          + f"; highest rate {args.peak_share:.0%} of what the inventory holds at its true speeds; SLO P99 TTFT "
          f"{scenario.slo.ttft_ms:.0f} ms, TPOT {scenario.slo.tpot_ms:.0f} ms; router policy {args.policy}")
    print_options(believed, true)

    def replay(fleet: Fleet, *, speeds: Mapping[str, StepCorrection], beliefs: Mapping[str, StepCorrection],
               loop: bool) -> LoopReplay:
        learner = FleetLearner(settings=estimator) if loop else None
        planner = Planner(scenario, believed_entries, seeds=seeds, threshold=args.replan_threshold,
                          every_s=args.replan_every_s) if loop else None
        return LoopReplay(scenario, fleet, settings, times, seed=args.seed, startup_s=args.startup_s,
                          initial=static_plan(fleet, curve.base(0.0), headroom=settings.headroom),
                          policy=args.policy, speeds=speeds, beliefs=beliefs, learner=learner, planner=planner,
                          samples_per_s=args.samples_per_s)

    runs = {"no loop": replay(believed, speeds=TRUTH, beliefs={}, loop=False),
            "loop": replay(believed, speeds=TRUTH, beliefs={}, loop=True),
            "true speeds known": replay(true, speeds=TRUTH, beliefs=TRUTH, loop=False),
            "correct catalog, loop": replay(believed, speeds={}, beliefs={}, loop=True)}
    titles = {"no loop": "1. mis-specified fleet, no loop (router and autoscaler on the catalog)",
              "loop": "2. mis-specified fleet, loop on",
              "true speeds known": "3. mis-specified fleet, router and autoscaler told the true speeds from the start",
              "correct catalog, loop": "4. correct catalog (every type runs as it says), loop on"}
    for name, r in runs.items():
        print_run(titles[name], r, times, bursts, timed(r, duration))

    blind, loop, correct = runs["no loop"], runs["loop"], runs["correct catalog, loop"]
    true_rps = {e.device: e.requests_per_s for e in true_entries}
    print_corrections(loop, true_rps)
    accurate = print_accuracy(loop, blind)
    largest = print_moves(correct)
    cost = print_costs(runs, true, believed, times, duration)

    def outside(r: LoopReplay) -> float:
        return float(r.met()[~first_minutes(times, bursts)].mean())
    attained, without = outside(loop), outside(blind)
    ratio = cost["loop"] / cost["true speeds known"]
    print(f"targets: TTFT and TPOT p50 predicted within 10% of observed after {ACCURACY_AFTER} answers on every type: "
          f"{verdict(accurate)}; correct catalog, no correction moves more than 3% (largest {largest:.1%}): "
          f"{verdict(largest <= 0.03)}; SLO outside the burst's first minute with the loop {attained:.2%} "
          f"(≥ 99%: {verdict(attained >= 0.99)}; without the loop {without:.2%}); cost {ratio:.3f}x the run told the "
          f"true speeds (≤ 1.05x: {verdict(ratio <= 1.05)})")


def print_corrections(loop: LoopReplay, true_rps: Mapping[str, float]) -> None:
    """Per type: the corrections in force, when they settled, the re-plans and the capacity planned at the end."""
    assert loop.planner is not None
    print(f"\nthe loop's corrections (mis-specified fleet; off: the largest difference of the step times over the "
          f"reference steps; settled: within {SETTLED:.0%} of the truth to the end)")
    for acc in loop.types:
        truth, steps, history = TRUTH.get(acc, IDENTITY), loop.steps(acc), loop.history[acc]
        settled = loop.settled(acc, truth)
        when = (f"settled after {settled[0]} answers, {settled[1]:.0f} s after its first" if settled
                else "not settled")
        first = f"first in force after {history[1][1]} answers" if len(history) > 1 else "never in force"
        print(f"  {acc:>10} (runs ×{truth.decode_scale:g}): {first}, {len(history) - 1} changes, {when}; at the end "
              f"{scales(history[-1][2])}, {distance(history[-1][2], truth, steps):.1%} off")
        replans = [e for e in loop.planner.replans if e.accelerator == acc]
        if replans:
            planned = [e.after_rps for e in replans]
            start = replans[0]
            print(f"  {'':>10}  {len(replans)} re-plans, the first at {start.at:.0f} s ({start.before_rps:.2f} → "
                  f"{start.after_rps:.2f} req/s at the SLO), planned between {min(planned):.2f} and "
                  f"{max(planned):.2f} req/s, at the end {planned[-1]:.2f} (true {true_rps[acc]:.2f})")


def print_accuracy(loop: LoopReplay, blind: LoopReplay) -> bool:
    """Predicted over observed p50 per type, with and without the loop; whether all are within 10 % with it."""
    print(f"\npredicted / observed p50 of the requests sent after a type's {ACCURACY_AFTER}th answer")
    accurate = True
    for acc in loop.types:
        ttft, tpot, n = loop.ratios(acc)
        b_ttft, b_tpot, b_n = blind.ratios(acc)
        accurate &= n > 0 and abs(ttft - 1) <= 0.1 and abs(tpot - 1) <= 0.1
        print(f"  {acc:>10}: loop TTFT {ttft:.3f}, TPOT {tpot:.3f} ({n} requests); no loop TTFT {b_ttft:.3f}, "
              f"TPOT {b_tpot:.3f} ({b_n})")
    return accurate


def print_moves(correct: LoopReplay) -> float:
    """How far each correction in force went from a correct catalog, and the largest."""
    assert correct.learner is not None and correct.planner is not None
    print("\ncorrect catalog, loop on: the farthest each correction in force went from the catalog")
    found = []
    for acc in correct.types:
        move, at, c = correct.largest_move(acc)
        found.append(move)
        end = correct.history[acc][-1][2]
        replans = sum(e.accelerator == acc for e in correct.planner.replans)
        print(f"  {acc:>10}: {move:.1%} at {at:.0f} s ({scales(c)}); at the end "
              f"{distance(end, IDENTITY, correct.steps(acc)):.1%} ({scales(end)}); {replans} re-plans")
    return max(found)


def print_costs(runs: Mapping[str, LoopReplay], true: Fleet, believed: Fleet, times: np.ndarray,
                duration: float) -> dict[str, float]:
    """Each run's cost, against the run told the true speeds and the plans made with hindsight on them."""
    peak = window_peak(times, 0.0, duration)
    hindsight = plan_cost(true, static_plan(true, peak, headroom=0.0)) * duration / HOUR
    catalog = plan_cost(believed, static_plan(believed, peak, headroom=0.0)) * duration / HOUR
    bound = lower_bound(true, times, duration)
    cost = {name: r.cost() for name, r in runs.items()}
    known = cost["true speeds known"]
    print(f"\ncost over {duration / 60:.0f} min: no loop ${cost['no loop']:.2f} ({cost['no loop'] / known:.3f}x the "
          f"run told the true speeds), loop ${cost['loop']:.2f} ({cost['loop'] / known:.3f}x), true speeds known "
          f"${known:.2f}")
    print(f"  with hindsight of the peak minute ({peak:.1f} req/s, no headroom), the static plan on the true speeds "
          f"costs ${hindsight:.2f} (loop {cost['loop'] / hindsight:.2f}x), on the catalog ${catalog:.2f}; the optimal "
          f"plan per 5 min on the true speeds (a bound) ${bound:.2f} (loop {cost['loop'] / bound:.2f}x)")
    return cost


if __name__ == "__main__":
    report.main(main, section="closed_loop")
