"""The autoscaler benchmarks' shared trace, fleet and report: a 2-hour diurnal curve with two 3× bursts.

Used by ``autoscale_replay.py`` (discrete-event, simulated time) and
``autoscale_live.py`` (``hetsched autoscale`` over HTTP, time-compressed), so
both report the same figures the same way. The rates are sized from the step
model: each replica's SLO capacity comes from the simulator's search, and the
curve's highest rate is a share of what the whole inventory holds at the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from hetsched.autoscale.fleet import Fleet
from hetsched.catalog import Device, load_catalog
from hetsched.optimizer.build import Demand, Problem
from hetsched.optimizer.explain import max_demand_scale
from hetsched.optimizer.solve import solve
from hetsched.optimizer.spec import CapacityEntry, ClusterSpec, ModelSpec, PoolSpec, WorkloadSpec
from hetsched.perf.correction import StepCorrection, corrected
from hetsched.perf.roofline import RooflineModel
from hetsched.sim.capacity import DEFAULT_SEEDS, Capacity, device_capacity, find_capacity
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import load_model
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO, LengthDistribution, Workload

HOUR = 3600.0
DAY_S = 2 * HOUR
BURSTS = ((1800.0, 600.0), (4800.0, 600.0))
"""(start, duration) of the 3× bursts, seconds into the trace."""
BURST_FACTOR = 3.0
TROUGH = 0.25
"""The diurnal curve's trough as a share of its peak."""
PEAK_SHARE = 0.6
"""The trace's highest rate (a burst on the diurnal peak's flank) as a share of what the inventory holds at the
SLO: bursts spill past the cheapest types onto dearer ones, and the peak minute plus headroom still fits."""
Event = tuple[float, OptionKey, int, str]
"""(time, option, +n started / −n stopped, the decision's reason)."""


Bursts = tuple[tuple[float, float], ...]
"""(start, duration) of each burst, seconds into the trace."""


@dataclass(frozen=True)
class Curve:
    """The demand: a diurnal curve from ``low`` to ``high`` req/s and back over ``day_s``, ×3 in ``bursts``."""

    low: float
    high: float
    day_s: float = DAY_S
    bursts: Bursts = BURSTS

    def base(self, t: float) -> float:
        """Diurnal curve: one trough-to-peak-to-trough day squeezed into the trace."""
        return self.low + (self.high - self.low) * (1 - math.cos(2 * math.pi * t / self.day_s)) / 2

    def rate(self, t: float) -> float:
        burst = any(start <= t < start + length for start, length in self.bursts)
        return self.base(t) * (BURST_FACTOR if burst else 1.0)

    @classmethod
    def sized(cls, fleet: Fleet, *, peak_share: float = PEAK_SHARE, day_s: float = DAY_S,
              bursts: Bursts = BURSTS) -> Curve:
        """The curve whose highest rate (over the whole trace) is ``peak_share`` of what ``fleet``'s inventory holds."""
        unit = cls(TROUGH, 1.0, day_s, bursts)
        highest = max(unit.rate(float(t)) for t in np.arange(0.0, day_s, 1.0))
        high = peak_share * inventory_rate(fleet) / highest
        return cls(TROUGH * high, high, day_s, bursts)


def arrivals(duration: float, curve: Curve, *, seed: int) -> np.ndarray:
    """Inhomogeneous Poisson arrivals by thinning."""
    rng = np.random.default_rng(seed)
    peak = BURST_FACTOR * curve.high
    n = rng.poisson(peak * duration * 1.05)
    times = np.sort(rng.uniform(0, duration, n))
    keep = rng.uniform(0, peak, n) < np.array([curve.rate(t) for t in times])
    return times[keep]


