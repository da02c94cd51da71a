"""Router overhead: added latency per streamed request, throughput of one core, decision time at scale.

1. Added latency: one simulated worker (qwen3-0.6b on h100-sxm, real time),
   a fixed open-loop rate, requests alternating between the worker directly
   and the router in front of it (and, with ``--baseline REV``, that
   revision's router); p50/p99 of TTFT and end-to-end for each, in the same
   run, and their difference.
2. Throughput on one core: the router pinned to CPU 0, closed-loop clients
   sending short requests, streamed and not, to a fast worker; the router's own
   CPU seconds per request give what one core sustains, independent of what
   the client and worker (on the other core) cost. With ``--baseline REV`` the
   same for that revision's router, and the ratio; with ``--profile FILE``, one
   more streamed run under cProfile, its profile written to FILE and its top
   functions printed.
3. Decision time: ``RouterState.decide`` over 1,000 endpoints of mixed
   accelerators with live load, per policy, against 10 endpoints.
4. Scale-out (``--scale-out``): ``hetsched route --workers 1`` against ``--workers 2``, unpinned, under the
   same closed-loop non-streamed load (an aiohttp client, the cheapest here) to the fast worker: requests/s
   achieved, the router's CPU per request and how its CPU split over the processes. On a machine with as
   many cores as router processes the client and the worker take their share from the same cores: the gain
   is bounded by the cores the router can get, printed beside it.

Run: ``.venv/bin/python benchmarks/router_overhead.py [--baseline REV] [--profile FILE] [--scale-out]`` (two to
five minutes; ``--quick``, every part on a second or two of load and a smaller pool, is a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pstats
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace

import aiohttp
import httpx
import numpy as np

from _loadgen import RouterProcess, pct, process_cpu_seconds, stream_once, wait_idle
from hetsched.router.config import parse_router_config
from hetsched.router.state import RouterState
from hetsched.router.types import EngineSignals, Policy, RouteRequest
from hetsched.simworker import WorkerSpec, spawn_worker
import report

MODEL = "qwen3-0.6b"


@dataclass(frozen=True)
class Sizes:
    """How long each part runs."""

    requests: int
    """Part 1: requests, alternating direct and through each router."""
    seconds: float
    """Parts 2 and 4: closed-loop seconds per run."""
    warmup_s: float
    """Parts 2 and 4: closed-loop warm-up before each run."""
    endpoints: int
    """Part 3: the large pool."""
    decisions: int
    """Part 3: decisions timed per policy and pool."""


FULL = Sizes(requests=400, seconds=15.0, warmup_s=2.0, endpoints=1000, decisions=2000)
QUICK = Sizes(requests=20, seconds=1.0, warmup_s=0.5, endpoints=100, decisions=50)


async def added_latency(worker_url: str, routers: dict[str, str], *, rate: float, requests: int) -> None:
    paths = {"direct": worker_url, **routers}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        for _ in range(10):  # warm every path
            for url in paths.values():
                await stream_once(client, url, model=MODEL, prompt_tokens=64, max_tokens=32)
        tasks = []
        rng = random.Random(1)
        start = time.monotonic()
        kinds = list(paths)
        for i in range(requests):
            start += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            kind = kinds[i % len(kinds)]
            tasks.append(asyncio.create_task(stream_once(client, paths[kind], model=MODEL, prompt_tokens=64,
                                                         max_tokens=32, kind=kind)))
        results = await asyncio.gather(*tasks)
    print(f"\n1. Added latency per streamed request ({requests} requests at {rate:g}/s, 64-token prompt, "
          f"32 tokens out, alternating {' / '.join(kinds)})")
    print(f"{'path':10} {'ok':>5} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p50':>10} {'E2E p99':>10}")
    rows = {}
    for kind in kinds:
        rs = [r for r in results if r.kind == kind]
        ttft = [r.ttft * 1e3 for r in rs]
        e2e = [(r.ttft + r.tpot * (r.tokens - 1)) * 1e3 for r in rs]
        rows[kind] = (pct(ttft, 50), pct(ttft, 99), pct(e2e, 50), pct(e2e, 99))
        print(f"{kind:10} {sum(r.ok for r in rs):>5} " + " ".join(f"{v:>8.2f}ms" for v in rows[kind]))
    for kind in routers:
        added = [rows[kind][i] - rows["direct"][i] for i in range(4)]
        print(f"{'+' + kind:10} {'':>5} " + " ".join(f"{v:>+8.2f}ms" for v in added))


async def _plain_once(client: httpx.AsyncClient, url: str) -> bool:
    body = {"model": MODEL, "prompt": "word " * 12, "max_tokens": 4}
    try:
        return (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
    except httpx.HTTPError:
        return False


async def one_core_cpu(router: RouterProcess, *, concurrency: int, seconds: float, warmup_s: float,
                       streamed: bool) -> float:
    """Router CPU milliseconds per request under ``concurrency`` closed-loop clients (printed with the rate)."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        done = failed = 0
        stop = 0.0

        async def one() -> bool:
            if streamed:
                return (await stream_once(client, router.url, model=MODEL, prompt_tokens=16, max_tokens=4)).ok
            return await _plain_once(client, router.url)

        async def loop() -> None:
            nonlocal done, failed
            while time.monotonic() < stop:
                ok = await one()
                done += ok
                failed += not ok

        stop = time.monotonic() + warmup_s
        await asyncio.gather(*(loop() for _ in range(8)))  # warm-up
        done = failed = 0
        stop = time.monotonic() + seconds
        cpu0, t0 = router.cpu_seconds(), time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        cpu, wall = router.cpu_seconds() - cpu0, time.monotonic() - t0
    per = cpu / max(done, 1) * 1e3
    print(f"   {'streamed' if streamed else 'non-streamed':13} {done:>6} done ({failed} failed), {done / wall:>5.0f} "
          f"req/s achieved; router CPU {per:.2f} ms/request -> one core ~{done / max(cpu, 1e-9):.0f} req/s; "
          f"router core busy {cpu / wall:.0%}")
    return per


