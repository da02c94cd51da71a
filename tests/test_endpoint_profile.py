"""Endpoint profiles: an open-loop load test against a small OpenAI-compatible server on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.step import StepShape
from hetsched.profiler.endpoint import LoadTestSettings, profile_endpoint
from hetsched.profiler.profile import ProfileSource

SERVED = "tiny-served"


def make_app() -> Starlette:
    """Streams one word per step; a step takes longer with more requests decoding and a longer prompt first."""
    active = {"n": 0}

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        if body.get("model") != SERVED:
            return JSONResponse({"error": {"message": "model not found"}}, status_code=404)
        prompt_words = len(body["prompt"].split())

        async def stream() -> Iterator[str]:  # type: ignore[misc]
            await asyncio.sleep(0.002 + prompt_words * 0.00002)  # prefill
            active["n"] += 1
            try:
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(0.003 + 0.001 * active["n"])
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}) + "\n\n"
            finally:
                active["n"] -= 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


SETTINGS = LoadTestSettings(rates=(20.0, 80.0), requests_per_rate=12, prompt_tokens=(16, 256), output_tokens=6)


def test_load_test_measures_ttft_and_tpot_per_request(server_url: str) -> None:
    seen = []
    profile = profile_endpoint("qwen3-0.6b", server_url, settings=SETTINGS, accelerator="l4",
                               on_request=seen.append)
    assert len(seen) == 24 and all(r.error is None for r in seen)
    assert all(r.chunks == 6 and r.ttft_s > 0 and r.tpot_s >= 0.003 for r in seen)
    assert profile.source is ProfileSource.ENDPOINT and profile.accelerator == "l4"
    summaries = profile.sweep["rates_summary"]
    assert [s["rate"] for s in summaries] == [20.0, 80.0]
    assert all(s["completed"] == 12 and s["tpot_p50_s"] > 0 for s in summaries)
    assert profile.provenance.device["served_model"] == SERVED
    one, many = StepShape.build(decode_contexts=[64]), StepShape.build(decode_contexts=[64] * 6)
    assert 0.003 <= profile.step_time(one) <= profile.step_time(many)
    assert profile.step_time(StepShape.build(prefill=[(256, 0)])) > 0


def test_unreachable_endpoint_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendUnavailableError, match=f"cannot reach the endpoint http://127.0.0.1:{port}"):
        profile_endpoint("qwen3-0.6b", f"http://127.0.0.1:{port}", settings=SETTINGS)


def test_wrong_model_and_bad_url_are_input_errors(server_url: str) -> None:
    with pytest.raises(InputError, match="not 'other'"):
        profile_endpoint("qwen3-0.6b", server_url, served_model="other", settings=SETTINGS)
    with pytest.raises(InputError, match="http://"):
        profile_endpoint("qwen3-0.6b", "localhost:8000", settings=SETTINGS)
    with pytest.raises(InputError, match="rates"):
        LoadTestSettings(rates=(0.0,))
