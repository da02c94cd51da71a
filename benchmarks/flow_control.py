"""Flow control under overload: request classes, priority, fair shares between tenants.

Workers: ``router_policies.py``'s pool (llama-3.1-8b on 2 × h100-sxm, 2 × a100-80gb, 4 × l4 simulated workers at
``--time-scale`` 0.1) and its short/long mix. Load: ``--window`` wall seconds of Poisson arrivals at ``--load``
(1.5) × the pool's SLO capacity (the sum of each replica's from the simulator's capacity search at the strictest
class's SLO, the interactive one: what the pool serves with every request meeting its class's SLO):

- 30 % interactive: TTFT 300 ms, TPOT 100 ms, priority 10, not sheddable;
- 70 % batch: TTFT 20 s, TPOT 200 ms, priority 0, sheddable;
- five tenants (``x-gateway-inference-fairness-id``), one of which sends ten times as much as each other one.

The same arrival sequence runs three ways through ``hetsched route`` (policy ``slo``, predictions scaled to the
workers' time scale, SLOs in wall time):

1. ``today``: no classes, no flow control, the default per-endpoint limits: what the router did before;
2. ``flow``: the two classes, flow control on, each endpoint's concurrency limit the mean number of requests its
   replica runs at its SLO capacity (the simulator's, so the router, not the engine, holds the queue), a fifth of
   it reserved for the interactive class (``reserved_share`` 0.2);
3. ``bucket``: a token bucket per tenant in front of ``today`` (SGLang's gateway's per-tenant rate limit): each
   tenant may send a fifth of the pool's SLO capacity (burst: one second of it); over it, 429.

Per class and tenant: SLO attainment (met over sent; a refusal is a miss), goodput (met, served from inside the
arrival window — its first token came before the window's end — per hardware second), shed (429s) and the mean
time in the router's queue. A batch request may wait 20 hardware seconds, far longer than the window: counting only
those that *ended* inside it would count the queue flow control holds as lost work, while counting those still
queued at its end would credit the capacity of the drain after it. (The batch goodput of requests that ended inside
the window is printed beside it.) The targets: the
interactive class's attainment, batch goodput against the capacity interactive leaves, Jain's fairness index
over the tenants whose batch demand exceeds their max-min fair share of it (the flooding tenant gets its
share, not more). Latencies are hardware time (wall × time scale).

Then, in this process: the time flow control adds to a request that does not queue, on a picker whose endpoints
are half full (``admit`` against the same picker without flow control), p50 over many requests; and the cost of
the cheapest plan for the offered load on the pool's accelerator types (the optimizer's capacity search) with
every request at the interactive SLO, against one with each class at its own.

``--quick``: one a100-80gb and one l4 worker at time scale 0.5, six seconds of arrivals, capacity searches on
one seed, the plans on the a100-80gb alone: a check that every part runs, not figures to quote.

Run: ``.venv/bin/python benchmarks/flow_control.py`` (about six minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import defaultdict
from functools import partial

import httpx

from _loadgen import Outcome, RouterProcess, stream_once, wait_idle
from hetsched.catalog import load_catalog
from hetsched.catalog.host import read_host
from hetsched.errors import InfeasibleError
from hetsched.optimizer.capacity import SimulatedCapacity
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.router.config import parse_router_config
from hetsched.router.openai import ApiKind
from hetsched.router.picker import FAIRNESS_HEADER, OBJECTIVE_HEADER, Picker
from hetsched.router.types import Front
from hetsched.sim.capacity import DEFAULT_SEEDS, Capacity, find_capacity
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO
from router_policies import MODEL, POOL, SLO_TARGET, spawn_fleet, workload
import report

QUICK_POOL = (("a100-80gb", 1), ("l4", 1))
CLASSES = {"interactive": (0.3, SLO(ttft_ms=300, tpot_ms=100), 10, False),
           "batch": (0.7, SLO(ttft_ms=20_000, tpot_ms=200), 0, True)}
"""Class: share of requests, SLO (hardware time), priority, sheddable."""
STRICTEST = CLASSES["interactive"][1]
TENANTS = {"flood": 10, "t1": 1, "t2": 1, "t3": 1, "t4": 1}
TARGET_INTERACTIVE, TARGET_BATCH, TARGET_JAIN, TARGET_OVERHEAD_MS = 0.99, 0.95, 0.95, 0.2


def capacities(pool: tuple[tuple[str, int], ...], seeds: tuple[int, ...]) -> dict[str, Capacity]:
    """Each replica's capacity at the strictest class's SLO (interactive), what it serves with every request
    meeting its class's SLO; a type too slow for that SLO (an L4's prefill of a long prompt) at the model's SLO,
    where it serves the loose class."""
    arch, catalog, mix = load_model(MODEL), load_catalog(), workload()
    found = {}
    for acc, _ in pool:
        try:
            found[acc] = find_capacity(arch, catalog.device(acc), workload=mix, slo=STRICTEST, seeds=seeds)
        except InfeasibleError:
            found[acc] = find_capacity(arch, catalog.device(acc), workload=mix, slo=SLO_TARGET, seeds=seeds)
    return found


def _strict(capacity: Capacity) -> bool:
    return capacity.ttft_ms.p99 <= STRICTEST.ttft_ms


def wall(slo: SLO, scale: float) -> dict[str, float]:
    return {"ttft_ms": slo.ttft_ms / scale, "tpot_ms": slo.tpot_ms / scale}


def router_config(workers: list, mode: str, caps: dict[str, Capacity], scale: float) -> dict:
    sized = mode == "flow"
    model: dict = {"slo": wall(SLO_TARGET, scale), "endpoints": [
        {"url": w.url, "accelerator": w.spec.accelerator,
         **({"max_concurrency": max(1, math.ceil(caps[w.spec.accelerator].mean_concurrency))} if sized else {})}
        for w in workers]}
    if sized:
        model["objectives"] = [{"name": name, "priority": priority, "sheddable": sheddable, "slo": wall(slo, scale)}
                               for name, (_share, slo, priority, sheddable) in CLASSES.items()]
    return {"policy": "slo", "time_scale": scale, "metrics_interval_s": 0.25, "health": {"check_interval_s": 0.25},
            "flow": {"enabled": sized, "reserved_share": 0.2}, "models": {MODEL: model}}


class Trace:
    """The arrival sequence: when (hardware s from the start), how long, which class and tenant."""

    def __init__(self, rate_hw: float, window_hw: float, seed: int = 7) -> None:
        rng = random.Random(seed)
        mix = workload()
        batch = mix.sample(max(2, int(rate_hw * window_hw)), rate=rate_hw, seed=seed)
        self.arrivals = (batch.arrival_s - batch.arrival_s[0]).tolist()
        self.lengths = list(zip(batch.input_tokens.tolist(), batch.output_tokens.tolist(), strict=True))
        names, weights = list(TENANTS), list(TENANTS.values())
        self.classes = ["interactive" if rng.random() < CLASSES["interactive"][0] else "batch" for _ in self.arrivals]
        self.tenants = rng.choices(names, weights, k=len(self.arrivals))
        self.window_hw = window_hw


class TokenBuckets:
    """One bucket per tenant: ``rate`` requests per wall second, ``burst`` at most; a request takes one token."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.level: dict[str, float] = defaultdict(lambda: burst)
        self.at: dict[str, float] = {}

    def take(self, tenant: str, now: float) -> bool:
        level = min(self.burst, self.level[tenant] + (now - self.at.get(tenant, now)) * self.rate)
        self.at[tenant] = now
        if level < 1:
            self.level[tenant] = level
            return False
        self.level[tenant] = level - 1
        return True


