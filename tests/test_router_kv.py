"""The router's view of its engines' KV caches from their KV events: consistency, fallbacks, the kv-aware policy,
and the subscription over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from hetsched.catalog.host import read_host
from hetsched.errors import InputError
from hetsched.kvcache.events import (END_SEQUENCE, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode)
from hetsched.kvcache.hashing import BlockHashing, text_token_ids
from hetsched.router.config import parse_router_config
from hetsched.router.discovery import endpoints_from_pods
from hetsched.router.kv import Gap, ModelKV, PrefixSource
from hetsched.router.kv_events import KVEventFeeds
from hetsched.router.openai import ApiKind
from hetsched.router.picker import Picker
from hetsched.router.policy import decide
from hetsched.router.types import DecisionReason, Endpoint, EndpointView, Front, Policy, RouteRequest
from test_tokenize import write_tokenizer

MODEL = "m"
HASHING = BlockHashing(block_size=16)
A, B = "http://a:1", "http://b:1"


def model_kv(**kwargs: float) -> tuple[ModelKV, list[tuple[str, str]]]:
    errors: list[tuple[str, str]] = []
    settings = {"max_blocks": 1 << 16, "resync_s": 5.0, "max_blocks_per_s": 1e6, **kwargs}
    kv = ModelKV(HASHING, max_blocks=int(settings["max_blocks"]), resync_s=settings["resync_s"],
                 max_blocks_per_s=settings["max_blocks_per_s"], on_error=lambda url, why: errors.append((url, why)))
    return kv, errors


def stored(hashes: list[int], block_size: int = 16) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), block_size)


def batch(sequence: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> EventBatch:
    return EventBatch(sequence, 0.0, events)


PROMPT = HASHING.block_hashes(list(range(16 * 8)))  # 8 blocks


def test_an_engine_followed_from_its_first_event_is_exact_at_once() -> None:
    kv, errors = model_kv()
    kv.attach(A)
    assert kv.source(A, 0.0) is PrefixSource.APPROXIMATION and "no events" in (kv.why_approximated(A, 0.0) or "")
    kv.receive(A, batch(0, stored(PROMPT[:5])), now=1.0)
    assert kv.source(A, 1.0) is PrefixSource.EVENTS
    assert kv.cached_tokens(PROMPT, [A], 1.0) == {A: 5 * 16}
    kv.receive(A, batch(1, BlockRemoved((PROMPT[3],))), now=2.0)
    assert kv.cached_tokens(PROMPT, [A], 2.0) == {A: 3 * 16}  # the chain breaks at the evicted block
    kv.receive(A, batch(2, AllBlocksCleared()), now=3.0)
    assert kv.cached_tokens(PROMPT, [A], 3.0) == {A: 0}
    assert errors == []


def test_a_late_join_or_a_gap_drops_the_endpoint_to_the_approximation_until_it_refills() -> None:
    kv, errors = model_kv(resync_s=5.0)
    kv.attach(A)
    assert kv.check(A, batch(7)) == Gap(0, 7)  # replay from 0 first, when the engine has a replay socket
    kv.receive(A, batch(7, stored(PROMPT)), now=10.0)  # none recovered: the blocks stored before 7 are unknown
    assert kv.source(A, 12.0) is PrefixSource.APPROXIMATION and errors == [(A, "late_join")]
    assert kv.cached_tokens(PROMPT, [A], 12.0) == {}
    assert kv.source(A, 15.0) is PrefixSource.EVENTS
    assert kv.cached_tokens(PROMPT, [A], 15.0) == {A: 8 * 16}  # what came with and after the dropping batch
    assert kv.check(A, batch(10)) == Gap(8, 10)
    kv.receive(A, batch(10), now=20.0)
    assert errors[-1] == (A, "gap") and kv.source(A, 20.0) is PrefixSource.APPROXIMATION
    assert kv.cached_tokens(PROMPT, [A], 25.0) == {A: 0}  # missed removals cannot linger: the index was cleared
    assert "missed events 8..9" in (kv.why_approximated(A, 21.0) or "")


def test_a_restarted_publisher_starts_over_and_a_batch_seen_twice_is_skipped() -> None:
    kv, errors = model_kv()
    kv.attach(A)
    kv.receive(A, batch(0, stored(PROMPT)), now=0.0)
    kv.receive(A, batch(1), now=0.0)
    kv.receive(A, batch(0, stored(PROMPT[:2])), now=1.0)
    assert kv.source(A, 1.0) is PrefixSource.EVENTS and kv.cached_tokens(PROMPT, [A], 1.0) == {A: 32}
    kv.receive(A, batch(1, stored(PROMPT[2:4])), now=1.0)
    kv.receive(A, batch(1, BlockRemoved((PROMPT[2],))), now=1.0)  # the same sequence again: not applied
    assert kv.cached_tokens(PROMPT, [A], 1.0) == {A: 64} and errors == []


def test_an_engine_whose_replay_holds_nothing_has_an_empty_cache_at_once() -> None:
    kv, errors = model_kv()
    kv.attach(A)
    kv.start_empty(A, now=2.0)
    assert kv.source(A, 2.0) is PrefixSource.EVENTS and kv.cached_tokens(PROMPT, [A], 2.0) == {A: 0}
    kv.receive(A, batch(0, stored(PROMPT[:1])), now=3.0)
    assert kv.cached_tokens(PROMPT, [A], 3.0) == {A: 16} and errors == []


def test_a_block_size_not_the_configured_one_a_flood_and_the_cap_each_drop_the_endpoint() -> None:
    kv, errors = model_kv()
    kv.attach(A)
    kv.receive(A, batch(0, stored(PROMPT[:2], block_size=32)), now=0.0)
    assert errors == [(A, "block_size")] and kv.cached_tokens(PROMPT, [A], 1.0) == {}

    kv, errors = model_kv(max_blocks_per_s=4)
    kv.attach(A)
    kv.receive(A, batch(0, stored(PROMPT[:3])), now=0.0)
    kv.receive(A, batch(1, stored(PROMPT[3:])), now=0.5)
    assert errors == [(A, "flood")] and kv.source(A, 0.5) is PrefixSource.APPROXIMATION

    kv, errors = model_kv(max_blocks=1024)
    kv.attach(A)
    kv.attach(B)
    kv.receive(A, batch(0, stored(list(range(1, 1001)))), now=0.0)
    kv.receive(B, batch(0, stored(list(range(2001, 2101)))), now=0.0)
    assert errors == [(A, "cap")]  # the holder of most blocks goes
    assert kv.source(B, 0.0) is PrefixSource.EVENTS


def test_an_endpoint_that_leaves_takes_its_blocks_with_it() -> None:
    kv, _ = model_kv()
    kv.attach(A)
    kv.receive(A, batch(0, stored(PROMPT)), now=0.0)
    kv.detach(A)
    assert kv.attached() == [] and kv.index.blocks(A) == 0
    assert kv.why_approximated(A, 0.0) == "the endpoint publishes no KV events"


def view(url: str, in_flight: int = 0) -> EndpointView:
    return EndpointView(Endpoint(url, MODEL, "h100-sxm"), in_flight=in_flight, in_flight_prompt_tokens=0,
                        in_flight_max_tokens=0)


def test_kv_aware_takes_the_most_cached_endpoint_within_the_load_bound() -> None:
    request = RouteRequest(MODEL, prompt_tokens=800, max_tokens=10)
    views = [view(A, 3), view(B, 0), view("http://c:1", 1)]
    decision = decide(Policy.KV_AWARE, request, views, cached={A: 512, "http://c:1": 448})
    assert decision.endpoint is not None and decision.endpoint.url == A and decision.reason is DecisionReason.PREFIX_HIT
    busy = [view(A, 20), view(B, 0), view("http://c:1", 1)]
    decision = decide(Policy.KV_AWARE, request, busy, cached={A: 512, "http://c:1": 448})
    assert decision.endpoint is not None and decision.endpoint.url == "http://c:1"  # A is over the bound
    decision = decide(Policy.KV_AWARE, request, views, cached={})
    assert decision.endpoint is not None and decision.endpoint.url == B and decision.reason is DecisionReason.CHOSEN


def test_kv_aware_sends_a_prompt_nobody_holds_half_of_to_the_least_loaded() -> None:
    """A system prompt every conversation shares does not bind a new conversation to the endpoints holding it."""
    request = RouteRequest(MODEL, prompt_tokens=2000, max_tokens=10)
    views = [view(A, 2), view(B, 0), view("http://c:1", 1)]
    decision = decide(Policy.KV_AWARE, request, views, cached={A: 512, "http://c:1": 512})
    assert decision.endpoint is not None and decision.endpoint.url == B and decision.reason is DecisionReason.CHOSEN
    decision = decide(Policy.KV_AWARE, request, views, cached={A: 1008, "http://c:1": 512})
    assert decision.endpoint is not None and decision.endpoint.url == A


def router_file(policy: str = "kv-aware", *, tokenizer: Path | None = None, **endpoint: str) -> dict[str, object]:
    kv_cache: dict[str, object] = {"block_size": 16, **({"tokenizer": str(tokenizer)} if tokenizer else {})}
    return {"policy": policy, "models": {MODEL: {"arch": "llama-3.1-8b", "kv_cache": kv_cache, "endpoints": [
        {"url": A, "accelerator": "h100-sxm", **endpoint}, {"url": B, "accelerator": "h100-sxm"}]}}}


def picker(config: dict[str, object]) -> Picker:
    return Picker(parse_router_config(config), front=Front.HTTP, host=read_host())


def test_the_picker_hashes_a_prompt_as_the_engines_do_and_reads_each_endpoint_s_source() -> None:
    p = picker(router_file(kv_events="tcp://127.0.0.1:5557"))
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    body = f'{{"model": "{MODEL}", "prompt": "{prompt}", "max_tokens": 4}}'.encode()
    route = p.route_request(body, ApiKind.COMPLETIONS, {})
    assert route.kv_hashes == tuple(HASHING.block_hashes(text_token_ids(prompt)[:-1]))
    kv = p.state.kv(MODEL)
    assert kv.attached() == [A]
    kv.receive(A, batch(0, stored(list(route.kv_hashes[:16]))), now=p.clock())
    cached = p.state.cached_tokens(route, [A, B], now=p.clock(), policy=Policy.KV_AWARE)
    assert cached == {A: 16 * 16, B: 0}  # B has no events: the approximation's (nothing sent there yet)
    decision = p.state.decide(route, now=p.clock())
    assert decision.endpoint is not None and decision.endpoint.url == A


def test_a_prompt_the_models_tokenizer_tokenized_counts_its_own_tokens(tmp_path: Path) -> None:
    """The share of a prompt a cache holds is of the tokens the engine sees, not of the text's estimate."""
    p = picker(router_file(kv_events="tcp://127.0.0.1:5557", tokenizer=write_tokenizer(tmp_path / "model")))
    prompt = "hello world you are kind " * 10
    body = f'{{"model": "{MODEL}", "prompt": "{prompt}", "max_tokens": 4}}'.encode()
    route = p.route_request(body, ApiKind.COMPLETIONS, {})
    assert route.prompt_tokens == 1 + 5 * 10  # <s> and its words, where the text's 250 bytes would count 63
    assert len(route.kv_hashes) == 3


