"""``hetsched calibrate --live``: learns a correction from running engines' metrics, stores it with its origin,
and refuses options it cannot use by name."""

from __future__ import annotations

import json
import threading
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