@dataclass(frozen=True)
class Scenario:
    """One model, its SLO and length mix, and the inventory: (pool, accelerator, GPUs), one node each."""

    model: str
    slo: SLO
    workload: Workload
    pools: tuple[tuple[str, str, int], ...]

    def capacities(self, *, seeds: Sequence[int] = DEFAULT_SEEDS,
                   speeds: Mapping[str, StepCorrection] | None = None) -> list[CapacityEntry]:
        """SLO capacity per accelerator at its smallest workable TP (the simulator's search over ``seeds``);
        ``speeds`` (by accelerator) searches on the step model under that correction."""
        found = (self.capacity(acc, seeds=seeds, speed=(speeds or {}).get(acc)) for _, acc, _ in self.pools)
        return [entry for entry in found if entry is not None]

    def capacity(self, accelerator: str, *, seeds: Sequence[int] = DEFAULT_SEEDS,
                 speed: StepCorrection | None = None) -> CapacityEntry | None:
        """One accelerator's SLO capacity at its smallest workable TP, its step model under ``speed`` when given
        (a device that runs other than the catalog says); None when none meets the SLO."""
        find = partial(find_capacity, seeds=seeds) if speed is None else partial(_find_at_speed, seeds=seeds,
                                                                                speed=speed)
        found = device_capacity(load_model(self.model), Device.whole(load_catalog().get(accelerator)),
                                workload=self.workload, slo=self.slo, find=find)
        if found.capacity is None or found.tp is None:
            return None
        return CapacityEntry(model=self.model, device=accelerator, tp=found.tp,
                             requests_per_s=found.capacity.requests_per_s)

    def cluster(self, capacities: list[CapacityEntry], *, name: str = "replay", min_replicas: int = 1) -> ClusterSpec:
        return ClusterSpec(
            name=name,
            pools=[PoolSpec(name=pool, accelerator=acc, nodes=1, max_gpus=gpus) for pool, acc, gpus in self.pools],
            models=[ModelSpec(name=self.model, slo=self.slo, min_replicas=min_replicas,
                              workload=WorkloadSpec(rate_rps=1.0, distribution=self.workload))],
            capacities=capacities)


def _find_at_speed(model: ModelArch, device: Device, *, tp: int, workload: Workload, slo: SLO, engine: EngineConfig,
                   seeds: Sequence[int], speed: StepCorrection, **_: object) -> Capacity:
    """The capacity search on the roofline under ``speed`` (what else the caller passes is for the default finder)."""
    return find_capacity(model, device, tp=tp, workload=workload, slo=slo, engine=engine, seeds=seeds,
                         step_model=corrected(RooflineModel(model, device, tp=tp, engine=engine), speed))


LIVE_8B = Scenario(
    "llama-3.1-8b", SLO(ttft_ms=2000, tpot_ms=100),
    Workload(name="rag-8b", input_len=LengthDistribution.lognormal(p50=1024, p99=4096, max_tokens=6144),
             output_len=LengthDistribution.lognormal(p50=256, p99=1024, max_tokens=1536)),
    pools=(("t4", "t4", 2), ("a30", "a30", 1), ("a10g", "a10g", 4)))
"""The live replay's: an 8B model on small accelerators, so two cores can serve it time-compressed. One T4 pair
(the cheapest per unit, at TP=2), one A30, four A10G: bursts spill onto the dearer types."""


def print_options(fleet: Fleet) -> None:
    for o in sorted(fleet.options, key=lambda o: o.price_per_hour / max(o.capacity.values())):
        cap = max(o.capacity.values())
        print(f"  {o.key.device:>10} TP={o.key.tp}: {cap:6.2f} req/s at SLO, ${o.price_per_hour:6.2f}/h, "
              f"${o.price_per_hour / cap:5.2f} per req/s·h, {int(fleet.pool_gpus[o.pool] // o.gpus)} fit")


# --- baselines -------------------------------------------------------------------

def _at_rate(fleet: Fleet, rate: float, *, headroom: float) -> Problem:
    """The fleet's placement problem with ``rate`` req/s of its one model, split over its buckets as planned."""
    problem = fleet.problem
    (model,) = fleet.models
    shares = {b.label: b.share for b in model.buckets}
    demands = tuple(Demand(d.model, d.role, d.bucket, rate * shares[d.bucket]) for d in problem.demands)
    return replace(problem, demands=demands, headroom=headroom,
                   models=tuple(replace(m, demand_rps=rate) for m in problem.models))


def inventory_rate(fleet: Fleet) -> float:
    """The most req/s of the fleet's one model its whole inventory holds at the SLO (no headroom)."""
    return max_demand_scale(_at_rate(fleet, 1.0, headroom=0.0))


def static_plan(fleet: Fleet, rate: float, *, headroom: float) -> dict[OptionKey, int]:
    """The cheapest static placement (the optimizer's MILP) for ``rate`` req/s of the fleet's one model."""
    problem = _at_rate(fleet, rate, headroom=headroom)
    solution = solve(problem)
    if not solution.found:
        raise SystemExit(f"no static plan holds {rate:.1f} req/s on this inventory")
    return solution.counts(problem)


def plan_cost(fleet: Fleet, counts: dict[OptionKey, int]) -> float:
    prices = {o.key: o.price_per_hour for o in fleet.options}
    return sum(n * prices[k] for k, n in counts.items())


