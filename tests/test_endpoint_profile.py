"""Endpoint profiles: an open-loop load test against a small OpenAI-compatible server on loopback.

The fake server tokenizes one character per token (so words are never tokens), states a small
``max_model_len`` and refuses requests beyond it as vLLM does, and can fail requests or slow down
from one round to the next.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from hetsched.cli import app as cli_app
from hetsched.cli.profile import summary
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.step import StepShape
from hetsched.profiler.endpoint import LoadTestSettings, RequestRecord, profile_endpoint
from hetsched.profiler.profile import ProfileSource
from hetsched.simworker import ThreadServer, WorkerSpec, start_worker_thread

SERVED = "tiny-served"
MAX_MODEL_LEN = 300
runner = CliRunner()


@dataclass
class FakeEngine:
    """What the fake saw, and how it misbehaves: every ``fail_every``-th request is a 500; each ``slow_every``
    requests make its steps one step-time slower."""

    fail_every: int = 0
    slow_every: int = 0
    tokenize: bool = True
    prompt_lengths: list[int] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    active: int = 0


def make_app(fake: FakeEngine) -> Starlette:
    """Streams one word per step; a step takes longer with more requests decoding and a longer prompt first."""

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": SERVED, "object": "model",
                                                         "max_model_len": MAX_MODEL_LEN}]})

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        tokens = [ord(c) for c in body["prompt"]]
        return JSONResponse({"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens})

    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        if body.get("model") != SERVED:
            return JSONResponse({"error": {"message": "model not found"}}, status_code=404)
        prompt = body["prompt"]
        n_prompt = len(prompt)  # a text prompt is one token per character, token ids one each
        fake.requests += 1
        if n_prompt + body["max_tokens"] > MAX_MODEL_LEN:
            fake.failed += 1
            return JSONResponse({"error": {"message": f"{n_prompt} + {body['max_tokens']} tokens exceed "
                                                      f"{MAX_MODEL_LEN}", "type": "BadRequestError"}}, status_code=400)
        if fake.fail_every and fake.requests % fake.fail_every == 0:
            fake.failed += 1
            return JSONResponse({"error": {"message": "engine hiccup"}}, status_code=500)
        fake.prompt_lengths.append(n_prompt)
        slower = 1 + (fake.requests - 1) // fake.slow_every if fake.slow_every else 1
        usage = body.get("stream_options", {}).get("include_usage")

        async def stream() -> AsyncIterator[str]:
            await asyncio.sleep(slower * (0.002 + n_prompt * 0.00002))  # prefill
            fake.active += 1
            try:
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(slower * (0.003 + 0.001 * fake.active))
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}) + "\n\n"
            finally:
                fake.active -= 1
            if usage:
                yield "data: " + json.dumps({"choices": [], "usage": {
                    "prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    if fake.tokenize:
        routes.append(Route("/tokenize", tokenize, methods=["POST"]))
    return Starlette(routes=routes)


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> FakeEngine:
    """A well-behaved fake, or one configured by ``@pytest.mark.parametrize("fake", [{...}], indirect=True)``."""
    return FakeEngine(**getattr(request, "param", {}))


@pytest.fixture
def server(fake: FakeEngine) -> Iterator[ThreadServer]:
    """The fake on uvicorn's own event loop (uvloop): a plain asyncio loop in a thread bunches streamed chunks."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(fake), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    with ThreadServer(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread) as served:
        yield served


SETTINGS = LoadTestSettings(rates=(20.0, 80.0), requests_per_rate=12, prompt_tokens=(16, 256), output_tokens=6,
                            stable_within=0.9)


def test_load_test_measures_ttft_and_tpot_per_request(server: ThreadServer) -> None:
    seen = []
    profile = profile_endpoint("qwen3-0.6b", server.url, settings=SETTINGS, accelerator="l4", on_request=seen.append)
    assert len(seen) == profile.sweep["requests"] and all(r.error is None for r in seen)
    assert all(r.output_tokens == 6 and r.chunks == 6 and r.ttft_s > 0 for r in seen)
    assert statistics.median(r.tpot_s for r in seen) >= 0.003  # one starved thread can bunch a request's chunks
    assert profile.source is ProfileSource.ENDPOINT and profile.accelerator == "l4"
    summaries = profile.sweep["rates_summary"]
    assert [s["rate"] for s in summaries] == [20.0, 80.0]
    assert all(s["completed"] % 12 == 0 and s["tpot_p50_s"] > 0 for s in summaries)
    assert profile.provenance.device["served_model"] == SERVED
    one, many = StepShape.build(decode_contexts=[64]), StepShape.build(decode_contexts=[64] * 6)
    assert 0.003 <= profile.step_time(one) <= profile.step_time(many)
    assert profile.step_time(StepShape.build(prefill=[(256, 0)])) > 0


def test_prompt_lengths_are_the_servers_tokens(server: ThreadServer, fake: FakeEngine) -> None:
    seen = []
    profile = profile_endpoint("qwen3-0.6b", server.url, settings=SETTINGS, on_request=seen.append)
    assert set(fake.prompt_lengths) == {16, 256}
    assert {r.prompt_tokens for r in seen} == {16, 256}
    prefill_points = {p.coords[0] for p in profile.table("step").points if p.coords[0] >= 16}
    assert prefill_points == {16.0, 256.0}
    assert profile.sweep["max_model_len"] == MAX_MODEL_LEN


