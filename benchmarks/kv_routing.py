"""Routing on the engines' own prefix caches (KV events) against the approximations and an oracle.

Fleet: llama-3.1-8b on 4 × a100-80gb ``hetsched sim-worker`` twins, each with vLLM's prefix cache, publishing its
KV events (and a replay socket), restarted empty for every run. Each twin's KV cache (``--kv-blocks``) is sized
from the workload: the blocks of the requests it runs at once (the simulator's mean concurrency at its SLO capacity
× a mean request's blocks) plus a third of the workload's distinct prompt blocks, so a router that keeps each
prefix on one twin keeps it cached while one that spreads it evicts.

Workloads (seeded; ``/v1/completions`` text, four bytes a token as router and twins count without a tokenizer, so
every router sees the same bytes):

- multi-turn chat, in the shape of vLLM's own multi-turn benchmark (``generate_multi_turn.json``): every
  conversation starts with a 500-token system prompt they all share and a context of its own (a document: lognormal,
  1,000 tokens on average, at most 5,000), then 6–9 turns of a user message (120–160 tokens) and the assistant's
  fixed, pre-generated reply (80–120 tokens, which the turn asks for). 24 conversations are open at once: each
  Poisson arrival is the next turn of one of them, drawn at random (a finished one is replaced by a new one), and is
  sent at its arrival time or once the conversation's previous turn has been answered, whichever is later. The
  request sequence is the same for every router; only a late answer moves a send time. SLO P99 TTFT 2 s (its longest
  prompts take most of a second to prefill uncached), TPOT 50 ms.
- short-turn chat: the same, without a context of its own, a 256-token system prompt, 3–6 turns of 128–512-token
  user messages and 16–48-token replies, 32 conversations open: what a turn adds is most of its prompt.
- shared system prompts (inference-perf's shared-prefix generator): 16 system prompts of 1,536 tokens, each request
  one of them, drawn at random, and its own question (32–128 tokens), 16–48 tokens out; Poisson arrivals.

Loads: 90 % and 50 % of the fleet's SLO capacity (P99 TTFT 500 ms and TPOT 50 ms where a workload names no
other), the simulator's capacity search for the workload's request lengths without any cache hit (a hit only makes
a request cheaper) on a replica of the twins' KV size, times the twins. The twins run at the time scale that makes 90 % load 14 requests per wall second
(the token stream this machine's CPU carries with every process on it).

Routers, each as two processes (the Helm chart's ``router.replicas``; ``--replicas``) over which the client
spreads the requests by a seeded draw, the same for every router, as a Service spreads connections; each over the
same request sequence: hetsched ``kv-aware`` and ``slo`` with the twins' KV events,
``prefix`` (the router's approximation: what it sent where) and ``round-robin``; vllm-router and sglang-router with
``cache_aware`` (installed into ``.venv-peers`` as ``router_peers.py`` does); and an oracle in this client that knows
every cache exactly: before each request it asks each twin's ``/kv/lookup`` how much of the prompt it holds and
sends it directly where kv-aware's rule would (the twin holding most, if at least half the prompt, among those
under the load bound ``PREFIX_BALANCE`` on its own requests in flight; else the least loaded). Its TTFT counts from that send: the lookups stand for knowledge,
not for work a router would do.

Figures per router, workload and load: the hit rate from the twins' own counters (Σ ``prefix_cache_hits`` /
Σ ``prefix_cache_queries``), TTFT p50 and p99 in hardware time (wall × time scale), goodput (requests meeting both
SLO thresholds per hardware second of arrivals) and the share meeting it; "lost" are requests that failed or had
not finished 30 wall seconds after the last arrival; "events" how many twins' KV events were in force in the router
at the end, summed over the replicas. Targets: hit rate ≥ 95 % of the oracle's (kv-aware and slo); on multi-turn
chat at 90 % load goodput ≥ 1.2 × the best peer's, and at 50 % TTFT p50 ≤ 0.8 × the lowest peer's (short-turn chat's
ratios are printed beside them); and the KV index's own targets
(``benchmarks/kv_index.py`` at a small size).

``--quick``: 2 twins, multi-turn chat at 90 % load with a score of requests, hetsched's routers and the oracle (no
peers, nothing installed); a check that the benchmark runs, not figures to quote.

Run: ``.venv/bin/python benchmarks/kv_routing.py [--write]`` (about 20 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import httpx

import kv_index
import report
from _loadgen import Outcome, RouterProcess, pct, stream_body, wait_idle
from hetsched.catalog import load_catalog
from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.errors import BackendUnavailableError
from hetsched.kvcache.hashing import BlockHashing, text_token_ids
from hetsched.kvcache.index import KVIndex
from hetsched.router.policy import kv_aware
from hetsched.router.types import Endpoint, EndpointView, Policy
from hetsched.sim.capacity import DEFAULT_SEEDS, Replica, find_capacity, search_rate
from hetsched.simworker import WorkerSpec
from hetsched.simworker.launch import WorkerProcess, free_port, spawn_worker
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, TraceRequest, Workload
from router_peers import PEERS, PeerProcess, ensure_peers

MODEL, ACCELERATOR = "llama-3.1-8b", "a100-80gb"
TWINS, QUICK_TWINS = 4, 2
REPLICAS = 2
"""Router processes per router, as the Helm chart runs the router (``router.replicas``); the client spreads the
requests over them as a Service would."""
SLO_TARGET = SLO(ttft_ms=500, tpot_ms=50)
DOCUMENT_SLO = SLO(ttft_ms=2000, tpot_ms=50)
"""Document chat's SLO: its longest prompts (a 5,000-token context and the turns after it) take most of a second
to prefill on this hardware when nothing of them is cached, which a 500 ms P99 would refuse at any rate."""
BLOCK_SIZE = EngineConfig().block_size
CACHE_SHARE = 1 / 3
"""Of the workload's distinct prompt blocks, the share each twin's cache holds beside its running requests."""
LOADS, QUICK_LOAD = (0.9, 0.5), 0.9
WALL_RATE = 14.0
"""Requests per wall second at 90 % load: the twins' time scale follows from it."""
REQUESTS = 140
QUICK_REQUESTS = 20
QUICK_SEEDS = (0,)
GRACE_S = 30.0
KV_INDEX_BLOCKS = 100_000

