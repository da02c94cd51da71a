"""Unified against prefill/decode-disaggregated placement on a heterogeneous fleet, planned and then driven.

    .venv/bin/python benchmarks/pd_disagg.py [--rate 24] [--drive-rate 8] [--time-scale 2] [--no-drive]

For each workload shape (long prompt with a short answer, RAG, chat, long answer) the optimizer plans
Llama-3.1-8B at the same SLO twice on the same fleet (H100 SXM, A100 80GB, L40S, L4 pools), once with
unified replicas and once disaggregated, every capacity from the simulator's SLO search on the calibrated
step model (prefill replicas under the TTFT target less the KV transfer off the node; decode replicas with
the prompt's KV arriving; prefill capped by the network). Prints $/hour of both, the ratio unified /
disaggregated (above 1: disaggregation is cheaper), and where each plan put its replicas.

Then both plans of each shape are driven end to end: one ``hetsched sim-worker`` process per planned replica
(``--role`` as planned, ``--time-scale`` faster than the hardware), a ``hetsched route`` process over them with
the ``slo`` policy (a disaggregated plan is routed in two stages: prefill, KV handoff, decode), and a client
sending Poisson arrivals of streamed requests of that shape. Two CPU cores cannot play the --rate fleet's
token stream (tens of thousands of tokens a second), so the drive plans again at ``--drive-rate``: the same
optimizer, fleet and SLO, fewer replicas, driven at that rate and at ``--overload`` times it. The twins run at
``--time-scale`` 2 with decode runs of up to ``--min-step-ms`` 50 wall ms sharing one token event: faster, their
loops fall behind on two cores and the lag, multiplied by the scale, swamps the plans' latencies. Reported in
hardware time (wall × time scale): goodput (requests meeting both SLO targets per second of the offered window),
SLO attainment, P99 TTFT (client's request to first token) and TPOT, and requests lost. The router's and HTTP's
wall time counts × the time scale too, twice for a two-stage request: the "idle" column is the TTFT of a 16-token
request to the idle twins, mostly that.

``--quick``: the chat shape alone, capacities from one seed's search, and one drive of the disaggregated plan (the
two-stage path), planned at half of the smallest replica's SLO capacity in the unified plan (one replica per role),
with a few requests: every part in seconds, the figures not the benchmark's.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import httpx
import numpy as np

from _loadgen import Outcome, RouterProcess, pct, stream_once, wait_idle
from hetsched.catalog import load_catalog
from hetsched.optimizer.build import CapacityMemo, CapacitySource
from hetsched.optimizer.capacity import SimulatedCapacity
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.spec import ClusterSpec
from hetsched.sim.capacity import find_capacity
from hetsched.sim.roles import Role
from hetsched.simworker import WorkerProcess, WorkerSpec, spawn_worker
import report

SHAPES = {  # name: (prompt tokens, answer tokens)
    "long prompt, short answer": (4000, 100),
    "RAG": (2000, 300),
    "chat": (512, 256),
    "long answer": (256, 1500),
}
POOLS = [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "a100", "accelerator": "a100-80gb", "nodes": 1},
         {"name": "l40s", "accelerator": "l40s", "nodes": 2}, {"name": "l4", "accelerator": "l4", "nodes": 4}]
SLO = {"ttft_ms": 1500, "tpot_ms": 60}
MODEL = "llama-3.1-8b"
QUICK_SHAPE = "chat"
QUICK_REQUESTS = 6


def smallest_replica_rps(plan: Plan) -> float:
    """The SLO capacity of the plan's smallest replica, req/s."""
    return min(g.capacity_rps / g.replicas for m in plan.models for g in m.replicas)


def spec(shape: tuple[int, int], rate: float, disaggregation: str) -> ClusterSpec:
    return parse_cluster({"pools": POOLS, "solver": {"headroom": 0.1, "time_limit_s": 30},
                          "models": [{"name": MODEL, "slo": SLO, "disaggregation": disaggregation,
                                      "workload": {"rate_rps": rate, "input_tokens": shape[0],
                                                   "output_tokens": shape[1]}}]})


def placement(plan: Plan) -> str:
    groups = [g for m in plan.models for g in m.replicas]
    return ", ".join(f"{g.replicas}×{g.device}{'' if g.tp == 1 else f'/tp{g.tp}'} {g.role}" for g in groups)


Replica = tuple[str, int, Role]
"""Device, TP and role of one planned replica: what one sim-worker plays."""


def replicas(plan: Plan) -> list[Replica]:
    return [(g.device, g.tp, g.role) for m in plan.models for g in m.replicas for _ in range(g.replicas)]


