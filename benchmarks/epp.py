"""The endpoint picker (``hetsched epp``): decision latency, goodput on a mixed fleet, CPU per request.

Workers: ``router_policies.py``'s pool, llama-3.1-8b on 2 × h100-sxm, 2 × a100-80gb and 4 × l4 simulated
workers at ``--time-scale`` 0.1, with its SLO and its short/long mix. Every EPP here is one ``hetsched epp
--config FILE`` process over those workers (its health and metrics polling live), ready once its gRPC health
service reports ``readiness`` SERVING. The gateway is ``_gateway.Gateway``, playing Envoy's side of ext_proc
(FULL_DUPLEX_STREAMED) in this process.

1. Decision latency: open-loop Poisson arrivals at 100 and 500 requests/s, each a streamed completion from the
   mix whose body goes in 4 KiB chunks; the time from sending the body's last chunk to reading the EPP's answer
   to the headers (the pick). Each request then goes through the response phase with a canned SSE answer
   (response headers, five body chunks), so the EPP does all its per-request work; nothing is forwarded. The EPP
   is pinned to one core and this process (and the idle workers) to the other, when there are two.
2. Goodput at ``--load`` (90 %) of the pool's SLO capacity, the sum of each replica's from the simulator's
   capacity search: the same Poisson arrival sequence through (a) the gateway asking the EPP (policy ``slo``)
   and forwarding to its pick, its answer streamed back through the EPP; (b) round-robin, the gateway alone, no
   EPP; (c) ``hetsched route`` (policy ``slo``), the clients sending to it. A token is timed when the client
   would see it: as the EPP hands its chunk back in (a), as it arrives in (b) and (c). Goodput as in
   ``router_policies.py``: requests meeting both SLO thresholds per hardware second of the arrival window.
3. CPU per request: the EPP's process against the router's over runs (a) and (c) (the same workers and request
   sequence, streamed), from ``/proc``: their CPU from the first arrival until the last answer, over the
   requests, and the same less what each spends idle (health and metrics polling, measured after the load).
   The gateway's CPU in (a) is not the EPP's, as the clients' in (c) is not the router's.

``--quick``: the same parts on a couple of workers (one a100-80gb, one l4, time scale 1) with a few dozen
requests each, sized the same way; a check that the benchmark runs, not figures to quote.

Run: ``.venv/bin/python benchmarks/epp.py`` (about four minutes; ``--quick`` under a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import time
from collections.abc import Awaitable, Callable
from itertools import cycle

import grpc
import httpx

from _gateway import CANNED_STREAM, Gateway, tokens_in
from _loadgen import EppProcess, Outcome, RouterProcess, pct, pin, stream_once, unique_prompt, wait_idle
from hetsched.router.types import Policy
from hetsched.simworker.launch import WorkerProcess
from router_policies import LONG, MODEL, POOL, QUICK_POOL, SHORT, SLO_TARGET, pool_capacity, router_config, \
    spawn_fleet, summarize, workload
import report

DECISION_RATES = (100.0, 500.0)
TARGET_P50_MS, TARGET_P99_MS = 1.0, 5.0
Send = Callable[[int, int, str], Awaitable[Outcome]]
"""A request of the trace (prompt tokens, tokens out, kind) sent one way, as its client saw it."""


def completion(prompt_tokens: int, max_tokens: int) -> bytes:
    """The streamed completion ``_loadgen.stream_once`` sends for the same lengths."""
    return json.dumps({"model": MODEL, "prompt": unique_prompt(prompt_tokens), "max_tokens": max_tokens,
                       "stream": True}).encode()


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=500))


class Pinning:
    """The EPP on the first core this process may use, this process and the workers on the others (none of it
    with fewer than two cores); :meth:`release` gives this process and the workers every core back."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.all = os.sched_getaffinity(0)
        cores = sorted(self.all)
        self.epp = cores[0] if len(cores) > 1 else None
        self.rest = set(cores[1:])
        self.pids = [os.getpid(), *(w.process.pid for w in workers)]

    def apply(self) -> None:
        if self.epp is not None:
            for pid in self.pids:
                pin(pid, self.rest)

    def release(self) -> None:
        for pid in self.pids:
            pin(pid, self.all)

    def describe(self) -> str:
        if self.epp is None:
            return "one core: nothing pinned, the EPP shares it with this process"
        return (f"EPP pinned to core {self.epp}; this process (the gateway) and the idle workers to core(s) "
                f"{','.join(map(str, sorted(self.rest)))}")


