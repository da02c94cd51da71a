"""A vLLM-v1-style continuous-batching scheduler for one engine replica.

There is no prefill or decode phase: each request has ``num_tokens`` (prompt +
tokens generated so far) and ``computed`` (tokens whose KV is written); a step
lets ``computed`` catch up, and when it reaches ``num_tokens`` the engine samples
one more token. A decode is just a request one token behind.

Each :meth:`Scheduler.schedule` call plans one step under explicit budgets:

1. every decoding request gets its one token (vLLM requires
   ``max_num_batched_tokens ≥ max_num_seqs``, so decodes always fit the budget);
   when the KV cache has no block for them, the most recently admitted running
   request is preempted (recompute: its KV is dropped and it re-queues first);
2. partially prefilled requests continue in admission order (chunked prefill);
3. waiting requests are admitted while tokens, sequence slots and KV blocks
   last; prefix-cache hits start them with ``computed`` past the shared prefix.
   A request that could never fit (longer than the model context or the whole
   KV cache) is rejected.

The prefix hit is ``cached_tokens`` handed in (the discrete-event simulator's
workloads, a KV cache arriving from a prefill instance) or, with
``prefix_caching``, also a real cache of prompt blocks by their hashes
(:mod:`hetsched.sim.prefix_cache`): every place that takes free blocks goes
through it, so blocks it must evict are evicted and reported
(:meth:`Scheduler.drain_events`).

:meth:`Scheduler.update_from_output` takes the finished step back. The class
neither owns a clock nor an event loop: the discrete-event simulator and a
real-time simulated worker both drive it.

Decoding requests are kept as an aggregate so a step costs O(prefills +
finishes), not O(batch): all decoders advance one token per step, so with a
global decode tick ``T`` a decoder's KV length is ``base + T − join``; block
demand per step comes from a count of decoders per phase ``(base − join) mod
block_size``, and finishes from a heap keyed by the tick they complete at.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from hetsched.errors import InputError
from hetsched.kvcache.events import KVEvent
from hetsched.perf.step import StepShape
from hetsched.sim.prefix_cache import PrefixCache
from hetsched.specs.engine import EngineConfig


K = TypeVar("K", bound=Hashable)
"""A request's id: whatever its owner finds it by (the simulator's index, the worker's counter)."""


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Request(Generic[K]):
    """One request's progress; fields of a decoding request are current after :meth:`Scheduler.refresh`."""

    id: K
    prompt_tokens: int
    max_output_tokens: int
    cached_tokens: int = 0
    """Leading prompt tokens whose KV is there without the scheduler's prefix cache (given by the caller)."""
    block_hashes: tuple[int, ...] = ()
    """Hashes of the prompt's full blocks, first to last, for the prefix cache."""
    token_ids: tuple[int, ...] = ()
    """The prompt's token ids, for the cache's ``BlockStored`` events (empty: unknown)."""
    status: RequestStatus = RequestStatus.WAITING
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    join_tick: int = -1
    """Decode tick its fields are current at, while decoding (−1 otherwise)."""
    decode_key: int = -1

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(frozen=True, slots=True)
class PrefillChunk(Generic[K]):
    request: Request[K]
    new_tokens: int
    context_tokens: int
    """Tokens already computed before this chunk (prefix hits included)."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput(Generic[K]):
    """One planned step (or ``num_steps`` identical decode-only steps, see :meth:`Scheduler.schedule`)."""

    prefills: tuple[PrefillChunk[K], ...]
    num_decodes: int
    shape: StepShape
    """Shape of the first step; each further step adds ``num_decodes`` to ``decode_kv_tokens``."""
    num_steps: int = 1
    preempted: tuple[Request[K], ...] = ()
    rejected: tuple[Request[K], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.num_decodes

    @property
    def last_shape(self) -> StepShape:
        if self.num_steps == 1:
            return self.shape
        s = self.shape
        return StepShape(s.prefill_tokens, s.prefill_seqs, s.prefill_attention_pairs, s.prefill_kv_tokens,
                         s.decode_seqs, s.decode_kv_tokens + (self.num_steps - 1) * self.num_decodes)


@dataclass(frozen=True, slots=True)
class StepResult(Generic[K]):
    """What a finished step changed: requests that got their first token, and those that completed."""

    first_token: tuple[Request[K], ...]
    finished: tuple[Request[K], ...]


@dataclass(slots=True)
class _Decoders(Generic[K]):
    """All decoding requests as aggregates (see the module docstring)."""

    block_size: int
    tick: int = 0
    count: int = 0
    offset_sum: int = 0
    """Σ (base − join) over decoders; their KV tokens sum to ``offset_sum + count·tick``."""
    phase: list[int] = field(default_factory=list)
    finishes: list[tuple[int, int, Request[K]]] = field(default_factory=list)
    members: dict[int, Request[K]] = field(default_factory=dict)
    keys: int = 0

    def add(self, req: Request[K]) -> None:
        offset = req.computed - self.tick  # stays constant: refresh moves computed and join_tick together
        req.join_tick = self.tick
        self.keys += 1
        req.decode_key = self.keys
        self.count += 1
        self.offset_sum += offset
        self.phase[offset % self.block_size] += 1
        heapq.heappush(self.finishes, (self.tick + req.max_output_tokens - req.generated, req.decode_key, req))
        self.members[req.decode_key] = req

    def remove(self, req: Request[K]) -> None:
        """Take ``req`` out, making its ``computed``, ``generated`` and ``blocks`` current."""
        self.refresh(req)
        offset = req.computed - req.join_tick
        self.count -= 1
        self.offset_sum -= offset
        self.phase[offset % self.block_size] -= 1
        del self.members[req.decode_key]
        req.join_tick = req.decode_key = -1  # its heap entry goes stale

    def refresh(self, req: Request[K]) -> None:
        steps = self.tick - req.join_tick
        req.computed += steps
        req.generated += steps
        req.join_tick = self.tick
        req.blocks = -(-req.computed // self.block_size)

    def new_blocks(self, steps: int) -> int:
        """Blocks the decoders need to run ``steps`` more steps."""
        bs = self.block_size
        full, rest = divmod(steps, bs)
        return full * self.count + sum(self.phase[(-(self.tick + k)) % bs] for k in range(rest))

    def steps_within(self, free_blocks: int, limit: int) -> int:
        """Most steps (≤ ``limit``) whose new blocks fit ``free_blocks``."""
        bs = self.block_size
        steps = min(limit, (free_blocks // self.count) * bs if self.count else limit)
        need = self.new_blocks(steps)
        while steps < limit:
            more = self.phase[(-(self.tick + steps)) % bs]
            if need + more > free_blocks:
                break
            need += more
            steps += 1
        return steps

    def steps_to_next_finish(self) -> int:
        while self.finishes and self.finishes[0][2].decode_key != self.finishes[0][1]:
            heapq.heappop(self.finishes)
        return self.finishes[0][0] - self.tick if self.finishes else 0

    def advance(self, steps: int) -> list[Request[K]]:
        """Run ``steps`` decode steps; return the decoders that completed, taken out."""
        self.tick += steps
        done: list[Request[K]] = []
        while self.finishes and self.finishes[0][0] <= self.tick:
            _, key, req = heapq.heappop(self.finishes)
            if req.decode_key == key:
                self.remove(req)
                done.append(req)
        return done


class Scheduler(Generic[K]):
    """Plans engine steps for one replica with ``num_blocks`` KV blocks; see the module docstring.

    ``free_blocks`` counts plain free blocks and, with ``prefix_caching``, free-but-cached ones, as vLLM does.
    """

    def __init__(self, engine: EngineConfig, *, num_blocks: int, max_model_len: int,
                 prefix_caching: bool = False) -> None:
        if engine.max_num_batched_tokens < engine.max_num_seqs:
            raise InputError(f"must be at least max_num_seqs ({engine.max_num_seqs}), got "
                             f"{engine.max_num_batched_tokens}", field="max_num_batched_tokens")
        if num_blocks < 1:
            raise InputError(f"expected at least one KV block, got {num_blocks}", field="num_blocks")
        self.engine = engine
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.free_blocks = num_blocks
        self.waiting: deque[Request[K]] = deque()
        self.running: dict[int, Request[K]] = {}
        """Admission order; the last entry is preempted first."""
        self._prefilling: dict[int, Request[K]] = {}
        self._decoders: _Decoders[K] = _Decoders(block_size=engine.block_size, phase=[0] * engine.block_size)
        self.prefix_cache = PrefixCache(engine.block_size) if prefix_caching else None

    # --- the interface ---------------------------------------------------------
    def add_request(self, request: Request[K]) -> None:
        self.waiting.append(request)

    def schedule(self, *, max_steps: int = 1) -> SchedulerOutput[K]:
        """Plan the next step.

        With ``max_steps`` > 1 and no prefill work to do, plan up to that many
        identical decode steps at once (vLLM's multi-step scheduling), stopping
        before the next finish and before the KV cache runs out; the caller caps
        ``max_steps`` by when its next request arrives.
        """
        dec, bs = self._decoders, self.engine.block_size
        budget = self.engine.max_num_batched_tokens
        preempted: list[Request[K]] = []

        # 1. Decodes: one token each; preempt the newest request while their blocks do not fit.
        while dec.count and dec.new_blocks(1) > self.free_blocks:
            preempted.append(self._preempt_last())
        budget -= dec.count

        # 2. Partial prefills already running, in admission order.
        chunks: list[PrefillChunk[K]] = []
        for req in list(self._prefilling.values()):
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.computed, budget)
            while self._blocks_for(req, n) > self._available() and req.status is RequestStatus.RUNNING:
                preempted.append(self._preempt_last())
            if req.status is not RequestStatus.RUNNING:
                break
            self._allocate(req, n)
            chunks.append(PrefillChunk(req, n, req.computed))
            budget -= n

        # 3. Admit waiting requests while tokens, sequence slots and blocks last.
        rejected: list[Request[K]] = []
        while self.waiting and budget and len(self.running) < self.engine.max_num_seqs and not preempted:
            req = self.waiting[0]
            if self._never_fits(req):
                self.waiting.popleft()
                req.status = RequestStatus.REJECTED
                rejected.append(req)
                continue
            hit_blocks, reclaimed = self.prefix_hit(req.block_hashes, req.num_tokens)
            hit = max(hit_blocks * bs, min(req.cached_tokens // bs * bs, req.num_tokens - 1))
            n = min(req.num_tokens - hit, budget)
            if -(-(hit + n) // bs) - hit_blocks + reclaimed > self._available():
                break
            self.waiting.popleft()
            req.status, req.computed, req.blocks = RequestStatus.RUNNING, hit, hit_blocks
            self.running[id(req)] = self._prefilling[id(req)] = req
            if self.prefix_cache is not None:
                self.prefix_cache.acquire(id(req), req.block_hashes, hit_blocks,
                                          query_tokens=None if req.preemptions else req.num_tokens)
                self.free_blocks -= reclaimed
            self._allocate(req, n)
            chunks.append(PrefillChunk(req, n, hit))
            budget -= n

        steps = 1
        if not chunks and max_steps > 1 and dec.count:
            steps = max(1, min(max_steps, dec.steps_to_next_finish(), dec.steps_within(self.free_blocks, max_steps)))
        self.free_blocks -= dec.new_blocks(steps)
        if self.prefix_cache is not None:
            self.prefix_cache.evict_to(self.free_blocks)
        assert self.free_blocks >= 0 and budget >= 0 and len(self.running) <= self.engine.max_num_seqs
        shape = StepShape(
            prefill_tokens=sum(c.new_tokens for c in chunks),
            prefill_seqs=len(chunks),
            prefill_attention_pairs=sum(c.new_tokens * c.context_tokens + c.new_tokens * (c.new_tokens + 1) / 2
                                        for c in chunks),
            prefill_kv_tokens=sum(c.new_tokens + c.context_tokens for c in chunks),
            decode_seqs=dec.count,
            decode_kv_tokens=dec.offset_sum + dec.count * (dec.tick + 1),
        )
        return SchedulerOutput(tuple(chunks), dec.count, shape, steps, tuple(preempted), tuple(rejected))

    def update_from_output(self, output: SchedulerOutput[K]) -> StepResult[K]:
        """Apply a finished step: advance decoders, finish prefill chunks, sample tokens."""
        finished = self._decoders.advance(output.num_steps) if output.num_decodes else []
        for req in finished:
            self._finish(req)
        first: list[Request[K]] = []
        cache, bs = self.prefix_cache, self.engine.block_size
        for chunk in output.prefills:
            req = chunk.request
            req.computed += chunk.new_tokens
            if cache is not None and req.block_hashes:
                cache.store(id(req), req.block_hashes, req.token_ids,
                            min(req.computed // bs, len(req.block_hashes)))
            if req.computed < req.num_tokens:
                continue
            del self._prefilling[id(req)]
            req.generated += 1
            if req.generated == 1:
                first.append(req)
            if req.generated >= req.max_output_tokens:
                self._finish(req)
                finished.append(req)
            else:
                self._decoders.add(req)
        return StepResult(tuple(first), tuple(finished))

    def abort(self, request: Request[K]) -> None:
        """Drop a request (its client went away) and free its blocks; call between steps."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            if request.join_tick >= 0:
                self._decoders.remove(request)
            self._prefilling.pop(id(request), None)
            del self.running[id(request)]
            self._release(request)
        else:
            return
        request.status = RequestStatus.ABORTED

    # --- views -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_decoding(self) -> int:
        return self._decoders.count

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache, once per request (0 without one)."""
        return self.prefix_cache.queries if self.prefix_cache is not None else 0

    @property
    def prefix_hits(self) -> int:
        """Of them, tokens found cached."""
        return self.prefix_cache.hits if self.prefix_cache is not None else 0

    def drain_events(self) -> list[KVEvent]:
        """The prefix cache's KV events since the last call, as vLLM batches them per step (none without one)."""
        return self.prefix_cache.drain_events() if self.prefix_cache is not None else []

    def decoding(self) -> Iterator[Request[K]]:
        """Requests that get one token in every step (O(batch); for real-time drivers)."""
        return iter(list(self._decoders.members.values()))

    def refresh(self, request: Request[K]) -> None:
        """Bring a decoding request's ``computed``/``generated``/``blocks`` up to date."""
        if request.join_tick >= 0:
            self._decoders.refresh(request)

    # --- helpers -----------------------------------------------------------------
    def _never_fits(self, req: Request[K]) -> bool:
        total = req.prompt_tokens + req.max_output_tokens
        return total > self.max_model_len or -(-total // self.engine.block_size) > self.num_blocks

    def _available(self) -> int:
        """Free blocks left once this step's decodes have theirs."""
        return self.free_blocks - self._decoders.new_blocks(1)

    def _blocks_for(self, req: Request[K], new_tokens: int) -> int:
        return -(-(req.computed + new_tokens) // self.engine.block_size) - req.blocks

    def prefix_hit(self, block_hashes: Sequence[int], num_tokens: int) -> tuple[int, int]:
        """Leading blocks the prefix cache holds of a prompt of ``num_tokens`` tokens with these full-block hashes
        (its last token is always computed again), and how many of them are free-but-cached; (0, 0) without a
        cache. The cache is only read."""
        if self.prefix_cache is None:
            return 0, 0
        return self.prefix_cache.match(block_hashes, (num_tokens - 1) // self.engine.block_size)

    def _allocate(self, req: Request[K], new_tokens: int) -> None:
        need = self._blocks_for(req, new_tokens)
        req.blocks += need
        self.free_blocks -= need
        if self.prefix_cache is not None:  # this step's decodes take theirs first
            self.prefix_cache.evict_to(self._available())

    def _release(self, req: Request[K]) -> None:
        cache = self.prefix_cache
        self.free_blocks += req.blocks if cache is None else cache.release(id(req), req.blocks)
        req.blocks = 0

    def _preempt_last(self) -> Request[K]:
        _, req = self.running.popitem()
        if req.join_tick >= 0:
            self._decoders.remove(req)
        self._prefilling.pop(id(req), None)
        self._release(req)
        req.computed = 0
        req.status = RequestStatus.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)
        return req

    def _finish(self, req: Request[K]) -> None:
        del self.running[id(req)]
        self._release(req)
        req.status = RequestStatus.FINISHED