def test_a_prompt_of_whole_blocks_can_hit_all_but_its_last_as_in_vllm() -> None:
    kv, _ = model_kv()
    kv.attach(A)
    tokens = list(range(64))
    kv.receive(A, batch(0, stored(HASHING.block_hashes(tokens))), now=0.0)
    assert kv.cached_tokens(kv.block_hashes(tokens), [A], 0.0) == {A: 48}  # the engine recomputes token 64
    assert kv.cached_tokens(kv.block_hashes(tokens + [1]), [A], 0.0) == {A: 64}


def test_a_kv_events_address_is_checked_where_it_is_written() -> None:
    with pytest.raises(InputError, match=r"endpoints\[0\]\.kv_events.*tcp://host:port"):
        parse_router_config(router_file(kv_events="http://127.0.0.1:5557"))
    with pytest.raises(InputError, match="kv_cache.block_size"):
        parse_router_config({"models": {MODEL: {"kv_cache": {"block_size": 0}}}})


def test_discovery_reads_the_kv_event_ports_a_pod_names() -> None:
    ports = [SimpleNamespace(name="http", container_port=8000), SimpleNamespace(name="kv-events", container_port=5557),
             SimpleNamespace(name="kv-events-replay", container_port=5558)]
    pod = SimpleNamespace(
        metadata=SimpleNamespace(name="p", namespace="n", deletion_timestamp=None,
                                 labels={"hetsched.io/model": MODEL, "hetsched.io/accelerator": "h100-sxm"}),
        spec=SimpleNamespace(containers=[SimpleNamespace(ports=ports)]),
        status=SimpleNamespace(pod_ip="10.0.0.5", conditions=[SimpleNamespace(type="Ready", status="True")]))
    (endpoint,) = endpoints_from_pods([pod], models=[MODEL], default_port=80)[MODEL]
    assert endpoint.kv_events == "tcp://10.0.0.5:5557" and endpoint.kv_events_replay == "tcp://10.0.0.5:5558"


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_the_router_follows_an_engine_s_events_and_replays_a_gap() -> None:
    context = zmq.asyncio.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    p = picker(router_file(kv_events=f"tcp://127.0.0.1:{port}", kv_events_replay=f"tcp://127.0.0.1:{replay_port}"))
    feeds = KVEventFeeds(p, context=context)
    kv = p.state.kv(MODEL)
    sent = {n: encode(b"", n, [stored([PROMPT[n]])]) for n in range(4)}

    published: list[int] = []
    asked: list[int] = []

    async def serve_replay() -> None:
        while True:
            identity, _, start = await replay.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for n in (n for n in published if n >= asked[-1]):
                await replay.send_multipart([identity, b"", *sent[n]])
            await replay.send_multipart([identity, b"", b"", END_SEQUENCE, b""])

    answering = asyncio.create_task(serve_replay())
    try:
        published.append(0)  # before the router subscribes: it learns it from the replay socket
        feeds.sync()
        await _until(lambda: kv.index.blocks(A) == 1)
        assert asked == [0] and kv.source(A, p.clock()) is PrefixSource.EVENTS
        published.extend((1, 2, 3))
        await pub.send_multipart(sent[3])  # 1 and 2 never arrive: the router asks the replay socket
        await _until(lambda: kv.index.blocks(A) == 4)
        assert asked == [0, 1]
        assert kv.source(A, p.clock()) is PrefixSource.EVENTS
        assert kv.cached_tokens(PROMPT, [A], p.clock()) == {A: 4 * 16}
        await pub.send_multipart([b"", (4).to_bytes(8, "big"), b"\xc1"])  # not msgpack
        await _until(lambda: kv.source(A, p.clock()) is PrefixSource.APPROXIMATION)
        assert [(url, why) for _, url, why in p.state.kv_errors] == [(A, "msgpack")]
        assert math.isfinite(kv.index.blocks(A))
    finally:
        answering.cancel()
        await feeds.aclose()
        pub.close(0)
        replay.close(0)
        context.term()