async def scale_out(config: dict, *, seconds: float, warmup_s: float, concurrency: int) -> None:
    """Part 4: the same closed loop against one router process, then two sharing the port."""
    body = {"model": MODEL, "prompt": "word " * 12, "max_tokens": 4}
    rates: dict[int, float] = {}
    print(f"\n4. Scale-out: --workers 1 against 2 ({concurrency} closed-loop clients, non-streamed 4-token requests, "
          f"{seconds:g} s each, {os.cpu_count()} cores)")
    for workers in (1, 2):
        router = RouterProcess(config, workers=workers)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
                # a new connection per request, as many clients behind a balancer: the kernel spreads connections
                done = failed = 0
                stop = 0.0

                async def loop() -> None:
                    nonlocal done, failed
                    while time.monotonic() < stop:
                        try:
                            async with session.post(f"{router.url}/v1/completions", json=body) as response:
                                await response.read()
                                done += response.status == 200
                                failed += response.status != 200
                        except aiohttp.ClientError:
                            failed += 1

                stop = time.monotonic() + warmup_s
                await asyncio.gather(*(loop() for _ in range(8)))  # warm-up
                done = failed = 0
                pids = router.pids()
                cpu0 = [process_cpu_seconds(pid) for pid in pids]
                load0, t0 = os.getloadavg()[0], time.monotonic()
                stop = t0 + seconds
                await asyncio.gather(*(loop() for _ in range(concurrency)))
                wall = time.monotonic() - t0
                cpu = [process_cpu_seconds(pid) - before for pid, before in zip(pids, cpu0, strict=True)]
        finally:
            router.stop()
        rates[workers] = done / wall
        serving = sorted((c for c in cpu if c > 0.05 * sum(cpu)), reverse=True)
        print(f"   --workers {workers}: {done:>6} done ({failed} failed), {rates[workers]:>5.0f} req/s; router CPU "
              f"{sum(cpu) / max(done, 1) * 1e3:.2f} ms/request, {sum(cpu) / wall:.2f} cores busy, split "
              f"{' / '.join(f'{c / sum(cpu):.0%}' for c in serving)}; load average {load0:.1f} -> "
              f"{os.getloadavg()[0]:.1f}")
    print(f"   throughput, 2 processes / 1: {rates[2] / rates[1]:.2f}x")


