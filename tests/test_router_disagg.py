"""The router's two-stage path for a disaggregated model, against twin prefill and decode workers; and its parts:
stage bodies, predictions by role, per-role turns, the role in config and discovery."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hetsched.catalog import load_catalog
from hetsched.errors import InputError
from hetsched.perf.step import StepShape
from hetsched.router.app import create_router_app
from hetsched.router.config import parse_router_config
from hetsched.router.discovery import endpoints_from_pods
from hetsched.router.predict import predict, transfer_seconds
from hetsched.router.profiles import endpoint_profile
from hetsched.router.stages import REMOTE_DECODE, decode_body, handed_params, prefill_body
from hetsched.router.state import RouterState
from hetsched.router.types import Endpoint, EndpointView, Handoff, Policy, RouteRequest
from hetsched.sim.roles import Role, kv_transfer_seconds
from hetsched.simworker import ThreadServer, WorkerSpec, build_engine, serve_in_thread, start_worker_thread
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO

ARCH = "qwen3-0.6b"
SPLIT, WHOLE = "split", "whole"
"""A disaggregated model and a unified one, both served by twins of ARCH."""
SCALE = 0.5
PROMPT = "x" * 16000
"""4,000 tokens."""


@pytest.fixture(scope="module")
def twins() -> Iterator[dict[str, list[ThreadServer]]]:
    def start(accelerator: str, role: Role, name: str) -> ThreadServer:
        return start_worker_thread(WorkerSpec(model=ARCH, accelerator=accelerator, time_scale=SCALE, role=role,
                                              served_name=name))

    servers = {"prefill": [start("h100-sxm", Role.PREFILL, SPLIT) for _ in range(2)],
               "decode": [start("l4", Role.DECODE, SPLIT) for _ in range(2)],
               "unified": [start("l4", Role.UNIFIED, WHOLE)]}
    yield servers
    for group in servers.values():
        for server in group:
            server.stop()


def _config(prefill: list[str], decode: list[str], unified: list[str] = (), **overrides: Any) -> dict:
    endpoints = [{"url": u, "accelerator": "h100-sxm", "role": "prefill"} for u in prefill] + \
        [{"url": u, "accelerator": "l4", "role": "decode"} for u in decode]
    models: dict = {SPLIT: {"arch": ARCH, "slo": {"ttft_ms": 3000, "tpot_ms": 200}, "endpoints": endpoints}}
    if unified:
        models[WHOLE] = {"arch": ARCH, "endpoints": [{"url": u, "accelerator": "l4"} for u in unified]}
    return {"models": models, "metrics_interval_s": 0.2,
            "health": {"check_interval_s": 60, "base_ejection_s": 30}} | overrides


def _router(prefill: list[str], decode: list[str], unified: list[str] = (), **overrides: Any) -> ThreadServer:
    return serve_in_thread(create_router_app(parse_router_config(_config(prefill, decode, unified, **overrides))))


def _urls(servers: list[ThreadServer]) -> list[str]:
    return [s.url for s in servers]


def _metric(text: str, name: str, **labels: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _dead(count: int = 1) -> list[str]:
    """``count`` distinct URLs where nothing listens (connection refused): ports held together while chosen."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# --- end to end ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_disaggregated_request_is_prefilled_then_decoded(twins: dict[str, list[ThreadServer]], chat: bool,
                                                            stream: bool) -> None:
    with _router(_urls(twins["prefill"]), _urls(twins["decode"])) as router, httpx.Client(timeout=30) as client:
        path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}) \
            if chat else ("/v1/completions", {"prompt": "Tell me a story."})
        body |= {"model": SPLIT, "max_tokens": 9, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        response = client.post(f"{router.url}{path}", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-hetsched-endpoint"] in _urls(twins["decode"])
        if stream:
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            tokens = [e for e in events if e["choices"] and (e["choices"][0].get("text")
                                                             or e["choices"][0].get("delta", {}).get("content"))]
            assert len(tokens) == 9 and events[-1]["usage"]["completion_tokens"] == 9
        else:
            assert response.json()["usage"]["completion_tokens"] == 9
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_requests_total", role="prefill", code="200") == 1
        assert _metric(metrics, "hetsched_router_requests_total", role="decode", code="200") == 1
        assert _metric(metrics, "hetsched_router_time_to_first_token_seconds_count", role="decode") == int(stream)
        assert _metric(metrics, "hetsched_router_in_flight_requests") == 0


def test_the_client_waits_for_prefill_transfer_and_one_decode_step(twins: dict[str, list[ThreadServer]]) -> None:
    arch = load_model(ARCH)
    h100, _ = build_engine(WorkerSpec(model=ARCH, accelerator="h100-sxm"))
    l4, _ = build_engine(WorkerSpec(model=ARCH, accelerator="l4"))
    prefill = h100.step_model.step_time(StepShape(4000, 1, 4000 * 4001 / 2, 4000, 0, 0))
    link = min(load_catalog().get("h100-sxm").network_gbs, load_catalog().get("l4").network_gbs)
    transfer = kv_transfer_seconds(arch, 4000, link_gbs=link)
    first_step = l4.step_model.step_time(StepShape(1, 1, 4000, 4000, 0, 0))
    expected = (prefill + transfer + first_step) / SCALE
    with _router(_urls(twins["prefill"])[:1], _urls(twins["decode"])[:1]) as router, \
            httpx.Client(timeout=30) as client:
        started = time.monotonic()
        arrivals = []
        body = {"model": SPLIT, "prompt": PROMPT, "max_tokens": 6, "stream": True}
        with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic() - started)
        assert len(arrivals) == 6 and expected <= arrivals[0]
        measured = _metric(client.get(f"{router.url}/metrics").text,
                           "hetsched_router_time_to_first_token_seconds_sum", role="decode")
        # from the client's request, not the decode's (which takes one step): bounds that hold however loaded the
        # machine, the router seeing the request after the client sent it and the token before the client does
        assert expected <= measured <= arrivals[0]


def _recorder(seen: list[tuple[str, dict, str | None]], *, prefill_status: int = 200,
              prefill_s: float = 0.0) -> Starlette:
    """Prefill instances (paths ``/p…``) and decode instances (``/d…``) in one app, recording each body and
    request id."""
    async def complete(request: Request) -> Response:
        name = request.path_params["name"]
        seen.append((name, await request.json(), request.headers.get("x-request-id")))
        if name.startswith("d"):
            return JSONResponse({"id": "cmpl-d", "choices": [{"index": 0, "text": " a b"}],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
        await asyncio.sleep(prefill_s)
        if prefill_status != 200:
            return JSONResponse({"error": {"message": "prompt too long", "type": "BadRequestError"}},
                                status_code=prefill_status)
        return JSONResponse({"id": "cmpl-p", "choices": [{"index": 0, "text": " a"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                             "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p0"}})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/{name}/v1/completions", complete, methods=["POST"]),
                             Route("/{name}/health", health)])


def test_the_prefill_answer_s_kv_transfer_params_go_to_the_decode() -> None:
    seen: list[tuple[str, dict, str | None]] = []
    with serve_in_thread(_recorder(seen)) as fake, _router([f"{fake.url}/p"], [f"{fake.url}/d"]) as router:
        body = {"model": SPLIT, "prompt": "abc", "max_tokens": 40, "min_tokens": 5}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    assert answer.status_code == 200 and answer.json()["id"] == "cmpl-d"
    (stage1, sent1, id1), (stage2, sent2, id2) = seen
    assert (stage1, stage2) == ("p", "d")
    assert sent1 == {"model": SPLIT, "prompt": "abc", "max_tokens": 1, "stream": False,
                     "kv_transfer_params": REMOTE_DECODE}
    assert sent2 == {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p0"}}
    assert id1 and id1 == id2  # one request id for both stages


def test_a_decode_instance_is_held_while_its_prefill_runs() -> None:
    seen: list[tuple[str, dict, str | None]] = []
    with serve_in_thread(_recorder(seen, prefill_s=0.3)) as fake, \
            _router([f"{fake.url}/p1", f"{fake.url}/p2"], [f"{fake.url}/d1", f"{fake.url}/d2"],
                    policy="least-request") as router:
        def send(_: int) -> int:
            return httpx.post(f"{router.url}/v1/completions", json={"model": SPLIT, "prompt": "abc"},
                              timeout=10).status_code

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(send, range(2))) == [200, 200]
    assert sorted(name for name, _, _ in seen if name.startswith("d")) == ["d1", "d2"]


@pytest.mark.parametrize("flow", [True, False], ids=["queued", "refused"])
def test_a_saturated_two_stage_model_queues_its_requests_under_flow_control(flow: bool) -> None:
    """One decode and one prefill place: the decode's is held through each request's prefill, so concurrent
    requests find the model saturated. Flow control queues them (each served in turn); without it they get 429."""
    seen: list[tuple[str, dict, str | None]] = []
    with serve_in_thread(_recorder(seen, prefill_s=0.2)) as fake:
        config = _config([f"{fake.url}/p1"], [f"{fake.url}/d1"], policy="least-request", flow={"enabled": flow})
        for endpoint in config["models"][SPLIT]["endpoints"]:
            endpoint["max_concurrency"] = 1
        with serve_in_thread(create_router_app(parse_router_config(config))) as router:
            def send(_: int) -> int:
                return httpx.post(f"{router.url}/v1/completions", json={"model": SPLIT, "prompt": "abc"},
                                  timeout=10).status_code

            with ThreadPoolExecutor(3) as pool:
                codes = sorted(pool.map(send, range(3)))
            metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    if flow:
        assert codes == [200, 200, 200]
        assert _metric(metrics, "hetsched_router_flow_dispatched_total", model=SPLIT) >= 3
        assert sum(1 for name, _, _ in seen if name == "p1") == 3
    else:
        assert codes.count(429) >= 1 and 200 in codes


def test_a_prefill_s_refusal_reaches_the_client_as_it_came() -> None:
    seen: list[tuple[str, dict, str | None]] = []
    with serve_in_thread(_recorder(seen, prefill_status=400)) as fake, \
            _router([f"{fake.url}/p"], [f"{fake.url}/d"]) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json={"model": SPLIT, "prompt": "abc"}, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "prompt too long"
    assert [name for name, _, _ in seen] == ["p"]


def test_a_failed_prefill_moves_to_another_instance(twins: dict[str, list[ThreadServer]]) -> None:
    with _router([*_dead(), twins["prefill"][0].url], _urls(twins["decode"]), policy="round-robin") as router, \
            httpx.Client(timeout=30) as client:
        for _ in range(3):
            response = client.post(f"{router.url}/v1/completions",
                                   json={"model": SPLIT, "prompt": "hi", "max_tokens": 3})
            assert response.status_code == 200, response.text
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_retries_total", reason="connection") >= 1


def test_a_failed_decode_before_its_first_byte_moves_to_another(twins: dict[str, list[ThreadServer]]) -> None:
    with _router(_urls(twins["prefill"]), [*_dead(), twins["decode"][0].url], policy="round-robin") as router, \
            httpx.Client(timeout=30) as client:
        for _ in range(3):
            response = client.post(f"{router.url}/v1/completions",
                                   json={"model": SPLIT, "prompt": "hi", "max_tokens": 3, "stream": True})
            assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
            assert response.headers["x-hetsched-endpoint"] == twins["decode"][0].url


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_a_stage_with_no_instance_left_is_an_openai_error(twins: dict[str, list[ThreadServer]], stage: str) -> None:
    prefill = _dead(2) if stage == "prefill" else _urls(twins["prefill"])
    decode = _dead(2) if stage == "decode" else _urls(twins["decode"])
    with _router(prefill, decode) as router, httpx.Client(timeout=30) as client:
        response = client.post(f"{router.url}/v1/completions",
                               json={"model": SPLIT, "prompt": "hi", "max_tokens": 3, "stream": True})
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "upstream_error" and error["code"] == "upstream_failed"
        assert f"2 {stage} endpoint(s) failed" in error["message"]
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_requests_total", role="decode") == 0


def test_a_unified_model_beside_a_disaggregated_one_is_routed_as_before(
        twins: dict[str, list[ThreadServer]]) -> None:
    with _router(_urls(twins["prefill"]), _urls(twins["decode"]), _urls(twins["unified"])) as router, \
            httpx.Client(timeout=30) as client:
        response = client.post(f"{router.url}/v1/completions", json={"model": WHOLE, "prompt": "hi", "max_tokens": 4})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert response.headers["x-hetsched-endpoint"] == twins["unified"][0].url
        metrics = client.get(f"{router.url}/metrics").text
        assert _metric(metrics, "hetsched_router_requests_total", role="unified") == 1
        assert _metric(metrics, "hetsched_router_requests_total", role="prefill") == 0


# --- the parts -----------------------------------------------------------------------------------------------

def test_stage_bodies_are_vllm_s_proxy_s() -> None:
    chat = {"model": "m", "messages": [], "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3}
    assert json.loads(prefill_body(chat)) == {"model": "m", "messages": [], "max_completion_tokens": 1,
                                              "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    assert json.loads(decode_body(chat, {"a": 1})) == {**chat, "kv_transfer_params": {"a": 1}}
    assert json.loads(decode_body(chat, None)) == chat
    assert handed_params(b'{"kv_transfer_params": {"a": 1}}') == {"a": 1}
    for answer in (b'{"kv_transfer_params": null}', b"[1]", b"not json", b'{"kv_transfer_params": {}}'):
        assert handed_params(answer) is None


def _view(url: str, role: Role, accelerator: str, *, in_flight: int = 0, prompt: int = 2000,
          out: int = 200) -> EndpointView:
    return EndpointView(Endpoint(url, ARCH, accelerator, role=role), in_flight=in_flight,
                        in_flight_prompt_tokens=in_flight * prompt, in_flight_max_tokens=in_flight * out)


def test_a_prefill_prediction_runs_to_the_client_s_first_token() -> None:
    profile = endpoint_profile(Endpoint("http://p", ARCH, "h100-sxm", role=Role.PREFILL), arch=ARCH)
    request = RouteRequest(ARCH, prompt_tokens=4000, max_tokens=1)
    slo = SLO(ttft_ms=1000, tpot_ms=50)
    alone = predict(profile, _view("http://p", Role.PREFILL, "h100-sxm"), request, slo=slo, role=Role.PREFILL)
    handoff = Handoff(network_gbs=6.25, ttft_s=0.05)
    after = predict(profile, _view("http://p", Role.PREFILL, "h100-sxm"), request, slo=slo, role=Role.PREFILL,
                    handoff=handoff)
    transfer = transfer_seconds(profile, handoff, 4000)
    assert transfer == pytest.approx(kv_transfer_seconds(load_model(ARCH), 4000, link_gbs=6.25))
    assert after.ttft_s - alone.ttft_s == pytest.approx(transfer - transfer_seconds(profile, Handoff(None), 4000)
                                                        + 0.05)
    assert after.tpot_s == 0.0 and after.violation == pytest.approx(after.ttft_s)
    queued = predict(profile, _view("http://p", Role.PREFILL, "h100-sxm", in_flight=8), request, slo=slo,
                     role=Role.PREFILL)
    assert queued.ttft_s > 3 * alone.ttft_s  # 36,000 prompt tokens ahead of it


def test_a_decode_prediction_has_no_prefill_in_its_steps() -> None:
    profile = endpoint_profile(Endpoint("http://d", ARCH, "l4", role=Role.DECODE), arch=ARCH)
    request = RouteRequest(ARCH, prompt_tokens=2000, max_tokens=200)
    busy = _view("http://d", Role.DECODE, "l4", in_flight=20)
    decode = predict(profile, busy, request, slo=None, role=Role.DECODE)
    unified = predict(profile, busy, request, slo=None)
    assert decode.tpot_s < unified.tpot_s and decode.ttft_s < unified.ttft_s


def test_round_robin_turns_are_kept_per_role() -> None:
    config = parse_router_config(_config(["http://p1", "http://p2"], ["http://d1", "http://d2"],
                                         policy="round-robin"))
    state = RouterState(config)
    state.set_endpoints(SPLIT, config.static_endpoints())
    assert state.disaggregated(SPLIT)
    picks = []
    for _ in range(2):
        for role in (Role.DECODE, Role.PREFILL):
            endpoint = state.decide(RouteRequest(SPLIT, 10, 10), now=0.0, role=role).endpoint
            assert endpoint is not None and endpoint.role is role
            picks.append(endpoint.url)
    assert picks == ["http://d1", "http://p1", "http://d2", "http://p2"]
    assert state.decide(RouteRequest(SPLIT, 10, 10), now=0.0).endpoint is None  # no unified endpoint


def test_the_slo_policy_prefers_the_prefill_whose_kv_reaches_the_decode_in_time() -> None:
    config = parse_router_config({"models": {SPLIT: {"arch": ARCH, "slo": {"ttft_ms": 400, "tpot_ms": 100},
                                                     "endpoints": [
        {"url": "http://l4", "accelerator": "l4", "role": "prefill"},
        {"url": "http://h100", "accelerator": "h100-sxm", "role": "prefill"},
        {"url": "http://d", "accelerator": "h100-sxm", "role": "decode"}]}}})
    state = RouterState(config)
    state.set_endpoints(SPLIT, config.static_endpoints())
    request = RouteRequest(SPLIT, prompt_tokens=6000, max_tokens=100)
    decode = state.decide(request, now=0.0, role=Role.DECODE)
    prefill = state.decide(request, now=0.0, role=Role.PREFILL, handoff=state.handoff(decode))
    assert decode.policy is Policy.SLO and prefill.endpoint is not None
    l4, h100 = prefill.predictions["http://l4"], prefill.predictions["http://h100"]
    assert prefill.endpoint.url == "http://h100" and h100.meets_slo and not l4.meets_slo


def test_a_model_needs_both_roles_and_no_unified_endpoints() -> None:
    with pytest.raises(InputError, match="needs prefill and decode endpoints"):
        parse_router_config(_config(["http://p"], []))
    mixed = _config(["http://p"], ["http://d"])
    mixed["models"][SPLIT]["endpoints"].append({"url": "http://u", "accelerator": "l4"})
    with pytest.raises(InputError, match="no unified ones"):
        parse_router_config(mixed)


def _pod(ip: str, role: str | None) -> SimpleNamespace:
    labels = {"hetsched.io/model": SPLIT, "hetsched.io/accelerator": "h100-sxm"} | \
        ({"hetsched.io/role": role} if role else {})
    return SimpleNamespace(metadata=SimpleNamespace(name=ip, labels=labels, deletion_timestamp=None),
                           status=SimpleNamespace(pod_ip=ip, conditions=[SimpleNamespace(type="Ready", status="True")]),
                           spec=SimpleNamespace(containers=[]))


def test_discovery_reads_the_role_label() -> None:
    pods = [_pod("10.0.0.1", "prefill"), _pod("10.0.0.2", "decode"), _pod("10.0.0.3", None),
            _pod("10.0.0.4", "both")]
    found = endpoints_from_pods(pods, models=[SPLIT], default_port=8000)
    assert [(e.url, e.role) for e in found[SPLIT]] == [
        ("http://10.0.0.1:8000", Role.PREFILL), ("http://10.0.0.2:8000", Role.DECODE),
        ("http://10.0.0.3:8000", Role.UNIFIED)]