GROUPS, GROUP_SYSTEM_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS = 16, 1536, (32, 128), (16, 48)
LETTERS = "abcdefghijklmnopqrstuvwxyz    "

HIT_SHARE_OF_ORACLE = 0.95
GOODPUT_OVER_PEER = 1.2
TTFT_UNDER_PEER = 0.8
EVENT_POLICIES = (Policy.KV_AWARE, Policy.SLO)
HETSCHED_POLICIES = (Policy.KV_AWARE, Policy.SLO, Policy.PREFIX, Policy.ROUND_ROBIN)
ORACLE = "oracle"


# --- workloads -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    after: int | None = None
    """The request (index) whose answer this one waits for: its conversation's previous turn."""

    @property
    def tokens(self) -> int:
        return len(text_token_ids(self.prompt))


@dataclass(frozen=True)
class Trace:
    """A workload's requests in arrival order, their Poisson gaps at one request per second, and its SLO."""

    name: str
    requests: tuple[Request, ...]
    gaps: tuple[float, ...]
    slo: SLO = SLO_TARGET

    def arrivals(self, rate: float) -> list[float]:
        """Arrival times (hardware seconds) at ``rate`` requests per second: the same draws at every rate."""
        at, out = 0.0, []
        for gap in self.gaps:
            out.append(at)
            at += gap / rate
        return out

    def mix(self) -> Workload:
        """The requests' lengths as the simulator's workload, every prompt computed in full (no cache hit)."""
        rows = tuple(TraceRequest(arrival_s=i, input_tokens=r.tokens, output_tokens=r.max_tokens)
                     for i, r in enumerate(self.requests))
        first = rows[0]
        return Workload(name=self.name, input_len=LengthDistribution.fixed(first.input_tokens),
                        output_len=LengthDistribution.fixed(first.output_tokens), trace=rows)

    def distinct_blocks(self) -> int:
        """Full prompt blocks with distinct hashes over the whole trace: what caching all of it would take."""
        hashing = BlockHashing(BLOCK_SIZE)
        return len({h for r in self.requests for h in hashing.block_hashes(text_token_ids(r.prompt))})

    def reusable(self) -> float:
        """The share of prompt tokens one cache holding every earlier prompt would hit: what any routing can reach."""
        hashing, seen = BlockHashing(BLOCK_SIZE), set[int]()
        hit = total = 0
        for request in self.requests:
            ids = text_token_ids(request.prompt)
            hashes = hashing.block_hashes(ids)
            usable = hashes[:(len(ids) - 1) // BLOCK_SIZE]  # the last token is always computed
            hit += BLOCK_SIZE * next((i for i, h in enumerate(usable) if h not in seen), len(usable))
            total += len(ids)
            seen.update(hashes)
        return hit / total

    def mean_blocks(self) -> float:
        """A request's blocks (prompt and output) on average."""
        return sum((r.tokens + r.max_tokens) / BLOCK_SIZE for r in self.requests) / len(self.requests)


def text(rng: random.Random, tokens: int) -> str:
    """Word-like ASCII of exactly ``tokens`` tokens (four bytes each)."""
    return "".join(rng.choices(LETTERS, k=4 * tokens))


def _gaps(rng: random.Random, n: int) -> tuple[float, ...]:
    return tuple(rng.expovariate(1.0) for _ in range(n))


@dataclass(frozen=True)
class ChatShape:
    """A multi-turn chat workload: token counts of its parts (ranges are uniform draws)."""

    name: str
    shared_tokens: int
    """The system prompt every conversation starts with."""
    context_tokens: tuple[float, int] | None
    """A conversation's own context after it (a document): lognormal mean and cap; None: no context."""
    turns: tuple[int, int]
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    open_conversations: int
    slo: SLO = SLO_TARGET


DOCUMENT_CHAT = ChatShape("multi-turn chat", shared_tokens=500, context_tokens=(1000.0, 5000), turns=(6, 9),
                          user_tokens=(120, 160), reply_tokens=(80, 120), open_conversations=24, slo=DOCUMENT_SLO)
"""vLLM's own multi-turn benchmark (``benchmarks/multi_turn/generate_multi_turn.json``): a 500-token common prefix,
a lognormal per-conversation prefix averaging 1,000 tokens (at most 5,000), 12–18 messages, user messages of 120–160
tokens, answers of 80–120, 24 conversations."""
SHORT_CHAT = ChatShape("short-turn chat", shared_tokens=256, context_tokens=None, turns=(3, 6),
                       user_tokens=(128, 512), reply_tokens=(16, 48), open_conversations=32)
"""Short conversations without a context of their own: a new user message is most of what a turn adds."""
CONTEXT_SIGMA = 0.6
"""The lognormal's sigma for a conversation's context length (its mean is the shape's)."""


@dataclass
class _Conversation:
    turns: list[tuple[str, str]]
    """Each turn's user message and the assistant's reply (fixed, as if generated before)."""
    history: str
    turn: int = 0
    last: int | None = None


def multi_turn(n: int, shape: ChatShape = DOCUMENT_CHAT, seed: int = 1) -> Trace:
    rng = random.Random(seed)
    system = "System: " + text(rng, shape.shared_tokens)

    def conversation() -> _Conversation:
        turns = [(text(rng, rng.randint(*shape.user_tokens)), text(rng, rng.randint(*shape.reply_tokens)))
                 for _ in range(rng.randint(*shape.turns))]
        if shape.context_tokens is None:
            return _Conversation(turns, system)
        mean, cap = shape.context_tokens
        tokens = min(cap, round(rng.lognormvariate(math.log(mean) - CONTEXT_SIGMA ** 2 / 2, CONTEXT_SIGMA)))
        return _Conversation(turns, f"{system}\n\nContext: {text(rng, max(tokens, 1))}")

    open_ = [conversation() for _ in range(shape.open_conversations)]
    requests = []
    for index in range(n):
        slot = rng.randrange(len(open_))
        talk = open_[slot]
        user, reply = talk.turns[talk.turn]
        prompt = f"{talk.history}\n\nUser: {user}\n\nAssistant:"
        requests.append(Request(prompt, len(reply) // 4, after=talk.last))
        talk.history, talk.turn, talk.last = f"{prompt} {reply}", talk.turn + 1, index
        if talk.turn == len(talk.turns):
            open_[slot] = conversation()
    return Trace(shape.name, tuple(requests), _gaps(rng, n), shape.slo)


def shared_prefix(n: int, seed: int = 2) -> Trace:
    rng = random.Random(seed)
    systems = [f"System {g}: " + text(rng, GROUP_SYSTEM_TOKENS) for g in range(GROUPS)]
    requests = tuple(Request(f"{rng.choice(systems)}\n\nQuestion: {text(rng, rng.randint(*QUESTION_TOKENS))}"
                             "\n\nAnswer:", rng.randint(*ANSWER_TOKENS)) for _ in range(n))
    return Trace("shared system prompts", requests, _gaps(rng, n))


# --- the fleet -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    """A workload's twins: KV blocks each, SLO capacity each (req/s, hardware) and the time scale they run at."""

    kv_blocks: int
    capacity: float
    binding: str
    time_scale: float


def size_twins(trace: Trace, twins: int, *, seeds: Sequence[int]) -> Sizing:
    """KV: the running requests' blocks at the natural KV's capacity plus ``CACHE_SHARE`` of the distinct prompt
    blocks; capacity: the simulator's search on a replica of that KV, for the requests' lengths without hits."""
    arch, device = load_model(MODEL), load_catalog().device(ACCELERATOR)
    mix = trace.mix()
    natural = find_capacity(arch, device, workload=mix, slo=trace.slo, seeds=seeds)
    kv_blocks = math.ceil(natural.mean_concurrency * trace.mean_blocks() + CACHE_SHARE * trace.distinct_blocks())
    replica = replace(Replica.build(arch, device, workload=mix), num_blocks=kv_blocks)
    probe, binding = search_rate(replica, mix, trace.slo, seeds=seeds)
    return Sizing(kv_blocks, probe.rate, str(binding), WALL_RATE / (LOADS[0] * twins * probe.rate))


@dataclass
class Twin:
    process: WorkerProcess
    events: str
    replay: str

    @property
    def url(self) -> str:
        return self.process.url


def spawn_twin(sizing: Sizing, *, attempts: int = 3) -> Twin:
    """A ``hetsched sim-worker`` with the workload's KV size and its KV events, started again on new ports when one
    it was given was taken before it bound it (by another twin, or an outgoing connection)."""
    error = BackendUnavailableError("no attempt")
    for _ in range(attempts):
        ports: set[int] = set()
        while len(ports) < 3:  # the system may hand a released port out again at once
            ports.add(free_port())
        port, *zmq_ports = sorted(ports)
        events, replay = (f"tcp://127.0.0.1:{p}" for p in zmq_ports)
        spec = WorkerSpec(model=MODEL, accelerator=ACCELERATOR, time_scale=sizing.time_scale,
                          kv_blocks=sizing.kv_blocks, kv_events=events, kv_events_replay=replay)
        try:
            return Twin(spawn_worker(spec, port=port, timeout=120.0), events, replay)
        except BackendUnavailableError as exc:
            error = exc
            if "address already in use" not in str(exc).lower():
                break
    raise error


def spawn_fleet(sizing: Sizing, count: int) -> list[Twin]:
    """``count`` twins started in parallel; all stopped if one fails to start."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(spawn_twin, sizing) for _ in range(count)]
    twins = [f.result() for f in futures if f.exception() is None]
    failed = [error for f in futures if (error := f.exception()) is not None]
    if failed:
        for twin in twins:
            twin.process.stop()
        raise failed[0]
    return twins


def counters(twin: Twin) -> tuple[float, float]:
    """The prefix-cache hits and queries (tokens) the twin counted."""
    found = parse_metrics_text(httpx.get(f"{twin.url}/metrics", timeout=5).text)
    return found.prefix_cache_hits or 0.0, found.prefix_cache_queries or 0.0


def router_config(twins: Sequence[Twin], policy: Policy, *, slo: SLO, time_scale: float) -> dict:
    events = policy in EVENT_POLICIES
    wall_slo = {"ttft_ms": slo.ttft_ms / time_scale, "tpot_ms": slo.tpot_ms / time_scale}
    return {"policy": str(policy), "time_scale": time_scale, "metrics_interval_s": 0.25,
            "health": {"check_interval_s": 0.25},
            "models": {MODEL: {"slo": wall_slo, "kv_cache": {"block_size": BLOCK_SIZE}, "endpoints": [
                {"url": t.url, "accelerator": ACCELERATOR,
                 **({"kv_events": t.events, "kv_events_replay": t.replay} if events else {})} for t in twins]}}}


# --- load ----------------------------------------------------------------------------------------------------


Send = Callable[[httpx.AsyncClient, dict, int], Awaitable[Outcome]]


def replica_draws(n: int, replicas: int, seed: int = 3) -> tuple[int, ...]:
    """Which router replica each request reaches, as a Service spreads connections: the same draws for every
    router, so each sees the same split."""
    rng = random.Random(seed)
    return tuple(rng.randrange(replicas) for _ in range(n))


def via(urls: Sequence[str], draws: Sequence[int]) -> Send:
    """Through the router replica ``draws`` names for each request."""
    async def send(client: httpx.AsyncClient, body: dict, index: int) -> Outcome:
        return await stream_body(client, urls[draws[index]], body)
    return send


def oracle(twins: Sequence[Twin]) -> Send:
    """Ask every twin how much of the prompt it holds; send to the one holding most under kv-aware's load bound,
    load being this client's requests in flight there."""
    endpoints = [Endpoint(t.url, MODEL, ACCELERATOR) for t in twins]
    in_flight = dict.fromkeys((t.url for t in twins), 0)

    async def send(client: httpx.AsyncClient, body: dict, index: int) -> Outcome:
        try:
            answers = await asyncio.gather(*(client.post(f"{e.url}/kv/lookup", json=body) for e in endpoints))
        except httpx.HTTPError as exc:
            return Outcome("", time.monotonic(), expected=body["max_tokens"], error=f"lookup: {exc}")
        cached = {e.url: int(a.json()["cached_tokens"]) for e, a in zip(endpoints, answers, strict=True)}
        chosen, _ = kv_aware([EndpointView(e, in_flight=in_flight[e.url]) for e in endpoints], cached,
                             len(text_token_ids(body["prompt"])))
        in_flight[chosen.url] += 1
        try:
            return await stream_body(client, chosen.url, body)
        finally:
            in_flight[chosen.url] -= 1
    return send


async def drive(trace: Trace, send: Send, *, rate: float, time_scale: float) -> list[Outcome]:
    """Every request at its arrival, or once the request it follows was answered, whichever is later."""
    arrivals = trace.arrivals(rate)
    answered = [asyncio.Event() for _ in trace.requests]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=500)) as client:
        start = time.monotonic()

        async def one(index: int, request: Request, at: float) -> Outcome:
            try:
                await asyncio.sleep(max(0.0, start + at / time_scale - time.monotonic()))
                if request.after is not None:
                    await answered[request.after].wait()
                body = {"model": MODEL, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True}
                return await send(client, body, index)
            finally:
                answered[index].set()

        tasks = [asyncio.create_task(one(i, r, at)) for i, (r, at) in enumerate(zip(trace.requests, arrivals,
                                                                                       strict=True))]
        done, pending = await asyncio.wait(tasks, timeout=arrivals[-1] / time_scale + GRACE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done else Outcome("", 0.0, error="timeout") for t in tasks]


# --- runs and figures ----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One router's figures on one workload at one load (hardware ms and requests per second)."""

    workload: str
    router: str
    """A hetsched policy, a peer's name or the oracle."""
    load: float
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    goodput: float
    met: float
    lost: int
    events: str
    share: str
    """Each twin's share of the prompt tokens, largest first (%)."""
    reasons: list[str] = field(default_factory=list)
    """Why requests were lost."""
    approximated: list[str] = field(default_factory=list)
    """Why the router used its approximation for an endpoint at the end, where it did."""


def good(outcome: Outcome, slo: SLO, time_scale: float) -> bool:
    return outcome.ok and outcome.ttft * time_scale * 1e3 <= slo.ttft_ms and (
        outcome.tokens < 2 or outcome.tpot * time_scale * 1e3 <= slo.tpot_ms)


async def event_sources(router_urls: Sequence[str]) -> tuple[str, list[str]]:
    """How many endpoints the router replicas follow by their KV events right now, of how many (summed over the
    replicas); why not the others."""
    async with httpx.AsyncClient() as client:
        rows = [row for url in router_urls
                for row in (await client.get(f"{url}/router/endpoints")).json()["endpoints"]]
    sources = [r["prefix_cache"] for r in rows]
    following = sum(s["source"] == "kv-events" for s in sources)
    return f"{following}/{len(rows)}", [f"approximation: {s['reason']}" for s in sources if "reason" in s]


async def run_once(trace: Trace, router: str, *, load: float, sizing: Sizing, twins_count: int,
                   replicas: int = REPLICAS) -> Row:
    """One router over the trace at ``load``, on twins started empty for it."""
    scale = sizing.time_scale
    rate = load * twins_count * sizing.capacity
    twins = await asyncio.to_thread(spawn_fleet, sizing, twins_count)
    servers: list[RouterProcess | PeerProcess] = []
    events: str = "-"
    why: list[str] = []
    try:
        if router == ORACLE:
            send = oracle(twins)
        else:
            for _ in range(replicas):
                servers.append(await asyncio.to_thread(PeerProcess, router, [t.url for t in twins],
                                                       policy="cache_aware") if router in PEERS else
                               await asyncio.to_thread(RouterProcess, router_config(
                                   twins, Policy(router), slo=trace.slo, time_scale=scale)))
            send = via([s.url for s in servers], replica_draws(len(trace.requests), replicas))
        outcomes = await drive(trace, send, rate=rate, time_scale=scale)
        if servers and router in EVENT_POLICIES:
            events, why = await event_sources([s.url for s in servers])
        async with httpx.AsyncClient() as client:
            await wait_idle(client, [t.url for t in twins], timeout=20)
        counted = [await asyncio.to_thread(counters, twin) for twin in twins]
    finally:
        for server in servers:
            server.stop()
        for twin in twins:
            twin.process.stop()
    done = [o for o in outcomes if o.ok]
    met = sum(good(o, trace.slo, scale) for o in outcomes)
    window = len(trace.requests) / rate
    hits, queries = sum(h for h, _ in counted), sum(q for _, q in counted)
    share = "/".join(f"{100 * q / max(queries, 1.0):.0f}" for q in sorted((q for _, q in counted), reverse=True))
    reasons = sorted({(o.error or f"{o.tokens}/{o.expected} tokens")[:70] for o in outcomes if not o.ok})
    return Row(trace.name, router, load, hits / max(queries, 1.0),
               pct([o.ttft * scale * 1e3 for o in done], 50), pct([o.ttft * scale * 1e3 for o in done], 99),
               met / window, met / len(outcomes), len(outcomes) - len(done), events, share, reasons[:3], why)


HEADER = (f"{'workload':22} {'router':28} {'load':>4} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'goodput':>8} {'SLO met':>8} {'lost':>5} {'events':>6}  prompt tokens by twin (%)")


def show(row: Row) -> None:
    print(f"{row.workload:22} {label(row.router):28} {row.load:>4.0%} {row.hit_rate:>8.1%} {row.ttft_p50:>7.0f}ms "
          f"{row.ttft_p99:>7.0f}ms {row.goodput:>8.2f} {row.met:>8.1%} {row.lost:>5} {row.events:>6}  {row.share}",
          flush=True)
    if row.reasons:
        print(f"   lost: {'; '.join(row.reasons)}")
    for why in row.approximated:
        print(f"   {why}")


def label(router: str) -> str:
    return f"{router} (cache_aware)" if router in PEERS else router if router == ORACLE else f"hetsched {router}"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def targets(rows: list[Row], traces: Sequence[Trace]) -> None:
    """Each target against the figures it names, with met / not met."""
    print("\ntargets:")
    find = {(r.workload, r.router, r.load): r for r in rows}
    top = LOADS[0]
    for trace in traces:
        best = find.get((trace.name, ORACLE, top))
        for policy in EVENT_POLICIES:
            ours = find.get((trace.name, policy.value, top))
            if best is None or ours is None:
                continue
            share = ours.hit_rate / best.hit_rate if best.hit_rate else float("nan")
            print(f"  {trace.name}: hetsched {policy} hit rate {ours.hit_rate:.1%} = {share:.1%} of the oracle's "
                  f"{best.hit_rate:.1%} (≥ {HIT_SHARE_OF_ORACLE:.0%}): {verdict(share >= HIT_SHARE_OF_ORACLE)}")
    for chat in (t.name for t in traces if t.name.endswith("chat")):
        peer_targets(find, chat, scored=chat == traces[0].name)


def peer_targets(find: dict[tuple[str, str, float], Row], chat: str, *, scored: bool) -> None:
    """Goodput at 90 % against the peer with the most, TTFT p50 at 50 % against the peer with the lowest; a
    workload that is not ``scored`` prints its ratios without a verdict."""
    top, low = LOADS
    peers = [find[(chat, p, load)] for p in PEERS for load in LOADS if (chat, p, load) in find]
    if not peers:
        print(f"  {chat}: against the peers' cache_aware: no peer ran")
        return
    busy = max((r for r in peers if r.load == top), key=lambda r: r.goodput, default=None)
    quiet = min((r for r in peers if r.load == low), key=lambda r: r.ttft_p50, default=None)
    for policy in EVENT_POLICIES:
        ours, ours_low = find.get((chat, policy.value, top)), find.get((chat, policy.value, low))
        if ours is not None and busy is not None:
            ratio = ours.goodput / busy.goodput if busy.goodput else float("inf")
            print(f"  {chat}: hetsched {policy} goodput at {top:.0%} {ours.goodput:.2f} = {ratio:.2f}× "
                  f"{busy.router}'s {busy.goodput:.2f} (≥ {GOODPUT_OVER_PEER:g}×): "
                  f"{verdict(ratio >= GOODPUT_OVER_PEER) if scored else 'no target'}")
        if ours_low is not None and quiet is not None:
            ratio = ours_low.ttft_p50 / quiet.ttft_p50
            print(f"  {chat}: hetsched {policy} TTFT p50 at {low:.0%} {ours_low.ttft_p50:.0f} ms = {ratio:.2f}× "
                  f"{quiet.router}'s {quiet.ttft_p50:.0f} ms (≤ {TTFT_UNDER_PEER:g}×): "
                  f"{verdict(ratio <= TTFT_UNDER_PEER) if scored else 'no target'}")


def kv_index_targets(blocks: int) -> None:
    """``benchmarks/kv_index.py``'s measurement of the index over 4 endpoints at ``blocks`` cached blocks."""
    shape = kv_index.fleet(blocks, 4)
    figures = kv_index.measure(KVIndex(), shape, shape.prompt(), 200)
    tokens = list(range(1, kv_index.PROMPT_TOKENS + 1))
    hashing = kv_index.median_us(lambda: BlockHashing(block_size=kv_index.BLOCK_SIZE).block_hashes(tokens), 20)
    checks = ((f"memory {figures.bytes_per_block:.1f} B/block/endpoint", f"≤ {kv_index.MAX_BYTES_PER_BLOCK}",
               figures.bytes_per_block <= kv_index.MAX_BYTES_PER_BLOCK),
              (f"events {figures.blocks_per_s:,.0f} blocks/s", f"≥ {kv_index.MIN_BLOCKS_PER_S:,}",
               figures.blocks_per_s >= kv_index.MIN_BLOCKS_PER_S),
              (f"matches {figures.matches_us:.0f} µs", f"< {kv_index.MAX_MATCHES_US:g}",
               figures.matches_us < kv_index.MAX_MATCHES_US),
              (f"hashing {hashing:.0f} µs", f"< {kv_index.MAX_HASHING_US:g}", hashing < kv_index.MAX_HASHING_US))
    print(f"  KV index ({blocks:,} blocks over 4 endpoints; benchmarks/kv_index.py measures 1,000,000): "
          + ", ".join(f"{name} ({bound}) {verdict(ok)}" for name, bound, ok in checks))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help=f"requests per run (default {REQUESTS}; --quick "
                                                     f"{QUICK_REQUESTS})")
    parser.add_argument("--quick", action="store_true", help="2 twins, multi-turn chat at 90 %% load, a score of "
                                                             "requests, hetsched and the oracle only")
    parser.add_argument("--replicas", type=int, default=REPLICAS, help=f"processes of each router (default "
                                                                         f"{REPLICAS}, the Helm chart's)")
    args = parser.parse_args()
    if args.replicas < 1:
        parser.error(f"--replicas: expected at least 1 router process, got {args.replicas}")
    n = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    twins = QUICK_TWINS if args.quick else TWINS
    traces = [multi_turn(n)] if args.quick else [multi_turn(n), multi_turn(n, SHORT_CHAT), shared_prefix(n)]
    loads = (QUICK_LOAD,) if args.quick else LOADS
    routers = [p.value for p in HETSCHED_POLICIES] + [ORACLE]
    if not args.quick:
        ensure_peers()
        routers += list(PEERS)
    print(f"{MODEL} on {twins} x {ACCELERATOR} twins restarted empty for every run; {args.replicas} replica(s) of "
          f"each router; {n} requests a run; latencies in hardware time; machine: {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f} at the start")
    rows: list[Row] = []
    for trace in traces:
        sizing = size_twins(trace, twins, seeds=QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
        mean_prompt = sum(r.tokens for r in trace.requests) / n
        print(f"\n{trace.name}: mean prompt {mean_prompt:,.0f} tokens, {trace.distinct_blocks():,} distinct prompt "
              f"blocks, {trace.reusable():.1%} of prompt tokens held by one cache of every earlier prompt; each twin "
              f"{sizing.kv_blocks:,} KV blocks; SLO P99 TTFT {trace.slo.ttft_ms:g} ms / TPOT {trace.slo.tpot_ms:g} ms, "
              f"capacity {sizing.capacity:.2f} req/s ({sizing.binding}-bound, "
              f"simulator, no hits); fleet {twins * sizing.capacity:.1f} req/s; time scale {sizing.time_scale:.3g}")
        print(HEADER)
        for load in loads:
            for router in routers:
                rows.append(row := await run_once(trace, router, load=load, sizing=sizing, twins_count=twins,
                                                   replicas=args.replicas))
                show(row)
    targets(rows, traces)
    kv_index_targets(kv_index.QUICK_BLOCKS if args.quick else KV_INDEX_BLOCKS)


if __name__ == "__main__":
    report.main(lambda: asyncio.run(main()), section="kv_routing")
