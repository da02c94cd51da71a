"""Replay a 2-hour demand trace (diurnal curve plus two 3× bursts) against an autoscaled heterogeneous fleet.

    .venv/bin/python benchmarks/autoscale_replay.py            # a few minutes on two cores
    .venv/bin/python benchmarks/autoscale_replay.py --quick    # a smoke run of every part, seconds

A discrete-event replay in simulated time, so two hours run in minutes on a
CPU without wall-clock jitter in the latencies:

* each replica is the shared continuous-batching :class:`~hetsched.sim.scheduler.Scheduler`
  timed by the step model (the catalog's roofline with its calibrated constants, what
  ``hetsched sim-worker`` runs), and exports vLLM's counters and histograms (vLLM's bucket bounds);
* every request is routed by the router's own decision function
  (``hetsched.router.policy.decide``; ``--policy``, least-request by default,
  with engine signals refreshed every second and the router's queue and KV-use limits, so
  overload is a 429);
* the autoscaler is :class:`~hetsched.autoscale.loop.Autoscaler` — the loop
  ``hetsched autoscale`` runs — with an applier that starts replicas (Ready
  after ``--startup-s``) and stops them (drained), and a metrics source of which
  2 % of scrapes fail.

The demand is sized from the same step model: each configuration's SLO capacity comes from the
simulator's search, and the trace's highest rate is ``--peak-share`` of what the whole inventory holds.

Reports SLO attainment (overall, outside and inside the first minute of each
burst), cost against two static plans solved with hindsight of the peak and
the sum of per-5-minute optimal plans (a lower bound no autoscaler reaches),
scale events per hour and up-down-up flaps, reaction time to each burst, and the targets met or not.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from _autoscale_trace import (BURSTS, HOUR, LIVE_8B, PEAK_SHARE, Curve, Event, Scenario, arrivals, first_minutes,
                              inventory_rate, lower_bound, plan_cost, print_attainment, print_events, print_options,
                              print_reactions, static_plan, window_peak)
from hetsched.autoscale.fleet import Fleet, build_fleet
from hetsched.autoscale.loop import Autoscaler
from hetsched.autoscale.policy import Reason
from hetsched.autoscale.signals import PodSample, Replica
from hetsched.catalog import Device, load_catalog
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.perf.correction import StepCorrection, corrected
from hetsched.perf.roofline import RooflineModel
from hetsched.router.config import ModelConfig
from hetsched.router.policy import decide as route
from hetsched.router.predict import EndpointProfile
from hetsched.router.profiles import roofline_profile
from hetsched.router.state import DecayingRate
from hetsched.router.types import Endpoint, EndpointView, Policy, RouteRequest
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.sim.capacity import DEFAULT_SEEDS, Replica as SimReplicaSpec
from hetsched.sim.scheduler import Request, Scheduler, SchedulerOutput
from hetsched.simworker.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import load_model
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO, LengthDistribution, Workload
import report

SCENARIO_70B = Scenario(
    "llama-3.1-70b", SLO(ttft_ms=2000, tpot_ms=80),
    Workload(name="chat-70b", input_len=LengthDistribution.lognormal(p50=1024, p99=4096, max_tokens=6144),
             output_len=LengthDistribution.lognormal(p50=512, p99=1536, max_tokens=2048)),
    pools=(("h100", "h100-sxm", 4), ("h200", "h200", 8), ("mi300x", "mi300x", 8), ("a100", "a100-80gb", 8)))
"""One node each, some capped so bursts spill onto the next cheapest type."""
SCENARIOS = {"70b": SCENARIO_70B, "live": LIVE_8B}
LEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
MAX_QUEUE, MAX_KV_USAGE = (ModelConfig.model_fields[name].default for name in ("max_queue", "max_kv_usage"))
"""The router's saturation limits by default: an endpoint's engine queue and KV use past which no policy sends
there."""
SIGNALS_EVERY_S = 1.0
SCRAPE_FAILURE = 0.02


# --- simulated replicas ---------------------------------------------------------

class Counts:
    """A cumulative histogram over fixed bounds (the last bucket is +Inf)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.le = (*map(float, bounds), math.inf)
        self.counts = np.zeros(len(self.le))
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[np.searchsorted(self.le, value)] += 1
        self.total += value

    def histogram(self) -> Histogram:
        return Histogram(self.le, tuple(np.cumsum(self.counts).tolist()), self.total)