async def run(url: str, trace: Trace, scale: float, buckets: TokenBuckets | None) -> tuple[list[Outcome], float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=500)) as client:
        tasks: list[asyncio.Task[Outcome]] = []
        start = time.monotonic()
        for at, (prompt, out), cls, tenant in zip(trace.arrivals, trace.lengths, trace.classes, trace.tenants,
                                                  strict=True):
            await asyncio.sleep(max(0.0, start + at / scale - time.monotonic()))
            if buckets is not None and not buckets.take(tenant, time.monotonic()):
                tasks.append(asyncio.create_task(_refused(cls)))
                continue
            headers = {OBJECTIVE_HEADER: cls, FAIRNESS_HEADER: tenant}
            tasks.append(asyncio.create_task(stream_once(client, url, model=MODEL, prompt_tokens=prompt,
                                                         max_tokens=out, kind=cls, headers=headers)))
        done, pending = await asyncio.wait(tasks, timeout=CLASSES["batch"][1].ttft_ms / 1000 / scale + 60)
        for task in pending:
            task.cancel()
        return [t.result() if t in done and not t.cancelled() else Outcome("timeout", 0.0, error="timeout")
                for t in tasks], start


async def _refused(kind: str) -> Outcome:
    return Outcome(kind, time.monotonic(), status=429, error="token bucket")


