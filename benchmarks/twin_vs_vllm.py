"""The digital twin against a real vLLM engine: the same open-loop workload through both, in one run.

    make test-real                                  # once: installs .venv-vllm and builds .real-model
    .venv/bin/python benchmarks/twin_vs_vllm.py [--max-num-seqs 32] [--requests 100]

1. Starts vLLM's CPU build (``.venv-vllm``) on the tiny local Qwen3 (``.real-model``) on loopback.
2. Warms it up (bursts of every prompt length up to a full batch, not measured), then calibrates the twin to
   it as ``hetsched calibrate cpu --endpoint`` does: the engine's block size and KV
   blocks from its ``/metrics``, its step time (kernel scale, step and per-sequence overhead, front-end time per
   request) fitted to a load test at 1, 3 and 6 req/s.
3. The twin's SLO capacity (the simulator's search on the calibrated model) at the stated SLO.
4. At rates of 10–100 % of that capacity, the same Poisson workload (128-token prompts, 64-token answers)
   through the real engine and through the calibrated twin (``sim-worker`` in this process), client-side
   TTFT and TPOT p50/p99 of each, their ratios twin / real, and the load average.
5. The real engine's capacity: the highest rate whose P99s meet the SLO, between measured rates by
   interpolation; its ratio to the twin's.

Bars: TTFT and TPOT p50 within ±15 % and p99 within ±25 % up to 80 % of capacity; capacity within ±15 %; on a
quiet machine (the load average is printed with every point).

``--quick`` starts no vLLM: a simulated worker stands in for the engine (a model of the tiny Qwen3's shape on this
machine's CPU, in this process), its calibration rates sized from its own SLO capacity, and every step above runs on a
few requests per rate at two rates. It checks that the benchmark runs; the figures are not the benchmark's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hetsched.catalog import Device, host_catalog
from hetsched.profiler.endpoint import (LoadTestSettings, RateSummary, engine_pages, observed_requests,
                                        run_load_test)
from hetsched.profiler.twin import TwinFit, engine_facts, fit_twin, step_samples
from hetsched.perf.roofline import RooflineModel
from hetsched.sim.capacity import find_capacity
from hetsched.simworker import WorkerSpec, start_worker_thread
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, Workload
import report

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_DIR = ROOT / ".real-model"
SERVED = "tiny-qwen3"
PROMPT, ANSWER = 128, 64
SLO_TARGET = SLO(ttft_ms=250, tpot_ms=25)
STAND_IN_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 8192,
                   "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 64, "intermediate_size": 768, "tie_word_embeddings": True,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
"""The stand-in's model: the shape ``tests/real/make_model.py`` gives the tiny Qwen3 vLLM serves."""
WORKLOAD = Workload(input_len=LengthDistribution.fixed(PROMPT), output_len=LengthDistribution.fixed(ANSWER))


@dataclass(frozen=True)
class Sizes:
    """How much of the engine one run measures."""

    calibration_requests: int
    """Requests per round of the calibration load test."""
    requests: int
    """Requests per measured rate."""
    fractions: tuple[float, ...]
    """Measured rates, × the twin's SLO capacity."""


FULL = Sizes(calibration_requests=30, requests=100, fractions=(0.1, 0.25, 0.4, 0.6, 0.8, 1.0))
QUICK = Sizes(calibration_requests=6, requests=8, fractions=(0.5, 1.0))
VLLM_CALIBRATION_RATES = (1.0, 3.0, 6.0)
STAND_IN_CALIBRATION_LOADS = (0.3, 0.6, 1.0)
"""The stand-in's calibration rates, × its own SLO capacity."""


@dataclass(frozen=True)
class Engine:
    """An OpenAI-compatible engine under test: where it answers and the model it serves (a name or a config path)."""

    url: str
    model: str
    calibration_rates: tuple[float, ...]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(port: int, max_num_seqs: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
            "--served-model-name", SERVED, "--dtype", "bfloat16", "--max-model-len", "2048",
            "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, engine: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise SystemExit(f"vLLM exited with {engine.returncode} before {url}/health answered; see {log}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"{url}/health did not answer in {timeout_s:.0f} s; see {log}")


def measure(url: str, rate: float, requests: int) -> tuple[RateSummary, float]:
    """The rate's percentiles and its mean client TTFT in seconds."""
    settings = LoadTestSettings(rates=(rate,), requests_per_rate=requests, prompt_tokens=(PROMPT,),
                                output_tokens=ANSWER, max_rounds=2, stable_within=0.99)
    result = asyncio.run(run_load_test(url, settings=settings))
    ttfts = [r.ttft_s for r in result.records if r.error is None and r.ttft_s is not None]
    return result.summaries[0], sum(ttfts) / max(len(ttfts), 1)


ENGINE_TIMES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                "prefill": "vllm:request_prefill_time_seconds"}


