"""The router's reading of a streamed response: tokens, TTFT and TPOT from vLLM's exact chunk sequence."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import generate_latest

from hetsched.catalog.host import HostInfo
from hetsched.router.answers import completion_tokens as _completion_tokens
from hetsched.router.app import RouterApp, create_router_app
from hetsched.errors import InputError
from hetsched.router.config import parse_router_config
from hetsched.router.openai import ApiKind, parse_request

MODEL = "qwen3-0.6b"
UPSTREAM = "http://vllm:8000"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _chat(delta: dict, finish: str | None = None) -> bytes:
    return _event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})


def _completion(text: str, finish: str | None = None) -> bytes:
    return _event({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})


USAGE = _event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
                "usage": {"prompt_tokens": 9, "total_tokens": 13, "completion_tokens": 4}})
DONE = _event("[DONE]")
LO = _chat({"content": "lo"})

CHAT = [  # (seconds after the request, raw bytes): what vLLM streams for 4 tokens, the last one the unseen EOS
    (0.010, _chat({"role": "assistant", "content": ""})),
    (0.100, _chat({"content": "Hel"})),
    (0.129, LO[:40]), (0.130, LO[40:]),  # one event split across two reads
    (0.160, _chat({"content": "!"})),
    (0.190, _chat({"content": ""}, "stop") + USAGE + DONE),
]
COMPLETION = [  # the same without usage: 3 tokens carry text, the final chunk only the finish reason
    (0.100, _completion(" Hel")),
    (0.130, _completion("lo")),
    (0.160, _completion("!")),
    (0.190, _completion("", "length") + DONE),
]


class _Stream(httpx.AsyncByteStream):
    def __init__(self, clock: _Clock, reads: list[tuple[float, bytes]]) -> None:
        self.clock, self.reads = clock, reads

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for at, raw in self.reads:
            self.clock.now = at
            yield raw


def _metrics(path: str, reads: list[tuple[float, bytes]]) -> dict[str, float]:
    """Stream one request through the router to a fake vLLM; the router's metric samples by name."""
    clock = _Clock()

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == path:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stream(clock, reads))
        return httpx.Response(200, text="")  # health and /metrics

    config = parse_router_config({"policy": "least-request",
                                  "models": {MODEL: {"endpoints": [{"url": UPSTREAM, "accelerator": "l4"}]}}})
    app = create_router_app(config, clock=clock, transport=httpx.MockTransport(upstream),
                            host=HostInfo(cores=4, memory_gb=16, cpu_model="test", clock_ghz=2.0))

    async def run() -> str:
        async with app.state.router.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                                     base_url="http://router") as client:
            body = {"model": MODEL, "stream": True, "max_tokens": 8}
            body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
            response = await client.post(path, json=body)
            assert response.status_code == 200 and response.text == b"".join(r for _, r in reads).decode()
        return generate_latest(app.state.router.metrics.registry).decode()

    samples: dict[str, float] = {}
    for line in asyncio.run(run()).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.split("{")[0]] = samples.get(name.split("{")[0], 0.0) + float(value)
    return samples


def test_tokens_come_from_usage_and_timing_from_content_chunks() -> None:
    m = _metrics("/v1/chat/completions", CHAT)
    assert m["hetsched_router_generation_tokens_total"] == 4  # not 6 events, nor 3 chunks with text
    assert m["hetsched_router_time_to_first_token_seconds_count"] == 1
    assert m["hetsched_router_time_to_first_token_seconds_sum"] == pytest.approx(0.100)  # not the role chunk's
    assert m["hetsched_router_time_per_output_token_seconds_sum"] == pytest.approx((0.160 - 0.100) / 3)


def test_a_whole_answer_counts_its_usage_not_text_that_looks_like_it() -> None:
    answer = {"id": "cmpl-1", "choices": [{"text": 'say "usage": {"completion_tokens": 99}'}],
              "usage": {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5}}
    assert _completion_tokens(json.dumps(answer).encode()) == 5
    assert _completion_tokens(json.dumps(answer, indent=2).encode()) == 5
    assert _completion_tokens(json.dumps({**answer, "usage": None}).encode()) == 0
    assert _completion_tokens(b'{"error": {"message": "bad"}}') == 0


def test_without_usage_each_chunk_with_content_is_a_token() -> None:
    m = _metrics("/v1/completions", COMPLETION)
    assert m["hetsched_router_generation_tokens_total"] == 3
    assert m["hetsched_router_time_to_first_token_seconds_sum"] == pytest.approx(0.100)
    assert m["hetsched_router_time_per_output_token_seconds_sum"] == pytest.approx((0.160 - 0.100) / 2)


def _app(upstream: httpx.MockTransport, clock: _Clock) -> RouterApp:
    config = parse_router_config({"policy": "least-request",
                                  "models": {MODEL: {"endpoints": [{"url": UPSTREAM, "accelerator": "l4"}]}}})
    return create_router_app(config, clock=clock, transport=upstream,
                             host=HostInfo(cores=4, memory_gb=16, cpu_model="test", clock_ghz=2.0))


def test_a_request_its_client_abandons_is_counted_with_its_own_code() -> None:
    clock = _Clock()
    first_sent, disconnect = asyncio.Event(), asyncio.Event()

    class _Hanging(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            clock.now = 0.100
            yield _completion(" Hel")
            await asyncio.Event().wait()  # the engine is still generating when the client leaves
            yield b""

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Hanging())
        return httpx.Response(200, text="")

    app = _app(httpx.MockTransport(upstream), clock)
    body = json.dumps({"model": MODEL, "stream": True, "prompt": "hi"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message.get("body"):
            first_sent.set()

    async def run() -> str:
        async with app.state.router.lifespan(app):
            served = asyncio.create_task(app(scope, receive, send))
            await first_sent.wait()
            clock.now = 0.250
            disconnect.set()
            await asyncio.wait_for(served, 5)
        return generate_latest(app.state.router.metrics.registry).decode()

    text = asyncio.run(run())
    assert 'hetsched_router_requests_total{accelerator="l4",code="499"' in text
    assert "hetsched_router_request_latency_seconds_count" in text
    latency = [line for line in text.splitlines() if line.startswith("hetsched_router_request_latency_seconds_sum")]
    assert float(latency[0].rsplit(" ", 1)[1]) == pytest.approx(0.250)


def test_models_pass_the_engine_s_fields_through() -> None:
    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "Qwen/Qwen3-0.6B", "object": "model", "created": 5, "owned_by": "vllm",
                 "root": "Qwen/Qwen3-0.6B", "max_model_len": 4096}]})
        return httpx.Response(200, text="")

    app = _app(httpx.MockTransport(upstream), _Clock())

    async def run() -> dict:
        async with app.state.router.lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                                     base_url="http://router") as client:
            return (await client.get("/v1/models")).json()

    (entry,) = asyncio.run(run())["data"]
    assert entry == {"id": MODEL, "object": "model", "created": 5, "owned_by": "vllm", "root": "Qwen/Qwen3-0.6B",
                     "max_model_len": 4096}


@pytest.mark.parametrize("body", [b'{"model": ', b"[" * 100_000, b'{"model": "\xff"}', b"[1]"])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_the_body(body: bytes) -> None:
    with pytest.raises(InputError) as caught:
        parse_request(body, ApiKind.CHAT)
    assert caught.value.field == "body"
