"""hetsched's router against vllm-router and sglang-router on the same simulated fleet and trace, in one run.

The peers (Rust routers on PyPI: vllm-router 0.1.17, sglang-router 0.3.2) go into ``.venv-peers``, a virtual
environment of this benchmark only, on the first run; hetsched never depends on them. Each router runs as its
own process and is driven by the same client and the same request sequence.

1. Overhead: one simulated worker (qwen3-0.6b on h100-sxm at ``--overhead-time-scale``), each router in front
   of it in turn. At each rate of ``--rates``, Poisson arrivals alternate between the worker directly and the
   router: the router's added TTFT p50/p99 on streamed requests and added end-to-end p50/p99 on non-streamed
   ones (each against the direct requests of the same stream), and the router's CPU per request (its
   processes' CPU time over the requests it carried), as a ratio to vllm-router's.
2. Goodput on a mixed fleet at ``--load`` (90 %) of its SLO capacity: ``router_policies.py``'s pool (2 ×
   h100-sxm, 2 × a100-80gb, 4 × l4; llama-3.1-8b at time scale 0.1), workload and SLO; each router with its
   best policy for this (hetsched ``slo``, the peers ``cache_aware``).
3. Median TTFT at 50 % load, the same way.
4. A worker kill: at 90 % load the worker with the most requests in flight (read from the workers' own
   ``/metrics``, the same for every router) is SIGKILLed a third of the way in, then restarted for the next
   router: requests lost that had not started streaming, broken streams and how many of those ended with an
   error event.

``--quick``: one rate for a second, then the fleet parts at ``--load`` only, on a couple of workers (one a100-80gb,
one l4, time scale 1) with a score of requests, sized the same way (one seed's search); the peers only where
``.venv-peers`` already holds them (a quick run installs nothing). A check that the benchmark runs, not figures to
quote.

Run: ``.venv/bin/python benchmarks/router_peers.py [--write]`` (about eight minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

import report
from _loadgen import Outcome, RouterProcess, pct, process_cpu_seconds, wait_idle
from hetsched.errors import BackendUnavailableError
from hetsched.router.types import Policy
from hetsched.sim.capacity import DEFAULT_SEEDS
from hetsched.simworker import WorkerSpec, spawn_worker
from hetsched.simworker.launch import WorkerProcess, free_port
from router_policies import (MODEL, POOL, QUICK_POOL, QUICK_REQUESTS, QUICK_SEEDS, SLO_TARGET, pool_capacity,
                             router_config, run_load, spawn_fleet, workload)

PEERS_VENV = Path(__file__).resolve().parent.parent / ".venv-peers"
PEER_PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2")
SMALL_MODEL = "qwen3-0.6b"
PEERS = ("vllm-router", "sglang-router")
QUICK_RATES = "50"
QUICK_SECONDS = 1.0


def peers_installed() -> bool:
    return all((PEERS_VENV / "bin" / name).exists() for name in PEERS)


def ensure_peers() -> Path:
    """``.venv-peers/bin``, with both peers installed in it (created on the first run)."""
    bin_dir = PEERS_VENV / "bin"
    if not peers_installed():
        print(f"installing {', '.join(PEER_PACKAGES)} into {PEERS_VENV.name}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", *PEER_PACKAGES], check=True)
    return bin_dir


class PeerProcess:
    """vllm-router or sglang-router over ``urls`` with ``policy``, in a child process."""

    def __init__(self, name: str, urls: list[str], *, policy: str) -> None:
        bin_dir = ensure_peers()
        self.port = free_port()
        command = [str(bin_dir / "vllm-router")] if name == "vllm-router" else [str(bin_dir / "sglang-router"),
                                                                                "launch"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                    "--prometheus-port", str(free_port()), "--worker-urls", *urls]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise BackendUnavailableError(f"{name} exited: {self.log.read()[-2000:]}")
            try:
                httpx.get(f"{self.url}/v1/models", timeout=0.5)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise BackendUnavailableError(f"{name} did not start")

    def pids(self) -> list[int]:
        return [self.process.pid]

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.unlink(self.log.name)


Router = RouterProcess | PeerProcess


def start_router(name: str, workers: list[WorkerProcess], *, hetsched_config: dict) -> Router:
    if name == "hetsched":
        return RouterProcess(hetsched_config)
    return PeerProcess(name, [w.url for w in workers], policy="cache_aware")


# --- 1. overhead -------------------------------------------------------------------------------------------


@dataclass
class Timed:
    via_router: bool
    ok: bool
    first_s: float  # TTFT when streamed, else end to end
    status: int = 0  # 0: no answer


async def timed_request(session: aiohttp.ClientSession, url: str, *, streamed: bool, via_router: bool) -> Timed:
    body = {"model": SMALL_MODEL, "prompt": "word " * 48, "max_tokens": 16, "stream": streamed}
    sent = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if not streamed:
                await response.read()
                return Timed(via_router, response.status == 200, time.monotonic() - sent, response.status)
            first = float("nan")
            async for chunk in response.content.iter_any():
                if first != first and b'"text"' in chunk:
                    first = time.monotonic() - sent
            return Timed(via_router, response.status == 200 and first == first, first, response.status)
    except aiohttp.ClientError:
        return Timed(via_router, False, float("nan"))


async def overhead_at(router: Router, worker_url: str, *, rate: float, seconds: float, streamed: bool,
                      seed: int) -> tuple[list[float], float, Counter[int]]:
    """Added p50/p99 (ms) at ``rate``, the router's CPU ms per request it carried, and failures by status."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(20):  # warm both paths' connections
            await asyncio.gather(timed_request(session, router.url, streamed=streamed, via_router=True),
                                 timed_request(session, worker_url, streamed=streamed, via_router=False))
        rng = random.Random(seed)
        tasks: list[asyncio.Task[Timed]] = []
        cpu0 = router.cpu_seconds()
        start = at = time.monotonic()
        i = 0
        while at - start < seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            via = i % 2 == 0
            tasks.append(asyncio.create_task(timed_request(session, router.url if via else worker_url,
                                                           streamed=streamed, via_router=via)))
            i += 1
        results = await asyncio.gather(*tasks)
        cpu = router.cpu_seconds() - cpu0
    routed = [r.first_s * 1e3 for r in results if r.via_router and r.ok]
    direct = [r.first_s * 1e3 for r in results if not r.via_router and r.ok]
    added = [pct(routed, q) - pct(direct, q) for q in (50, 99)]
    carried = sum(r.via_router for r in results)
    return added, cpu / max(carried, 1) * 1e3, Counter(r.status for r in results if not r.ok)