class Twins:
    """Sim-worker processes by what they play, started as drives need them and kept for the next drive."""

    def __init__(self, *, scale: float, min_step_ms: float) -> None:
        self.scale, self.min_step_ms = scale, min_step_ms
        self.by_replica: dict[Replica, list[WorkerProcess]] = {}
        self.all: list[WorkerProcess] = []

    def take(self, wanted: list[Replica]) -> list[tuple[Replica, WorkerProcess]]:
        need = {r: wanted.count(r) - len(self.by_replica.get(r, [])) for r in set(wanted)}
        specs = [(r, WorkerSpec(model=MODEL, accelerator=r[0], tp=r[1], role=r[2], time_scale=self.scale,
                                min_step_wall_s=self.min_step_ms / 1e3))
                 for r, n in need.items() for _ in range(max(n, 0))]
        with ThreadPoolExecutor(max(len(specs), 1)) as pool:
            futures = [(r, pool.submit(spawn_worker, spec, timeout=180)) for r, spec in specs]
        for replica, future in futures:  # every one that started is stopped with the rest, even if one failed
            if future.exception() is None:
                self.by_replica.setdefault(replica, []).append(future.result())
                self.all.append(future.result())
        failed = [f.exception() for _, f in futures if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
        return [(r, self.by_replica[r][wanted[:i].count(r)]) for i, r in enumerate(wanted)]

    def stop(self) -> None:
        for worker in self.all:
            worker.process.terminate()
        for worker in self.all:
            worker.stop()


@dataclass
class Drive:
    """One drive of one plan, in hardware time."""

    goodput: float
    attained: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    lost: int


def router_config(workers: list[tuple[Replica, WorkerProcess]]) -> dict:
    return {"policy": "slo", "metrics_interval_s": 0.25, "health": {"check_interval_s": 0.5},
            "models": {MODEL: {"slo": SLO, "endpoints": [
                {"url": w.url, "accelerator": r[0], "tp": r[1], "role": str(r[2])} for r, w in workers]}}}


async def run_load(url: str, shape: tuple[int, int], *, rate: float, n: int, scale: float,
                   seed: int = 7) -> list[Outcome]:
    """``n`` streamed requests of ``shape``, Poisson at ``rate`` (hardware req/s)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=500)) as client:
        start = time.monotonic()
        tasks = []
        for at in arrivals:
            await asyncio.sleep(max(0.0, start + at / scale - time.monotonic()))
            tasks.append(asyncio.create_task(stream_once(client, url, model=MODEL, prompt_tokens=shape[0],
                                                         max_tokens=shape[1])))
        return list(await asyncio.gather(*tasks))


def summarize(outcomes: list[Outcome], *, rate: float, scale: float) -> Drive:
    """Goodput per hardware second of the offered window (``n / rate``), as ``router_policies.py`` counts it."""
    done = [o for o in outcomes if o.ok]
    good = [o for o in done if o.ttft * scale * 1e3 <= SLO["ttft_ms"]
            and (o.tokens < 2 or o.tpot * scale * 1e3 <= SLO["tpot_ms"])]
    return Drive(goodput=len(good) * rate / len(outcomes), attained=len(good) / len(outcomes),
                 ttft_p99_ms=pct([o.ttft * scale * 1e3 for o in done], 99),
                 tpot_p99_ms=pct([o.tpot * scale * 1e3 for o in done if o.tokens > 1], 99),
                 lost=len(outcomes) - len(done))


async def drive(plan: Plan, shape: tuple[int, int], twins: Twins, *, rates: list[float],
                n: int) -> tuple[list[Drive], float]:
    """The plan's replicas as twins behind a router, driven with ``n`` requests at each of ``rates``; and the TTFT
    of a 16-token request to the idle twins (hardware ms): mostly the router's and HTTP's wall time × the scale."""
    workers = twins.take(replicas(plan))
    router = RouterProcess(router_config(workers))
    results = []
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            probes = [await stream_once(client, router.url, model=MODEL, prompt_tokens=16, max_tokens=2)
                      for _ in range(5)]
            overhead = float(np.median([o.ttft for o in probes])) * twins.scale * 1e3
            for rate in rates:
                outcomes = await run_load(router.url, shape, rate=rate, n=n, scale=twins.scale)
                results.append(summarize(outcomes, rate=rate, scale=twins.scale))
                await wait_idle(client, [w.url for _, w in workers])
    finally:
        router.stop()
    return results, overhead


MODES = (("unified", "unified"), ("disaggregated", "prefill_decode"))
"""(label, the cluster file's disaggregation) of the two plans of a shape."""


def drives(args: argparse.Namespace, shapes: dict[str, tuple[int, int]], sources: dict[str, CapacitySource], *,
           drive_rate: float) -> None:
    catalog = load_catalog()
    loads = [1.0] if args.quick else [1.0, args.overload]
    modes = MODES[1:] if args.quick else MODES
    print(f"\ndriven through the router and twins: plans made again for {drive_rate:.3g} req/s, driven at "
          f"{' and '.join(f'{x:g}×' for x in loads)} that with {args.requests} requests each; time ×{args.time_scale:g}, "
          f"latencies in hardware time\n")
    print(f"{'workload':26} {'plan':14} {'$/h':>5} {'load':>5} {'goodput':>8} {'SLO met':>8} {'TTFT p99':>9} "
          f"{'TPOT p99':>9} {'lost':>5} {'idle':>6}  replicas")
    twins = Twins(scale=args.time_scale, min_step_ms=args.min_step_ms)
    try:
        for name, shape in shapes.items():
            for label, mode in modes:
                plan = optimize(spec(shape, drive_rate, mode), catalog=catalog, capacity_source=sources[name])
                if plan.status is PlanStatus.INFEASIBLE:
                    print(f"{name:26} {label:14} infeasible")
                    continue
                results, overhead = asyncio.run(drive(plan, shape, twins, n=args.requests,
                                                      rates=[drive_rate * x for x in loads]))
                for i, (load, r) in enumerate(zip(loads, results, strict=True)):
                    head = (f"{name if label == modes[0][0] else '':26} {label:14} {plan.cost_per_hour:5.2f}" if i == 0
                            else f"{'':26} {'':14} {'':5}")
                    tail = f" {overhead:4.0f}ms  {placement(plan)}" if i == 0 else ""
                    print(f"{head} {load:4g}× {r.goodput:8.2f} {r.attained:8.1%} {r.ttft_p99_ms:7.0f}ms "
                          f"{r.tpot_p99_ms:7.1f}ms {r.lost:5}{tail}", flush=True)
    finally:
        twins.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=24.0, help="requests per second of the model")
    parser.add_argument("--drive-rate", type=float,
                        help="requests per second the drive plans for (default 8; --quick: half of the smallest "
                             "replica's SLO capacity in the unified plan)")
    parser.add_argument("--overload", type=float, default=1.5, help="second drive at this × the drive rate")
    parser.add_argument("--requests", type=int, help=f"requests per drive (default 50; --quick {QUICK_REQUESTS})")
    parser.add_argument("--time-scale", type=float, default=2.0, help="twins' simulated seconds per wall second")
    parser.add_argument("--min-step-ms", type=float, default=50.0,
                        help="twins' shortest decode step in wall ms (decode runs share one token event)")
    parser.add_argument("--no-drive", action="store_true", help="plan and compare costs only")
    parser.add_argument("--quick", action="store_true", help="the chat shape, one seed, a small drive: a smoke run")
    args = parser.parse_args()
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else 50)
    shapes = {QUICK_SHAPE: SHAPES[QUICK_SHAPE]} if args.quick else SHAPES
    find = partial(find_capacity, seeds=(0,)) if args.quick else find_capacity
    # one memo per shape (its key has no lengths): the drive's plans ask for the cost plans' capacities again
    sources: dict[str, CapacitySource] = {name: CapacityMemo(SimulatedCapacity(find=find)) for name in shapes}
    catalog = load_catalog()
    started = time.perf_counter()
    print(f"{MODEL} at {args.rate:g} req/s, P99 TTFT ≤ {SLO['ttft_ms']} ms, TPOT ≤ {SLO['tpot_ms']} ms; "
          f"pools: {', '.join(p['accelerator'] + '×' + str(p['nodes'] * catalog.get(p['accelerator']).gpus_per_node) for p in POOLS)}\n")
    print(f"{'workload':28} {'unified $/h':>12} {'disagg. $/h':>12} {'unified/disagg.':>16}")
    details = []
    smallest = []
    for name, shape in shapes.items():
        unified = optimize(spec(shape, args.rate, "unified"), catalog=catalog, capacity_source=sources[name])
        split = optimize(spec(shape, args.rate, "prefill_decode"), catalog=catalog, capacity_source=sources[name])
        costs = [p.cost_per_hour if p.status is not PlanStatus.INFEASIBLE else None for p in (unified, split)]
        ratio = f"{costs[0] / costs[1]:16.2f}" if None not in costs else f"{'—':>16}"
        print(f"{name:28} {costs[0] or float('nan'):12.2f} {costs[1] or float('nan'):12.2f} {ratio}")
        details.append((name, placement(unified), placement(split)))
        if unified.status is not PlanStatus.INFEASIBLE:
            smallest.append(smallest_replica_rps(unified))
    print()
    for name, unified_text, split_text in details:
        print(f"{name}:\n  unified: {unified_text}\n  disaggregated: {split_text}")
    if not args.no_drive:
        if args.quick and args.drive_rate is None and not smallest:
            raise SystemExit("--quick sizes the drive from the unified plan, and there is none; give --drive-rate")
        drive_rate = args.drive_rate or (min(smallest) / 2 if args.quick else 8.0)
        drives(args, shapes, sources, drive_rate=drive_rate)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    report.main(main, section="pd_disagg")
