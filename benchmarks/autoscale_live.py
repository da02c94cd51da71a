"""Replay the autoscaler's 2-hour trace live: ``hetsched autoscale --config FILE`` over HTTP, time-compressed.

    .venv/bin/python benchmarks/autoscale_live.py                                           # about 45 minutes
    .venv/bin/python benchmarks/autoscale_live.py --hours 0.25 --minutes 2.5 --skip-static   # a short run
    .venv/bin/python benchmarks/autoscale_live.py --quick                                   # a smoke run, seconds

The same trace as ``autoscale_replay.py`` (diurnal curve plus two 3× bursts),
but nothing is simulated in this process: it writes an autoscale file (the
cluster inline, three accelerator types, the local applier), starts
``hetsched autoscale --config FILE -o json`` as a child process — simulated
vLLM workers started and stopped by the local applier behind the real router,
time running ``time_scale`` times faster than the wall clock — and sends
the trace as open-loop Poisson streaming requests to that router over HTTP.
TTFT and TPOT are measured by the client and converted to simulated time
(wall × time scale); replicas over time, cost, scale events and reaction
times come from the JSON rounds the command prints.

On two cores the wall request rate is kept to tens per second: an 8B model on
small accelerators, a low request rate, a compression of about 6×, and
engines that run decode steps shorter than ``--min-step-wall-s`` several at
once. The rates are sized from the step model as in ``autoscale_replay.py``:
the trace's highest rate is ``--peak-share`` of what the inventory holds at
the SLO. Whether the machine kept up is reported, not assumed: how late the
load generator sent arrivals, and the same run with a static fleet provisioned
for the peak (the autoscaler pinned by min = max replicas), whose misses are
the machine's and the engines', not the policy's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import yaml

from _autoscale_trace import (BURSTS, HOUR, LIVE_8B, PEAK_SHARE, Curve, Event, Scenario, arrivals, first_minutes,
                              inventory_rate, lower_bound, plan_cost, print_attainment, print_events, print_options,
                              print_reactions, static_plan, window_peak)
from _loadgen import Outcome, stream_once
from hetsched.autoscale.fleet import Fleet, build_fleet
from hetsched.catalog import load_catalog
from hetsched.optimizer.spec import Role
from hetsched.router.types import Policy
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.simworker.launch import free_port
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO
import report

SCENARIO = LIVE_8B
MODEL = SCENARIO.model
STARTUP_S = 30.0
DRAIN_S = 30.0


@dataclass(frozen=True)
class Length:
    """How much of the trace runs, and in how many wall minutes."""

    hours: float
    minutes: float


FULL = Length(2.0, 20.0)
QUICK = Length(0.02, 0.1)
"""The trace's first 72 s in 6 wall seconds, through ``hetsched autoscale`` and its workers as in a full run; the
figures are not the benchmark's."""


@dataclass
class Run:
    """What one live run measured, on the trace's clock (simulated seconds since its first arrival)."""

    outcomes: list[Outcome]
    lateness_s: np.ndarray
    """How late each request was sent against its arrival time (simulated seconds)."""
    rounds: list[tuple[float, dict]] = field(default_factory=list)
    """(trace time the round was read, the JSON object) per round."""
    errors: str = ""


def autoscale_file(scenario: Scenario, capacities: list, workers: dict[OptionKey, int], *, port: int, policy: Policy,
                   time_scale: float, min_step_wall_s: float, settings: dict, pinned: bool) -> dict:
    """The ``hetsched autoscale`` file: the cluster inline, the local applier, the starting workers."""
    total = sum(workers.values())
    cluster = scenario.cluster(capacities, name="autoscale-live", min_replicas=total if pinned else 1)
    return {
        "cluster": cluster.model_dump(mode="json", exclude_none=True),
        **({"max_replicas": {scenario.model: total}} if pinned else {}),
        "autoscale": {**settings, **({"resolve_interval_s": 0} if pinned else {})},
        "applier": {"kind": "local", "time_scale": time_scale, "startup_s": STARTUP_S, "drain_s": DRAIN_S,
                    "min_step_wall_s": min_step_wall_s},
        "router": {"port": port, "policy": policy.value},
        "workers": [{"model": k.model, "pool": k.pool, "device": k.device, "tp": k.tp, "replicas": n}
                    for k, n in sorted(workers.items()) if n],
    }


