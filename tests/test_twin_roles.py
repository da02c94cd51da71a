"""The twin's roles of disaggregated serving: a prefill answers one token and the KV's whereabouts, a decode waits
the KV's transfer and generates the answer, a unified worker ignores the handshake."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from hetsched.catalog import load_catalog
from hetsched.perf.step import StepShape
from hetsched.sim.roles import Role, kv_transfer_seconds
from hetsched.simworker import ThreadServer, WorkerSpec, build_engine, start_worker_thread
from hetsched.specs.registry import load_model

MODEL = "qwen3-0.6b"
SCALE = 0.5
"""Slow motion: the simulated times dominate the HTTP and scheduling overheads of a busy test machine."""
PROMPT = "x" * 16000
"""4,000 tokens (four bytes a token): a KV cache of 0.46 GB to move."""
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's disaggregated proxy asks a prefill instance for."""


@pytest.fixture(scope="module")
def twins() -> Iterator[dict[Role, ThreadServer]]:
    servers = {Role.PREFILL: start_worker_thread(WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=SCALE,
                                                            role=Role.PREFILL)),
               Role.DECODE: start_worker_thread(WorkerSpec(model=MODEL, accelerator="l4", time_scale=SCALE,
                                                           role=Role.DECODE)),
               Role.UNIFIED: start_worker_thread(WorkerSpec(model=MODEL, accelerator="l4", time_scale=SCALE))}
    yield servers
    for server in servers.values():
        server.stop()


def _stream(url: str, body: dict) -> tuple[list[float], list[dict]]:
    """Arrival times (from the request) and payloads of a completion stream's token events."""
    started = time.monotonic()
    arrivals, events = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - started)
                events.append(json.loads(line[6:]))
    return arrivals, events


def test_a_prefill_answers_one_token_and_where_its_kv_waits(twins: dict[Role, ThreadServer]) -> None:
    url = twins[Role.PREFILL].url
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 50,
                                                       "kv_transfer_params": REMOTE_DECODE}, timeout=30).json()
    assert answer["usage"] == {"prompt_tokens": 4000, "completion_tokens": 1, "total_tokens": 4001}
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == 4000 // 16 and params["remote_request_id"] == answer["id"]
    assert params["remote_network_gbs"] == load_catalog().get("h100-sxm").network_gbs
    assert {"remote_engine_id", "remote_host", "remote_port", "tp_size"} <= params.keys()
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 9,
                                                           "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["usage"]["completion_tokens"] == 1 and "kv_transfer_params" not in chat  # nobody asked for a handoff


def test_a_decode_waits_the_transfer_then_computes_only_the_last_prompt_token(
        twins: dict[Role, ThreadServer]) -> None:
    arch, l4 = load_model(MODEL), load_catalog().device("l4")
    transfer = kv_transfer_seconds(arch, 4000, link_gbs=min(l4.accelerator.network_gbs, 50.0)) / SCALE
    engine, _ = build_engine(WorkerSpec(model=MODEL, accelerator="l4"))
    first_step = engine.step_model.step_time(StepShape(1, 1, 4000, 4000, 0, 0)) / SCALE
    whole_prompt = engine.step_model.step_time(StepShape(4000, 1, 4000 * 4001 / 2, 4000, 0, 0)) / SCALE
    assert transfer > 0.1 and whole_prompt > transfer + first_step  # the two paths are told apart

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_network_gbs": 50.0}}
    arrivals, events = _stream(twins[Role.DECODE].url, body)
    assert len(events) == 12 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert transfer + first_step <= arrivals[0] < transfer + first_step + 0.1 + 0.2 * transfer
    assert arrivals[-1] - arrivals[0] > 11 * first_step / 2  # the other 11 come one decode step apart

    other = "y" * len(PROMPT)  # the handed-off prompt's blocks are in the decode's prefix cache now
    recomputed, _ = _stream(twins[Role.DECODE].url, {**body, "prompt": other, "kv_transfer_params": None})
    assert recomputed[0] >= whole_prompt  # without a handoff a decode instance computes the prompt itself


def test_a_decode_waits_on_the_slower_link(twins: dict[Role, ThreadServer]) -> None:
    worker = twins[Role.DECODE]
    slow = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_network_gbs": 1.0}}
    transfer = kv_transfer_seconds(load_model(MODEL), 4000, link_gbs=1.0) / SCALE
    arrivals, _ = _stream(worker.url, slow)
    assert arrivals[0] >= transfer


def test_a_unified_worker_ignores_the_handshake(twins: dict[Role, ThreadServer]) -> None:
    url = twins[Role.UNIFIED].url
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5,
                                                       "kv_transfer_params": REMOTE_DECODE}, timeout=30).json()
    assert answer["usage"]["completion_tokens"] == 5 and "kv_transfer_params" not in answer
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "kv_transfer_params": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