def baseline_source(rev: str, into: str) -> str:
    """The ``hetsched`` package as of ``rev``, extracted (``git archive``) under ``into``."""
    archive = subprocess.run(["git", "archive", rev, "hetsched"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def decision_time(endpoints: int, policy: Policy, *, decisions: int = 2000) -> tuple[float, float]:
    rng = random.Random(7)
    accelerators = ["h100-sxm", "a100-80gb", "l4", "l40s"]
    config = parse_router_config({"policy": str(policy), "models": {"llama-3.1-8b": {
        "slo": {"ttft_ms": 500, "tpot_ms": 50},
        "endpoints": [{"url": f"http://10.0.{i // 250}.{i % 250}:8000", "accelerator": accelerators[i % 4]}
                      for i in range(endpoints)]}}})
    state = RouterState(config, rng=rng)
    state.set_endpoints("llama-3.1-8b", config.static_endpoints())
    request = RouteRequest("llama-3.1-8b", 800, 200, tuple(rng.getrandbits(64) for _ in range(8)))
    for endpoint in config.static_endpoints():
        for _ in range(rng.randint(0, 40)):
            state.start(endpoint.url, request)
        running = rng.randint(0, 60)
        state.record_signals(endpoint.url, EngineSignals(scraped_at=0.0, running=running, waiting=rng.randint(0, 5),
                                                         kv_usage=rng.random()))
    times = []
    for _ in range(decisions):
        t0 = time.perf_counter()
        state.decide(request, now=1.0)
        times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help=f"part 1 requests (default {FULL.requests}; --quick "
                                                      f"{QUICK.requests})")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, help=f"parts 2 and 4: seconds per run (default {FULL.seconds:g}; "
                                                       f"--quick {QUICK.seconds:g})")
    parser.add_argument("--baseline", help="a git revision whose router is measured beside this tree's")
    parser.add_argument("--profile", help="write a cProfile of this tree's router under streamed load here")
    parser.add_argument("--skip-latency", action="store_true", help="leave out part 1 (added latency)")
    parser.add_argument("--skip-decisions", action="store_true", help="leave out part 3 (decision time)")
    parser.add_argument("--skip-one-core", action="store_true", help="leave out part 2 (one core)")
    parser.add_argument("--scale-out", action="store_true", help="add part 4 (--workers 1 against 2)")
    parser.add_argument("--quick", action="store_true", help="every part on a second or two of load: a smoke run")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    sizes = replace(sizes, requests=args.requests or sizes.requests, seconds=args.seconds or sizes.seconds)
    scratch = tempfile.TemporaryDirectory()
    sources: dict[str, str | None] = {"router": None}
    if args.baseline:
        sources["baseline"] = baseline_source(args.baseline, scratch.name)

    if not args.skip_latency:
        worker = spawn_worker(WorkerSpec(model=MODEL, accelerator="h100-sxm"), timeout=120)
        routers = {kind: RouterProcess({"models": {MODEL: {"endpoints": [{"url": worker.url,
                                                                          "accelerator": "h100-sxm"}]}}},
                                       source=source) for kind, source in sources.items()}
        try:
            await added_latency(worker.url, {kind: r.url for kind, r in routers.items()}, rate=args.rate,
                                requests=sizes.requests)
        finally:
            for router in routers.values():
                router.stop()
            worker.stop()

    fast = spawn_worker(WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=100.0), port=None, timeout=120)
    config = {"models": {MODEL: {"endpoints": [{"url": fast.url, "accelerator": "h100-sxm"}]}}}
    try:
        async with httpx.AsyncClient() as client:
            await wait_idle(client, [fast.url])
        if args.scale_out:
            await scale_out(config, seconds=sizes.seconds, warmup_s=sizes.warmup_s, concurrency=64)
        if not args.skip_one_core:
            print(f"\n2. Router on one core (32 closed-loop clients, 4-token requests, {sizes.seconds:g} s each)")
        cpu: dict[tuple[str, bool], float] = {}
        for streamed in (True, False) if not args.skip_one_core else ():
            for kind, source in sources.items():
                router = RouterProcess(config, cpu=0, source=source)
                print(f"   {kind}:")
                try:
                    cpu[kind, streamed] = await one_core_cpu(router, concurrency=32, seconds=sizes.seconds,
                                                             warmup_s=sizes.warmup_s, streamed=streamed)
                finally:
                    router.stop()
        if args.baseline and not args.skip_one_core:
            for streamed in (True, False):
                print(f"   CPU per request, {'streamed' if streamed else 'non-streamed'}: this tree / "
                      f"{args.baseline} = {cpu['router', streamed] / cpu['baseline', streamed]:.2f}")
        if args.profile:
            router = RouterProcess(config, cpu=0, profile=args.profile)
            try:
                await one_core_cpu(router, concurrency=32, seconds=sizes.seconds, warmup_s=sizes.warmup_s,
                                   streamed=True)
            finally:
                router.stop()
            out = io.StringIO()
            pstats.Stats(args.profile, stream=out).sort_stats("tottime").print_stats(25)
            print("   profile (streamed, by own time):\n" + out.getvalue())
    finally:
        fast.stop()
        scratch.cleanup()

    if args.skip_decisions:
        return
    print("\n3. Decision time (RouterState.decide, live load on every endpoint)")
    big = sizes.endpoints
    print(f"{'policy':14} {'10 endpoints p99':>17} {f'{big} p50':>10} {f'{big} p99':>10} {'ratio p99':>10}")
    for policy in Policy:
        _, small99 = decision_time(10, policy, decisions=sizes.decisions)
        big50, big99 = decision_time(big, policy, decisions=sizes.decisions)
        print(f"{policy:14} {small99 * 1e6:>15.0f}µs {big50 * 1e3:>8.2f}ms {big99 * 1e3:>8.2f}ms {big99 / small99:>9.0f}×")


if __name__ == "__main__":
    report.main(lambda: asyncio.run(main()), section="router_overhead")