async def decision_latency(epp: EppProcess, *, counts: dict[float, int], seed: int = 5) -> dict[float, tuple]:
    """Part 1: per rate, the pick's p50 and p99 (ms) over ``counts[rate]`` Poisson arrivals (printed)."""
    mix = random.Random(seed)
    results: dict[float, tuple] = {}
    async with grpc.aio.insecure_channel(epp.address) as channel:
        gateway = Gateway(channel)

        def body() -> bytes:
            return completion(*(LONG if mix.random() < 0.2 else SHORT))

        for _ in range(50):  # warm the channel and the EPP's caches
            await gateway.request(body(), expected=tokens_in(b"".join(CANNED_STREAM)))
        print(f"{'rate/s':>7} {'requests':>9} {'ok':>6} {'pick p50':>9} {'pick p99':>9} {'pick max':>9} "
              f"{'send lag p99':>13} {'EPP CPU/req':>12} {'EPP core':>9}")
        for rate, n in counts.items():
            arrivals = random.Random(seed + int(rate))

            async def one(at: float) -> tuple[float, Outcome, float]:
                lag = time.monotonic() - at
                out, decision = await gateway.request(body(), expected=tokens_in(b"".join(CANNED_STREAM)))
                return lag, out, decision

            tasks = []
            cpu0 = epp.cpu_seconds()
            start = at = time.monotonic()
            for _ in range(n):
                at += arrivals.expovariate(rate)
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.create_task(one(at)))
            done = await asyncio.gather(*tasks)
            wall, cpu = time.monotonic() - start, epp.cpu_seconds() - cpu0
            ok = [(lag, d) for lag, out, d in done if out.ok]
            picks = [d * 1e3 for _, d in ok]
            p50, p99 = pct(picks, 50), pct(picks, 99)
            results[rate] = (p50, p99)
            worst = max(picks, default=float("nan"))
            print(f"{rate:>7.0f} {n:>9} {len(ok):>6} {p50:>7.2f}ms {p99:>7.2f}ms {worst:>7.2f}ms "
                  f"{pct([lag * 1e3 for lag, _, _ in done], 99):>11.2f}ms {cpu / n * 1e3:>10.2f}ms "
                  f"{cpu / wall:>9.0%}")
            failed = [out.error for _, out, _ in done if not out.ok]
            if failed:
                print(f"   failed {len(failed)}: {failed[0]}")
    return results


async def run_trace(send: Send, arrivals: list[float], lengths: list[tuple[int, int]], *, scale: float,
                    grace: float) -> list[Outcome]:
    """The trace's requests at their arrival times (hardware seconds, ``scale`` × wall); those unfinished
    ``grace`` seconds after the last was sent are lost."""
    tasks: list[asyncio.Task[Outcome]] = []
    start = time.monotonic()
    for at, (prompt, out) in zip(arrivals, lengths, strict=True):
        await asyncio.sleep(max(0.0, start + at / scale - time.monotonic()))
        tasks.append(asyncio.create_task(send(prompt, out, "long" if prompt == LONG[0] else "short")))
    done, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        task.cancel()
    return [t.result() if t in done and not t.cancelled() else Outcome("timeout", 0.0, error="timeout")
            for t in tasks]


async def idle_rate(cpu_seconds: Callable[[], float], seconds: float) -> float:
    """CPU seconds per second a process spends with no requests (its polling)."""
    cpu0, t0 = cpu_seconds(), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds() - cpu0) / (time.monotonic() - t0)


async def measured(send: Send, cpu_seconds: Callable[[], float], trace: dict, *,
                   idle_s: float) -> tuple[list[Outcome], dict]:
    """The trace through ``send``, with the CPU the serving process spent on it, and what it spends idle
    afterwards (warm, its polling alone: the seconds after a start hold one-off work, kept out of both)."""
    await asyncio.sleep(2.0)
    cpu0, t0 = cpu_seconds(), time.monotonic()
    outcomes = await run_trace(send, **trace)
    cpu, wall = cpu_seconds() - cpu0, time.monotonic() - t0
    await asyncio.sleep(1.0)  # the last answers' accounting
    idle = await idle_rate(cpu_seconds, idle_s)
    return outcomes, {"cpu": cpu, "wall": wall, "idle": idle, "requests": len(outcomes)}


