"""A simulated worker with a tail (issue 28): dispersed steps and a front end that queues requests and tokens."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time

import pytest

from hetsched.cli import app as cli
from hetsched.errors import InputError
from hetsched.perf.tail import Dispersion, FrontEnd, Tail
from hetsched.sim.scheduler import Request
from hetsched.simworker import SimEngine, WorkerSpec, build_engine, spawn_worker
from hetsched.simworker.engine import RequestTiming, StepObserver
from simworker_cli import MODEL, Start, runner, start  # noqa: F401 (the fixture)


def test_the_flags_build_the_tail_and_the_banner_says_so(start: Start) -> None:
    plain, banner = start()
    assert plain.engine.front is None and plain.engine.dispersion is None and "front end" not in banner
    worker, banner = start("--step-dispersion", "0.4", "--frontend-request-ms", "3", "--frontend-token-ms",
                           "0.25", "--seed", "7")
    assert worker.engine.dispersion == Dispersion.lognormal(0.4)
    assert worker.engine.front is not None
    assert worker.engine.front.front_end == FrontEnd(request_s=0.003, token_s=0.00025)
    assert "front end 3 ms a request, 0.25 ms a token" in banner and "steps × (p50 ×" in banner
    knots, _ = start("--step-dispersion", "0:0.5,0.5:0.9,0.99:2,1:3")
    assert knots.engine.dispersion is not None and knots.engine.front is None


@pytest.mark.parametrize(("flag", "value"), [("--frontend-request-ms", "-1"), ("--frontend-request-ms", "nan"),
                                             ("--frontend-token-ms", "inf"), ("--step-dispersion", "fast"),
                                             ("--step-dispersion", "-0.3"), ("--step-dispersion", "0:2,1:1")])
def test_a_bad_tail_flag_is_refused_by_name(flag: str, value: str) -> None:
    result = runner.invoke(cli, ["sim-worker", "--model", MODEL, "--accelerator", "l4", flag, value])
    assert isinstance(result.exception, InputError), result.output
    assert result.exception.field == flag


def test_dispersed_steps_are_the_model_s_times_the_seeded_draws() -> None:
    dispersion = Dispersion.lognormal(0.5)
    engine, _ = build_engine(WorkerSpec(model=MODEL, accelerator="l4", max_model_len=2048,
                                        tail=Tail(dispersion=dispersion), seed=3))
    engine.scheduler.add_request(Request(0, 256, 64))
    engine.scheduler.update_from_output(engine.scheduler.schedule())
    output = engine.scheduler.schedule(max_steps=1)
    base = engine.step_model.step_time(output.shape)
    draws = random.Random(3)
    assert engine._drawn(output, base) == pytest.approx(base * dispersion.quantile(draws.random()))
    assert engine._drawn(output, base) == pytest.approx(base * dispersion.quantile(draws.random()))


class _Timings(StepObserver):
    def __init__(self) -> None:
        self.finished: list[RequestTiming] = []

    def on_finished(self, timing: RequestTiming) -> None:
        self.finished.append(timing)


def _engine(front: FrontEnd, observer: StepObserver) -> SimEngine:
    base, _ = build_engine(WorkerSpec(model=MODEL, accelerator="l4", max_model_len=2048))
    return SimEngine(base.step_model.model, engine=base.engine_config, num_blocks=base.scheduler.num_blocks,
                     max_model_len=2048, observer=observer, tail=Tail(front_end=front))


async def _first_and_last(engine: SimEngine, prompt: int, out: int) -> tuple[float, float]:
    sent = time.monotonic()
    first = last = 0.0
    async for _ in engine.generate(prompt, out):
        last = time.monotonic() - sent
        first = first or last
    return first, last


def test_the_front_end_queues_requests_before_the_engine_sees_them() -> None:
    timings = _Timings()

    async def run() -> list[tuple[float, float]]:
        engine = _engine(FrontEnd(request_s=0.05), timings)
        engine.start()
        try:
            return await asyncio.gather(*(_first_and_last(engine, 64, 2) for _ in range(4)))
        finally:
            await engine.stop()

    seen = sorted(run_first for run_first, _ in asyncio.run(run()))
    assert seen[-1] >= 0.2 - 0.01  # the fourth waits for the three ahead of it in the front end
    assert max(t.ttft_s for t in timings.finished) < 0.1  # the engine's own TTFT does not count it


def test_tokens_reach_the_client_as_the_front_end_sends_them() -> None:
    timings = _Timings()

    async def run() -> tuple[float, float]:
        engine = _engine(FrontEnd(token_s=0.02), timings)
        engine.start()
        try:
            return await _first_and_last(engine, 64, 8)
        finally:
            await engine.stop()

    first, last = asyncio.run(run())
    assert last - first >= 7 * 0.02 - 0.01  # each token waits for the one before it to be sent
    assert timings.finished[0].e2e_s < last - 0.05


def test_a_spawned_worker_gets_its_tail_as_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def popen(args: list[str], **kwargs: object) -> None:
        seen.append(args)
        raise OSError("not started in this test")

    monkeypatch.setattr(subprocess, "Popen", popen)
    spec = WorkerSpec(model=MODEL, accelerator="l4", tail=Tail(Dispersion.lognormal(0.2), FrontEnd(0.002, 0.0001)),
                      seed=4)
    with pytest.raises(OSError):
        spawn_worker(spec, port=18000)
    args = seen[0]
    assert Dispersion.parse(args[args.index("--step-dispersion") + 1]).quantile(0.99) == pytest.approx(
        Dispersion.lognormal(0.2).quantile(0.99), rel=1e-3)
    assert float(args[args.index("--frontend-request-ms") + 1]) == pytest.approx(2.0)
    assert float(args[args.index("--frontend-token-ms") + 1]) == pytest.approx(0.1)
    assert args[args.index("--seed") + 1] == "4"
