"""Replay a 2-hour demand trace (diurnal curve plus two 3× bursts) against an autoscaled heterogeneous fleet.

    .venv/bin/python benchmarks/autoscale_replay.py            # about three minutes on two cores

A discrete-event replay in simulated time, so two hours run in minutes on a
CPU (time compression ≈ 40×) without wall-clock jitter in the latencies:

* each replica is the shared continuous-batching :class:`~hetsched.sim.scheduler.Scheduler`
  timed by the roofline step model (what ``hetsched sim-worker`` runs), and
  exports vLLM's counters and histograms (vLLM's bucket bounds);
* every request is routed by the router's own decision function
  (``hetsched.router.policy.decide``; ``--policy``, least-request by default,
  with engine signals refreshed every second and the router's queue limit, so
  overload is a 429);
* the autoscaler is :class:`~hetsched.autoscale.loop.Autoscaler` — the loop
  ``hetsched autoscale`` runs — with an applier that starts replicas (Ready
  after ``--startup-s``) and stops them (drained), and a metrics source of which
  2 % of scrapes fail.

Reports SLO attainment (overall, outside and inside the first minute of each
burst), cost against two static plans solved with hindsight of the peak and
the sum of per-5-minute optimal plans (a lower bound no autoscaler reaches),
scale events per hour and up-down-up flaps, and reaction time to each burst.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from _autoscale_trace import (BURSTS, HOUR, LIVE_8B, Event, Scenario, arrivals, base_rate, first_minutes, lower_bound,
                              plan_cost, print_attainment, print_events, print_options, print_reactions, static_plan,
                              window_peak)
from hetsched.autoscale.fleet import Fleet, build_fleet
from hetsched.autoscale.loop import Autoscaler, Replica
from hetsched.autoscale.policy import Reason
from hetsched.autoscale.settings import AutoscaleSettings
from hetsched.autoscale.signals import PodSample
from hetsched.catalog import Device, load_catalog
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.optimizer.build import OptionKey
from hetsched.router.policy import decide as route
from hetsched.router.profiles import roofline_profile
from hetsched.router.types import Endpoint, EndpointView, Policy, RouteRequest
from hetsched.sim.capacity import Replica as SimReplicaSpec
from hetsched.sim.scheduler import Request, Scheduler, SchedulerOutput
from hetsched.simworker.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from hetsched.specs.registry import load_model
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
MAX_QUEUE = 64
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
    """The event loop: arrivals, engine steps, signal refreshes and autoscaler rounds."""

    def __init__(self, scenario: Scenario, fleet: Fleet, settings: AutoscaleSettings, times: np.ndarray, *,
                 seed: int,
                 startup_s: float, autoscale: bool, initial: dict[OptionKey, int], policy: Policy,
                 verbose: bool = False) -> None:
        self.fleet, self.settings, self.startup_s, self.verbose = fleet, settings, startup_s, verbose
        self.policy = policy
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
        spec = _spec(self.arch, device, tp, self.scenario.workload)
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
        self.events[applied:] = [(t, k, n, reason.get(k[0], "")) for t, k, n, _ in self.events[applied:]]
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
                              kv_usage=1 - r.scheduler.free_blocks / r.scheduler.num_blocks, max_queue=MAX_QUEUE)

    def _on_arrival(self, i: int) -> None:
        self.next_arrival = i + 1
        if i + 1 < len(self.arrival):
            self._push(float(self.arrival[i + 1]), "arrival", i + 1)
        ready = [r for r in self.replicas_() if self.now >= r.ready_at]
        views = {r.name: replace(r.view, in_flight=r.in_flight, in_flight_prompt_tokens=r.prompt_in_flight,
                                 in_flight_max_tokens=r.max_tokens_in_flight) for r in ready if r.view is not None}
        slo = self.scenario.slo
        request = RouteRequest(model=self.scenario.model, prompt_tokens=int(self.inputs[i]),
                               max_tokens=int(self.outputs[i]), slo=slo)
        decision = route(self.policy, request, list(views.values()), slo=slo, headroom=0.8,
                         profiles={r.name: roofline_profile(r.endpoint.model, r.endpoint.accelerator, r.endpoint.tp)
                                   for r in ready})
        if decision.endpoint is None:
            self.failed[i] = True
            return
        replica = next(r for r in ready if r.name == decision.endpoint.url)
        replica.scheduler.add_request(Request(i, int(self.inputs[i]), int(self.outputs[i])))
        replica.in_flight += 1
        replica.prompt_in_flight += int(self.inputs[i])
        replica.max_tokens_in_flight += int(self.outputs[i])
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
        self._step(r)

    def _done(self, r: SimReplica, i: int, *, failed: bool) -> None:
        self.failed[i] |= failed
        r.in_flight -= 1
        r.prompt_in_flight -= int(self.inputs[i])
        r.max_tokens_in_flight -= int(self.outputs[i])
        if r.stopping and r.in_flight == 0:
            r.ended = self.now

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


_SPECS: dict[tuple[str, int], SimReplicaSpec] = {}


def _spec(arch: object, device: Device, tp: int, workload: Workload) -> SimReplicaSpec:
    key = (device.id, tp)
    if key not in _SPECS:
        _SPECS[key] = SimReplicaSpec.build(arch, device, tp=tp, workload=workload)  # type: ignore[arg-type]
    return _SPECS[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="70b",
                        help="70b: the headline; live: autoscale_live.py's model, workload and inventory "
                             "(run it with --low 0.3 --high 1.0)")
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--low", type=float, default=2.0, help="trough of the diurnal curve, req/s")
    parser.add_argument("--high", type=float, default=8.0, help="peak of the diurnal curve, req/s")
    parser.add_argument("--startup-s", type=float, default=30.0, help="seconds until a new replica is Ready")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--headroom", type=float, default=AutoscaleSettings().headroom,
                        help="capacity over demand, for the autoscaler and the peak-provisioned plan")
    parser.add_argument("--skip-static", action="store_true", help="do not replay the static plans")
    parser.add_argument("--verbose", action="store_true", help="print every decision that is not steady")
    parser.add_argument("--policy", type=Policy, default=Policy.LEAST_REQUEST, choices=list(Policy),
                        help="the router's policy")
    args = parser.parse_args()
    wall = time.perf_counter()
    duration = args.hours * HOUR
    scenario = SCENARIOS[args.scenario]
    fleet = build_fleet(scenario.cluster(scenario.capacities()), load_catalog())
    settings = AutoscaleSettings(headroom=args.headroom)
    times = arrivals(duration, low=args.low, high=args.high, seed=args.seed)
    print(f"trace: {len(times)} requests over {duration / HOUR:.1f} h, diurnal {args.low}-{args.high} req/s, "
          f"3x bursts at {', '.join(f'{s / 60:.0f} min' for s, _ in BURSTS)}")
    print_options(fleet)

    initial = static_plan(fleet, base_rate(0.0, low=args.low, high=args.high), headroom=settings.headroom)
    replay = Replay(scenario, fleet, settings, times, seed=args.seed, startup_s=args.startup_s, autoscale=True,
                    initial=initial, policy=args.policy, verbose=args.verbose)
    replay.run(duration)
    auto_wall = time.perf_counter() - wall

    peak = window_peak(times, 0.0, duration)
    statics = {"hindsight-optimal static (peak, no headroom)": static_plan(fleet, peak, headroom=0.0),
               f"peak-provisioned static (peak + {settings.headroom:.0%} headroom)":
                   static_plan(fleet, peak, headroom=settings.headroom)}
    lower = lower_bound(fleet, times, duration)

    met = replay.met()
    in_first_minute = first_minutes(times)
    print(f"\nautoscaled replay: {duration / auto_wall:.0f}x faster than real time ({auto_wall:.0f} s wall)")
    print_attainment(times, met, int(replay.failed.sum()))
    cost = replay.cost()
    print(f"  cost: ${cost:.2f} for {duration / HOUR:.1f} h (${cost / (duration / HOUR):.2f}/h on average)")
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
                           initial=counts,
                           policy=args.policy)
            fixed.run(duration)
            fm = fixed.met()
            replayed[plan] = (f"; replayed: SLO {fm.mean():.2%} overall, {fm[~in_first_minute].mean():.2%} outside "
                              "burst starts")
        print(line + replayed.get(plan, ""))
    applied = [e for e in replay.events if e[3] != "initial"]
    print_events(applied, hours=duration / HOUR, window=settings.scale_down_stabilization_s)
    print_reactions(applied, replay.ready_log, low=args.low, high=args.high, duration=duration)

if __name__ == "__main__":
    report.main(main, section="autoscale_replay")
