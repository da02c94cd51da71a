"""The router over real simulated workers on loopback: streaming, failover, overload, bad requests, cancel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hetsched.router.app import create_router_app
from hetsched.router.config import parse_router_config
from hetsched.router.types import DecisionReason, RouteRequest
from hetsched.simworker import ThreadServer, WorkerSpec, serve_in_thread, start_worker_thread
from hetsched.simworker.launch import free_port

MODEL = "qwen3-0.6b"


@pytest.fixture(scope="module")
def workers() -> Iterator[list[ThreadServer]]:
    servers = [start_worker_thread(WorkerSpec(model=MODEL, accelerator=acc, time_scale=1.0))
               for acc in ("h100-sxm", "l4")]
    yield servers
    for server in servers:
        server.stop()


def _router(endpoints: list[dict], **overrides: object) -> ThreadServer:
    raw: dict = {"models": {MODEL: {"slo": {"ttft_ms": 2000, "tpot_ms": 200}, "endpoints": endpoints}},
                 "metrics_interval_s": 0.2, "health": {"check_interval_s": 0.2, "base_ejection_s": 30}}
    raw.update(overrides)
    return serve_in_thread(create_router_app(parse_router_config(raw)))


def _endpoints(workers: list[ThreadServer], **extra: object) -> list[dict]:
    return [{"url": w.url, "accelerator": acc, **extra} for w, acc in zip(workers, ("h100-sxm", "l4"), strict=True)]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_streaming_passes_through_token_by_token(workers: list[ThreadServer]) -> None:
    with _router(_endpoints(workers)) as router, httpx.Client(timeout=10) as client:
        events: list[dict] = []
        body = {"model": MODEL, "prompt": "Tell me a story. " * 8, "max_tokens": 40, "stream": True}
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-hetsched-endpoint"] in {w.url for w in workers}
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        assert len(events) == 40 and events[-1]["choices"][0]["finish_reason"] == "length"
        chat = client.post(f"{router.url}/v1/chat/completions",
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_time_to_first_token_seconds_count", model=MODEL) == 1
        assert _metric(metrics, "hetsched_router_requests_total", code="200") == 2
        assert _metric(metrics, "hetsched_router_routing_decisions_total", policy="slo") == 2
        models = client.get(f"{router.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]


async def _answered_health(scope, send) -> bool:  # type: ignore[no-untyped-def]
    """For a fake engine: True when ``scope`` was not a request for an answer (a lifespan event, or the router's
    health check, answered 200 here)."""
    if scope["type"] != "http":
        return True
    if scope["method"] == "GET":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return True
    return False


def _gated_stream(gate: threading.Event, released: list[bool]) -> Callable[..., Awaitable[None]]:
    """An engine that streams one event, and the next only once ``gate`` is set (``released`` says whether it was,
    or 10 s passed first)."""
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if await _answered_health(scope, send):
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "more_body": True, "body": b'data: {"choices":[{"text":"a"}]}\n\n'})
        released.append(await asyncio.to_thread(gate.wait, 10))
        await send({"type": "http.response.body", "more_body": True, "body": b'data: {"choices":[{"text":"b"}]}\n\n'})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    return app


def test_a_stream_reaches_the_client_event_by_event() -> None:
    """The engine sends its second event only once the client has read the first, which a router holding the
    answer back would never let happen: told by order, not by when the events arrive."""
    gate, released = threading.Event(), []
    with serve_in_thread(_gated_stream(gate, released)) as engine, \
            _router([{"url": engine.url, "accelerator": "h100-sxm"}]) as router, httpx.Client(timeout=30) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
        texts = []
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
                    gate.set()
    assert released == [True] and texts == ["a", "b"]


def test_the_slo_policy_predicts_a_cpu_endpoint_as_this_machine() -> None:
    config = parse_router_config({"policy": "slo", "models": {MODEL: {"slo": {"ttft_ms": 60000, "tpot_ms": 5000},
                                  "endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "cpu"}]}}})
    router = create_router_app(config).state.router
    decision = router.state.decide(RouteRequest(MODEL, prompt_tokens=100, max_tokens=10), now=0.0)
    assert decision.reason is DecisionReason.SLO_MET and decision.prediction is not None


def _failing_app() -> Starlette:
    async def fail(request):  # type: ignore[no-untyped-def]
        return Response(b'{"error": "engine dead"}', status_code=503, media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", fail, methods=["POST"]),
                             Route("/health", fail, methods=["GET"])])


async def _dies_after_headers(scope, receive, send):  # type: ignore[no-untyped-def]
    """Accepts the request, sends a 200 head, then crashes before the first token."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    raise RuntimeError("engine crashed")


ONE_HEALTH_CHECK = {"check_interval_s": 3600, "base_ejection_s": 30}
"""Health settings under which the router checks ``/health`` once, as it starts, and never again in a test: a
periodic check landing between two requests would add a failure or clear the count, as the machine's load has it."""


@pytest.mark.parametrize(("failing", "reason"), [("refused", "connection"), ("5xx", "5xx"),
                                                 ("dies after its head", "connection")])