async def overhead(args: argparse.Namespace) -> None:
    rates = [float(r) for r in args.rates.split(",")]
    routers = args.routers
    worker = spawn_worker(WorkerSpec(model=SMALL_MODEL, accelerator="h100-sxm", time_scale=args.overhead_time_scale),
                          port=None, timeout=180)
    config = {"policy": "least-request", "models": {SMALL_MODEL: {"endpoints": [
        {"url": worker.url, "accelerator": "h100-sxm"}]}}}
    print(f"1. Overhead: one worker ({SMALL_MODEL} on h100-sxm, time scale {args.overhead_time_scale:g}), 48-token "
          f"prompts, 16 tokens out, Poisson arrivals alternating direct / through the router, {args.seconds:g} s per "
          f"rate and mode; added = router's percentile - direct's (ms)")
    print(f"{'router':14} {'req/s':>6} {'+TTFT p50':>10} {'+TTFT p99':>10} {'+E2E p50':>9} {'+E2E p99':>9} "
          f"{'CPU ms/req str':>15} {'non-str':>8} {'failed':>7}  load")
    cpu: dict[tuple[str, float, bool], float] = {}
    try:
        for name in routers:
            router = start_router(name, [worker], hetsched_config=config)
            try:
                for rate in rates:
                    s_added, cpu[name, rate, True], s_failed = await overhead_at(
                        router, worker.url, rate=rate, seconds=args.seconds, streamed=True, seed=int(rate))
                    n_added, cpu[name, rate, False], n_failed = await overhead_at(
                        router, worker.url, rate=rate, seconds=args.seconds, streamed=False, seed=int(rate) + 1)
                    print(f"{name:14} {rate:>6g} {s_added[0]:>+9.2f} {s_added[1]:>+10.2f} {n_added[0]:>+9.2f} "
                          f"{n_added[1]:>+9.2f} {cpu[name, rate, True]:>15.2f} {cpu[name, rate, False]:>8.2f} "
                          f"{sum((s_failed + n_failed).values()):>7}  {os.getloadavg()[0]:.1f}", flush=True)
                    if s_failed or n_failed:
                        print("   failed by status (0: no answer): " + ", ".join(
                            f"{status} x {count}" for status, count in (s_failed + n_failed).most_common()))
            finally:
                router.stop()
    finally:
        worker.stop()
    if "vllm-router" in routers:
        print("router CPU per request / vllm-router's (streamed, non-streamed): " + "; ".join(
            f"{name} at {rate:g}/s {cpu[name, rate, True] / cpu['vllm-router', rate, True]:.2f}x, "
            f"{cpu[name, rate, False] / cpu['vllm-router', rate, False]:.2f}x"
            for name in routers if name != "vllm-router" for rate in rates))