async def _wait_ready(client: httpx.AsyncClient, url: str, count: int, process: subprocess.Popen,
                      timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"hetsched autoscale exited with {process.returncode}")
        try:
            endpoints = (await client.get(f"{url}/router/endpoints")).json()["endpoints"]
            if len(endpoints) >= count:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.2)
    raise SystemExit(f"the router did not list {count} Ready endpoints within {timeout:.0f} s")


async def _drive(url: str, times: np.ndarray, inputs: np.ndarray, outputs: np.ndarray, *, time_scale: float,
                 ready: int, process: subprocess.Popen, started: list[float]) -> tuple[list[Outcome], np.ndarray]:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await _wait_ready(client, url, ready, process)
        t0 = time.monotonic()
        started.append(t0)
        tasks = []
        planned = t0 + times / time_scale
        for i, at in enumerate(planned):
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_once(client, url, model=MODEL, prompt_tokens=int(inputs[i]),
                                                         max_tokens=int(outputs[i]))))
        outcomes = list(await asyncio.gather(*tasks))
    lateness = (np.array([o.sent for o in outcomes]) - planned) * time_scale
    return outcomes, lateness


def run_live(config: dict, times: np.ndarray, inputs: np.ndarray, outputs: np.ndarray, *, time_scale: float) -> Run:
    """Start ``hetsched autoscale`` on ``config``, send the trace through its router, stop it; what was measured."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "autoscale.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = open(Path(tmp) / "stderr.log", "w+")
        process = subprocess.Popen([sys.executable, "-m", "hetsched", "autoscale", "--config", str(path), "-o", "json"],
                                   stdout=subprocess.PIPE, stderr=log, text=True)
        received: list[tuple[float, dict]] = []

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith("{"):
                    received.append((time.monotonic(), json.loads(line)))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        started: list[float] = []
        try:
            url = f"http://127.0.0.1:{config['router']['port']}"
            ready = sum(w["replicas"] for w in config["workers"])
            outcomes, lateness = asyncio.run(_drive(url, times, inputs, outputs, time_scale=time_scale, ready=ready,
                                                    process=process, started=started))
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
            reader.join(5)
            log.seek(0)
            errors = log.read()
            log.close()
    t0 = started[0]
    return Run(outcomes, lateness, [((at - t0) * time_scale, obj) for at, obj in received],
               errors=errors[errors.find("Traceback"):] if "Traceback" in errors else "")


# --- from the JSON rounds to replicas, cost and events -------------------------------

def _placement(obj: dict) -> dict[OptionKey, tuple[int, int]]:
    return {(obj["model"], r["pool"], r["device"], r["tp"], Role.UNIFIED): (r["replicas"], r["ready"])
            for r in obj["replicas"]}


def replicas_over_time(run: Run, fleet: Fleet, duration: float) -> tuple[float, list[Event],
                                                                             list[tuple[float, float]]]:
    """Cost of the replicas asked for (starting ones included) over ``[0, duration]``, the applied changes, and
    (time, Ready capacity) after each round."""
    prices = {o.key: o.price_per_hour for o in fleet.options}
    capacity = {o.key: max(o.capacity.values()) for o in fleet.options}
    cost, events, ready_log = 0.0, [], []
    previous: dict[OptionKey, tuple[int, int]] | None = None
    rounds = run.rounds
    for n, (t, obj) in enumerate(rounds):
        placement = _placement(obj)
        end = rounds[n + 1][0] if n + 1 < len(rounds) else duration
        span = max(0.0, min(end, duration) - max(t, 0.0))
        cost += sum(c[0] * prices[k] for k, c in placement.items()) * span / HOUR
        if previous is not None and t >= 0:
            for key in sorted(set(placement) | set(previous)):
                delta = placement.get(key, (0, 0))[0] - previous.get(key, (0, 0))[0]
                if delta:
                    events.append((t, key, delta, obj["reason"]))
        ready_log.append((t, sum(c[1] * capacity[k] for k, c in placement.items())))
        previous = placement
    return cost, events, ready_log


def met(run: Run, slo: SLO, *, time_scale: float) -> np.ndarray:
    ttft = np.array([o.ttft for o in run.outcomes]) * time_scale
    tpot = np.array([o.tpot if o.tokens > 1 else 0.0 for o in run.outcomes]) * time_scale
    ok = np.array([o.ok for o in run.outcomes])
    with np.errstate(invalid="ignore"):
        return ok & (ttft * 1e3 <= slo.ttft_ms) & (tpot * 1e3 <= slo.tpot_ms)


def print_machine(run: Run, *, time_scale: float) -> None:
    """Whether the machine kept up: the load generator's lateness."""
    late = run.lateness_s
    print(f"  load generator lateness (simulated s): p50 {np.percentile(late, 50):.3f}, "
          f"p99 {np.percentile(late, 99):.3f}, max {late.max():.2f}; "
          f"{(late > 0.1 * time_scale).mean():.2%} sent more than 0.1 s (wall) late")
    if run.errors:
        print(f"  hetsched autoscale errors:\n{run.errors[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, help=f"simulated length of the trace (default {FULL.hours:g}; "
                                                     f"--quick {QUICK.hours:g})")
    parser.add_argument("--minutes", type=float, help=f"wall minutes the trace is compressed into (default "
                                                       f"{FULL.minutes:g}; --quick {QUICK.minutes:g})")
    parser.add_argument("--peak-share", type=float, default=PEAK_SHARE,
                        help="the trace's highest rate as a share of what the inventory holds at the SLO")
    parser.add_argument("--min-step-wall-s", type=float, default=0.1,
                        help="engines run decode steps shorter than this (wall) several at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--headroom", type=float, default=AutoscaleSettings().headroom,
                        help="capacity over demand, for the autoscaler and the peak-provisioned plan")
    parser.add_argument("--skip-static", action="store_true", help="do not run the static fleet")
    parser.add_argument("--policy", type=Policy, default=Policy.LEAST_REQUEST, choices=list(Policy),
                        help="the router's policy")
    parser.add_argument("--quick", action="store_true",
                        help=f"the trace's first {QUICK.hours * HOUR:.0f} s in {QUICK.minutes * 60:.0f} wall seconds, "
                             "capacities from one seed's search, no static fleet: a smoke run")
    args = parser.parse_args()
    length = QUICK if args.quick else FULL
    duration = (args.hours or length.hours) * HOUR
    minutes = args.minutes or length.minutes
    time_scale = duration / (minutes * 60)
    capacities = SCENARIO.capacities(seeds=(0,)) if args.quick else SCENARIO.capacities()
    fleet = build_fleet(SCENARIO.cluster(capacities), load_catalog())
    curve = Curve.sized(fleet, peak_share=args.peak_share)
    times = arrivals(duration, curve, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    inputs = SCENARIO.workload.input_len.sample(rng, len(times))
    outputs = SCENARIO.workload.output_len.sample(rng, len(times))
    peak = window_peak(times, 0.0, duration)
    bursts = ", ".join(f"{s / 60:.0f} min" for s, _ in BURSTS if s < duration) or "none"
    print(f"trace: {len(times)} requests over {duration / HOUR:.2g} h, diurnal {curve.low:.2f}-{curve.high:.2f} "
          f"req/s, 3x bursts at {bursts}; "
          f"highest rate {args.peak_share:.0%} of the {inventory_rate(fleet):.2f} req/s the inventory holds at the "
          f"SLO; {MODEL}, SLO P99 TTFT {SCENARIO.slo.ttft_ms:.0f} ms / TPOT {SCENARIO.slo.tpot_ms:.0f} ms")
    print(f"live: time x{time_scale:.1f} ({minutes:.2g} wall minutes), peak minute {peak:.1f} req/s = "
          f"{peak * time_scale:.0f} req/s on the wall clock; decode steps under {args.min_step_wall_s * 1e3:.0f} ms "
          f"wall ({args.min_step_wall_s * time_scale * 1e3:.0f} ms simulated) run several at once")
    print_options(fleet)

    settings = {"headroom": args.headroom}
    initial = static_plan(fleet, curve.base(0.0), headroom=args.headroom)
    config = autoscale_file(SCENARIO, capacities, initial, port=free_port(), policy=args.policy,
                            time_scale=time_scale, min_step_wall_s=args.min_step_wall_s, settings=settings,
                            pinned=False)
    wall = time.perf_counter()
    live = run_live(config, times, inputs, outputs, time_scale=time_scale)
    wall = time.perf_counter() - wall
    cost, events, ready_log = replicas_over_time(live, fleet, duration)
    ok = met(live, SCENARIO.slo, time_scale=time_scale)
    print(f"\nautoscaled, live ({wall / 60:.1f} wall minutes; {len(live.rounds)} rounds):")
    print_attainment(times, ok, sum(not o.ok for o in live.outcomes))
    print_machine(live, time_scale=time_scale)
    print(f"  cost: ${cost:.2f} for {duration / HOUR:.2g} h (${cost / (duration / HOUR):.2f}/h on average)")
    lower = lower_bound(fleet, times, duration)
    print(f"  lower bound (optimal plan per 5 min, no headroom, instant moves): ${lower:.2f} "
          f"(autoscaler {cost / lower:.2f}x)")
    hindsight = static_plan(fleet, peak, headroom=0.0)
    provisioned = static_plan(fleet, peak, headroom=args.headroom)
    for name, counts in (("hindsight-optimal static (peak, no headroom)", hindsight),
                         (f"peak-provisioned static (peak + {args.headroom:.0%} headroom)", provisioned)):
        static_cost = plan_cost(fleet, counts) * duration / HOUR
        print(f"  {name}: {sum(counts.values())} replicas "
              f"({', '.join(f'{n} {k.device} TP={k.tp}' for k, n in sorted(counts.items()) if n)}), "
              f"${static_cost:.2f} (autoscaler {cost / static_cost:.2f}x)")
    window = AutoscaleSettings(headroom=args.headroom).scale_down_stabilization_s
    print_events(events, hours=duration / HOUR, window=window)
    print_reactions(events, ready_log, curve, duration=duration)

    if args.quick or args.skip_static:
        print("\nstatic fleet: not run (--quick or --skip-static)")
        return
    config = autoscale_file(SCENARIO, capacities, provisioned, port=free_port(), policy=args.policy,
                            time_scale=time_scale, min_step_wall_s=args.min_step_wall_s, settings=settings,
                            pinned=True)
    fixed = run_live(config, times, inputs, outputs, time_scale=time_scale)
    fixed_ok = met(fixed, SCENARIO.slo, time_scale=time_scale)
    fixed_events = replicas_over_time(fixed, fleet, duration)[1]
    print(f"\npeak-provisioned static fleet, live, same settings ({sum(provisioned.values())} replicas; "
          f"{len(fixed_events)} scale events):")
    print_attainment(times, fixed_ok, sum(not o.ok for o in fixed.outcomes))
    print_machine(fixed, time_scale=time_scale)
    first = first_minutes(times)
    print(f"  autoscaler vs this fleet: SLO outside burst starts {ok[~first].mean():.2%} vs "
          f"{fixed_ok[~first].mean():.2%}; both miss {(~ok & ~fixed_ok).sum()} requests, only the autoscaler "
          f"{(~ok & fixed_ok).sum()}, only the static fleet {(ok & ~fixed_ok).sum()}")


if __name__ == "__main__":
    report.main(main, section="autoscale_live")
