"""The router's view of a real engine's prefix cache, from the engine's own KV events (docs/router.md, "Exact
prefix caches from KV events").

A picker whose one endpoint is the engine follows its KV events and hashes each chat as the engine does (the
model's tokenizer, the chat template rendered as the engine renders it). Multi-turn conversations, interleaved
turn by turn so that together they overflow the engine's small KV cache (run.sh sizes it), then each
conversation's first prompt once more, are sent one at a time. Before each request the router predicts the
engine's cached prompt tokens; ``vllm:prefix_cache_hits_total`` before and after it says what the engine found.
They must agree within one block on 99 % of requests, and an eviction the small cache forces must reach the index
within a second of the answer of the request that caused it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from real_support import REAL_ENGINE, Engine, KVEvents

from hetsched.catalog.host import read_host
from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.router.config import parse_router_config
from hetsched.router.kv import PrefixSource
from hetsched.router.kv_events import KVEventFeeds
from hetsched.router.openai import ApiKind, parse_request
from hetsched.router.picker import Picker
from hetsched.router.types import Front, Policy, RouteRequest

pytestmark = REAL_ENGINE

ARTIFACT = Path("test-artifacts/real/kv-prefix.json")
CHAT = "/v1/chat/completions"
CONVERSATIONS, TURNS = 24, 4
USER_WORDS, SYSTEM_WORDS = 120, 80
"""About 200 and 130 tokens: the conversations' last turns need about 1.3 × the engine's 16k tokens of KV cache."""
ANSWER_TOKENS = 8
WITHIN_ONE_BLOCK = 0.99
EVICTION_DELAY_S = 1.0
QUIET_S = 0.1
"""After an answer the idle engine publishes nothing more: the index has caught up once no event came this long."""
CATCH_UP_S = 1.0
WATCH_S = 0.002
WORDS = ("route cache block engine token prompt request answer queue batch prefix model server router index event "
         "replay socket evict store hash chain memory layer shard worker policy latency budget window river stone "
         "garden lantern copper violet harbor meadow thunder pencil marble").split()


@dataclass(frozen=True)
class Sample:
    """One request: what the router predicted the engine holds of its prompt, and what the engine found."""

    conversation: int
    turn: int
    prompt_tokens: int
    """The engine's count (its ``usage``)."""
    router_tokens: int
    """The router's count of the same prompt, from the model's tokenizer and chat template."""
    predicted: int
    hits: int
    """The engine's ``vllm:prefix_cache_hits_total`` over the request."""
    lookups: int
    """The engine's ``vllm:prefix_cache_queries_total`` over the request: its prompt tokens, once per lookup."""


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


SYSTEM = _text(random.Random("system"), SYSTEM_WORDS)
"""The system prompt the even conversations share."""


def _user(conversation: int, turn: int) -> str:
    return f"Conversation {conversation}, turn {turn}: " + _text(random.Random(f"{conversation}/{turn}"), USER_WORDS)


def _picker(engine: Engine, kv_events: KVEvents) -> Picker:
    """A kv-aware router for the engine alone, with its tokenizer and KV events (``resync_s`` 0: a late join is in
    force again at once, and refills from the replay)."""
    model_dir = engine.model_dir.resolve()
    endpoint = {"url": engine.url, "accelerator": "cpu", "kv_events": kv_events.endpoint,
                "kv_events_replay": kv_events.replay}
    config = {"policy": "kv-aware", "models": {engine.model: {
        "arch": str(model_dir / "config.json"), "max_model_len": engine.max_model_len,
        "kv_cache": {"tokenizer": str(model_dir), "block_size": kv_events.block_size, "resync_s": 0},
        "endpoints": [endpoint]}}}
    return Picker(parse_router_config(config), front=Front.HTTP, host=read_host())


async def _prefix_counters(client: httpx.AsyncClient) -> tuple[float, float]:
    """The engine's prefix-cache (hits, queries) so far, summed over its label sets."""
    found = parse_metrics_text((await client.get("/metrics")).text)
    return found.prefix_cache_hits or 0.0, found.prefix_cache_queries or 0.0


@dataclass(frozen=True)
class Exchange:
    """One request as both sides saw it: ``sample``, the engine's answer, and when it was sent and answered."""

    sample: Sample
    answer: dict[str, Any]
    sent: float
    answered: float