async def goodput(workers: list[WorkerProcess], trace: dict, *, window_hw: float,
                  idle_s: float) -> tuple[dict, dict]:
    """Part 2: the three runs (rows printed); their goodput rows and the EPP's and the router's CPU books."""
    scale = trace["scale"]
    config = router_config(workers, Policy.SLO)
    accelerator_of = {w.url: w.spec.accelerator for w in workers}
    rows, books, picks = {}, {}, []
    print(f"\n{'run':14} {'goodput':>8} {'SLO met':>8} {'lost':>6} {'TTFT p99':>10} {'TPOT p99':>10}   "
          f"traffic share by accelerator")

    epp = EppProcess(config)
    try:
        async with client() as http, grpc.aio.insecure_channel(epp.address) as channel:
            gateway = Gateway(channel, http)

            async def via_epp(prompt: int, out: int, kind: str) -> Outcome:
                outcome, decision = await gateway.request(completion(prompt, out), kind=kind, expected=out)
                picks.append(decision * 1e3)
                return outcome

            outcomes, books["epp"] = await measured(via_epp, epp.cpu_seconds, trace, idle_s=idle_s)
    finally:
        epp.stop()
    rows["epp"] = summarize("epp (slo)", outcomes, scale=scale, window_hw=window_hw, accelerator_of=accelerator_of)
    _lost(outcomes)
    async with httpx.AsyncClient() as http:
        await wait_idle(http, [w.url for w in workers])

    turn = cycle(workers)
    async with client() as http:
        async def round_robin(prompt: int, out: int, kind: str) -> Outcome:
            worker = next(turn)
            outcome = await stream_once(http, worker.url, model=MODEL, prompt_tokens=prompt, max_tokens=out,
                                        kind=kind)
            outcome.endpoint = worker.url
            return outcome

        outcomes = await run_trace(round_robin, **trace)
    rows["round-robin"] = summarize("round-robin", outcomes, scale=scale, window_hw=window_hw,
                                    accelerator_of=accelerator_of)
    _lost(outcomes)
    async with httpx.AsyncClient() as http:
        await wait_idle(http, [w.url for w in workers])

    router = RouterProcess(config)
    try:
        async with client() as http:
            async def via_route(prompt: int, out: int, kind: str) -> Outcome:
                return await stream_once(http, router.url, model=MODEL, prompt_tokens=prompt, max_tokens=out,
                                         kind=kind)

            outcomes, books["route"] = await measured(via_route, router.cpu_seconds, trace, idle_s=idle_s)
    finally:
        router.stop()
    rows["route"] = summarize("route (slo)", outcomes, scale=scale, window_hw=window_hw,
                              accelerator_of=accelerator_of)
    _lost(outcomes)
    async with httpx.AsyncClient() as http:
        await wait_idle(http, [w.url for w in workers])

    print(f"pick latency in the EPP run (under this load, unpinned): p50 {pct(picks, 50):.2f} ms, "
          f"p99 {pct(picks, 99):.2f} ms")
    return rows, books


