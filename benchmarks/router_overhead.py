"""Router overhead: added latency per streamed request, throughput of one core, decision time at scale.

1. Added latency: one simulated worker (qwen3-0.6b on h100-sxm, real time),
   a fixed open-loop rate, requests alternating between the worker directly
   and the router in front of it; p50/p99 of TTFT and end-to-end for both, in
   the same run, and their difference.
2. Throughput on one core: the router pinned to CPU 0, closed-loop clients
   sending short streamed requests to a fast worker; the router's own CPU
   seconds per request give what one core sustains, independent of what the
   client and worker (on the other core) cost.
3. Decision time: ``RouterState.decide`` over 1,000 endpoints of mixed
   accelerators with live load, per policy, against 10 endpoints.

Run: ``.venv/bin/python benchmarks/router_overhead.py`` (about two minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx
import numpy as np

from _loadgen import RouterProcess, pct, stream_once, wait_idle
from hetsched.router.config import parse_router_config
from hetsched.router.state import RouterState
from hetsched.router.types import EngineSignals, Policy, RouteRequest
from hetsched.simworker import WorkerSpec, spawn_worker

MODEL = "qwen3-0.6b"


async def added_latency(worker_url: str, router_url: str, *, rate: float, requests: int) -> None:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        for _ in range(10):  # warm both paths
            await stream_once(client, worker_url, model=MODEL, prompt_tokens=64, max_tokens=32)
            await stream_once(client, router_url, model=MODEL, prompt_tokens=64, max_tokens=32)
        tasks = []
        rng = random.Random(1)
        start = time.monotonic()
        for i in range(requests):
            start += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            url, kind = (router_url, "router") if i % 2 else (worker_url, "direct")
            tasks.append(asyncio.create_task(stream_once(client, url, model=MODEL, prompt_tokens=64, max_tokens=32,
                                                         kind=kind)))
        results = await asyncio.gather(*tasks)
    print(f"\n1. Added latency per streamed request ({requests} requests at {rate:g}/s, 64-token prompt, "
          f"32 tokens out, half direct, half via the router)")
    print(f"{'path':8} {'ok':>5} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p50':>10} {'E2E p99':>10}")
    rows = {}
    for kind in ("direct", "router"):
        rs = [r for r in results if r.kind == kind]
        ttft = [r.ttft * 1e3 for r in rs]
        e2e = [(r.ttft + r.tpot * (r.tokens - 1)) * 1e3 for r in rs]
        rows[kind] = (pct(ttft, 50), pct(ttft, 99), pct(e2e, 50), pct(e2e, 99))
        print(f"{kind:8} {sum(r.ok for r in rs):>5} " + " ".join(f"{v:>8.2f}ms" for v in rows[kind]))
    added = [rows["router"][i] - rows["direct"][i] for i in range(4)]
    print(f"{'added':8} {'':>5} " + " ".join(f"{v:>+8.2f}ms" for v in added))


async def one_core_throughput(worker_url: str, router: RouterProcess, *, concurrency: int, seconds: float) -> None:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        stop = time.monotonic() + seconds
        done = 0
        failed = 0

        async def loop() -> None:
            nonlocal done, failed
            while time.monotonic() < stop:
                r = await stream_once(client, router.url, model=MODEL, prompt_tokens=16, max_tokens=4)
                done += r.ok
                failed += not r.ok

        await asyncio.gather(*(loop() for _ in range(8)))  # warm-up
        done = failed = 0
        stop = time.monotonic() + seconds
        cpu0, t0 = router.cpu_seconds(), time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        cpu, wall = router.cpu_seconds() - cpu0, time.monotonic() - t0
    print(f"\n2. Router on one core ({concurrency} closed-loop clients, streamed 4-token requests, {seconds:g} s)")
    print(f"   completed {done} ({failed} failed) = {done / wall:.0f} req/s achieved on this 2-core machine "
          f"(client and worker share the other core)")
    print(f"   router CPU: {cpu:.2f} s = {cpu / max(done, 1) * 1e3:.2f} ms per request "
          f"-> one core sustains ~{done / cpu:.0f} req/s; router core busy {cpu / wall:.0%}")


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
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()

    worker = spawn_worker(WorkerSpec(model=MODEL, accelerator="h100-sxm"))
    router = RouterProcess({"models": {MODEL: {"endpoints": [{"url": worker.url, "accelerator": "h100-sxm"}]}}})
    try:
        await added_latency(worker.url, router.url, rate=args.rate, requests=args.requests)
    finally:
        router.stop()
        worker.stop()

    fast = spawn_worker(WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=100.0), port=None)
    router = RouterProcess({"models": {MODEL: {"endpoints": [{"url": fast.url, "accelerator": "h100-sxm"}]}}},
                           cpu=0)
    try:
        async with httpx.AsyncClient() as client:
            await wait_idle(client, [fast.url])
        await one_core_throughput(fast.url, router, concurrency=32, seconds=args.seconds)
    finally:
        router.stop()
        fast.stop()

    print("\n3. Decision time (RouterState.decide, live load on every endpoint)")
    print(f"{'policy':14} {'10 endpoints p99':>17} {'1000 p50':>10} {'1000 p99':>10} {'ratio p99':>10}")
    for policy in Policy:
        _, small99 = decision_time(10, policy)
        big50, big99 = decision_time(1000, policy)
        print(f"{policy:14} {small99 * 1e6:>15.0f}µs {big50 * 1e3:>8.2f}ms {big99 * 1e3:>8.2f}ms {big99 / small99:>9.0f}×")


if __name__ == "__main__":
    asyncio.run(main())