def test_failover_before_the_first_byte_and_ejection(workers: list[ThreadServer], failing: str, reason: str) -> None:
    """Round-robin over the failing endpoint and a worker: every request that tries the failing one first moves
    to the worker (a retry takes the other turn, so from the second request on each tries the failing one
    first), until three failures in a row eject it; at most one of the three is the start's health check."""
    with contextlib.ExitStack() as stack:
        if failing == "refused":
            bad = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
        else:
            bad = stack.enter_context(serve_in_thread(_failing_app() if failing == "5xx" else _dies_after_headers)).url
        endpoints = [{"url": bad, "accelerator": "h100-sxm"}, {"url": workers[0].url, "accelerator": "h100-sxm"}]
        router = stack.enter_context(_router(endpoints, policy="round-robin", health=ONE_HEALTH_CHECK))
        client = stack.enter_context(httpx.Client(timeout=10))
        for _ in range(8):
            response = client.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
            assert response.status_code == 200, response.text
            assert response.headers["x-hetsched-endpoint"] == workers[0].url
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_retries_total", reason=reason) >= 2
        assert _metric(metrics, "hetsched_router_ejections_total") == 1
        state = {e["url"]: e for e in client.get(f"{router.url}/router/endpoints").json()["endpoints"]}
        assert not state[bad]["healthy"] and state[workers[0].url]["healthy"]


@pytest.mark.parametrize(("status", "headers", "answered"), [(500, {}, 502), (503, {}, 502),
                                                             (503, {"Retry-After": "7"}, 503)])
def test_when_every_endpoint_fails_the_client_reads_what_the_last_engine_said(
        status: int, headers: dict[str, str], answered: int) -> None:
    async def exhausted(request: Request) -> Response:
        return JSONResponse({"error": {"message": "no free KV cache blocks", "type": "server_error"}}, status,
                            headers=headers)

    app = Starlette(routes=[Route("/v1/completions", exhausted, methods=["POST"]), Route("/health", _health_ok)])
    with serve_in_thread(app) as engine, _router([{"url": engine.url, "accelerator": "h100-sxm"}]) as router, \
            httpx.Client(timeout=10) as client:
        response = client.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == answered  # a busy engine's "come back in 7 s" reaches the client
        assert response.headers.get("retry-after") == headers.get("Retry-After")
        message = response.json()["error"]["message"]
        assert f"{engine.url} answered HTTP {status}: no free KV cache blocks" in message


async def _health_ok(request: Request) -> Response:
    return Response(b"")


def test_overload_answers_429_with_retry_after(workers: list[ThreadServer]) -> None:
    endpoints = [{"url": workers[0].url, "accelerator": "h100-sxm", "max_concurrency": 1}]
    with _router(endpoints, retry_after_s=2) as router, httpx.Client(timeout=10) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4000, "stream": True}
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as held:
            lines = held.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            refused = client.post(f"{router.url}/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
            assert refused.json()["error"]["code"] == "saturated"


def test_bad_requests_get_openai_error_bodies(workers: list[ThreadServer]) -> None:
    with _router(_endpoints(workers), max_body_bytes=2048) as router, httpx.Client(timeout=10) as client:
        url = f"{router.url}/v1/chat/completions"
        malformed = client.post(url, content=b'{"model": ', headers={"content-type": "application/json"})
        assert malformed.status_code == 400
        error = malformed.json()["error"]
        assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
        unknown = client.post(url, json={"model": "qwen3-0.6", "messages": [{"role": "user", "content": "x"}]})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found" and MODEL in unknown.json()["error"]["message"]
        missing = client.post(url, json={"model": MODEL})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
        huge = client.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]})
        assert huge.status_code == 413
        nowhere = client.post(f"{router.url}/v1/embeddings", json={"model": MODEL, "input": "x"})
        assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "not_found_error"
        assert "/v1/chat/completions" in nowhere.json()["error"]["message"]
        wrong_method = client.get(url)
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"
        for slo in ("soon", "inf", "1e400"):
            bad_slo = client.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                                  headers={"x-slo-ttft-ms": slo})
            assert bad_slo.status_code == 400 and bad_slo.json()["error"]["param"] == "x-slo-ttft-ms"