@dataclass(eq=False)
class SimReplica:
    name: str
    key: OptionKey
    spec: SimReplicaSpec
    scheduler: Scheduler
    started: float
    ready_at: float
    price_per_hour: float
    endpoint: Endpoint
    stopping: bool = False
    ended: float | None = None
    busy: bool = False
    decode_dt: float = 0.0
    in_flight: int = 0
    prompt_in_flight: int = 0
    max_tokens_in_flight: int = 0
    sent_prompts: DecayingRate = field(default_factory=DecayingRate)
    """Prompt tokens sent here per second lately (``EndpointState.sent_prompts``)."""
    completed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Counts = field(default_factory=lambda: Counts(TTFT_BUCKETS))
    tpot: Counts = field(default_factory=lambda: Counts(TPOT_BUCKETS))
    inputs: Counts = field(default_factory=lambda: Counts(LEN_BUCKETS))
    outputs: Counts = field(default_factory=lambda: Counts(LEN_BUCKETS))
    view: EndpointView | None = None

    def metrics(self) -> EngineMetrics:
        running = self.scheduler.num_running
        return EngineMetrics(completed=self.completed, running=running, waiting=self.in_flight - running,
                             kv_usage=1 - self.scheduler.free_blocks / self.scheduler.num_blocks,
                             prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                             ttft_s=self.ttft.histogram(), tpot_s=self.tpot.histogram(),
                             input_tokens=self.inputs.histogram(), output_tokens=self.outputs.histogram())