def engine_time_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the engine's own TTFT, queue and prefill histograms, over all label sets."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    sums = {key: [0.0, 0.0] for key in ENGINE_TIMES}
    for family in text_string_to_metric_families(text):
        for key, name in ENGINE_TIMES.items():
            if family.name in (name, name.removesuffix("_seconds")):
                for sample in family.samples:
                    if sample.name.endswith("_sum"):
                        sums[key][0] += sample.value
                    elif sample.name.endswith("_count"):
                        sums[key][1] += sample.value
    return {key: (total, count) for key, (total, count) in sums.items()}


def engine_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> str:
    """Mean milliseconds per request of each engine-side time between two scrapes."""
    parts = []
    for key in ENGINE_TIMES:
        total, count = after[key][0] - before[key][0], after[key][1] - before[key][1]
        parts.append(f"{key} {total / count * 1e3:.1f}" if count else f"{key} —")
    return ", ".join(parts)


def warm_up(url: str, max_num_seqs: int) -> None:
    """Bursts up to a full batch of every prompt length used, so no measured request meets a shape first."""
    settings = LoadTestSettings(rates=(4.0 * max_num_seqs,), requests_per_rate=2 * max_num_seqs,
                                prompt_tokens=(64, PROMPT, 512), output_tokens=ANSWER, max_rounds=2,
                                stable_within=0.99)
    started = time.monotonic()
    result = asyncio.run(run_load_test(url, settings=settings))
    print(f"warm-up: {len(result.records)} requests in bursts of up to {max_num_seqs} in "
          f"{time.monotonic() - started:.0f} s, not measured (load {load()})")


def calibrate(engine_under_test: Engine, device: Device, max_num_seqs: int, requests: int) -> tuple[TwinFit, WorkerSpec]:
    url = engine_under_test.url
    metrics, info = asyncio.run(engine_pages(url))
    facts = engine_facts(metrics, max_model_len=info.max_model_len, url=url)
    settings = LoadTestSettings(rates=engine_under_test.calibration_rates, requests_per_rate=requests,
                                prompt_tokens=(64, PROMPT, 512), output_tokens=ANSWER, max_rounds=2)
    result = asyncio.run(run_load_test(url, settings=settings))
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, block_size=facts.block_size)
    arch = load_model(engine_under_test.model)
    fit = fit_twin(step_samples(observed_requests(result)), model=arch, device=device, engine=engine,
                   source=f"fitted to the engine at {url}")
    spec = WorkerSpec(model=engine_under_test.model, accelerator="cpu", served_name=SERVED,
                      max_model_len=facts.max_model_len or 2048, engine=engine, kv_blocks=facts.kv_blocks,
                      perf=fit.constants, request_overhead_ms=fit.request_overhead_ms)
    print(f"calibration: kernels × {fit.kernel_scale:g}, {fit.step_overhead_ms:g} ms per step + "
          f"{fit.seq_overhead_us:g} µs per sequence in it, "
          f"{fit.request_overhead_ms:g} ms per request; {facts.block_size}-token blocks, {facts.kv_blocks} KV "
          f"blocks; fit error " + ", ".join(f"{k} {v.median_abs:.1%}" for k, v in fit.residuals.items())
          + f"  (load {load()})")
    return fit, spec


@dataclass(frozen=True)
class Point:
    rate: float
    real: RateSummary
    twin: RateSummary
    load: str


def meets(s: RateSummary) -> bool:
    return (s.ttft_p99_s or 1e9) * 1e3 <= SLO_TARGET.ttft_ms and (s.tpot_p99_s or 1e9) * 1e3 <= SLO_TARGET.tpot_ms


def measured_capacity(points: list[Point]) -> float:
    """The highest rate meeting the SLO, interpolated on the worst P99/target ratio to the first failing rate."""
    best = 0.0
    previous: tuple[float, float] | None = None
    for p in points:
        worst = max((p.real.ttft_p99_s or 1e9) * 1e3 / SLO_TARGET.ttft_ms,
                    (p.real.tpot_p99_s or 1e9) * 1e3 / SLO_TARGET.tpot_ms)
        if worst <= 1.0:
            best, previous = p.rate, (p.rate, worst)
            continue
        if previous is not None:
            r0, w0 = previous
            best = r0 + (1.0 - w0) / (worst - w0) * (p.rate - r0)
        break
    return best


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}" if a and b else "    —"