def test_every_request_keeps_within_max_model_len(server: ThreadServer, fake: FakeEngine) -> None:
    settings = LoadTestSettings(rates=(20.0,), requests_per_rate=10, prompt_tokens=(16, 1024), output_tokens=6,
                                stable_within=0.9)
    profile = profile_endpoint("qwen3-0.6b", server.url, settings=settings)
    assert fake.failed == 0 and not profile.failures
    assert set(fake.prompt_lengths) <= {16, MAX_MODEL_LEN - 6} and max(fake.prompt_lengths) == MAX_MODEL_LEN - 6
    assert any("prompt length 1024 capped to 294" in w for w in profile.sweep["warnings"])
    with pytest.raises(InputError, match="no room for a prompt within max_model_len 300"):
        profile_endpoint("qwen3-0.6b", server.url, settings=LoadTestSettings(output_tokens=300))


@pytest.fixture
def cli_db(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HETSCHED_DATABASE_URL", database_url)
    return database_url


@pytest.mark.parametrize("fake", [{"fail_every": 3}], indirect=True)
def test_failed_requests_are_stored_and_shown(server: ThreadServer, fake: FakeEngine, cli_db: str) -> None:
    args = ["profile", "qwen3-0.6b", "--source", "endpoint", "--url", server.url, "--rates", "20",
            "--requests", "9", "--prompt-tokens", "16,64", "--output-tokens", "4", "--max-rounds", "2"]
    made = runner.invoke(cli_app, [*args, "-o", "json"])
    assert made.exit_code == 0, made.output
    stored = json.loads(made.stdout)
    assert fake.failed > 0 and stored["failed_points"] == fake.failed
    assert any(f"{fake.failed} of {fake.requests} requests failed" in w for w in stored["warnings"])
    shown = runner.invoke(cli_app, ["profiles", "show", str(stored["id"])])
    assert f"{fake.failed} of {fake.requests} requests failed" in shown.stdout
    assert "HTTP 500" in shown.stdout and "0 failed" not in shown.stdout


def test_a_rate_repeats_until_its_medians_are_stable(server: ThreadServer) -> None:
    settings = LoadTestSettings(rates=(20.0,), requests_per_rate=8, prompt_tokens=(16,), output_tokens=6,
                                max_rounds=4, stable_within=0.9)
    profile = profile_endpoint("qwen3-0.6b", server.url, settings=settings)
    (rate,) = profile.sweep["rates_summary"]
    assert rate["rounds"] == 2 and rate["stable"] and rate["completed"] == 16
    assert not any("not stable" in w for w in profile.sweep["warnings"])


@pytest.mark.parametrize("fake", [{"slow_every": 8}], indirect=True)
def test_medians_that_keep_moving_are_reported_unstable(server: ThreadServer) -> None:
    settings = LoadTestSettings(rates=(20.0,), requests_per_rate=8, prompt_tokens=(16,), output_tokens=6,
                                max_rounds=3, stable_within=0.1)
    profile = profile_endpoint("qwen3-0.6b", server.url, settings=settings)
    (rate,) = profile.sweep["rates_summary"]
    assert rate["rounds"] == 3 and not rate["stable"]
    assert any("at 20 req/s not stable after 3 round(s)" in w for w in profile.sweep["warnings"])


def test_steps_beyond_the_measured_concurrency_are_marked_extrapolated(server: ThreadServer) -> None:
    profile = profile_endpoint("qwen3-0.6b", server.url, settings=SETTINGS)
    measured = profile.sweep["measured"]
    assert 1 <= measured["decode_seqs"] < 32 and measured["prefill_tokens"] == 256
    marked = summary(profile)["extrapolated"]
    assert "sequences decoding" in marked["decode 128 @ 4k ctx"]
    assert "2048 prefill tokens, measured up to 256" in marked["prefill 1×2048"]
    assert "decode 1 @ 1k ctx" in marked  # a 1k context is beyond the 262 tokens measured


@pytest.mark.parametrize("fake", [{"tokenize": False}], indirect=True)
def test_a_server_without_tokenize_is_a_clear_error(server: ThreadServer) -> None:
    with pytest.raises(BackendUnavailableError, match=f"{server.url}/tokenize answered HTTP 404; expected vLLM's"):
        profile_endpoint("qwen3-0.6b", server.url, settings=SETTINGS)


def test_unreachable_endpoint_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendUnavailableError, match=f"cannot reach the endpoint http://127.0.0.1:{port}"):
        profile_endpoint("qwen3-0.6b", f"http://127.0.0.1:{port}", settings=SETTINGS)


def test_wrong_model_and_bad_url_are_input_errors(server: ThreadServer) -> None:
    with pytest.raises(InputError, match="not 'other'"):
        profile_endpoint("qwen3-0.6b", server.url, served_model="other", settings=SETTINGS)
    with pytest.raises(InputError, match="http://"):
        profile_endpoint("qwen3-0.6b", "localhost:8000", settings=SETTINGS)
    with pytest.raises(InputError, match="rates"):
        LoadTestSettings(rates=(0.0,))


def test_the_sim_worker_twin_is_profiled_in_its_own_tokens() -> None:
    spec = WorkerSpec(model="qwen3-0.6b", accelerator="l4", time_scale=20.0, max_model_len=512)
    settings = LoadTestSettings(rates=(20.0,), requests_per_rate=6, prompt_tokens=(16, 1024), output_tokens=8,
                                stable_within=0.9)
    seen: list[RequestRecord] = []
    with start_worker_thread(spec) as twin:
        profile = profile_endpoint("qwen3-0.6b", twin.url, settings=settings, on_request=seen.append)
    assert not profile.failures and {r.prompt_tokens for r in seen} == {16, 512 - 8}
    assert all(r.output_tokens == 8 for r in seen)
