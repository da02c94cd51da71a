"""``hetsched epp`` against a gateway double that plays Envoy from the ext_proc contract, over simulated workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from envoy_double import EnvoyDouble, GatewayResult, _headers
from hetsched.catalog.host import read_host
from hetsched.router.config import parse_router_config
from hetsched.router.epp import EppServer, PoolGauges
from hetsched.router.h1 import H1Upstream
from hetsched.router.picker import Picker
from hetsched.router.types import Front
from hetsched.simworker import ThreadServer, WorkerSpec, serve_in_thread, start_worker_thread

MODEL = "qwen3-0.6b"
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
ACCELERATORS = ("h100-sxm", "a100-80gb", "l4")


@pytest.fixture(scope="module")
def workers() -> Iterator[list[ThreadServer]]:
    servers = [start_worker_thread(WorkerSpec(model=MODEL, accelerator=acc, time_scale=1.0)) for acc in ACCELERATORS]
    yield servers
    for server in servers:
        server.stop()


def _endpoints(workers: list[ThreadServer], **extra: object) -> list[dict]:
    return [{"url": w.url, "accelerator": acc, **extra} for w, acc in zip(workers, ACCELERATORS)]


@contextlib.asynccontextmanager
async def _epp(endpoints: list[dict], *, forward: bool = True, **overrides: object
               ) -> AsyncIterator[tuple[EppServer, EnvoyDouble]]:
    raw: dict = {"models": {MODEL: {"slo": {"ttft_ms": 2000, "tpot_ms": 200}, "endpoints": endpoints}},
                 "metrics_interval_s": 0.2, "health": {"check_interval_s": 0.2, "base_ejection_s": 30}}
    raw.update(overrides)
    picker = Picker(parse_router_config(raw), front=Front.EPP, host=read_host())
    server = EppServer(picker, upstream=H1Upstream(connect_timeout_s=1.0), host="127.0.0.1", port=0, health_port=0,
                       readiness_interval_s=0.05)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel, \
                httpx.AsyncClient(timeout=20) as http:
            yield server, EnvoyDouble(channel, http if forward else None)
    finally:
        await server.stop(0)


def _address(worker: ThreadServer) -> str:
    return worker.url.removeprefix("http://")


def _metric(server: EppServer, metric: str, **labels: str) -> float:
    total = 0.0
    for line in generate_latest(server.picker.metrics.registry).decode().splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _in_flight(server: EppServer) -> int:
    return sum(server.picker.state.get(e.url).in_flight for e in server.picker.state.endpoints())


async def _settled(server: EppServer, *, within_s: float = 10.0) -> int:
    """Requests in flight once the EPP has seen its streams end (a cancel reaches it a moment later)."""
    for _ in range(int(within_s / 0.02)):
        if _in_flight(server) == 0:
            return 0
        await asyncio.sleep(0.02)
    return _in_flight(server)


def _completion(**extra: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Tell me a story. " * 8, "max_tokens": 12, **extra}).encode()


def _error(result: GatewayResult) -> dict:
    return json.loads(result.body)["error"]


async def test_the_whole_path_streamed_and_whole(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (server, gateway):
        streamed = await gateway.request(_completion(stream=True, stream_options={"include_usage": True}))
        whole = await gateway.request(_completion())
    known = {_address(w) for w in workers}
    for result in (streamed, whole):
        assert result.status == 200
        assert result.picked[0] == result.metadata_pick.split(",")[0] and result.headers[
            "x-gateway-destination-endpoint"] == result.metadata_pick
        assert len(result.picked) == 3 and set(result.picked) == known  # the policy's ranking as fallbacks
        assert result.served == result.picked[0]
        assert "content-length" not in result.headers  # the body came back as it was
    assert streamed.forwarded_body == _completion(stream=True, stream_options={"include_usage": True})
    assert streamed.body.count(b"data: ") == 12 + 2  # 12 tokens, the usage chunk and [DONE], passed through
    assert json.loads(whole.body)["usage"]["completion_tokens"] == 12
    assert _metric(server, "hetsched_router_requests_total", front="epp", code="200") == 2
    assert _metric(server, "hetsched_router_time_to_first_token_seconds_count", front="epp") == 1
    assert _metric(server, "hetsched_router_generation_tokens_total", front="epp") == 24  # usage, both answers
    assert _metric(server, "hetsched_router_routing_decisions_total", policy="slo", front="epp") >= 2
    assert _in_flight(server) == 0


async def test_a_body_in_one_byte_chunks_is_read_whole(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (server, gateway):
        result = await gateway.request(_completion(), chunk_bytes=1)
    assert result.status == 200 and result.forwarded_body == _completion()
    assert _in_flight(server) == 0


async def test_the_subset_hint_confines_the_pick(workers: list[ThreadServer]) -> None:
    only = _address(workers[2])
    async with _epp(_endpoints(workers)) as (_, gateway):
        as_list = await gateway.request(_completion(), subset=[only])
        as_string = await gateway.request(_completion(), subset=f"{only}, {_address(workers[1])}")
        unknown = await gateway.request(_completion(), subset=["10.9.9.9:8000"])
        empty = await gateway.request(_completion(), subset=[])
    assert as_list.picked == [only] and as_list.status == 200
    assert set(as_string.picked) == {only, _address(workers[1])}
    for refused in (unknown, empty):
        assert refused.immediate and refused.status == 503
    assert "names no endpoint this picker knows (10.9.9.9:8000)" in _error(unknown)["message"]


async def test_no_endpoints_is_a_503_and_an_unknown_model_a_404(workers: list[ThreadServer]) -> None:
    async with _epp([]) as (_, gateway):
        none = await gateway.request(_completion())
    async with _epp(_endpoints(workers)) as (_, gateway):
        unknown = await gateway.request(json.dumps({"model": "nope", "prompt": "x"}).encode())
        bad_json = await gateway.request(b'{"model": ')
        bad_field = await gateway.request(json.dumps({"model": MODEL, "prompt": 5}).encode())
    assert none.status == 503 and _error(none)["code"] == "no_endpoint" and none.headers["retry-after"] == "1"
    assert unknown.status == 404 and _error(unknown)["code"] == "model_not_found"
    assert bad_json.status == 400 and bad_json.headers["content-type"] == "application/json"
    assert bad_field.status == 400 and _error(bad_field)["param"] == "prompt"


async def test_the_model_rewrite_changes_the_body_and_its_length(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (_, gateway):
        result = await gateway.request(json.dumps({"model": "alias", "prompt": "hi", "max_tokens": 3}).encode(),
                                       headers={"x-gateway-model-name-rewrite": MODEL})
    assert result.status == 200
    assert json.loads(result.forwarded_body)["model"] == MODEL
    assert result.headers["content-length"] == str(len(result.forwarded_body))


async def test_a_body_over_the_limit_is_a_413_and_the_server_keeps_serving(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers), max_body_bytes=2048) as (_, gateway):
        big = await gateway.request(json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode(), chunk_bytes=1000)
        after = await gateway.request(_completion())
    assert big.status == 413 and "2048" in _error(big)["message"]
    assert after.status == 200


async def test_a_body_before_headers_is_refused_and_the_server_keeps_serving(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (server, gateway):
        call = gateway.stub.Process()
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        after = await gateway.request(_completion())
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "request_body while waiting for request_headers" in caught.value.details()
    assert after.status == 200 and _in_flight(server) == 0


async def test_every_endpoint_saturated_is_a_429_with_retry_after(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers[:1], max_concurrency=1)) as (server, gateway):
        held = gateway.stub.Process()  # picked, its response never comes: the endpoint's one place is taken
        await held.write(pb.ProcessingRequest(request_headers=_headers({":path": "/v1/completions"}, end=False)))
        await held.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=_completion(), end_of_stream=True)))
        assert (await held.read()).HasField("request_headers")
        refused = await gateway.request(_completion())
        held.cancel()
        assert await _settled(server) == 0
    assert refused.status == 429 and refused.headers["retry-after"] == "1"
    assert _error(refused)["code"] == "saturated"


async def test_the_endpoint_that_served_is_charged(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers), policy="round-robin") as (server, gateway):
        result = await gateway.request(_completion(), served_override=_address(workers[0]))
        other = next(w for w in workers if _address(w) != result.picked[0])
        moved = await gateway.request(_completion(), served_override=_address(other))
    assert _metric(server, "hetsched_router_requests_total", endpoint=other.url, code="200") >= 1
    assert _metric(server, "hetsched_router_retries_total", reason="gateway", front="epp") >= 1
    assert moved.status == 200 and _in_flight(server) == 0


async def test_the_gateway_cancelling_ends_the_accounting(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (server, gateway):
        result = await gateway.request(_completion(stream=True, max_tokens=30), cancel_after_chunks=2)
        assert await _settled(server) == 0
        assert _metric(server, "hetsched_router_requests_total", code="499", front="epp") == 1
    assert result.status == 200


async def test_an_endpoint_killed_mid_stream_leaves_nothing_in_flight() -> None:
    async def breaks_off(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices":[{"text":"a"}]}\n\n'
            raise RuntimeError("the engine died")
        return StreamingResponse(events(), media_type="text/event-stream")

    dying = serve_in_thread(Starlette(routes=[Route("/v1/completions", breaks_off, methods=["POST"])]))
    try:
        async with _epp([{"url": dying.url, "accelerator": "l4"}]) as (server, gateway):
            result = await gateway.request(_completion(stream=True))
            assert await _settled(server) == 0
    finally:
        dying.stop()
    assert result.broken and result.body.startswith(b'data: {"choices"')


async def test_a_thousand_concurrent_streams_leak_nothing(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers), forward=False) as (server, gateway):
        results = await asyncio.gather(*(gateway.request(_completion(stream=True)) for _ in range(1000)))
        assert await _settled(server) == 0
        assert _metric(server, "hetsched_router_requests_total", code="200", front="epp") == 1000
    assert all(r.status == 200 for r in results)


async def test_health_and_pool_gauges(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (server, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            live = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
            for _ in range(100):
                ready = await health.Check(health_pb2.HealthCheckRequest(service="readiness"))
                if ready.status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            ext_proc = await health.Check(health_pb2.HealthCheckRequest(
                service="envoy.service.ext_proc.v3.ExternalProcessor"))
        server.picker.metrics.registry.register(PoolGauges(server.picker, "pool-a"))
        assert _metric(server, "inference_pool_ready_pods", name="pool-a") == 3
        assert "inference_pool_average_kv_cache_utilization" in generate_latest(
            server.picker.metrics.registry).decode()
    assert live.status == ready.status == ext_proc.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_request_without_a_body_goes_by_load(workers: list[ThreadServer]) -> None:
    async with _epp(_endpoints(workers)) as (server, gateway):
        result = await gateway.request(None, path="/v1/models")
    assert result.status == 200 and len(result.picked) == 1 and _in_flight(server) == 0


async def test_the_command_serves_a_router_file_and_stops_on_sigterm(workers: list[ThreadServer], tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys

    import yaml

    from hetsched.simworker.launch import free_port

    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"models": {MODEL: {"endpoints": _endpoints(workers)}}}))
    port, health_port, metrics_port = free_port(), free_port(), free_port()
    process = subprocess.Popen([sys.executable, "-m", "hetsched", "epp", "--config", str(path), "--port", str(port),
                                "--health-port", str(health_port), "--metrics-port", str(metrics_port)],
                               stderr=subprocess.PIPE, env={**os.environ, "HETSCHED_DATABASE_URL":
                                                            f"sqlite:///{tmp_path / 'store.db'}"})
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(300):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    check = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                    if check.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the EPP never became ready")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, httpx.AsyncClient(timeout=20) as http:
            result = await EnvoyDouble(channel, http).request(_completion())
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert result.status == 200
        assert 'hetsched_router_requests_total{accelerator=' in metrics and 'front="epp"' in metrics
        assert 'inference_pool_ready_pods{name="router"} 3.0' in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr.decode()


@pytest.mark.parametrize("stop_after", ["headers", "half a body", "the pick"])
async def test_a_gateway_that_disconnects_at_any_point_leaks_nothing(workers: list[ThreadServer],
                                                                     stop_after: str) -> None:
    async with _epp(_endpoints(workers)) as (server, gateway):
        call = gateway.stub.Process()
        await call.write(pb.ProcessingRequest(request_headers=_headers({":path": "/v1/completions"}, end=False)))
        if stop_after != "headers":
            body = _completion()
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:20])))
        if stop_after == "the pick":
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body[20:], end_of_stream=True)))
            assert (await call.read()).HasField("request_headers")
            assert _in_flight(server) == 1
        call.cancel()
        assert await _settled(server) == 0
        assert (await gateway.request(_completion())).status == 200


async def test_the_picker_serves_the_named_models_and_a_pool_s_pods_replace_the_file_s_endpoints(
        workers: list[ThreadServer]) -> None:
    from hetsched.errors import InputError
    from hetsched.router.config import picker_config

    file = parse_router_config({"models": {MODEL: {"endpoints": _endpoints(workers)}, "other": {}}})
    assert picker_config(file, [], from_pool=False) is file
    pooled = picker_config(file, [MODEL], from_pool=True)
    assert list(pooled.models) == [MODEL] and pooled.models[MODEL].endpoints == []
    assert list(picker_config(None, ["a", "b"], from_pool=True).models) == ["a", "b"]
    for named, problem in (([], "--model, or give a --config file"), (["nope"], "nope not in the file's models")):
        with pytest.raises(InputError, match=problem) as caught:
            picker_config(None if not named else file, named, from_pool=True)
        assert caught.value.field == "--model"
