"""The simulated vLLM worker: engine behaviour (batching, preemption, cancel) and its OpenAI surface."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from hetsched.catalog import load_catalog
from hetsched.perf.memory import fit
from hetsched.perf.step import OpTime, StepShape
from hetsched.simworker import SimEngine, WorkerSpec, build_engine, start_worker_thread
from hetsched.simworker.engine import RequestTiming, StepObserver
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model

MODEL = "qwen3-0.6b"


class FixedStep:
    """1 ms per step plus 1 µs per token: enough shape to see batching."""

    def step_time(self, shape: StepShape) -> float:
        return 1e-3 + 1e-6 * shape.tokens

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        return [OpTime("step", self.step_time(shape), 0.0, 0.0, "fixed")]


class Recorder(StepObserver):
    def __init__(self) -> None:
        self.finished: list[RequestTiming] = []
        self.preempted = 0
        self.aborted = 0

    def on_finished(self, timing: RequestTiming) -> None:
        self.finished.append(timing)

    def on_preempted(self, count: int) -> None:
        self.preempted += count

    def on_aborted(self) -> None:
        self.aborted += 1


async def _collect(engine: SimEngine, prompt: int, out: int) -> list[int]:
    return [n async for n in engine.generate(prompt, out)]


def test_kv_capacity_comes_from_the_memory_model() -> None:
    engine, _ = build_engine(WorkerSpec(model=MODEL, accelerator="l4", max_model_len=4096))
    memory = fit(load_model(MODEL), load_catalog().device("l4"), context_len=4096)
    assert engine.scheduler.num_blocks == memory.max_kv_tokens // EngineConfig().block_size


def test_a_worker_on_cpu_serves_as_this_machine() -> None:
    with start_worker_thread(WorkerSpec(model=MODEL, accelerator="cpu", time_scale=100.0, max_model_len=2048)) as cpu:
        answer = httpx.post(f"{cpu.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            timeout=10)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_engine_batches_requests_and_preempts_when_kv_runs_out() -> None:
    async def run() -> tuple[list[list[int]], Recorder, int]:
        recorder = Recorder()
        engine = SimEngine(FixedStep(), engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=512),
                           num_blocks=24, max_model_len=256, time_scale=50.0, observer=recorder)
        engine.start()
        try:
            outputs = await asyncio.gather(*(_collect(engine, 64, 60) for _ in range(6)))
        finally:
            await engine.stop()
        return outputs, recorder, engine.steps

    outputs, recorder, steps = asyncio.run(run())
    assert all(out[-1] == 60 for out in outputs) and len(recorder.finished) == 6
    assert all(out == sorted(out) for out in outputs)  # tokens only ever grow
    assert recorder.preempted > 0  # 6 × (64 + 60) tokens need 48 blocks; there are 24
    assert steps < 6 * 61  # continuous batching: far fewer steps than serving one at a time
    assert all(t.ttft_s <= t.e2e_s for t in recorder.finished)


def test_cancelling_a_waiting_request_takes_it_out_of_the_queue() -> None:
    async def run() -> tuple[Recorder, int]:
        recorder = Recorder()
        engine = SimEngine(FixedStep(), engine=EngineConfig(max_num_seqs=1, max_num_batched_tokens=64),
                           num_blocks=64, max_model_len=512, time_scale=0.5, observer=recorder)
        engine.start()
        try:
            first = asyncio.create_task(_collect(engine, 16, 50))
            await asyncio.sleep(0.01)
            queued = engine.generate(16, 50)
            waiting = asyncio.create_task(queued.__anext__())
            await asyncio.sleep(0.01)
            assert engine.num_waiting == 1
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await queued.aclose()
            left = engine.num_waiting
            await first
        finally:
            await engine.stop()
        return recorder, left

    recorder, left = asyncio.run(run())
    assert left == 0 and recorder.aborted == 1 and len(recorder.finished) == 1


def test_cancelling_a_running_request_frees_its_kv_blocks() -> None:
    async def run() -> tuple[Recorder, int, int, int]:
        recorder = Recorder()
        engine = SimEngine(FixedStep(), engine=EngineConfig(max_num_seqs=4, max_num_batched_tokens=256),
                           num_blocks=64, max_model_len=1024, time_scale=0.5, observer=recorder)
        engine.start()
        try:
            stream = engine.generate(128, 400)
            await stream.__anext__()  # first token: the request is running and holds blocks
            held = engine.scheduler.num_blocks - engine.scheduler.free_blocks
            await stream.aclose()
            await asyncio.sleep(0.05)  # the step in flight comes back, then the abort applies
            return recorder, held, engine.scheduler.free_blocks, engine.num_running
        finally:
            await engine.stop()

    recorder, held, free, running = asyncio.run(run())
    assert held >= 128 // 16
    assert free == 64 and running == 0
    assert recorder.aborted == 1 and not recorder.finished


@pytest.fixture(scope="module")
def worker():  # type: ignore[no-untyped-def]
    server = start_worker_thread(WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=5.0, max_model_len=2048))
    yield server
    server.stop()


def test_chat_stream_has_a_role_event_then_one_per_token_and_usage(worker) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 7,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{worker.url}/v1/chat/completions", json=body, timeout=10) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # as vLLM sends it
    tokens = [c for c in chunks[1:] if c["choices"]]
    assert len(tokens) == 7 and all(c["choices"][0]["delta"]["content"] for c in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 7


def test_worker_refuses_what_vllm_would(worker) -> None:  # type: ignore[no-untyped-def]
    too_long = httpx.post(f"{worker.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    other = httpx.post(f"{worker.url}/v1/completions", json={"model": "llama-3.1-8b", "prompt": "x"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{worker.url}/v1/models").json()["data"][0]["max_model_len"] == 2048


def test_worker_metrics_use_vllm_names(worker) -> None:  # type: ignore[no-untyped-def]
    httpx.post(f"{worker.url}/v1/completions", json={"model": MODEL, "prompt": "count me", "max_tokens": 5},
               timeout=10)
    text = httpx.get(f"{worker.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    from hetsched.router.signals import parse_engine_metrics

    signals = parse_engine_metrics(text, scraped_at=0.0)
    assert signals.running == 0 and signals.kv_capacity_tokens and signals.kv_usage == 0.0


def _series(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_each_token_gap_is_one_itl_observation_and_each_request_one_tpot(worker) -> None:  # type: ignore[no-untyped-def]
    before = httpx.get(f"{worker.url}/metrics").text
    httpx.post(f"{worker.url}/v1/completions", json={"model": MODEL, "prompt": "count me", "max_tokens": 40},
               timeout=10)
    after = httpx.get(f"{worker.url}/metrics").text
    itl, tpot = "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds"
    assert _series(after, f"{itl}_count") - _series(before, f"{itl}_count") == 39
    assert _series(after, f"{tpot}_count") - _series(before, f"{tpot}_count") == 1
    gaps = _series(after, f"{itl}_sum") - _series(before, f"{itl}_sum")
    mean = _series(after, f"{tpot}_sum") - _series(before, f"{tpot}_sum")
    assert gaps == pytest.approx(39 * mean) and mean > 0  # the gaps add up to the request's decode time
    assert f'{itl}_bucket{{engine="0",le="80.0",model_name="{MODEL}"}}' in after  # vLLM's buckets


def test_the_worker_answers_n_choices_as_vllm_does() -> None:
    with start_worker_thread(WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=20.0)) as server, \
            httpx.Client(timeout=30) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3}
        full = client.post(f"{server.url}/v1/chat/completions", json=body).json()
        assert [c["index"] for c in full["choices"]] == [0, 1, 2]
        assert all(c["message"]["content"] for c in full["choices"]) and full["usage"]["completion_tokens"] == 9
        streamed = client.post(f"{server.url}/v1/chat/completions", json=body | {
            "stream": True, "stream_options": {"include_usage": True}}).text
        events = [json.loads(line[5:]) for line in streamed.splitlines()
                  if line.startswith("data:") and "[DONE]" not in line]
        by_choice: dict[int, list[dict]] = {}
        for event in events:
            for choice in event["choices"]:
                by_choice.setdefault(choice["index"], []).append(choice)
        assert sorted(by_choice) == [0, 1, 2]
        for choices in by_choice.values():  # a role event, then 3 tokens, the last with its finish reason
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            assert len(choices) == 4 and choices[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 9
        assert client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}
                           ).status_code == 400


def test_a_dead_engine_loop_fails_health() -> None:
    import httpx

    from hetsched.simworker import WorkerSpec, start_worker_thread

    worker = start_worker_thread(WorkerSpec(model="qwen3-0.6b", accelerator="l4", min_step_wall_s=float("inf")))
    try:
        with httpx.Client(timeout=5) as client:
            assert client.get(f"{worker.url}/health").status_code == 200
            with contextlib.suppress(httpx.TimeoutException):
                client.post(f"{worker.url}/v1/completions", json={"model": "qwen3-0.6b", "prompt": "hi",
                                                                  "max_tokens": 4}, timeout=1)
            health = client.get(f"{worker.url}/health")
        assert health.status_code == 503 and "the engine loop died" in health.json()["error"]["message"]
    finally:
        worker.stop()