def _lost(outcomes: list[Outcome]) -> None:
    reasons: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            reason = (o.error or f"{o.tokens}/{o.expected} tokens")[:70]
            reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        print("   lost: " + "; ".join(f"{n} x {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])))


def cpu_per_request(books: dict) -> float:
    """Part 3 (printed): the EPP's CPU per request over the router's."""
    print(f"\n{'process':8} {'requests':>9} {'CPU s':>7} {'wall s':>7} {'ms/request':>11} {'idle ms/s':>10} "
          f"{'net of idle ms/request':>23}")
    per, net = {}, {}
    for name, b in books.items():
        per[name] = b["cpu"] / b["requests"] * 1e3
        net[name] = (b["cpu"] - b["idle"] * b["wall"]) / b["requests"] * 1e3
        print(f"{name:8} {b['requests']:>9} {b['cpu']:>7.2f} {b['wall']:>7.1f} {per[name]:>11.2f} "
              f"{b['idle'] * 1e3:>10.1f} {net[name]:>23.2f}")
    ratio = per["epp"] / per["route"]
    print(f"CPU per request epp / route: {ratio:.2f}x (net of idle polling {net['epp'] / net['route']:.2f}x; "
          f"target <= 1: {'met' if ratio <= 1 else 'not met'})")
    return ratio


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a couple of workers, a few dozen requests per part")
    parser.add_argument("--time-scale", type=float, help="worker time scale (default 0.1; --quick 1)")
    parser.add_argument("--load", type=float, default=0.9, help="share of the pool's SLO capacity (part 2)")
    parser.add_argument("--window", type=float, default=15.0, help="wall seconds of arrivals per run (part 2)")
    parser.add_argument("--decision-seconds", type=float, default=8.0, help="seconds per rate (part 1)")
    args = parser.parse_args()
    pool = QUICK_POOL if args.quick else POOL
    scale = args.time_scale or (1.0 if args.quick else 0.1)
    idle_s = 1.0 if args.quick else 3.0
    started = time.monotonic()

    print(f"machine: {os.cpu_count()} cores, load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} at the "
          f"start; tree {_revision()}")
    mix = workload()
    capacity = pool_capacity(mix, pool)
    total = sum(capacity[acc] * n for acc, n in pool)
    rate = args.load * total
    window_hw = (30 / rate) if args.quick else args.window * scale
    n = max(round(rate * window_hw), 1)
    batch = mix.sample(n, rate=rate, seed=11)
    arrivals = (batch.arrival_s - batch.arrival_s[0]).tolist()
    lengths = list(zip(batch.input_tokens.tolist(), batch.output_tokens.tolist(), strict=True))
    fleet = ", ".join(f"{count} x {acc}" for acc, count in pool)
    print(f"workers: {MODEL} on {fleet} (time scale {scale:g}); SLO TTFT {SLO_TARGET.ttft_ms:g} ms / TPOT "
          f"{SLO_TARGET.tpot_ms:g} ms; SLO capacity per replica (req/s, simulator): "
          + ", ".join(f"{acc} {capacity[acc]:.2f}" for acc, _ in pool) + f"; pool {total:.1f} req/s")

    workers = spawn_fleet(scale, pool)
    gc.collect()
    gc.freeze()  # this process's long-lived objects out of the collector's way: its pauses would read as latency
    try:
        counts = {r: 40 if args.quick else int(r * args.decision_seconds) for r in DECISION_RATES}
        pinning = Pinning(workers)
        print(f"\n1. Decision latency: Poisson arrivals, streamed completions from the mix (body in 4 KiB chunks), "
              f"canned 5-chunk SSE answers through the EPP (policy slo, {len(workers)} live endpoints); "
              f"{pinning.describe()}")
        epp = EppProcess(router_config(workers, Policy.SLO), cpu=pinning.epp)
        pinning.apply()
        try:
            latency = await decision_latency(epp, counts=counts)
        finally:
            pinning.release()
            epp.stop()
        top = max(DECISION_RATES)
        p50, p99 = latency[top]
        print("decision latency p50/p99: " + ", ".join(f"{r:.0f}/s {latency[r][0]:.2f}/{latency[r][1]:.2f} ms"
                                                      for r in DECISION_RATES)
              + f" (target at {top:.0f}/s: p50 <= {TARGET_P50_MS:g} ms {_met(p50 <= TARGET_P50_MS)}, "
                f"p99 <= {TARGET_P99_MS:g} ms {_met(p99 <= TARGET_P99_MS)})")

        print(f"\n2. Goodput at {args.load:.0%} of the pool's SLO capacity = {rate:.1f} req/s hardware "
              f"({rate * scale:.1f}/s wall), {n} requests (80 % {SHORT[0]} in / {SHORT[1]} out, 20 % {LONG[0]} / "
              f"{LONG[1]}), the same sequence for each run; latencies in hardware time")
        trace = {"arrivals": arrivals, "lengths": lengths, "scale": scale,
                 "grace": (arrivals[-1] if arrivals else 0) / scale + (10 if args.quick else 30)}
        rows, books = await goodput(workers, trace, window_hw=window_hw, idle_s=idle_s)
        epp_rate, route_rate, rr_rate = (rows[k]["goodput"] for k in ("epp", "route", "round-robin"))
        over_route = epp_rate / route_rate if route_rate else float("nan")
        over_rr = epp_rate / rr_rate if rr_rate else float("nan")
        print(f"goodput epp / route: {over_route:.2f}x (target >= 0.97: {_met(over_route >= 0.97)}), "
              f"epp / round-robin: {over_rr:.2f}x (target >= 1.3: {_met(over_rr >= 1.3)})")

        print("\n3. CPU per request over runs (a) epp and (c) route above (each process's own, from /proc)")
        cpu_per_request(books)
    finally:
        for worker in workers:
            worker.stop()
    print(f"\ntook {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    report.main(lambda: asyncio.run(main()), section="epp")
