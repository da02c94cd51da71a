"""The simulated worker's prefix cache seen from outside: vLLM's KV events on ZMQ, their replay, its counters."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client import generate_latest
from simworker_cli import Start, runner, start  # noqa: F401 (the fixture)
from test_tokenize import write_tokenizer

from hetsched.cli import app as cli
from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.errors import InputError
from hetsched.kvcache.events import END_SEQUENCE, BlockStored, EventBatch, decode
from hetsched.kvcache.hashing import BlockHashing, HashAlgorithm
from hetsched.router.openai import ApiKind, parse_request
from hetsched.router.tokenize import PromptTokenizer, prompt_token_ids
from hetsched.simworker import WorkerSpec, start_worker_thread
from hetsched.simworker.launch import ThreadServer, free_port

MODEL = "qwen3-0.6b"
PREFIX = "".join(f"{i:04d}" for i in range(80))
"""320 bytes: 80 tokens of the text fallback, five blocks of 16."""
TOPIC = "kv"


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _publishing_worker(tokenizer: Path | None = None) -> tuple[ThreadServer, str, str]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    spec = WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=20.0, max_model_len=2048, kv_events=pub,
                      kv_events_replay=replay, kv_events_topic=TOPIC,
                      tokenizer=None if tokenizer is None else str(tokenizer))
    return start_worker_thread(spec), pub, replay


def _subscribe(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # a subscriber sees only what is published once it has joined
    return sub


def _receive(sub: zmq.Socket[bytes], *, until_stored: int) -> list[EventBatch]:
    """Batches until ``until_stored`` blocks were stored (a step's events may trail its tokens a little)."""
    batches: list[EventBatch] = []
    while sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored)) < until_stored:
        assert sub.poll(5000), "no KV events arrived"
        topic, batch = decode(sub.recv_multipart())
        assert topic == TOPIC.encode()
        batches.append(batch)
    return batches


def _prefix_counts(base_url: str) -> tuple[float, float]:
    """The worker's ``vllm:prefix_cache_queries_total`` and ``_hits_total``, read as any engine's are."""
    found = parse_metrics_text(httpx.get(f"{base_url}/metrics").text)
    assert found.prefix_cache_queries is not None and found.prefix_cache_hits is not None
    return found.prefix_cache_queries, found.prefix_cache_hits


def _complete(base_url: str, prompt: str) -> dict[str, object]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _token_ids(prompt: str) -> list[int]:
    body = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    return prompt_token_ids(parse_request(body, ApiKind.COMPLETIONS), None)


def test_shared_prefix_blocks_are_published_hit_and_replayed(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    first, second = PREFIX + "a" * 100, PREFIX + "b" * 100  # 105 tokens each: six full blocks, five shared
    hashing = BlockHashing(block_size=16)
    ids = _token_ids(first)
    expected_first, expected_second = hashing.block_hashes(ids), hashing.block_hashes(_token_ids(second))
    assert expected_first[:5] == expected_second[:5] and expected_first[5] != expected_second[5]
    server, pub, replay = _publishing_worker()
    with server:
        sub = _subscribe(context, pub)
        queries, hits = _prefix_counts(server.url)
        _complete(server.url, first)
        _complete(server.url, second)
        batches = _receive(sub, until_stored=7)
        queries_after, hits_after = _prefix_counts(server.url)
        assert hits_after - hits == 5 * 16
        assert queries_after - queries == 2 * 105

        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[list[bytes]] = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            frames = dealer.recv_multipart()
            if frames == [b"", b"", END_SEQUENCE, b""]:
                break
            replayed.append(frames)

    assert [b.sequence for b in batches] == list(range(len(batches)))
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored == [BlockStored(tuple(expected_first), None, tuple(ids[:96]), 16),
                      BlockStored((expected_second[5],), expected_second[4], tuple(_token_ids(second)[80:96]), 16)]
    assert all(f[0] == b"" and f[1] == TOPIC.encode() for f in replayed)
    assert [decode(f[1:])[1].events for f in replayed] == [b.events for b in batches]
    assert [decode(f[1:])[1].sequence for f in replayed] == [b.sequence for b in batches]


def test_a_tokenizer_makes_the_blocks_the_models_own(tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    directory = write_tokenizer(tmp_path / "model")
    server, pub, _ = _publishing_worker(directory)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 12}], "max_tokens": 2}
    ids = PromptTokenizer.load(directory).token_ids(parse_request(json.dumps(body).encode(), ApiKind.CHAT))
    with server:
        sub = _subscribe(context, pub)
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
        (batch,) = _receive(sub, until_stored=len(ids) // 16)
        counted = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert answer["usage"]["prompt_tokens"] == len(ids) == 30
    assert counted["tokens"] == [1, 8, 9] and counted["count"] == 3
    assert batch.events == (BlockStored(tuple(BlockHashing(16).block_hashes(ids)), None, tuple(ids[:16]), 16),)


def test_the_flags_set_the_prefix_cache(start: Start) -> None:  # noqa: F811 (the fixture)
    plain, banner = start("--no-prefix-caching")
    assert plain.engine.scheduler.prefix_cache is None and "no prefix caching" in banner
    assert 'enable_prefix_caching="False"' in generate_latest(plain.metrics.registry).decode()
    cbor, _ = start("--prefix-caching-hash-algo", "sha256_cbor")
    assert cbor.engine.scheduler.prefix_cache is not None and cbor.hashing.algorithm is HashAlgorithm.SHA256_CBOR
    assert 'enable_prefix_caching="True"' in generate_latest(cbor.metrics.registry).decode()


def test_a_replay_socket_needs_a_publisher() -> None:
    result = runner.invoke(cli, ["sim-worker", "--model", MODEL, "--accelerator", "l4",
                                 "--kv-events-replay", "tcp://127.0.0.1:5558"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--kv-events-replay"


def test_a_lookup_answers_the_cached_prefix_without_touching_the_cache() -> None:
    spec = WorkerSpec(model=MODEL, accelerator="h100-sxm", time_scale=20.0, max_model_len=2048)
    with start_worker_thread(spec) as server:
        _complete(server.url, PREFIX + "a" * 100)  # 105 tokens: six full blocks cached

        def lookup(prompt: str) -> dict[str, int]:
            answer = httpx.post(f"{server.url}/kv/lookup", json={"model": MODEL, "prompt": prompt})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        queries, _ = _prefix_counts(server.url)
        assert lookup(PREFIX + "a" * 100) == {"prompt_tokens": 105, "cached_tokens": 96}
        assert lookup(PREFIX + "b" * 100) == {"prompt_tokens": 105, "cached_tokens": 80}
        assert lookup(PREFIX[:64]) == {"prompt_tokens": 16, "cached_tokens": 0}  # the last token is always computed
        assert lookup("z" * 320)["cached_tokens"] == 0
        assert _prefix_counts(server.url)[0] == queries
        assert httpx.post(f"{server.url}/kv/lookup", json={"prompt": 3}).status_code == 400