class Replay:
    """The event loop: arrivals, engine steps, signal refreshes and autoscaler rounds.

    ``speeds`` (by device id) times a device's replicas by the step model under that correction instead of the step
    model itself: hardware that runs other than the catalog says. :meth:`profile`, :meth:`dispatched` and
    :meth:`finished` are where a subclass gives the router other profiles and sees each request sent and answered.
    """

    def __init__(self, scenario: Scenario, fleet: Fleet, settings: AutoscaleSettings, times: np.ndarray, *,
                 seed: int,
                 startup_s: float, autoscale: bool, initial: dict[OptionKey, int], policy: Policy,
                 verbose: bool = False, speeds: Mapping[str, StepCorrection] | None = None) -> None:
        self.fleet, self.settings, self.startup_s, self.verbose = fleet, settings, startup_s, verbose
        self.policy = policy
        self.speeds = dict(speeds or {})
        rng = np.random.default_rng(seed + 1)
        self.arrival = times
        self.scenario = scenario
        self.inputs = scenario.workload.input_len.sample(rng, len(times))
        self.outputs = scenario.workload.output_len.sample(rng, len(times))
        self.first = np.full(len(times), np.nan)
        self.finish = np.full(len(times), np.nan)
        self.failed = np.zeros(len(times), dtype=bool)
        self.now = 0.0
        self.queue: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.fleet_replicas: list[SimReplica] = []
        self.names = itertools.count(1)
        self.scrape_rng = np.random.default_rng(seed + 2)
        self.route_rng = random.Random(seed + 3)
        """The slo policy's spread among equals: seeded, so a replay under it is repeatable."""
        self.arch = load_model(scenario.model)
        self.prices = {o.key: o.price_per_hour for o in fleet.options}
        self.capacity_of = {o.key: max(o.capacity.values()) for o in fleet.options}
        self.events: list[Event] = []
        """(time, option, +n started / −n stopped, the decision's reason) as applied."""
        self.ready_log: list[tuple[float, float]] = []
        """(time, Ready capacity) after each change of the Ready set."""
        self.autoscaler = Autoscaler(fleet, settings, self, self, clock=lambda: self.now) if autoscale else None
        for key, n in initial.items():
            self.start(key, n, ready=True)
        self.next_arrival = 0

    # --- the Applier and MetricsSource the autoscaler drives ---------------------
    def replicas_(self) -> list[SimReplica]:
        return [r for r in self.fleet_replicas if not r.stopping]

    def replicas(self) -> list[Replica]:  # Applier
        return [Replica(r.name, r.key, r.name, self.now >= r.ready_at) for r in self.replicas_()]

    def start(self, key: OptionKey, count: int, *, ready: bool = False) -> None:
        model, _, device_id, tp, _ = key
        accelerator, _, profile = device_id.partition(":")
        device = Device.of(load_catalog().get(accelerator), profile or None)
        spec = _spec(self.arch, device, tp, self.scenario.workload, self.speeds.get(device_id))
        for _ in range(count):
            ready_at = self.now if ready else self.now + self.startup_s
            name = f"{device_id}-{next(self.names)}"
            replica = SimReplica(name=name, key=key, spec=spec,
                                 scheduler=Scheduler(spec.engine, num_blocks=spec.num_blocks,
                                                     max_model_len=spec.max_model_len),
                                 started=self.now, ready_at=ready_at, price_per_hour=self.prices[key],
                                 endpoint=Endpoint(url=name, model=model, accelerator=device_id, tp=tp))
            self.fleet_replicas.append(replica)
            self._push(ready_at, "ready", replica)
        self.events.append((self.now, key, count, "initial"))

    def stop(self, key: OptionKey, count: int) -> None:
        mine = sorted((r for r in self.replicas_() if r.key == key), key=lambda r: (self.now >= r.ready_at, r.started))
        for replica in mine[:count]:
            replica.stopping = True
            if replica.in_flight == 0:
                replica.ended = self.now
        self.events.append((self.now, key, -count, ""))
        self._log_ready()

    def collect(self, replicas: object, *, now: float) -> list[PodSample]:  # MetricsSource
        out = []
        for r in self.replicas_():
            failed = self.scrape_rng.uniform() < SCRAPE_FAILURE
            out.append(PodSample(pod=r.name, key=r.key, ready=now >= r.ready_at, scraped_at=now,
                                 metrics=None if failed else r.metrics()))
        return out

    # --- the event loop ---------------------------------------------------------------
    def _push(self, at: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.queue, (at, next(self.seq), kind, payload))

    def run(self, duration: float) -> None:
        self._push(0.0, "signals")
        if self.autoscaler is not None:
            self._push(0.0, "tick")
        if len(self.arrival):
            self._push(float(self.arrival[0]), "arrival", 0)
        while self.queue:
            at, _, kind, payload = heapq.heappop(self.queue)
            if at > duration and kind in ("tick", "signals"):
                continue
            self.now = at
            getattr(self, f"_on_{kind}")(payload)
        for r in self.fleet_replicas:
            if r.ended is None:
                r.ended = max(duration, self.now)

    def _on_ready(self, replica: SimReplica) -> None:
        self._refresh(replica)
        self._log_ready()

    def _on_tick(self, _: object) -> None:
        assert self.autoscaler is not None
        applied = len(self.events)
        decision = self.autoscaler.step()
        reason = {m.model: m.reason.value for m in decision.models}
        self.events[applied:] = [(t, k, n, reason.get(k.model, "")) for t, k, n, _ in self.events[applied:]]
        if self.verbose:
            for m in decision.models:
                if m.reason is not Reason.STEADY:
                    print(f"  {self.now:7.0f}s {m.message}")
        self._push(self.now + self.settings.interval_s, "tick")

    def _on_signals(self, _: object) -> None:
        for r in self.replicas_():
            self._refresh(r)
        self._push(self.now + SIGNALS_EVERY_S, "signals")

    def _refresh(self, r: SimReplica) -> None:
        running = r.scheduler.num_running
        r.view = EndpointView(r.endpoint, in_flight=r.in_flight, in_flight_prompt_tokens=r.prompt_in_flight,
                              in_flight_max_tokens=r.max_tokens_in_flight, running=running,
                              waiting=r.in_flight - running,
                              kv_usage=1 - r.scheduler.free_blocks / r.scheduler.num_blocks,
                              max_queue=MAX_QUEUE, max_kv_usage=MAX_KV_USAGE)

    def _on_arrival(self, i: int) -> None:
        self.next_arrival = i + 1
        if i + 1 < len(self.arrival):
            self._push(float(self.arrival[i + 1]), "arrival", i + 1)
        ready = [r for r in self.replicas_() if self.now >= r.ready_at]
        views = {r.name: replace(r.view, in_flight=r.in_flight, in_flight_prompt_tokens=r.prompt_in_flight,
                                 in_flight_max_tokens=r.max_tokens_in_flight,
                                 prompt_tokens_per_s=r.sent_prompts.read(self.now))
                 for r in ready if r.view is not None}
        slo = self.scenario.slo
        request = RouteRequest(model=self.scenario.model, prompt_tokens=int(self.inputs[i]),
                               max_tokens=int(self.outputs[i]), slo=slo)
        decision = route(self.policy, request, list(views.values()), slo=slo, headroom=0.8, rng=self.route_rng,
                         profiles={r.name: self.profile(r) for r in ready})
        if decision.endpoint is None:
            self.failed[i] = True
            return
        replica = next(r for r in ready if r.name == decision.endpoint.url)
        self.dispatched(replica, request, views[replica.name], i)
        replica.scheduler.add_request(Request(i, int(self.inputs[i]), int(self.outputs[i])))
        replica.in_flight += 1
        replica.prompt_in_flight += int(self.inputs[i])
        replica.max_tokens_in_flight += int(self.outputs[i])
        replica.sent_prompts.add(int(self.inputs[i]), self.now)
        replica.inputs.observe(int(self.inputs[i]))
        replica.prompt_tokens += int(self.inputs[i])
        if not replica.busy:
            replica.busy = True
            self._step(replica)

    def _step(self, r: SimReplica) -> None:
        upcoming = float(self.arrival[self.next_arrival]) if self.next_arrival < len(self.arrival) else math.inf
        steps = 1 if r.decode_dt <= 0 else max(1, int(min(256.0, (upcoming - self.now) / r.decode_dt)))
        output = r.scheduler.schedule(max_steps=steps)
        for req in output.rejected:
            self._done(r, req.id, failed=True)
        if output.is_empty:
            r.busy = False
            return
        first = r.spec.step_model.step_time(output.shape)
        if not output.prefills:
            r.decode_dt = first
        seconds = first if output.num_steps == 1 else \
            output.num_steps * (first + r.spec.step_model.step_time(output.last_shape)) / 2
        self._push(self.now + seconds, "step_end", (r, output))

    def _on_step_end(self, payload: tuple[SimReplica, SchedulerOutput]) -> None:
        r, output = payload
        result = r.scheduler.update_from_output(output)
        for req in result.first_token:
            self.first[req.id] = self.now
            r.ttft.observe(self.now - self.arrival[req.id])
        for req in result.finished:
            n = int(self.outputs[req.id])
            self.finish[req.id] = self.now
            if n > 1:
                r.tpot.observe((self.now - self.first[req.id]) / (n - 1))
            r.outputs.observe(n)
            r.generation_tokens += n
            r.completed += 1
            self._done(r, req.id, failed=False)
            self.finished(r, req.id)
        self._step(r)

    def _done(self, r: SimReplica, i: int, *, failed: bool) -> None:
        self.failed[i] |= failed
        r.in_flight -= 1
        r.prompt_in_flight -= int(self.inputs[i])
        r.max_tokens_in_flight -= int(self.outputs[i])
        if r.stopping and r.in_flight == 0:
            r.ended = self.now

    # --- what a subclass may see or change ------------------------------------------
    def profile(self, r: SimReplica) -> EndpointProfile:
        """What the router predicts ``r`` with: its hardware's roofline profile."""
        return roofline_profile(r.endpoint.model, r.endpoint.accelerator, r.endpoint.tp)

    def dispatched(self, r: SimReplica, request: RouteRequest, view: EndpointView, i: int) -> None:
        """Request ``i`` is sent to ``r``, whose state before it was ``view``."""

    def finished(self, r: SimReplica, i: int) -> None:
        """Request ``i`` finished on ``r`` (its first token and finish times are recorded)."""

    def _log_ready(self) -> None:
        held = sum(self.capacity_of[r.key] for r in self.replicas_() if self.now >= r.ready_at)
        self.ready_log.append((self.now, held))

    # --- results -------------------------------------------------------------------
    def met(self) -> np.ndarray:
        ttft = self.first - self.arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(self.outputs > 1, (self.finish - self.first) / (self.outputs - 1), 0.0)
        slo = self.scenario.slo
        return (~self.failed & ~np.isnan(self.finish) & (ttft * 1e3 <= slo.ttft_ms) & (tpot * 1e3 <= slo.tpot_ms))

    def cost(self) -> float:
        return sum((r.ended - r.started) * r.price_per_hour / HOUR for r in self.fleet_replicas)  # type: ignore[operator]


