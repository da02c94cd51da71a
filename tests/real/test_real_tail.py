"""The tail against a real engine: what hetsched learns at three rates predicts a fourth, and the SLO capacity.

vLLM's CPU build serves the tiny Qwen3 from its own process group pinned to core 0 (its API server, engine core
and worker share it; ``VLLM_CPU_OMP_THREADS_BIND=0``), with histogram buckets 10 % apart so that its own TTFT and
inter-token-latency quantiles can be read to a few percent; this test's process, the load generator, runs on core
1. Requests are 128-token prompts and 64-token answers, Poisson arrivals, streamed.

1. Start from the ``cpu`` device's prior: its catalog roofline, no correction, no tail.
2. Learn at three rates (fractions of the prior's SLO capacity), 40 s each: every 5 s the engine's ``/metrics``
   are a window for the online estimator (:class:`~hetsched.router.learning.WindowLearner`, as ``calibrate
   --live`` learns); then the tail (:func:`~hetsched.sim.tail_fit.fit_tail`): the step dispersion from the
   engine's token gaps, the front end from the gap between the clients' TTFT and the engine's own.
3. Predict, by simulation, the engine's TTFT and ITL p50 and P99 at a fourth rate no fit used (70 % of the
   predicted capacity), run it, and compare with what the engine reports: targets 15 % on the p50s, 25 % on the
   P99s.
4. The SLO capacity at a P99 TTFT target (the clients' TTFT, front end included): predicted by the capacity
   search under the correction and the tail, measured by running the engine at rates around it; target 20 %.

Every figure is printed with the load average beside it, before (prior; correction alone) and after the tail, and
written to ``test-artifacts/real/tail.json``. The host is shared: run it when ``uptime`` shows little else.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_support import MODEL_DIR_ENV, REAL_ENGINE

from hetsched.catalog import Device, load_catalog
from hetsched.catalog.host import HostInfo, read_host
from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.perf.correction import StepCorrection, corrected
from hetsched.perf.online import CorrectionKey, OnlineEstimator
from hetsched.perf.tail import FrontEnd, GapHistogram, Tail
from hetsched.profiler.twin import engine_facts
from hetsched.router.learning import WindowLearner
from hetsched.router.profiles import arch_profile
from hetsched.sim.capacity import find_capacity
from hetsched.sim.metrics import TokenGaps
from hetsched.sim.simulator import simulate
from hetsched.sim.step_cache import MemoizedStepModel
from hetsched.sim.tail_fit import TailWindow, fit_tail, relative_error
from hetsched.simworker.launch import free_port
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, Workload

pytestmark = REAL_ENGINE

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ARTIFACTS = ROOT / "test-artifacts" / "real"
SERVED = "tiny-qwen3"
PROMPT, ANSWER = 128, 64
MAX_NUM_SEQS = 32
ENGINE_CONFIG = EngineConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048, block_size=128)
WORKLOAD = Workload(input_len=LengthDistribution.fixed(PROMPT), output_len=LengthDistribution.fixed(ANSWER))
SLO_TARGET = SLO(ttft_ms=200.0, tpot_ms=1000.0)
"""The capacity's target is on P99 TTFT alone (the TPOT bound is out of reach of this engine)."""
LEARN_FRACTIONS = (0.2, 0.45, 0.7)
"""The learning rates, × the SLO capacity predicted from what was learned before each (the first: the prior's)."""
LEARN_S = 40.0
HELD_OUT_FRACTION = 0.8
"""The held-out rate, × the predicted capacity (with the tail)."""
HELD_OUT_S = 60.0
PROBE_FRACTIONS = (0.85, 1.0, 1.15, 1.3, 1.5)
"""Rates the engine's capacity is measured at, × the predicted capacity, until one misses the target."""
PROBE_S = 30.0
SCRAPE_S = 5.0
P50_TARGET, P99_TARGET, CAPACITY_TARGET = 0.15, 0.25, 0.20
BUCKETS = [round(0.0005 * 1.1 ** i, 7) for i in range(112)]
"""0.5 ms to about 20 s, 10 % apart: the engine's own quantiles to a few percent."""
SIM_SEEDS = (0, 1, 2)
SIM_REQUESTS = 2000


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def say(line: str) -> None:
    print(f"{line}  (load {load()})", flush=True)