def test_bearer_token_is_required_when_configured(workers: list[ThreadServer],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_ROUTER_TOKEN", "s3cret")
    with _router(_endpoints(workers), auth_token_env="TEST_ROUTER_TOKEN") as router, \
            httpx.Client(timeout=10) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert client.post(f"{router.url}/v1/completions", json=body).status_code == 401
        ok = client.post(f"{router.url}/v1/completions", json=body, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    monkeypatch.setenv("TEST_TEAM_KEY", "team-key")
    keyed = {"auth_token_env": "TEST_ROUTER_TOKEN", "api_keys": [{"key_env": "TEST_TEAM_KEY", "tenant": "team"}]}
    with _router(_endpoints(workers), **keyed) as router, httpx.Client(timeout=10) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for key, status in (("team-key", 200), ("s3cret", 200), ("team-keyx", 401)):
            answer = client.post(f"{router.url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            assert answer.status_code == status, key
        metrics = client.get(f"{router.url}/metrics", headers={"authorization": "Bearer s3cret"}).text
        assert _metric(metrics, "hetsched_router_flow_dispatched_total", tenant="team") == 1


def test_client_disconnect_cancels_the_upstream_request(workers: list[ThreadServer]) -> None:
    worker = workers[1]
    with _router([{"url": worker.url, "accelerator": "l4"}]) as router, httpx.Client(timeout=10) as client:
        def running() -> float:
            return _metric(client.get(f"{worker.url}/metrics").text, "vllm:num_requests_running")

        completed = _metric(client.get(f"{worker.url}/metrics").text, "vllm:request_success_total")
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)
            next(lines)
            assert running() == 1
        deadline = time.monotonic() + 5  # 2000 tokens take the worker far longer: only an abort ends it this soon
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running() == 0
        # as in vLLM 0.32, a request its client abandoned is not counted as finished, under any reason
        assert _metric(client.get(f"{worker.url}/metrics").text, "vllm:request_success_total") == completed
        state = client.get(f"{router.url}/router/endpoints").json()["endpoints"]
        assert state[0]["in_flight"] == 0


def _breaks_off(*, streaming: bool) -> Callable[..., Awaitable[None]]:
    """An engine that begins an answer, then dies: a stream after one event, a whole answer after 60 of its
    1,000 declared bytes."""
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if await _answered_health(scope, send):
            return
        head = [(b"content-type", b"text/event-stream")] if streaming else \
            [(b"content-type", b"application/json"), (b"content-length", b"1000")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "more_body": True,
                    "body": b'data: {"choices":[{"text":"a"}]}\n\n' if streaming else b'{"choices":[{"text":"' + b"a" * 40})
        raise RuntimeError("engine crashed")
    return app


@pytest.mark.parametrize("streaming", [False, True])
def test_an_answer_its_engine_breaks_off_reaches_the_client_cut_short(streaming: bool) -> None:
    health = {**ONE_HEALTH_CHECK, "eject_after_failures": 1}  # its one failure ejects it, and no check clears that
    with serve_in_thread(_breaks_off(streaming=streaming)) as engine, \
            _router([{"url": engine.url, "accelerator": "h100-sxm"}], health=health) as router, \
            httpx.Client(timeout=10) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": streaming}
        if streaming:  # the stream ends with an error event, as a client of an SSE API reads one
            with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert json.loads(events[-1][6:])["error"]["type"] == "upstream_error"
        else:  # the client's HTTP library sees an incomplete body, not a whole one that is not JSON
            with pytest.raises(httpx.RemoteProtocolError):
                client.post(f"{router.url}/v1/completions", json=body)
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_requests_total", code="stream-error") == 1
        assert _metric(metrics, "hetsched_router_ejections_total") == 1
        assert not client.get(f"{router.url}/router/endpoints").json()["endpoints"][0]["healthy"]


def test_the_routers_time_limit_cuts_a_long_answer_without_counting_it_against_the_engine(
        workers: list[ThreadServer]) -> None:
    endpoints = [{"url": workers[1].url, "accelerator": "l4"}]
    with _router(endpoints, request_timeout_s=0.5, health={"eject_after_failures": 1}) as router, \
            httpx.Client(timeout=10) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000}
        with client.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-1][6:])["error"]
        assert error["type"] == "timeout" and "request_timeout_s" in error["message"]
        whole = client.post(f"{router.url}/v1/completions", json=body)  # an engine answers it all at once
        assert whole.status_code == 504 and whole.json()["error"]["type"] == "timeout"
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_requests_total", code="timeout") == 1
        state = client.get(f"{router.url}/router/endpoints").json()["endpoints"]
        assert state[0]["healthy"] and state[0]["consecutive_failures"] == 0


def test_a_whole_answer_keeps_its_length_and_its_usage_is_counted_past_the_first_mebibyte() -> None:
    seen: list[Headers] = []
    text = "x" * (3 << 19)  # 1.5 MiB of choices before the usage, as engines order them

    async def engine(request: Request) -> Response:
        seen.append(request.headers)
        return JSONResponse({"choices": [{"text": text}], "usage": {"prompt_tokens": 1, "completion_tokens": 7}})

    app = Starlette(routes=[Route("/v1/completions", engine, methods=["POST"]), Route("/health", engine)])
    with serve_in_thread(app) as served, _router([{"url": served.url, "accelerator": "h100-sxm"}]) as router, \
            httpx.Client(timeout=10) as client:
        response = client.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                               headers={"accept-encoding": "gzip"})
        assert response.status_code == 200 and response.headers["content-length"] == str(len(response.content))
        assert response.json()["choices"][0]["text"] == text
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_generation_tokens_total", model=MODEL) == 7
        assert "accept-encoding" not in seen[-1]  # the router reads the usage: engines answer it uncompressed