class Follower:
    """A picker following the engine's KV events, and what the test reads of it."""

    def __init__(self, picker: Picker, url: str, model: str) -> None:
        self.picker, self.url, self.model = picker, url, model
        self.kv = picker.state.kv(model)
        self.tokenizer = picker.tokenizers[model]

    def route(self, body: dict[str, Any]) -> RouteRequest:
        return self.picker.route_request(json.dumps(body).encode(), ApiKind.CHAT, {})

    def cached(self, route: RouteRequest) -> int:
        """The prompt tokens the router predicts the engine finds in its prefix cache."""
        picker = self.picker
        return picker.state.cached_tokens(route, [self.url], now=picker.clock(), policy=Policy.KV_AWARE)[self.url]

    def in_force(self) -> bool:
        return self.kv.source(self.url, self.picker.clock()) is PrefixSource.EVENTS

    def blocks_reported(self, kind: str) -> float:
        labels = {"model": self.model, "endpoint": self.url, "kind": kind}
        return self.picker.metrics.registry.get_sample_value("hetsched_router_kv_event_blocks_total", labels) or 0.0

    def _events_seen(self) -> tuple[float, ...]:
        return tuple(self.blocks_reported(kind) for kind in ("stored", "removed", "cleared"))

    async def caught_up(self, route: RouteRequest) -> None:
        """Wait until the index holds the answered prompt's blocks and no event came for ``QUIET_S`` (at most
        ``CATCH_UP_S``: a later event then shows as a mismatch, which the test counts)."""
        full = len(route.kv_hashes) * self.kv.hashing.block_size
        start = time.monotonic()
        seen, quiet_since = self._events_seen(), start
        while (now := time.monotonic()) - start < CATCH_UP_S:
            if (latest := self._events_seen()) != seen:
                seen, quiet_since = latest, now
            elif now - quiet_since >= QUIET_S and self.cached(route) >= full:
                return
            await asyncio.sleep(0.005)

    async def exchange(self, client: httpx.AsyncClient, body: dict[str, Any], *, conversation: int,
                       turn: int) -> tuple[Exchange, RouteRequest]:
        """Predict, send, and read the engine's prefix-cache counters over the request; then wait for the index."""
        route = self.route(body)
        assert self.in_force(), self.kv.why_approximated(self.url, self.picker.clock())
        predicted = self.cached(route)
        hits_before, lookups_before = await _prefix_counters(client)
        sent = time.monotonic()
        answer = await _send(client, body)
        answered = time.monotonic()
        prompt_tokens = answer["usage"]["prompt_tokens"]
        deadline = answered + 5.0  # the API server records a step's counters as it passes its outputs on
        while (counters := await _prefix_counters(client))[1] - lookups_before < prompt_tokens \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        router_tokens = len(self.tokenizer.token_ids(parse_request(json.dumps(body).encode(), ApiKind.CHAT)))
        sample = Sample(conversation, turn, prompt_tokens, router_tokens, predicted, int(counters[0] - hits_before),
                        int(counters[1] - lookups_before))
        await self.caught_up(route)
        return Exchange(sample, answer, sent, answered), route


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _until_in_force(follower: Follower, client: httpx.AsyncClient) -> None:
    """Warm-up chats until the router follows the engine's events: an idle engine publishes nothing, so the first
    batch the subscription sees comes with a request (a late join is replayed, or resyncs at once)."""
    for attempt in range(20):
        body = {"model": follower.model, "messages": [{"role": "user", "content": f"Warm-up {attempt}: {SYSTEM}"}],
                "max_tokens": 1, "temperature": 0.0}
        await _send(client, body)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if follower.in_force():
                await follower.caught_up(follower.route(body))
                return
            await asyncio.sleep(0.02)
    pytest.fail(f"the router never followed {follower.url}'s KV events; its errors: {follower.picker.state.kv_errors}")


@dataclass
class EvictionWatch:
    """When the index first shows fewer cached tokens of one prompt than it held (an eviction reaching it)."""

    follower: Follower
    route: RouteRequest
    held: int
    seen_at: float | None = None

    async def run(self) -> None:
        while self.follower.cached(self.route) >= self.held:
            await asyncio.sleep(WATCH_S)
        self.seen_at = time.monotonic()