def window_peak(times: np.ndarray, start: float, end: float, window: float = 60.0) -> float:
    inside = times[(times >= start) & (times < end)]
    if not len(inside):
        return 0.0
    edges = np.arange(start, end + window, window)
    return float(np.histogram(inside, edges)[0].max() / window)


def lower_bound(fleet: Fleet, times: np.ndarray, duration: float) -> float:
    """Cost of the optimal plan per 5-minute window (no headroom, instant moves): a bound, not a policy."""
    return sum(plan_cost(fleet, static_plan(fleet, max(window_peak(times, t, t + 300.0), 0.01), headroom=0.0))
               * 300.0 / HOUR for t in np.arange(0.0, duration, 300.0))


# --- the report ------------------------------------------------------------------

def first_minutes(times: np.ndarray, bursts: Bursts = BURSTS) -> np.ndarray:
    """Requests that arrived in the first minute of a burst (detection plus start-up; excluded from the bar)."""
    inside = np.zeros(len(times), dtype=bool)
    for start, _ in bursts:
        inside |= (times >= start) & (times < start + 60.0)
    return inside


def print_attainment(times: np.ndarray, met: np.ndarray, failed: int, *, bursts: Bursts = BURSTS) -> None:
    """SLO attainment overall, outside and inside the first minute of each burst, and by period."""
    first = first_minutes(times, bursts)
    inside = f"{met[first].mean():.2%}" if first.any() else "none"
    print(f"  SLO attainment: {met.mean():.2%} overall, {met[~first].mean():.2%} outside the first minute "
          f"of each burst, {inside} inside it; {failed} refused or failed")
    periods = [("before the first burst", 0.0, bursts[0][0])]
    for n, (start, length) in enumerate(bursts, 1):
        periods += [(f"burst {n}, minute 1", start, start + 60), (f"burst {n}, minutes 2-3", start + 60, start + 180),
                    (f"burst {n}, rest", start + 180, start + length),
                    (f"after burst {n}, 10 min", start + length, start + length + 600)]
    periods.append(("after that", bursts[-1][0] + bursts[-1][1] + 600, math.inf))
    shares = []
    for name, low, high in periods:
        inside = (times >= low) & (times < high)
        if inside.any():
            shares.append(f"{name} {met[inside].mean():.2%}")
    print("    by period: " + "; ".join(shares))


def flaps(events: list[Event], window: float) -> int:
    """Up, then down, then up again of the model's replica total within ``window`` seconds (moves to a re-solved
    plan, which add before they remove at constant capacity, are not scaling)."""
    moves: list[tuple[float, int]] = []
    for t, _, n, reason in events:
        if reason == "move-to-plan":
            continue
        if moves and moves[-1][0] == t:
            moves[-1] = (t, moves[-1][1] + n)
        else:
            moves.append((t, n))
    signs = [(t, 1 if n > 0 else -1) for t, n in moves if n]
    return sum(1 for (t1, a), (_, b), (t3, c) in zip(signs, signs[1:], signs[2:])
               if a > 0 > b and c > 0 and t3 - t1 < window)


def print_events(events: list[Event], *, hours: float, window: float) -> int:
    """Replicas started and stopped, rounds, and the up-down-up flaps (returned)."""
    starts = sum(n for _, _, n, _ in events if n > 0)
    stops = -sum(n for _, _, n, _ in events if n < 0)
    rounds = len({t for t, _, _, _ in events})
    move_rounds = len({t for t, _, _, reason in events if reason == "move-to-plan"})
    flapped = flaps(events, window)
    print(f"  scale events: {starts} replicas started, {stops} stopped, in {rounds} rounds "
          f"({rounds / hours:.1f} rounds/h, {(starts + stops) / hours:.1f} replica changes/h; "
          f"{move_rounds} rounds were moves to a re-solved plan); up-down-up flaps within "
          f"{window:.0f} s: {flapped}")
    return flapped


def print_reactions(events: list[Event], ready_log: list[tuple[float, float]], curve: Curve, *,
                    duration: float) -> None:
    """Per burst: the first scale-up after it starts, and when Ready capacity first covers its rate."""
    for start, _ in curve.bursts:
        if start >= duration:
            continue
        first_up = next((t for t, _, n, _ in events if n > 0 and t > start), math.nan)
        need = curve.rate(start)
        covered = next((t for t, held in ready_log if t >= start and held >= need), math.nan)
        print(f"  burst at {start / 60:.0f} min (to {need:.1f} req/s): first scale-up after {first_up - start:.0f} s, "
              f"Ready capacity covers it after {covered - start:.0f} s")