@contextmanager
def vllm_engine(max_num_seqs: int) -> Iterator[Engine]:
    """vLLM's CPU build on the tiny local model, stopped with its process group."""
    if not VLLM_PYTHON.exists() or not (MODEL_DIR / "config.json").exists():
        raise SystemExit("run 'make test-real' once first: it installs .venv-vllm and builds .real-model "
                         "(or --quick, which stands a simulated worker in for vLLM)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = ROOT / "test-artifacts" / "real" / "twin-vs-vllm-engine.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    engine = start_engine(port, max_num_seqs, log)
    try:
        wait_healthy(url, engine, 600, log)
        print(f"vLLM up at {url} in {time.monotonic() - started:.0f} s (load {load()})")
        yield Engine(url, str(MODEL_DIR / "config.json"), VLLM_CALIBRATION_RATES)
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(engine.pid, signal.SIGKILL)


@contextmanager
def stand_in_engine(max_num_seqs: int, device: Device) -> Iterator[Engine]:
    """A simulated worker in vLLM's place, its calibration rates sized from its own SLO capacity."""
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps(STAND_IN_CONFIG))
        capacity = find_capacity(load_model(str(config)), device, workload=WORKLOAD, slo=SLO_TARGET, engine=engine,
                                 seeds=(0,)).requests_per_s
        spec = WorkerSpec(model=str(config), accelerator="cpu", served_name=SERVED, max_model_len=2048,
                          engine=engine)
        with start_worker_thread(spec) as server:
            print(f"--quick: no vLLM started; a simulated worker stands in for the engine at {server.url} (the tiny "
                  f"Qwen3's shape on this machine's cpu, SLO capacity {capacity:.1f} req/s)")
            yield Engine(server.url, str(config), tuple(round(capacity * x, 2) for x in STAND_IN_CALIBRATION_LOADS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--requests", type=int, help=f"requests per rate (default {FULL.requests}; --quick "
                                                      f"{QUICK.requests})")
    parser.add_argument("--quick", action="store_true", help="a simulated worker for vLLM, a few requests: a smoke run")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    requests = args.requests or sizes.requests
    started = time.monotonic()
    device = Device.whole(host_catalog().get("cpu"))
    engine_under_test = stand_in_engine(args.max_num_seqs, device) if args.quick else vllm_engine(args.max_num_seqs)
    with engine_under_test as engine:
        url = engine.url
        warm_up(url, args.max_num_seqs)
        fit, spec = calibrate(engine, device, args.max_num_seqs, sizes.calibration_requests)
        arch = load_model(spec.model)
        twin_model = RooflineModel(arch, device, engine=spec.engine, constants=spec.perf)
        predicted = find_capacity(arch, device, workload=WORKLOAD, slo=SLO_TARGET, engine=spec.engine,
                                  step_model=twin_model).requests_per_s
        print(f"twin capacity at P99 TTFT ≤ {SLO_TARGET.ttft_ms:g} ms, TPOT ≤ {SLO_TARGET.tpot_ms:g} ms: "
              f"{predicted:.1f} req/s (simulator; the front end's {fit.request_overhead_ms:g} ms per request is "
              "outside it)\n")
        twin = start_worker_thread(spec)
        points = []
        try:
            print(f"{'rate':>6} {'load':>15} | {'TTFT p50 twin/real ms':>22} {'ratio':>5} | {'TTFT p99':>15} "
                  f"{'ratio':>5} | {'TPOT p50':>13} {'ratio':>5} | {'TPOT p99':>13} {'ratio':>5}")
            for fraction in sizes.fractions:
                rate = round(predicted * fraction, 2)
                before = engine_time_sums(url)
                real, real_mean = measure(url, rate, requests)
                engine_side = engine_means_ms(before, engine_time_sums(url))
                simulated, _ = measure(twin.url, rate, requests)
                point = Point(rate, real, simulated, load())
                points.append(point)

                def ms(v: float | None) -> str:
                    return f"{v * 1e3:6.1f}" if v else "     —"

                print(f"{rate:6.2f} {point.load:>15} | {ms(simulated.ttft_p50_s)} / {ms(real.ttft_p50_s)}"
                      f"{'':>7} {ratio(simulated.ttft_p50_s, real.ttft_p50_s)} | "
                      f"{ms(simulated.ttft_p99_s)}/{ms(real.ttft_p99_s)} {ratio(simulated.ttft_p99_s, real.ttft_p99_s)} | "
                      f"{ms(simulated.tpot_p50_s)}/{ms(real.tpot_p50_s)} {ratio(simulated.tpot_p50_s, real.tpot_p50_s)} | "
                      f"{ms(simulated.tpot_p99_s)}/{ms(real.tpot_p99_s)} {ratio(simulated.tpot_p99_s, real.tpot_p99_s)}")
                print(f"{'':>24}real engine, mean ms per request: client TTFT {real_mean * 1e3:.1f}; engine's own "
                      f"{engine_side}")
        finally:
            twin.stop()
        real_capacity = measured_capacity(points)
        print(f"\ncapacity at the SLO: twin {predicted:.1f} req/s, real engine {real_capacity:.1f} req/s "
              f"(measured rates, interpolated), ratio twin/real {predicted / real_capacity:.2f}"
              if real_capacity else "\nthe real engine met the SLO at no measured rate")
        print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    report.main(main, section="twin_vs_vllm")