def _order() -> list[tuple[int, int]]:
    """(conversation, turn) in the order sent: round-robin by turn, then every first prompt again (turn 0)."""
    return [(c, t) for t in range(1, TURNS + 1) for c in range(CONVERSATIONS)] + [(c, 0) for c in range(CONVERSATIONS)]


@pytest.mark.asyncio
async def test_the_routers_prefix_cache_is_the_engines_and_follows_its_evictions(engine: Engine,
                                                                                kv_events: KVEvents) -> None:
    picker = _picker(engine, kv_events)
    follower = Follower(picker, engine.url, engine.model)
    context = zmq.asyncio.Context()
    feeds = KVEventFeeds(picker, context=context)
    histories = {c: [{"role": "system", "content": SYSTEM}] if c % 2 == 0 else [] for c in range(CONVERSATIONS)}
    first_prompts: dict[int, list[dict[str, str]]] = {}
    exchanges: list[Exchange] = []
    watch: EvictionWatch | None = None
    watching: asyncio.Task[None] | None = None
    feeds.sync()
    try:
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
            await _until_in_force(follower, client)
            for conversation, turn in _order():
                messages = first_prompts[conversation] if turn == 0 else [
                    *histories[conversation], {"role": "user", "content": _user(conversation, turn)}]
                body = {"model": engine.model, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0.0}
                done, route = await follower.exchange(client, body, conversation=conversation, turn=turn)
                exchanges.append(done)
                if turn:
                    content = done.answer["choices"][0]["message"]["content"] or ""
                    histories[conversation] = [*messages, {"role": "assistant", "content": content}]
                    first_prompts.setdefault(conversation, messages)
                if watch is None:  # the first conversation's first prompt, as the index holds it now
                    watch = EvictionWatch(follower, route, held=follower.cached(route))
                    assert watch.held == len(route.kv_hashes) * kv_events.block_size > 0
                    watching = asyncio.create_task(watch.run())
    finally:
        if watching is not None:
            watching.cancel()
        await feeds.aclose()
        context.term()

    samples = [e.sample for e in exchanges]
    block = kv_events.block_size
    close = sum(abs(s.predicted - s.hits) <= block for s in samples)
    removed = follower.blocks_reported("removed")
    assert watch is not None
    delay = _eviction_delay(watch, exchanges)
    summary = {"requests": len(samples), "exact": sum(s.predicted == s.hits for s in samples),
               "within_one_block": close, "within_one_block_share": close / len(samples),
               "predicted_tokens": sum(s.predicted for s in samples), "engine_hit_tokens": sum(s.hits for s in samples),
               "prompt_tokens": sum(s.prompt_tokens for s in samples),
               "router_token_counts_equal": sum(s.router_tokens == s.prompt_tokens for s in samples),
               "blocks_stored": follower.blocks_reported("stored"), "blocks_removed": removed,
               "eviction_delay_s": delay, "kv_event_errors": picker.state.kv_errors}
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps({"summary": summary, "samples": [asdict(s) for s in samples]}, indent=1))
    print("router vs engine prefix-cache hits:", json.dumps(summary))
    off = [s for s in samples if abs(s.predicted - s.hits) > block]
    assert all(s.lookups == s.prompt_tokens for s in samples), "the engine looked a prompt up other than once"
    assert summary["router_token_counts_equal"] == len(samples), "the router tokenized a chat unlike the engine"
    assert close >= WITHIN_ONE_BLOCK * len(samples), f"off by more than a block: {off[:5]}"
    assert removed > 0, "the conversations never made the engine evict: its KV cache is larger than run.sh sets"
    assert delay is not None, "no eviction of the first conversation's first prompt reached the index"
    revisit = next(s for s in samples if (s.conversation, s.turn) == (0, 0))
    assert revisit.hits < watch.held, "the engine still held the first prompt the index saw evicted"
    assert delay <= EVICTION_DELAY_S, f"the eviction reached the index {delay:.3f} s after the answer"


def _eviction_delay(watch: EvictionWatch, exchanges: list[Exchange]) -> float | None:
    """Seconds from the answer of the request the eviction came with (the last one sent before the index showed
    it: in flight then, or answered) to the index showing it; negative: before that answer."""
    if watch.seen_at is None:
        return None
    seen = watch.seen_at
    return seen - max(e.answered for e in exchanges if e.sent <= seen)  # requests go one at a time