def _met(o: Outcome, slo: SLO, scale: float) -> bool:
    return o.ok and o.ttft * scale * 1e3 <= slo.ttft_ms and (o.tokens < 2 or o.tpot * scale * 1e3 <= slo.tpot_ms)


def _ended(o: Outcome) -> float:
    return o.sent + o.ttft + (o.tpot * (o.tokens - 1) if o.tokens > 1 else 0.0)


def queue_seconds(metrics: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(class, tenant) → (sum, count) of the router's time-in-queue histogram."""
    found: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in metrics.splitlines():
        for suffix, i in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("hetsched_router_flow_queue_seconds" + suffix):
                labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
                key = (labels["objective"].strip('"'), labels["tenant"].strip('"'))
                found[key][i] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in found.items()}


def max_min_shares(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of ``capacity`` among tenants asking ``demand`` (water-filling)."""
    shares, left, open_ = {}, capacity, dict(demand)
    while open_:
        even = left / len(open_)
        small = {t: d for t, d in open_.items() if d <= even}
        if not small:
            shares.update({t: even for t in open_})
            break
        for t, d in small.items():
            shares[t] = d
            left -= d
            del open_[t]
    return shares


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values and any(values) else float("nan")


def summarize(mode: str, outcomes: list[Outcome], start: float, trace: Trace, scale: float, metrics: str,
              capacity_hw: float) -> dict[str, float]:
    end = start + trace.window_hw / scale
    waits = queue_seconds(metrics)
    print(f"\n{mode}: {len(outcomes)} requests")
    print(f"  {'class':12} {'tenant':7} {'sent':>5} {'met':>7} {'goodput':>8} {'shed':>5} {'failed':>6} "
          f"{'queue ms':>9}")
    figures: dict[str, float] = {}
    goodput: dict[tuple[str, str], float] = {}
    for cls, (_share, slo, _p, _s) in CLASSES.items():
        rows = [(o, t) for o, t, c in zip(outcomes, trace.tenants, trace.classes, strict=True) if c == cls]
        for tenant in (*TENANTS, "all"):
            mine = [o for o, t in rows if tenant in ("all", t)]
            if not mine:
                continue
            met = [o for o in mine if _met(o, slo, scale)]
            good = sum(1 for o in met if o.sent + o.ttft <= end) / trace.window_hw
            ended = sum(1 for o in met if _ended(o) <= end) / trace.window_hw
            shed = sum(1 for o in mine if o.status == 429)
            failed = sum(1 for o in mine if not o.ok and o.status != 429)
            wait = [waits.get((cls, t), (0.0, 0.0)) for t in (TENANTS if tenant == "all" else (tenant,))]
            count = sum(w[1] for w in wait)
            queue_ms = sum(w[0] for w in wait) / count * 1e3 * scale if count else 0.0
            goodput[(cls, tenant)] = good
            print(f"  {cls:12} {tenant:7} {len(mine):>5} {len(met) / len(mine):>7.1%} {good:>8.1f} {shed:>5} "
                  f"{failed:>6} {queue_ms:>9.0f}")
            if tenant == "all":
                figures[f"{cls}_attained"] = len(met) / len(mine)
                figures[f"{cls}_goodput"] = good
                figures[f"{cls}_goodput_ended"] = ended
    left = max(0.0, capacity_hw - figures["interactive_goodput"])
    demand = {t: sum(1 for c, tt in zip(trace.classes, trace.tenants, strict=True) if c == "batch" and tt == t)
              / trace.window_hw for t in TENANTS}
    shares = max_min_shares(demand, left)
    backlogged = [t for t in TENANTS if demand[t] > shares[t] * 1.001]
    figures["jain"] = jain([goodput[("batch", t)] for t in backlogged]) if len(backlogged) > 1 else 1.0
    figures["batch_of_left"] = figures["batch_goodput"] / left if left else float("nan")
    flood = goodput[("batch", "flood")] / shares["flood"] if shares["flood"] else float("nan")
    print(f"  batch goodput {figures['batch_goodput']:.1f} req/s of the {left:.1f} interactive leaves "
          f"({figures['batch_of_left']:.0%}; of those that ended inside the window "
          f"{figures['batch_goodput_ended']:.1f}); backlogged tenants: {', '.join(backlogged) or 'none'}, Jain "
          f"{figures['jain']:.3f}; the flooding tenant got {flood:.2f}x its max-min share "
          f"({goodput[('batch', 'flood')]:.1f} of {shares['flood']:.1f} req/s)")
    return figures


async def added_latency(requests: int) -> tuple[float, float]:
    """p50 microseconds of ``admit`` + ``start`` + ``finish`` for a request that does not queue, with flow control
    and without, on pickers whose endpoints are half full; the two take turns request by request, so the
    machine's drift and the interpreter's warming fall on both alike."""
    body = json.dumps({"model": MODEL, "prompt": "word " * 200, "max_tokens": 32}).encode()
    headers = {OBJECTIVE_HEADER: "interactive", FAIRNESS_HEADER: "t1"}
    pickers, routes = [], []
    for enabled in (True, False):
        raw = {"flow": {"enabled": enabled}, "policy": "slo", "models": {MODEL: {
            "slo": SLO_TARGET.model_dump(include={"ttft_ms", "tpot_ms"}),
            "objectives": [{"name": name, "priority": p, "sheddable": s, "slo": slo.model_dump(include={"ttft_ms", "tpot_ms"})}
                           for name, (_share, slo, p, s) in CLASSES.items()],
            "endpoints": [{"url": f"http://10.0.{i}.{j}:8000", "accelerator": acc, "max_concurrency": 8}
                          for i, (acc, n) in enumerate(POOL) for j in range(n)]}}}
        picker = Picker(parse_router_config(raw), front=Front.HTTP, host=read_host())
        route = picker.route_request(body, ApiKind.COMPLETIONS, headers)
        for endpoint in picker.state.endpoints():
            for _ in range(endpoint.max_concurrency // 2):
                picker.start(endpoint, route)
        pickers.append(picker)
        routes.append(route)
    timings: list[list[float]] = [[], []]
    for _ in range(requests):
        for picker, route, taken in zip(pickers, routes, timings, strict=True):
            began = time.perf_counter()
            decision = await picker.admit(route, size_bytes=len(body))
            assert decision.endpoint is not None
            ticket = picker.start(decision.endpoint, route)
            picker.finish(ticket, decision.endpoint)
            taken.append(time.perf_counter() - began)
    return statistics.median(timings[0]) * 1e6, statistics.median(timings[1]) * 1e6


def plan_costs(pool: tuple[tuple[str, int], ...], rate_hw: float,
               seeds: tuple[int, ...]) -> tuple[float, float, list[str]]:
    """$/hour of the cheapest plan for ``rate_hw`` with every request at the interactive SLO, and with each class
    at its own; the second plan's replicas by class."""
    short, long_ = workload().trace[0], workload().trace[-1]
    buckets = [{"name": "short", "input_tokens": short.input_tokens, "output_tokens": short.output_tokens,
                "share": 0.8},
               {"name": "long", "input_tokens": long_.input_tokens, "output_tokens": long_.output_tokens, "share": 0.2}]
    pools = [{"name": acc, "accelerator": acc, "nodes": 16} for acc, _ in pool]
    one = {"name": MODEL, "slo": CLASSES["interactive"][1].model_dump(include={"ttft_ms", "tpot_ms"}),
           "workload": {"rate_rps": rate_hw, "buckets": buckets}}
    split = {**one, "objectives": [{"name": name, "demand_share": share,
                                    "slo": slo.model_dump(include={"ttft_ms", "tpot_ms"})}
                                   for name, (share, slo, _p, _s) in CLASSES.items()]}
    source = SimulatedCapacity(find=partial(find_capacity, seeds=seeds))
    together = optimize(parse_cluster({"pools": pools, "models": [one]}), capacity_source=source)
    apart = optimize(parse_cluster({"pools": pools, "models": [split]}), capacity_source=source)
    placed = [f"{m.name}: " + ", ".join(f"{g.replicas} x {g.device}" for g in m.replicas) for m in apart.models]
    return together.cost_per_hour, apart.cost_per_hour, placed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--load", type=float, default=1.5, help="share of the pool's SLO capacity")
    parser.add_argument("--window", type=float, default=60.0, help="wall seconds of arrivals")
    parser.add_argument("--modes", default="today,flow,bucket", help="which of today, flow, bucket to run")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    pool = QUICK_POOL if args.quick else POOL
    scale = 0.5 if args.quick else args.time_scale
    window = 6.0 if args.quick else args.window
    seeds = DEFAULT_SEEDS[:1] if args.quick else DEFAULT_SEEDS
    caps = capacities(pool, seeds)
    capacity_hw = sum(caps[acc].requests_per_s * n for acc, n in pool)
    rate_hw = args.load * capacity_hw
    trace = Trace(rate_hw, window * scale)
    print(f"workers: {MODEL} on {', '.join(f'{n} x {acc}' for acc, n in pool)} (time scale {scale:g}); SLO "
          f"capacity per replica (req/s, simulator, TTFT {STRICTEST.ttft_ms:g} / TPOT {STRICTEST.tpot_ms:g} ms): "
          + ", ".join(f"{acc} {caps[acc].requests_per_s:.2f} ({caps[acc].mean_concurrency:.1f} running on average"
                      f"{'' if _strict(caps[acc]) else f'; at TTFT {SLO_TARGET.ttft_ms:g} ms, too slow for the other'})"
                      for acc, _ in pool) + f"; pool {capacity_hw:.1f} req/s")
    print(f"load {args.load:g} x = {rate_hw:.1f} req/s hardware ({rate_hw * scale:.1f}/s wall) for {window:g} s wall, "
          f"{len(trace.arrivals)} requests: " + "; ".join(
              f"{name} {share:.0%} (TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms, priority {p}"
              f"{', sheddable' if s else ''})" for name, (share, slo, p, s) in CLASSES.items())
          + f"; tenants {', '.join(f'{t} x{w}' for t, w in TENANTS.items())}")
    workers = spawn_fleet(scale, pool)
    results: dict[str, dict[str, float]] = {}
    try:
        for mode in args.modes.split(","):
            router = RouterProcess(router_config(workers, "flow" if mode == "flow" else "today", caps, scale))
            per_tenant = capacity_hw * scale / len(TENANTS)
            buckets = TokenBuckets(per_tenant, max(1.0, per_tenant)) if mode == "bucket" else None
            try:
                outcomes, start = await run(router.url, trace, scale, buckets)
                metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
            finally:
                router.stop()
            results[mode] = summarize(mode, outcomes, start, trace, scale, metrics, capacity_hw)
            print(f"  ({time.monotonic() - start:.0f} s wall from the first arrival to the last answer)")
            async with httpx.AsyncClient() as client:
                await wait_idle(client, [w.url for w in workers])
    finally:
        for worker in workers:
            worker.stop()
    if set(results) != {"today", "flow", "bucket"}:
        print("\n(not every mode ran: no comparison)")
        return
    with_flow, without = await added_latency(200 if args.quick else 20_000)
    plan_pool = pool[:1] if args.quick else pool
    strict_cost, split_cost, placed = plan_costs(plan_pool, rate_hw, seeds)
    added_ms = (with_flow - without) / 1e3
    flow, today = results["flow"], results["today"]
    print(f"\nadded to a request that does not queue (endpoints half full, p50 of admit+start+finish): "
          f"{with_flow:.1f} us with flow control, {without:.1f} us without: {added_ms:+.3f} ms")
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(f"interactive attainment: flow {flow['interactive_attained']:.1%} (today {today['interactive_attained']:.1%}, "
          f"bucket {results['bucket']['interactive_attained']:.1%}; target >= {TARGET_INTERACTIVE:.0%}: "
          f"{verdict(flow['interactive_attained'] >= TARGET_INTERACTIVE)})")
    print(f"batch goodput of the capacity interactive leaves: flow {flow['batch_of_left']:.0%} (today "
          f"{today['batch_of_left']:.0%}; target >= {TARGET_BATCH:.0%}: {verdict(flow['batch_of_left'] >= TARGET_BATCH)})")
    print(f"Jain's index over backlogged tenants: flow {flow['jain']:.3f} (today {today['jain']:.3f}; target >= "
          f"{TARGET_JAIN}: {verdict(flow['jain'] >= TARGET_JAIN)})")
    print(f"added p50 without queueing: {added_ms:.3f} ms (target <= {TARGET_OVERHEAD_MS} ms: "
          f"{verdict(added_ms <= TARGET_OVERHEAD_MS)})")
    print(f"plan for {rate_hw:.1f} req/s on {', '.join(acc for acc, _ in plan_pool)}: the interactive SLO for every request "
          f"${strict_cost:.2f}/h; each class at its own ${split_cost:.2f}/h ({'; '.join(placed)}): "
          f"{split_cost / strict_cost:.2f}x (target < 1: {verdict(split_cost < strict_cost)})")


if __name__ == "__main__":
    report.main(lambda: asyncio.run(main()), section="flow_control")
