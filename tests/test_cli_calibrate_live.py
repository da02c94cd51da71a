"""``hetsched calibrate --live``: learns a correction from running engines' metrics, stores it with its origin,
and refuses options it cannot use by name."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import InputError
from hetsched.simworker import WorkerSpec, start_worker_thread

runner = CliRunner()
MODEL = "qwen3-0.6b"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "db.sqlite"
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{path}")
    return path


def _load(urls: list[str], stop: threading.Event) -> None:
    """Requests of a few sizes, eight at a time per engine, until ``stop``."""
    sizes = [(40, 12), (200, 24), (600, 8), (120, 40)]

    def one(url: str, i: int) -> None:
        prompt, out = sizes[i % len(sizes)]
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "word " * prompt,
                                                           "max_tokens": out})

    threads = [threading.Thread(target=one, args=(url, i), daemon=True) for url in urls for i in range(8)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(timeout=10)


def test_live_engines_teach_a_correction_stored_with_its_origin(store: Path) -> None:
    workers = [start_worker_thread(WorkerSpec(model=MODEL, accelerator="l4", time_scale=5.0, slowdown_prefill=1.5,
                                              slowdown_decode=1.5)) for _ in range(2)]
    stop = threading.Event()
    load = threading.Thread(target=_load, args=([w.url for w in workers], stop), daemon=True)
    load.start()
    try:
        args = ["calibrate", "l4", "--live", "--model", MODEL, "--window", "3", "--interval", "0.5", "-o", "json"]
        for worker in workers:
            args += ["--url", worker.url]
        result = runner.invoke(app, args)
    finally:
        stop.set()
        load.join(timeout=15)
        for worker in workers:
            worker.stop()
    assert result.exit_code == 0, result.output
    learned = json.loads(result.stdout)
    assert learned["key"] == {"model": MODEL, "accelerator": "l4", "tp": 1, "engine": "", "attention_backend": ""}
    assert learned["observations"] > 0 and learned["sources"] == 2
    assert learned["correction"]["decode_scale"] > 1.0  # the engines run slower than the catalog says
    assert learned["id"] is not None
    from hetsched.store.corrections import list_corrections
    from hetsched.store.db import open_store

    [stored] = list_corrections(open_store(f"sqlite:///{store}"))
    assert stored.id == learned["id"] and workers[0].url in stored.origin and "--live" in stored.origin


@pytest.mark.parametrize("args, field", [
    (["--live", "--model", MODEL], "--url"),
    (["--live", "--model", MODEL, "--url", "http://a:1", "--prometheus", "http://p:9090"], "--url"),
    (["--live", "--model", MODEL, "--url", "ftp://a"], "--url"),
    (["--live", "--url", "http://a:1"], "--model"),
    (["--live", "--model", MODEL, "--url", "http://a:1", "--window", "nan"], "--window"),
    (["--live", "--model", MODEL, "--url", "http://a:1", "--interval", "0"], "--interval"),
    (["--live", "--model", MODEL, "--url", "http://a:1", "--window", "5", "--interval", "10"], "--interval"),
    (["--live", "--model", MODEL, "--url", "http://a:1", "--endpoint", "http://b:1"], "--endpoint"),
    (["--live", "--model", MODEL, "--url", "http://a:1", "--tp", "3"], "--tp"),
    (["--url", "http://a:1"], "--url"),
])
def test_live_options_it_cannot_use_are_named(store: Path, args: list[str], field: str) -> None:
    result = runner.invoke(app, ["calibrate", "l4", *args])
    assert isinstance(result.exception, InputError), result.output
    assert result.exception.field == field


def test_an_engine_that_does_not_answer_teaches_nothing_and_stores_nothing(store: Path) -> None:
    result = runner.invoke(app, ["calibrate", "l4", "--live", "--model", MODEL, "--url", "http://127.0.0.1:9",
                                 "--window", "1", "--interval", "0.5", "-o", "json"])
    assert result.exit_code == 0, result.output
    learned = json.loads(result.stdout)
    assert learned["observations"] == 0 and learned["id"] is None and not learned["trusted"]


def test_the_engines_token_gaps_teach_the_step_dispersion_stored_with_the_correction() -> None:
    import math

    import numpy as np

    from hetsched.cli.live import live_tail
    from hetsched.engine_metrics.types import EngineMetrics, Histogram
    from hetsched.perf.correction import StepCorrection
    from hetsched.perf.tail import Dispersion, Tail
    from hetsched.router.profiles import roofline_profile
    from hetsched.sim.simulator import simulate
    from hetsched.specs.engine import EngineConfig
    from hetsched.specs.workload import LengthDistribution, Workload

    profile = roofline_profile(MODEL, "l4", 1)
    true = Dispersion.lognormal(0.5)
    engine = EngineConfig(max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens)
    workload = Workload(input_len=LengthDistribution.fixed(300), output_len=LengthDistribution.fixed(60))
    run = simulate(profile.step_model, workload.sample(1500, rate=10.0, seed=3), engine=engine, num_blocks=40000,
                   max_model_len=8192, tail=Tail(dispersion=true), seed=3, token_gaps=True)
    assert run.token_gaps is not None
    gaps = np.repeat(np.array(run.token_gaps.seconds), np.array(run.token_gaps.weights))
    bounds = tuple(0.0005 * 1.1 ** i for i in range(112)) + (math.inf,)
    itl = Histogram(bounds, tuple(float(np.sum(gaps <= b)) for b in bounds), float(gaps.sum()))

    def reading(n: float, gaps: Histogram | None) -> EngineMetrics:
        sizes = Histogram((1e9, math.inf), (n, n), 0.0)
        return EngineMetrics(completed=n, itl_s=gaps, input_tokens=Histogram(sizes.le, sizes.counts, 300 * n),
                             output_tokens=Histogram(sizes.le, sizes.counts, 60 * n))

    empty = Histogram(bounds, (0.0,) * len(bounds), 0.0)
    tail = live_tail(profile, StepCorrection(), {"pod-a": [(0.0, reading(0, empty)), (150.0, reading(1500, itl))]})
    assert tail is not None and tail.dispersion is not None and tail.front_end is None
    for q in (0.5, 0.9, 0.99):
        assert tail.dispersion.quantile(q) == pytest.approx(true.quantile(q), rel=0.25)
    coarse = Histogram((0.01, math.inf), (itl.count, itl.count), itl.total)  # vLLM's default first bucket
    assert live_tail(profile, StepCorrection(), {"pod-a": [(0.0, reading(0, Histogram((0.01, math.inf), (0, 0), 0))),
                                                            (150.0, reading(1500, coarse))]}) is None


def _prometheus_series(at: float, slow: float) -> list[dict]:
    """Two pods of qwen3-0.6b on an l4, ``slow`` times as slow as the catalog, as Prometheus holds their series
    at ``at``: 20 more finished requests each second, each of a 200-token prompt and 40 tokens out."""
    from hetsched.router.predict import predict
    from hetsched.router.profiles import roofline_profile
    from hetsched.router.types import Endpoint, EndpointView, RouteRequest

    view = EndpointView(Endpoint("x", "", ""), in_flight=3, in_flight_prompt_tokens=600, in_flight_max_tokens=120,
                        running=3, waiting=0)
    p = predict(roofline_profile(MODEL, "l4", 1), view, RouteRequest(model="", prompt_tokens=200, max_tokens=40),
                slo=None)
    n = 20 * at
    series = []
    for pod in ("engine-a", "engine-b"):
        def point(name: str, value: float, **labels: str) -> dict:
            return {"metric": {"__name__": name, "pod": pod, **labels}, "value": [at, str(value)]}
        series += [point("vllm:num_requests_running", 4), point("vllm:num_requests_waiting", 0),
                   point("vllm:request_success_total", n)]
        for name, mean in (("time_to_first_token_seconds", p.ttft_s * slow),
                           ("request_time_per_output_token_seconds", p.tpot_s * slow),
                           ("request_queue_time_seconds", 0.0), ("request_prompt_tokens", 200.0),
                           ("request_generation_tokens", 40.0)):
            series += [point(f"vllm:{name}_bucket", n, le="+Inf"), point(f"vllm:{name}_sum", n * mean),
                       point(f"vllm:{name}_count", n)]
    return series


def test_a_prometheus_server_s_past_teaches_a_correction(store: Path) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlsplit

    asked: list[float] = []

    class Prometheus(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            query = parse_qs(urlsplit(self.path).query)
            at = float(query["time"][0])
            asked.append(at)
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": _prometheus_series(
                at - start, 1.5)}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    start = time.time() - 3600
    server = ThreadingHTTPServer(("127.0.0.1", 0), Prometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = runner.invoke(app, ["calibrate", "l4", "--live", "--model", MODEL, "--prometheus",
                                     f"http://127.0.0.1:{server.server_address[1]}", "--window", "600",
                                     "--interval", "10", "-o", "json"])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    learned = json.loads(result.stdout)
    assert len(asked) == 61 and asked == sorted(asked)  # instants over the past window, oldest first
    assert learned["sources"] == 2 and learned["trusted"] and learned["id"] is not None
    assert learned["correction"]["decode_scale"] == pytest.approx(1.5, rel=0.15)