# --- 2-4. the mixed fleet ------------------------------------------------------------------------------------


def busiest(workers: list[WorkerProcess]) -> WorkerProcess:
    """The worker with the most requests running and waiting, by its own ``/metrics``."""
    def load(worker: WorkerProcess) -> float:
        try:
            text = httpx.get(f"{worker.url}/metrics", timeout=2).text
        except httpx.HTTPError:
            return -1.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
    return max(workers, key=load)


def why_lost(outcomes: list[Outcome]) -> str:
    """The commonest reasons requests were lost, for the line under a router's row."""
    reasons = Counter((o.error or f"{o.tokens}/{o.expected} tokens")[:70] for o in outcomes if not o.ok)
    return "; ".join(f"{count} x {reason}" for reason, count in reasons.most_common(3))


def good(outcome: Outcome, scale: float) -> bool:
    return outcome.ok and outcome.ttft * scale * 1e3 <= SLO_TARGET.ttft_ms and (
        outcome.tokens < 2 or outcome.tpot * scale * 1e3 <= SLO_TARGET.tpot_ms)


def fleet_requests(args: argparse.Namespace, rate: float) -> int:
    """Requests per fleet run at ``rate`` (hardware req/s): the window's, or --quick's few dozen."""
    return QUICK_REQUESTS if args.quick else int(rate * args.window * args.time_scale)