_SPECS: dict[tuple[str, int, StepCorrection | None], SimReplicaSpec] = {}


def _spec(arch: ModelArch, device: Device, tp: int, workload: Workload,
          speed: StepCorrection | None = None) -> SimReplicaSpec:
    """A replica of ``device`` at ``tp``, its steps timed by the step model (under ``speed`` when given)."""
    key = (device.id, tp, speed)
    if key not in _SPECS:
        step_model = None if speed is None else corrected(RooflineModel(arch, device, tp=tp), speed)
        _SPECS[key] = SimReplicaSpec.build(arch, device, tp=tp, workload=workload, step_model=step_model)
    return _SPECS[key]


@dataclass(frozen=True)
class Run:
    """What one replay covers: the scenario, the trace's length and the seeds of the capacity search."""

    scenario: str
    hours: float
    capacity_seeds: tuple[int, ...]


FULL = Run("70b", 2.0, DEFAULT_SEEDS)
QUICK = Run("live", 0.75, (0,))
"""The small scenario's first 45 minutes (the diurnal rise, burst 1 and the scale-down after it), its capacities
from one seed's search: every part of the replay in seconds, the figures not the benchmark's."""


@dataclass(frozen=True)
class Targets:
    """What the autoscaled replay must reach."""

    outside_burst_starts: float = 0.99
    overall: float = 0.98
    cost_vs_hindsight: float = 0.8
    flaps: int = 0

    def report(self, *, outside: float, overall: float, cost_ratio: float, flaps: int) -> str:
        def verdict(ok: bool) -> str:
            return "met" if ok else "NOT met"
        return (f"targets: SLO outside burst starts {outside:.2%} (≥ {self.outside_burst_starts:.0%}: "
                f"{verdict(outside >= self.outside_burst_starts)}), overall {overall:.2%} (≥ {self.overall:.0%}: "
                f"{verdict(overall >= self.overall)}), cost {cost_ratio:.2f}x the hindsight-optimal static plan "
                f"(≤ {self.cost_vs_hindsight:g}x: {verdict(cost_ratio <= self.cost_vs_hindsight)}), flaps {flaps} "
                f"({self.flaps}: {verdict(flaps <= self.flaps)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS),
                        help=f"{FULL.scenario} (default): the headline; live (--quick's): autoscale_live.py's model, "
                             "workload and inventory")
    parser.add_argument("--hours", type=float, help=f"length of the trace (default {FULL.hours:g}; --quick "
                                                     f"{QUICK.hours:g})")
    parser.add_argument("--peak-share", type=float, default=PEAK_SHARE,
                        help="the trace's highest rate as a share of what the inventory holds at the SLO")
    parser.add_argument("--startup-s", type=float, default=30.0, help="seconds until a new replica is Ready")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--headroom", type=float, default=AutoscaleSettings().headroom,
                        help="capacity over demand, for the autoscaler and the peak-provisioned plan")
    parser.add_argument("--skip-static", action="store_true", help="do not replay the static plans")
    parser.add_argument("--verbose", action="store_true", help="print every decision that is not steady")
    parser.add_argument("--policy", type=Policy, default=Policy.LEAST_REQUEST, choices=list(Policy),
                        help="the router's policy")
    parser.add_argument("--quick", action="store_true",
                        help=f"the {QUICK.scenario} scenario's first {QUICK.hours * 60:.0f} minutes, capacities from "
                             "one seed's search: a smoke run")
    args = parser.parse_args()
    run = QUICK if args.quick else FULL
    wall = time.perf_counter()
    duration = (args.hours or run.hours) * HOUR
    scenario = SCENARIOS[args.scenario or run.scenario]
    fleet = build_fleet(scenario.cluster(scenario.capacities(seeds=run.capacity_seeds)), load_catalog())
    settings = AutoscaleSettings(headroom=args.headroom)
    curve = Curve.sized(fleet, peak_share=args.peak_share)
    times = arrivals(duration, curve, seed=args.seed)
    bursts = ", ".join(f"{s / 60:.0f} min" for s, _ in BURSTS if s < duration) or "none"
    print(f"trace: {len(times)} requests over {duration / HOUR:.2g} h, diurnal {curve.low:.2f}-{curve.high:.2f} "
          f"req/s, 3x bursts at {bursts}; highest rate {args.peak_share:.0%} of the {inventory_rate(fleet):.2f} req/s "
          "the inventory holds at the SLO")
    print_options(fleet)

    initial = static_plan(fleet, curve.base(0.0), headroom=settings.headroom)
    replay = Replay(scenario, fleet, settings, times, seed=args.seed, startup_s=args.startup_s, autoscale=True,
                    initial=initial, policy=args.policy, verbose=args.verbose)
    replay.run(duration)
    auto_wall = time.perf_counter() - wall

    peak = window_peak(times, 0.0, duration)
    hindsight = static_plan(fleet, peak, headroom=0.0)
    statics = {"hindsight-optimal static (peak, no headroom)": hindsight,
               f"peak-provisioned static (peak + {settings.headroom:.0%} headroom)":
                   static_plan(fleet, peak, headroom=settings.headroom)}
    lower = lower_bound(fleet, times, duration)

    met = replay.met()
    in_first_minute = first_minutes(times)
    print(f"\nautoscaled replay: {duration / auto_wall:.0f}x faster than real time ({auto_wall:.0f} s wall)")
    print_attainment(times, met, int(replay.failed.sum()))
    cost = replay.cost()
    print(f"  cost: ${cost:.2f} for {duration / HOUR:.2g} h (${cost / (duration / HOUR):.2f}/h on average)")
    print(f"  lower bound (optimal plan per 5 min, no headroom, instant moves): ${lower:.2f} "
          f"(autoscaler {cost / lower:.2f}x)")
    replayed: dict[tuple[tuple[OptionKey, int], ...], str] = {}
    for name, counts in statics.items():
        static_cost = plan_cost(fleet, counts) * duration / HOUR
        line = (f"  {name}: {sum(counts.values())} replicas, ${static_cost:.2f} "
                f"(autoscaler {cost / static_cost:.2f}x)")
        plan = tuple(sorted(counts.items()))
        if not args.skip_static and plan not in replayed:
            fixed = Replay(scenario, fleet, settings, times, seed=args.seed, startup_s=0.0, autoscale=False,
                           initial=counts, policy=args.policy)
            fixed.run(duration)
            fm = fixed.met()
            replayed[plan] = (f"; replayed: SLO {fm.mean():.2%} overall, {fm[~in_first_minute].mean():.2%} outside "
                              "burst starts")
        print(line + replayed.get(plan, ""))
    applied = [e for e in replay.events if e[3] != "initial"]
    flapped = print_events(applied, hours=duration / HOUR, window=settings.scale_down_stabilization_s)
    print_reactions(applied, replay.ready_log, curve, duration=duration)
    print(Targets().report(outside=float(met[~in_first_minute].mean()), overall=float(met.mean()),
                           cost_ratio=cost / (plan_cost(fleet, hindsight) * duration / HOUR), flaps=flapped))


if __name__ == "__main__":
    report.main(main, section="autoscale_replay")