# --- the pinned engine ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pinned:
    url: str
    host: HostInfo
    """This machine as ``hetsched`` sees it unpinned: the ``cpu`` device's prior is the catalog's for it (its
    constants were fitted to one-thread kernels on the whole host, as the engine's one OpenMP thread runs)."""


@pytest.fixture(scope="module")
def pinned() -> Iterator[Pinned]:
    """vLLM on core 0 with fine buckets; this process on core 1 while the module runs."""
    if os.cpu_count() is None or (os.cpu_count() or 0) < 2:
        pytest.skip("needs two cores: one for the engine, one for the load generator")
    model_dir = Path(os.environ.get(MODEL_DIR_ENV, ROOT / ".real-model")).resolve()
    if not VLLM_PYTHON.exists() or not (model_dir / "config.json").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test-real`")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = ARTIFACTS / "tail-engine.log"
    buckets = json.dumps({"time_to_first_token": BUCKETS, "inter_token_latency": BUCKETS,
                          "request_latency": BUCKETS})
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    args = ["taskset", "-c", "0", str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", SERVED, "--dtype", "bfloat16",
            "--max-model-len", "2048", "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1",
            "--port", str(port), "--custom-histogram-buckets", buckets]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    affinity = os.sched_getaffinity(0)
    host = read_host()
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                pytest.fail(f"the pinned vLLM exited with {process.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the pinned vLLM did not answer {url}/health in 600 s; see {log}")
            time.sleep(2)
        os.sched_setaffinity(0, {1})
        say(f"pinned vLLM up at {url} (engine on core 0, load generator on core 1)")
        yield Pinned(url, host)
    finally:
        os.sched_setaffinity(0, affinity)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- traffic -------------------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """One rate's run: the clients' TTFTs, the engine's metrics before and after, and the scrapes between."""

    rate: float
    ttft_s: list[float] = field(default_factory=list)
    failed: int = 0
    before: EngineMetrics | None = None
    after: EngineMetrics | None = None
    scrapes: list[tuple[float, EngineMetrics]] = field(default_factory=list)
    load: str = ""

    def engine(self, name: str) -> Histogram:
        assert self.before is not None and self.after is not None
        after, before = getattr(self.after, name), getattr(self.before, name)
        assert after is not None and before is not None, f"the engine's metrics lack {name}"
        return after.minus(before)

    @property
    def client_ttft_mean_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s)

    def client_ttft_p99_s(self) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def _one(client: httpx.AsyncClient, prompt: list[int], traffic: Traffic) -> None:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": ANSWER, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
            first = True
            async for line in response.aiter_lines():
                if first and line.startswith("data:") and "[DONE]" not in line:
                    event = json.loads(line[5:])
                    if event.get("choices") and event["choices"][0].get("text"):
                        traffic.ttft_s.append(time.perf_counter() - sent)
                        first = False
    except httpx.HTTPError:
        traffic.failed += 1


async def _metrics(client: httpx.AsyncClient) -> EngineMetrics:
    return parse_metrics_text((await client.get("/metrics", timeout=30)).text)


async def _drive(url: str, rate: float, seconds: float, seed: int) -> Traffic:
    rng = random.Random(seed)
    traffic = Traffic(rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        traffic.before = await _metrics(client)
        start = time.perf_counter()

        async def scrape() -> None:
            while True:
                await asyncio.sleep(SCRAPE_S)
                traffic.scrapes.append((time.perf_counter() - start, await _metrics(client)))

        scraper = asyncio.create_task(scrape())
        tasks, at = [], 0.0
        while True:
            at += rng.expovariate(rate)
            if at > seconds:
                break
            await asyncio.sleep(max(start + at - time.perf_counter(), 0.0))
            prompt = [rng.randrange(100, 8000) for _ in range(PROMPT)]
            tasks.append(asyncio.create_task(_one(client, prompt, traffic)))
        await asyncio.gather(*tasks)
        scraper.cancel()
        traffic.after = await _metrics(client)
        traffic.scrapes.append((time.perf_counter() - start, traffic.after))
    traffic.load = load()
    return traffic


def drive(url: str, rate: float, seconds: float, seed: int) -> Traffic:
    return asyncio.run(_drive(url, rate, seconds, seed))


def warm_up(url: str) -> None:
    """Bursts up to a full batch, then a few seconds at a moderate rate: no measured request meets a new shape."""
    async def bursts() -> None:
        traffic = Traffic(0.0)
        async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=None)) as client:
            for size in (1, 4, 16, MAX_NUM_SEQS, MAX_NUM_SEQS):
                rng = random.Random(size)
                await asyncio.gather(*(_one(client, [rng.randrange(100, 8000) for _ in range(PROMPT)], traffic)
                                       for _ in range(size)))

    asyncio.run(bursts())
    drive(url, 10.0, 10.0, seed=99)


# --- predictions ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """TTFT (engine's own and the clients') and ITL percentiles, milliseconds."""

    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    client_ttft_p50: float | None = None
    client_ttft_p99: float | None = None


def simulated(model: Any, num_blocks: int, rate: float, tail: Tail) -> Figures:
    engine_ttft: list[float] = []
    client_ttft: list[float] = []
    seconds: tuple[float, ...] = ()
    weights: tuple[int, ...] = ()
    for seed in SIM_SEEDS:
        run = simulate(model, WORKLOAD.sample(SIM_REQUESTS, rate=rate, seed=seed), engine=ENGINE_CONFIG,
                       num_blocks=num_blocks, max_model_len=2048, measure=range(2 * MAX_NUM_SEQS, SIM_REQUESTS),
                       tail=tail, seed=seed, token_gaps=True)
        engine_ttft += run.times.engine_ttft.tolist()
        client_ttft += run.times.ttft.tolist()
        assert run.token_gaps is not None
        seconds += run.token_gaps.seconds
        weights += run.token_gaps.weights
    gaps = TokenGaps(seconds, weights)

    def q(values: list[float], p: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)] * 1e3

    return Figures(q(engine_ttft, 0.5), q(engine_ttft, 0.99), (gaps.quantile(0.5) or 0.0) * 1e3,
                   (gaps.quantile(0.99) or 0.0) * 1e3, q(client_ttft, 0.5), q(client_ttft, 0.99))


def measured(traffic: Traffic) -> Figures:
    ttft, itl = traffic.engine("ttft_s"), traffic.engine("itl_s")
    ordered = sorted(traffic.ttft_s)
    return Figures((ttft.quantile(0.5) or 0.0) * 1e3, (ttft.quantile(0.99) or 0.0) * 1e3,
                   (itl.quantile(0.5) or 0.0) * 1e3, (itl.quantile(0.99) or 0.0) * 1e3,
                   ordered[len(ordered) // 2] * 1e3, traffic.client_ttft_p99_s() * 1e3)


def capacity(arch: Any, device: Device, model: Any, tail: Tail | None) -> float:
    return find_capacity(arch, device, workload=WORKLOAD, slo=SLO_TARGET, engine=ENGINE_CONFIG, step_model=model,
                         tail=tail).requests_per_s


def measured_capacity(probes: list[Traffic]) -> float | None:
    """The highest rate whose clients' P99 TTFT meets the target, interpolated on P99 / target between the last
    passing probe and the first failing one; None when the lowest probe already fails or none fails."""
    ordered = sorted(probes, key=lambda t: t.rate)
    previous: tuple[float, float] | None = None
    for traffic in ordered:
        worst = traffic.client_ttft_p99_s() * 1e3 / SLO_TARGET.ttft_ms
        if worst > 1.0:
            if previous is None:
                return None
            r0, w0 = previous
            return r0 + (1.0 - w0) / (worst - w0) * (traffic.rate - r0)
        previous = (traffic.rate, worst)
    return None


def _row(name: str, figures: Figures, real: Figures | None = None) -> str:
    def cell(key: str) -> str:
        value = getattr(figures, key)
        if value is None:
            return f"{'—':>15}"
        if real is None or getattr(real, key) is None:
            return f"{value:8.2f}{'':>7}"
        return f"{value:8.2f} {relative_error(value, getattr(real, key)):+6.1%}"

    keys = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "client_ttft_p50", "client_ttft_p99")
    return f"  {name:<22}" + " ".join(cell(k) for k in keys)


# --- the test ------------------------------------------------------------------------------------------------


def _histograms(traffic: Traffic) -> dict[str, Any]:
    """The engine's own histograms over a run, for reading again without an engine."""
    out: dict[str, Any] = {}
    for name in ("ttft_s", "itl_s", "prefill_s", "queue_s", "tpot_s"):
        try:
            h = traffic.engine(name)
        except AssertionError:
            continue
        out[name] = {"le": [b if math.isfinite(b) else "+Inf" for b in h.le], "counts": list(h.counts),
                     "total": h.total}
    return {"rate": traffic.rate, "load": traffic.load, "client_ttft_s": traffic.ttft_s, "engine": out,
            "running": [m.running for _, m in traffic.scrapes]}


@pytest.mark.timeout(2400)
def test_three_rates_predict_a_fourth_and_the_slo_capacity(pinned: Pinned) -> None:
    url = pinned.url
    report: dict[str, Any] = {"load_at_start": load()}
    warm_up(url)
    say("warmed up")
    arch = load_model(str(Path(os.environ.get(MODEL_DIR_ENV, ROOT / ".real-model")).resolve() / "config.json"))
    profile = arch_profile(arch, "cpu", 1, ENGINE_CONFIG, 2048, pinned.host)
    device = load_catalog().device("cpu", host=pinned.host)
    facts = engine_facts(httpx.get(f"{url}/metrics", timeout=30).text, max_model_len=2048, url=url)
    num_blocks = facts.kv_blocks
    prior = MemoizedStepModel(profile.step_model)

    # 1. The prior's capacity sets the first learning rate.
    prior_capacity = capacity(arch, device, profile.step_model, None)
    say(f"prior (the cpu device's roofline, no correction): SLO capacity {prior_capacity:.1f} req/s at P99 TTFT "
        f"≤ {SLO_TARGET.ttft_ms:g} ms")

    # 2. Learn at three rates, each a share of the capacity predicted from what was learned before it.
    key = CorrectionKey(arch.name, "cpu")
    estimator = OnlineEstimator()
    learner = WindowLearner(estimator, littles_law=True)
    learned: list[Traffic] = []
    so_far = prior_capacity
    for i, fraction in enumerate(LEARN_FRACTIONS):
        rate = round(so_far * fraction, 2)
        traffic = drive(url, rate, LEARN_S, seed=i)
        for at, metrics in [(0.0, traffic.before), *traffic.scrapes]:
            assert metrics is not None
            learner.scraped(key, profile, "engine", metrics, at=at + 1000.0 * i)
        learned.append(traffic)
        learning = estimator.estimate(key).correction
        so_far = capacity(arch, device, corrected(profile.step_model, learning),
                          Tail(front_end=FrontEnd(latency_s=learning.request_overhead_s)))
        say(f"learned at {rate:.2f} req/s: {len(traffic.ttft_s)} requests, {traffic.failed} failed; capacity "
            f"so far {so_far:.1f} req/s")
    estimate = estimator.estimate(key)
    correction: StepCorrection = estimate.correction
    say(f"correction from {estimate.observations} observations: prefill ×{correction.prefill_scale:.3f}, decode "
        f"×{correction.decode_scale:.3f}, {correction.step_overhead_s * 1e3:.3f} ms a step, "
        f"{correction.request_overhead_s * 1e3:.3f} ms a request; residual median {estimate.residual_median:.1%}")
    model = MemoizedStepModel(corrected(profile.step_model, correction))
    windows = [TailWindow(t.rate, WORKLOAD, GapHistogram(t.engine("itl_s").le, t.engine("itl_s").counts,
                                                         t.engine("itl_s").total),
                          t.client_ttft_mean_s, t.engine("ttft_s").total / t.engine("ttft_s").count)
               for t in learned]
    fit = fit_tail(model, windows, engine=ENGINE_CONFIG, num_blocks=num_blocks, max_model_len=2048,
                   latency_s=correction.request_overhead_s)
    tail = fit.tail
    front = tail.front_end or FrontEnd()
    say(f"tail: steps × ({tail.dispersion.describe() if tail.dispersion else 'none'}); front end "
        f"{front.request_s * 1e3:.2f} ms a request + {front.token_s * 1e3:.3f} ms a token, "
        f"{front.latency_s * 1e3:.2f} ms before the first step")
    report.update(correction=asdict(correction), tail=tail.to_json(),
                  learned=[{"rate": t.rate, "requests": len(t.ttft_s), "load": t.load} for t in learned])

    # 3. Predict a fourth rate, then run it.
    untailed = Tail(front_end=FrontEnd(latency_s=correction.request_overhead_s))
    corrected_capacity = capacity(arch, device, model, untailed)
    tailed_capacity = capacity(arch, device, model, tail)
    held_out = round(tailed_capacity * HELD_OUT_FRACTION, 2)
    predictions = {"prior": simulated(prior, num_blocks, held_out, Tail()),
                   "correction": simulated(model, num_blocks, held_out, untailed),
                   "correction + tail": simulated(model, num_blocks, held_out, tail)}
    traffic = drive(url, held_out, HELD_OUT_S, seed=7)
    real = measured(traffic)
    say(f"held-out rate {held_out:.2f} req/s: {len(traffic.ttft_s)} requests, {traffic.failed} failed; "
        f"load during it {traffic.load}")
    print(f"  {'ms (error vs engine)':<22}" + " ".join(f"{h:>15}" for h in (
        "TTFT p50", "TTFT P99", "ITL p50", "ITL P99", "client TTFT p50", "client P99")))
    print(_row("engine (measured)", real))
    for name, figures in predictions.items():
        print(_row(name, figures, real))
    report["held_out"] = {"rate": held_out, "load": traffic.load, "measured": asdict(real),
                          "predicted": {k: asdict(v) for k, v in predictions.items()}}

    # 4. The SLO capacity: measured at rates around the prediction.
    probes: list[Traffic] = [traffic]
    fraction = HELD_OUT_FRACTION
    while traffic.client_ttft_p99_s() * 1e3 > SLO_TARGET.ttft_ms and fraction > 0.1:  # below the held-out rate
        fraction *= 0.7
        traffic = drive(url, round(tailed_capacity * fraction, 2), PROBE_S, seed=30 + len(probes))
        probes.append(traffic)
        say(f"probe {traffic.rate:.2f} req/s: clients' P99 TTFT {traffic.client_ttft_p99_s() * 1e3:.0f} ms")
    for i, fraction in enumerate(PROBE_FRACTIONS if len(probes) == 1 else ()):
        rate = round(tailed_capacity * fraction, 2)
        probe = drive(url, rate, PROBE_S, seed=20 + i)
        probes.append(probe)
        p99 = probe.client_ttft_p99_s() * 1e3
        say(f"probe {rate:.2f} req/s: clients' P99 TTFT {p99:.0f} ms ({len(probe.ttft_s)} requests)")
        if p99 > SLO_TARGET.ttft_ms:
            break
    real_capacity = measured_capacity(probes)
    say(f"SLO capacity at P99 TTFT ≤ {SLO_TARGET.ttft_ms:g} ms: engine {real_capacity or math.nan:.1f} req/s; "
        f"predicted: prior {prior_capacity:.1f} ({relative_error(prior_capacity, real_capacity):+.1%}), "
        f"correction {corrected_capacity:.1f} ({relative_error(corrected_capacity, real_capacity):+.1%}), "
        f"correction + tail {tailed_capacity:.1f} ({relative_error(tailed_capacity, real_capacity):+.1%})")
    report["capacity"] = {"measured": real_capacity, "prior": prior_capacity, "correction": corrected_capacity,
                          "correction + tail": tailed_capacity,
                          "probes": [{"rate": p.rate, "client_ttft_p99_ms": p.client_ttft_p99_s() * 1e3,
                                      "load": p.load} for p in probes]}
    report["load_at_end"] = load()
    report["runs"] = [_histograms(t) for t in (*learned, *probes)]
    report["fit"] = {"probabilities": fit.probabilities, "observed": fit.observed_gaps_s,
                     "simulated": fit.simulated_gaps_s, "untailed": fit.untailed_gaps_s}
    (ARTIFACTS / "tail.json").write_text(json.dumps(report, indent=1))

    predicted = predictions["correction + tail"]
    misses = []
    for name, target in (("ttft_p50", P50_TARGET), ("itl_p50", P50_TARGET), ("ttft_p99", P99_TARGET),
                         ("itl_p99", P99_TARGET)):
        error = relative_error(getattr(predicted, name), getattr(real, name))
        if abs(error) > target:
            misses.append(f"{name} {getattr(predicted, name):.2f} ms against the engine's {getattr(real, name):.2f} "
                          f"({error:+.1%}, target ±{target:.0%})")
    assert real_capacity is not None, "the engine's capacity was not bracketed by the probes"
    error = relative_error(tailed_capacity, real_capacity)
    if abs(error) > CAPACITY_TARGET:
        misses.append(f"capacity {tailed_capacity:.1f} req/s against the engine's {real_capacity:.1f} ({error:+.1%}, "
                      f"target ±{CAPACITY_TARGET:.0%})")
    assert not misses, f"load {load()}: " + "; ".join(misses)
