"""vLLM v1's prefix cache beside the scheduler's block counts: which prompt blocks are cached, who holds them,
which go first when blocks run out, and the KV events that tell a subscriber so.

The scheduler (:mod:`hetsched.sim.scheduler`) counts a replica's free blocks; this cache knows which blocks hold
a prompt block's hash (vLLM's chained block hash, :mod:`hetsched.kvcache.hashing`). As in vLLM's block pool:

- a cached block has a reference count, the running requests whose block tables hold it; at zero it stays cached
  but free ("free-but-cached"), at the tail of an LRU queue;
- a request hits the longest leading run of its block hashes the cache holds; hit blocks that were free are
  referenced again and leave the queue;
- a prompt block is cached, and a ``BlockStored`` event queued, once a step has computed it full;
- a request that finishes, is aborted or is preempted lets go of its blocks in reverse order, so its deepest
  block is evicted first;
- the scheduler's free blocks count plain and free-but-cached ones together, as vLLM's do: when it takes blocks,
  :meth:`PrefixCache.evict_to` keeps the free-but-cached ones within what is left, evicting from the LRU head and
  queuing a ``BlockRemoved`` for each.

Simplifications: only prompt blocks are cached (blocks of generated tokens go back to the plain free pool); plain
free blocks are used before any cached one is evicted (vLLM keeps both in one LRU queue); a block a request
computes while an equal one is cached is a duplicate that stays uncached (vLLM caches it under the same hash
too), so each hash is one block, stored and removed once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from hetsched.kvcache.events import BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class _Holding:
    """One running request's share of the cache."""

    refs: list[int]
    """Hashes of the cached blocks its block table holds, in block order."""
    done: int
    """Leading prompt blocks already hit, cached or found duplicate."""


class PrefixCache:
    """The cached prompt blocks of one replica with blocks of ``block_size`` tokens; see the module docstring.

    Requests are known by a key their owner picks (the scheduler's ``id(request)``) from :meth:`acquire`, which
    every admission calls, to :meth:`release`.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.queries = 0
        """Prompt tokens looked up (vLLM's ``prefix_cache_queries``)."""
        self.hits = 0
        """Of them, tokens found cached (vLLM's ``prefix_cache_hits``)."""
        self._refs: dict[int, int] = {}
        """Every cached block's hash and the requests holding it."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Free-but-cached blocks, the next to evict first."""
        self._holdings: dict[int, _Holding] = {}
        self._events: list[KVEvent] = []

    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def num_free_cached(self) -> int:
        return len(self._free)

    def free_order(self) -> list[int]:
        """Hashes of the free-but-cached blocks, the next to evict first."""
        return list(self._free)

    def match(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """How many leading blocks of ``hashes`` (at most ``max_blocks``) are cached, and how many of those are
        free: taking them takes that many from the free blocks."""
        refs, free = self._refs, self._free
        hit = reclaimed = 0
        for block_hash in islice(hashes, max(max_blocks, 0)):
            if block_hash not in refs:
                break
            hit += 1
            reclaimed += block_hash in free
        return hit, reclaimed

    def acquire(self, key: int, hashes: Sequence[int], hit_blocks: int, *, query_tokens: int | None) -> None:
        """Admit request ``key`` holding its first ``hit_blocks`` blocks (its :meth:`match`); ``query_tokens``
        counts its lookup (None: a readmission, which vLLM does not count again)."""
        refs, free = self._refs, self._free
        held = list(hashes[:hit_blocks])
        for block_hash in held:
            if not refs[block_hash]:
                del free[block_hash]
            refs[block_hash] += 1
        self._holdings[key] = _Holding(held, hit_blocks)
        if query_tokens is not None:
            self.queries += query_tokens
            self.hits += hit_blocks * self.block_size

    def store(self, key: int, hashes: Sequence[int], token_ids: Sequence[int], full_blocks: int) -> None:
        """Cache request ``key``'s prompt blocks up to ``full_blocks`` (those its computed tokens fill), each run
        of them one ``BlockStored`` as vLLM sends per request and step."""
        holding = self._holdings[key]
        start = run = holding.done
        if full_blocks <= start:
            return
        refs = self._refs
        for index in range(start, full_blocks):
            block_hash = hashes[index]
            if block_hash in refs:  # a duplicate: this request's copy stays uncached
                self._stored(hashes, token_ids, run, index)
                run = index + 1
            else:
                refs[block_hash] = 1
                holding.refs.append(block_hash)
        self._stored(hashes, token_ids, run, full_blocks)
        holding.done = full_blocks

    def release(self, key: int, blocks: int) -> int:
        """Request ``key`` lets go of its ``blocks`` blocks, deepest first; how many become free (its uncached
        ones, and the cached ones nobody else holds)."""
        holding = self._holdings.pop(key)
        refs, free = self._refs, self._free
        freed = blocks - len(holding.refs)
        for block_hash in reversed(holding.refs):
            left = refs[block_hash] - 1
            refs[block_hash] = left
            if not left:
                free[block_hash] = None
                freed += 1
        return freed

    def evict_to(self, free_blocks: int) -> None:
        """Evict from the LRU head until the free-but-cached blocks are at most ``free_blocks``."""
        free, refs, events = self._free, self._refs, self._events
        while len(free) > free_blocks:
            block_hash, _ = free.popitem(last=False)
            del refs[block_hash]
            events.append(BlockRemoved((block_hash,)))

    def drain_events(self) -> list[KVEvent]:
        """The events queued since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _stored(self, hashes: Sequence[int], token_ids: Sequence[int], start: int, stop: int) -> None:
        if stop > start:
            size = self.block_size
            self._events.append(BlockStored(tuple(hashes[start:stop]), hashes[start - 1] if start else None,
                                            tuple(token_ids[start * size:stop * size]), size))