async def fleet(args: argparse.Namespace) -> None:
    scale = args.time_scale
    pool = QUICK_POOL if args.quick else POOL
    mix = workload()
    capacity = pool_capacity(mix, pool, seeds=QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    total = sum(capacity[acc] * n for acc, n in pool)
    workers = spawn_fleet(scale, pool)
    best = {"hetsched": "slo", "vllm-router": "cache_aware", "sglang-router": "cache_aware"}
    print(f"\n2-4. Mixed fleet: {MODEL} on " + ", ".join(f"{n} x {acc}" for acc, n in pool)
          + f" (time scale {scale:g}); SLO TTFT {SLO_TARGET.ttft_ms:g} ms / TPOT {SLO_TARGET.tpot_ms:g} ms; "
          f"pool SLO capacity {total:.1f} req/s; "
          + (f"{QUICK_REQUESTS} requests" if args.quick else f"{args.window:g} wall s of arrivals")
          + " per run; latencies in hardware time")
    print(f"{'router (policy)':28} {'load':>5} {'goodput':>8} {'SLO met':>8} {'lost':>5} {'TTFT p50':>9} "
          f"{'TTFT p99':>9}")
    try:
        for load in (args.load,) if args.quick else (args.load, 0.5):
            rate = load * total
            batch = mix.sample(fleet_requests(args, rate), rate=rate, seed=11)
            arrivals = (batch.arrival_s - batch.arrival_s[0]).tolist()
            lengths = list(zip(batch.input_tokens.tolist(), batch.output_tokens.tolist(), strict=True))
            window_hw = QUICK_REQUESTS / rate if args.quick else args.window * scale
            grace = arrivals[-1] / scale + 30
            for name in args.routers:
                router = start_router(name, workers, hetsched_config=router_config(workers, Policy.SLO))
                try:
                    outcomes = await run_load(router.url, arrivals, lengths, scale=scale, grace=grace)
                finally:
                    router.stop()
                done = [o for o in outcomes if o.ok]
                goodput = sum(good(o, scale) for o in outcomes) / window_hw
                print(f"{name + ' (' + best[name] + ')':28} {load:>5.0%} {goodput:>8.1f} "
                      f"{sum(good(o, scale) for o in outcomes) / len(outcomes):>8.1%} {len(outcomes) - len(done):>5} "
                      f"{pct([o.ttft * scale * 1e3 for o in done], 50):>7.0f}ms "
                      f"{pct([o.ttft * scale * 1e3 for o in done], 99):>7.0f}ms", flush=True)
                if len(done) < len(outcomes):
                    print(f"   lost: {why_lost(outcomes)}")
                async with httpx.AsyncClient() as client:
                    await wait_idle(client, [w.url for w in workers])
        await kill_runs(workers, args, mix=mix, total=total)
    finally:
        for worker in workers:
            worker.stop()


async def kill_runs(workers: list[WorkerProcess], args: argparse.Namespace, *, mix: object, total: float) -> None:
    scale = args.time_scale
    rate = args.load * total
    batch = mix.sample(fleet_requests(args, rate), rate=rate, seed=13)  # type: ignore[attr-defined]
    arrivals = (batch.arrival_s - batch.arrival_s[0]).tolist()
    lengths = list(zip(batch.input_tokens.tolist(), batch.output_tokens.tolist(), strict=True))
    print(f"\n4. Worker kill at {args.load:.0%} load ({len(arrivals)} requests): the busiest worker SIGKILLed a third "
          f"of the way in")
    print(f"{'router':14} {'killed':>10} {'lost':>5} {'not streaming':>14} {'broken streams':>15} "
          f"{'with error event':>17}")
    for name in args.routers:
        router = start_router(name, workers, hetsched_config=router_config(workers, Policy.SLO))
        killed: list[WorkerProcess] = []

        def at_start(start: float) -> None:
            async def kill() -> None:
                await asyncio.sleep(max(0.0, start + arrivals[-1] / scale / 3 - time.monotonic()))
                victim = await asyncio.to_thread(busiest, workers)
                victim.kill()
                killed.append(victim)
            watchers.append(asyncio.create_task(kill()))

        watchers: list[asyncio.Task[None]] = []
        try:
            outcomes = await run_load(router.url, arrivals, lengths, scale=scale, grace=arrivals[-1] / scale + 30,
                                      on_start=at_start)
            await asyncio.gather(*watchers)
        finally:
            router.stop()
        lost = [o for o in outcomes if not o.ok]
        broken = [o for o in lost if o.started_streaming]
        flagged = sum(o.error == "stream error event" for o in broken)
        victim = killed[0]
        print(f"{name:14} {victim.spec.accelerator:>10} {len(lost):>5} {len(lost) - len(broken):>14} "
              f"{len(broken):>15} {flagged:>17}", flush=True)
        if lost:
            print(f"   lost: {why_lost(outcomes)}")
        if name == args.routers[-1]:
            break  # no router left to give the whole fleet back to
        index = workers.index(victim)
        workers[index] = spawn_worker(victim.spec, port=int(victim.url.rsplit(":", 1)[1]), timeout=180)
        async with httpx.AsyncClient() as client:
            await wait_idle(client, [w.url for w in workers])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", help=f"overhead: request rates (req/s), comma-separated (default 25,50,100; "
                                         f"--quick {QUICK_RATES})")
    parser.add_argument("--seconds", type=float, help=f"overhead: seconds per rate and mode (default 6; --quick "
                                                       f"{QUICK_SECONDS:g})")
    parser.add_argument("--overhead-time-scale", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, help="the mixed fleet's time scale (default 0.1; --quick 1)")
    parser.add_argument("--load", type=float, default=0.9, help="goodput and kill runs: share of SLO capacity")
    parser.add_argument("--window", type=float, default=8.0, help="wall seconds of arrivals per fleet run")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-fleet", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="a second of overhead, two workers, a few dozen requests; peers only if installed")
    args = parser.parse_args()
    args.rates = args.rates or (QUICK_RATES if args.quick else "25,50,100")
    args.seconds = args.seconds or (QUICK_SECONDS if args.quick else 6.0)
    args.time_scale = args.time_scale or (1.0 if args.quick else 0.1)
    if args.quick and not peers_installed():
        print(f"{', '.join(PEERS)}: not in {PEERS_VENV.name} (a full run installs them; --quick does not), so "
              "hetsched alone")
        args.routers = ("hetsched",)
    else:
        ensure_peers()
        args.routers = ("hetsched", *PEERS)
    print(f"machine: {os.cpu_count()} cores, load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} at the "
          f"start; every process (client, workers, router) shares them")
    if not args.skip_overhead:
        await overhead(args)
    if not args.skip_fleet:
        await fleet(args)


if __name__ == "__main__":
    report.main(lambda: asyncio.run(main()), section="router_peers")
