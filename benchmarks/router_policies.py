"""Routing policies on a heterogeneous pool of simulated workers, and a fault run.

Pool: llama-3.1-8b on 2 × h100-sxm, 2 × a100-80gb and 4 × l4, each a
``hetsched sim-worker`` process driving the shared scheduler at
``--time-scale`` (0.1: ten times slower than the hardware, so that the
token stream fits this machine's CPU). Workload: 80 % short requests
(256 prompt tokens, 32 out) and 20 % long ones (1536 in, 64 out), Poisson
arrivals at ``--load`` × the pool's SLO capacity, which is the sum of each
replica's capacity from the simulator's capacity search (same SLO, same mix).

For every policy, the same request sequence runs through a fresh router; the
client times every token. Latencies are reported in hardware time (wall ×
time scale). Goodput counts requests that completed with P99-style per-request
TTFT ≤ SLO and TPOT ≤ SLO, per hardware second of the arrival window;
"lost" are requests that errored or had not finished 30 wall seconds after
the last arrival.

The fault run repeats the ``slo`` policy and SIGKILLs the busiest worker a
third of the way into the window: it reports requests lost (split by whether they
had started streaming) and how long the router took to eject the dead worker.

``--quick``: ``slo``, then the fault run, on a couple of workers (one a100-80gb, one l4, time
scale 1) with a score of requests, sized the same way from the pool's SLO capacity (one seed's search); a check that
the benchmark runs, not figures to quote.

Run: ``.venv/bin/python benchmarks/router_policies.py`` (about six minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from _loadgen import Outcome, RouterProcess, pct, stream_once, wait_idle
from hetsched.catalog import load_catalog
from hetsched.router.types import Policy
from hetsched.sim.capacity import DEFAULT_SEEDS, find_capacity
from hetsched.simworker import WorkerSpec, spawn_worker
from hetsched.simworker.launch import WorkerProcess
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, TraceRequest, Workload
import report

MODEL = "llama-3.1-8b"
POOL = (("h100-sxm", 2), ("a100-80gb", 2), ("l4", 4))
QUICK_POOL = (("a100-80gb", 1), ("l4", 1))
QUICK_POLICIES = (Policy.SLO,)
QUICK_REQUESTS = 20
QUICK_SEEDS = (0,)
SHORT, LONG = (256, 32), (1536, 64)
SLO_TARGET = SLO(ttft_ms=1000, tpot_ms=100)


def workload() -> Workload:
    rows = [TraceRequest(arrival_s=i, input_tokens=SHORT[0], output_tokens=SHORT[1]) for i in range(4)]
    rows.append(TraceRequest(arrival_s=4, input_tokens=LONG[0], output_tokens=LONG[1]))
    return Workload(name="short-long-mix", input_len=LengthDistribution.fixed(SHORT[0]),
                    output_len=LengthDistribution.fixed(SHORT[1]), trace=tuple(rows))


def pool_capacity(mix: Workload, pool: tuple[tuple[str, int], ...] = POOL, *,
                  seeds: Sequence[int] = DEFAULT_SEEDS) -> dict[str, float]:
    """Each accelerator's SLO capacity (req/s per replica) for ``mix``: the simulator's search over ``seeds``."""
    arch, catalog = load_model(MODEL), load_catalog()
    return {acc: find_capacity(arch, catalog.device(acc), workload=mix, slo=SLO_TARGET, seeds=seeds).requests_per_s
            for acc, _ in pool}


def router_config(workers: list, policy: Policy) -> dict:
    return {"policy": str(policy), "metrics_interval_s": 0.25,
            "health": {"check_interval_s": 0.25},
            "models": {MODEL: {"slo": SLO_TARGET.model_dump(include={"ttft_ms", "tpot_ms"}),
                               "endpoints": [{"url": w.url, "accelerator": w.spec.accelerator} for w in workers]}}}


async def run_load(router_url: str, arrivals: list[float], lengths: list[tuple[int, int]], *,
                   scale: float, grace: float, on_start=None) -> list[Outcome]:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=500)) as client:
        tasks: list[asyncio.Task[Outcome]] = []
        start = time.monotonic()
        if on_start is not None:
            on_start(start)
        for at, (prompt, out) in zip(arrivals, lengths, strict=True):
            await asyncio.sleep(max(0.0, start + at / scale - time.monotonic()))
            tasks.append(asyncio.create_task(stream_once(client, router_url, model=MODEL, prompt_tokens=prompt,
                                                         max_tokens=out, kind="long" if prompt == LONG[0] else "short")))
        done, pending = await asyncio.wait(tasks, timeout=grace)
        for task in pending:
            task.cancel()
        return [t.result() if t in done and not t.cancelled() else Outcome("timeout", 0.0, error="timeout")
                for t in tasks]


def summarize(name: str, outcomes: list[Outcome], *, scale: float, window_hw: float,
              accelerator_of: dict[str, str], pool: tuple[tuple[str, int], ...] = POOL) -> dict:
    good = [o for o in outcomes if o.ok and o.ttft * scale * 1e3 <= SLO_TARGET.ttft_ms
            and (o.tokens < 2 or o.tpot * scale * 1e3 <= SLO_TARGET.tpot_ms)]
    done = [o for o in outcomes if o.ok]
    share = Counter(accelerator_of.get(o.endpoint, "?") for o in done)
    row = {"policy": name, "goodput": len(good) / window_hw, "attained": len(good) / len(outcomes),
           "failed": len(outcomes) - len(done),
           "ttft_p99": pct([o.ttft * scale * 1e3 for o in done], 99),
           "tpot_p99": pct([o.tpot * scale * 1e3 for o in done if o.tokens > 1], 99),
           "share": " ".join(f"{acc.split('-')[0]}:{share[acc] / max(len(done), 1):.0%}" for acc, _ in pool)}
    print(f"{name:14} {row['goodput']:>8.1f} {row['attained']:>8.1%} {row['failed']:>6} {row['ttft_p99']:>10.0f} "
          f"{row['tpot_p99']:>10.1f}   {row['share']}", flush=True)
    return row



def spawn_fleet(scale: float, pool: tuple[tuple[str, int], ...] = POOL) -> list[WorkerProcess]:
    """One simulated worker per GPU of ``pool``, started in parallel; all stopped if one fails to start."""
    specs = [WorkerSpec(model=MODEL, accelerator=acc, time_scale=scale) for acc, count in pool for _ in range(count)]
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(spawn_worker, spec, timeout=180) for spec in specs]
    failed = [f.exception() for f in futures if f.exception() is not None]
    workers = [f.result() for f in futures if f.exception() is None]
    if failed:
        for worker in workers:
            worker.stop()
        raise failed[0]  # type: ignore[misc]
    return workers


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, help="worker time scale (default 0.1; --quick 1)")
    parser.add_argument("--load", type=float, default=0.85, help="share of the pool's SLO capacity")
    parser.add_argument("--window", type=float, default=15.0, help="wall seconds of arrivals per policy")
    parser.add_argument("--policies", help="comma-separated (default: every policy; --quick "
                                           f"{','.join(p.value for p in QUICK_POLICIES)})")
    parser.add_argument("--no-fault", action="store_true")
    parser.add_argument("--quick", action="store_true", help="two workers, the slo policy and the fault run, a score of requests")
    args = parser.parse_args()
    scale = args.time_scale or (1.0 if args.quick else 0.1)
    pool = QUICK_POOL if args.quick else POOL
    policies = args.policies if args.policies is not None else ",".join(
        p.value for p in (QUICK_POLICIES if args.quick else Policy))

    mix = workload()
    capacity = pool_capacity(mix, pool, seeds=QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    total = sum(capacity[acc] * n for acc, n in pool)
    rate = args.load * total
    print(f"SLO capacity per replica (req/s, simulator): "
          + ", ".join(f"{acc} {capacity[acc]:.2f}" for acc, _ in pool) + f"; pool {total:.1f} req/s")
    window_hw = QUICK_REQUESTS / rate if args.quick else args.window * scale
    n = max(round(rate * window_hw), 1)
    batch = mix.sample(n, rate=rate, seed=11)
    arrivals = (batch.arrival_s - batch.arrival_s[0]).tolist()
    lengths = list(zip(batch.input_tokens.tolist(), batch.output_tokens.tolist(), strict=True))
    print(f"load {args.load:.0%} = {rate:.1f} req/s hardware ({rate * scale:.1f}/s wall), {n} requests, "
          f"time scale {scale:g}, SLO TTFT {SLO_TARGET.ttft_ms:g} ms / TPOT {SLO_TARGET.tpot_ms:g} ms")

    workers = spawn_fleet(scale, pool)
    accelerator_of = {w.url: w.spec.accelerator for w in workers}
    grace = (arrivals[-1] if arrivals else 0) / scale + (10 if args.quick else 30)
    rows = {}
    try:
        print(f"\n{'policy':14} {'goodput':>8} {'SLO met':>8} {'lost':>6} {'TTFT p99':>10} {'TPOT p99':>10}   "
              f"traffic share by accelerator")
        for name in filter(None, policies.split(",")):
            policy = Policy(name)
            router = RouterProcess(router_config(workers, policy))
            try:
                outcomes = await run_load(router.url, arrivals, lengths, scale=scale, grace=grace)
            finally:
                router.stop()
            rows[name] = summarize(name, outcomes, scale=scale, window_hw=window_hw, accelerator_of=accelerator_of,
                                   pool=pool)
            async with httpx.AsyncClient() as client:
                await wait_idle(client, [w.url for w in workers])
        for base in ("round-robin", "least-request"):
            if "slo" in rows and base in rows and rows[base]["goodput"] > 0:
                print(f"goodput slo / {base}: {rows['slo']['goodput'] / rows[base]['goodput']:.2f}×")

        if not args.no_fault:
            await fault_run(workers, arrivals, lengths, scale=scale, grace=grace)
    finally:
        for worker in workers:
            worker.stop()


async def fault_run(workers: list, arrivals: list[float], lengths: list[tuple[int, int]], *, scale: float,
                    grace: float) -> None:
    router = RouterProcess(router_config(workers, Policy.SLO))
    victims: list = []
    killed_at: list[float] = []
    ejected_at: list[float] = []

    async def kill_and_watch(start: float) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[-1] / scale / 3 - time.monotonic()))
        async with httpx.AsyncClient() as client:
            rows = (await client.get(f"{router.url}/router/endpoints")).json()["endpoints"]
            busiest = max(rows, key=lambda r: r["in_flight"])["url"]
            victim = next(w for w in workers if w.url == busiest)
            victim.kill()
            killed_at.append(time.monotonic())
            victims.append((victim, max(r["in_flight"] for r in rows)))
            while time.monotonic() - killed_at[0] < 30:
                rows = (await client.get(f"{router.url}/router/endpoints")).json()["endpoints"]
                if not next(r for r in rows if r["url"] == victim.url)["healthy"]:
                    ejected_at.append(time.monotonic())
                    return
                await asyncio.sleep(0.01)

    watchers: list[asyncio.Task[None]] = []
    try:
        outcomes = await run_load(router.url, arrivals, lengths, scale=scale, grace=grace,
                                  on_start=lambda start: watchers.append(asyncio.create_task(kill_and_watch(start))))
        await asyncio.gather(*watchers)
        metrics = httpx.get(f"{router.url}/metrics").text
    finally:
        router.stop()
    lost = [o for o in outcomes if not o.ok]
    streaming = sum(o.started_streaming for o in lost)
    retries = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("hetsched_router_retries_total{"))
    eject_ms = (ejected_at[0] - killed_at[0]) * 1e3 if ejected_at else float("nan")
    reasons = Counter((o.started_streaming, (o.error or f"{o.tokens}/{o.expected} tokens")[:60]) for o in lost)
    victim, in_flight = victims[0]
    print(f"\nfault run (slo policy; the busiest worker, {victim.spec.accelerator} with {in_flight} requests in flight, "
          f"SIGKILLed a third of the way in): {len(outcomes)} requests, "
          f"{len(lost)} lost = {streaming} already streaming + {len(lost) - streaming} not yet streaming; "
          f"{retries:.0f} retried elsewhere; ejected {eject_ms:.0f} ms (wall) after the kill")
    for (started, reason), count in reasons.most_common():
        print(f"   lost {count}: {'streaming' if started else 'not streaming'}: {reason}")


if __name__ == "__main__":
    report.main(lambda: asyncio.run(main()), section="router_policies")
