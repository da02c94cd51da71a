"""Which endpoint holds which KV-cache block: the router's index, fed by the engines' KV events.

A Python ``dict[int, set[str]]`` costs a few hundred bytes per block, and a fleet caches millions of blocks, so the
index keeps no Python object per block. Each medium ("GPU", "CPU", ...) has one open-addressing hash table in
numpy: ``keys[capacity]`` holds the 64-bit block hashes (0 marks an empty slot, so a real hash of 0 is stored as
1, the same block as 1 then: a 2⁻⁶⁴ chance), ``masks[capacity, words]`` a bitmask of the endpoints holding each
block, one bit per endpoint slot (a word per 64 endpoints). A block's home slot is the top bits of its hash times
2⁶⁴/φ (Fibonacci hashing, so hashes that are not uniform, small ints say, still spread), a collision probes the
next slots (linear probing), and a delete shifts the rest of its probe chain back (no tombstones, so lookups
never slow down with churn).

The table is rebuilt (sorted by home slot, placed in one vectorised pass) to hold between ¼ and ½ of its slots:
when a store would fill it past ⅝, when removes empty it below ¼, and when clearing an endpoint empties many
entries. So past the smallest table (1,024 slots) it stays ¼ to ⅝ full, and with a slot of 16 bytes up to 64
endpoints an entry costs 26 to 64 bytes, less per endpoint where endpoints share it. Events are applied one hash
at a time in Python through memoryviews of the arrays (a numpy call per event would cost more than the few hashes
most events carry); clearing an endpoint is vectorised.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence

import numpy as np

from hetsched.errors import InputError

LOW_64 = (1 << 64) - 1
FIBONACCI = 0x9E3779B97F4A7C15
"""2⁶⁴/φ, odd: multiplying by it mixes every bit of a hash into the top bits, the home slot."""
MIN_CAPACITY = 1024
GROW_NUMERATOR, GROW_DENOMINATOR = 5, 8
"""A table is rebuilt twice as large when a store would fill more than ⅝ of its slots."""
SHRINK_DENOMINATOR = 4
"""... and half as large when removes leave less than ¼ of them full."""
BULK_DELETE_DENOMINATOR = 32
"""Clearing an endpoint rebuilds the table when it empties more than 1/32 of the slots (one by one is slower)."""


def _capacity_for(entries: int, ceiling: int) -> int:
    """The smallest power of two (at least :data:`MIN_CAPACITY`, at most ``ceiling``) at most half full."""
    capacity = MIN_CAPACITY
    while capacity < 2 * entries and capacity < ceiling:
        capacity *= 2
    return capacity


def _ceiling(limit: int) -> int:
    """The capacity that ``limit`` entries fill to at most ⅝: the table never grows past it."""
    capacity = MIN_CAPACITY
    while capacity * GROW_NUMERATOR < limit * GROW_DENOMINATOR:
        capacity *= 2
    return capacity


def _view(array: np.ndarray) -> memoryview:
    """A flat view whose items are Python ints: a tenth of numpy's cost per item read or written."""
    return array.data.cast("B").cast("Q")


class _Table:
    """One medium's blocks: the hash table of the module docstring and the blocks each endpoint slot holds."""

    keys: np.ndarray
    """uint64[capacity]: the block hashes, 0 in an empty slot."""
    masks: np.ndarray
    """uint64[capacity, words]: bit *e* of a row is set when endpoint slot *e* holds the block."""
    capacity: int

    def __init__(self, *, limit: int, words: int) -> None:
        self.limit = limit
        self.ceiling = _ceiling(limit)
        self.words = words
        self.size = 0
        self.held = [0] * (64 * words)
        self._place(np.zeros(0, np.uint64), np.zeros((0, words), np.uint64), MIN_CAPACITY)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.masks.nbytes) + sys.getsizeof(self.held) + \
            sum(sys.getsizeof(count) for count in self.held)

    def _place(self, keys: np.ndarray, masks: np.ndarray, capacity: int) -> None:
        """Make the table ``capacity`` slots holding ``keys`` and their ``masks`` rows.

        Sorted by home slot, entry *i* goes to ``max(home_i, position_{i−1} + 1)``, which is ``i + max_{j≤i}
        (home_j − j)``: a running maximum. The few that run past the end wrap round by probing, as inserts do.
        """
        self.capacity, self._mask, self._shift = capacity, capacity - 1, 64 - capacity.bit_length() + 1
        home = ((keys * np.uint64(FIBONACCI)) >> np.uint64(self._shift)).astype(np.int64)
        order = np.argsort(home)
        step = np.arange(len(keys))
        position = step + np.maximum.accumulate(home[order] - step) if len(keys) else step
        fits = position < capacity
        self.keys = np.zeros(capacity, np.uint64)
        self.masks = np.zeros((capacity, self.words), np.uint64)
        self.keys[position[fits]] = keys[order[fits]]
        self.masks[position[fits]] = masks[order[fits]]
        self._keys, self._masks = _view(self.keys), _view(self.masks)
        for index in order[~fits]:
            slot = ~self._probe(int(keys[index]))
            self.keys[slot] = keys[index]
            self.masks[slot] = masks[index]
        self.size = len(keys)

    def _rebuild(self, capacity: int) -> None:
        """Re-place the entries some endpoint still holds into ``capacity`` slots."""
        live = np.flatnonzero(self.masks.any(axis=1))
        self._place(self.keys[live], self.masks[live], capacity)

    def widen(self, words: int) -> None:
        """Room for ``64 * words`` endpoint slots."""
        masks = np.zeros((self.capacity, words), np.uint64)
        masks[:, :self.words] = self.masks
        self.masks, self._masks, self.words = masks, _view(masks), words
        self.held.extend([0] * (64 * words - len(self.held)))

    def _probe(self, key: int) -> int:
        """The slot holding ``key``, or ``~slot`` of the empty slot that ends its probe chain."""
        keys, mask = self._keys, self._mask
        slot = ((key * FIBONACCI) & LOW_64) >> self._shift
        while True:
            found = keys[slot]
            if found == key:
                return slot
            if not found:
                return ~slot
            slot = (slot + 1) & mask

    def row(self, slot: int) -> int:
        """The endpoints holding the entry at ``slot``, as one bitmask."""
        if self.words == 1:
            return int(self._masks[slot])
        return int.from_bytes(self._masks[slot * self.words:(slot + 1) * self.words].cast("B"), "little")

    def find(self, block: int) -> int:
        """The slot of ``block``, negative when no endpoint holds it."""
        return self._probe(block or 1)

    def store(self, hashes: Sequence[int], endpoint: int, start: int) -> int:
        """Mark ``hashes[start:]`` held by ``endpoint``; the index of the first that did not fit (the table holds
        ``limit`` entries and it is new), or ``len(hashes)``."""
        word, bit, words = endpoint >> 6, 1 << (endpoint & 63), self.words
        for index in range(start, len(hashes)):
            key = hashes[index] or 1
            slot = self._probe(key)
            if slot < 0:
                if self.size >= self.limit:
                    return index
                if self.size >= self.capacity * GROW_NUMERATOR // GROW_DENOMINATOR:
                    self._rebuild(2 * self.capacity)
                    slot = self._probe(key)
                slot = ~slot
                self._keys[slot] = key
                self.size += 1
            at = slot * words + word
            mask = self._masks[at]
            if not mask & bit:
                self._masks[at] = mask | bit
                self.held[endpoint] += 1
        return len(hashes)

    def remove(self, hashes: Sequence[int], endpoint: int) -> None:
        """Unmark ``hashes`` for ``endpoint``; hashes it does not hold are ignored."""
        word, bit, words = endpoint >> 6, 1 << (endpoint & 63), self.words
        for block in hashes:
            slot = self._probe(block or 1)
            if slot < 0:
                continue
            at = slot * words + word
            mask = self._masks[at]
            if mask & bit:
                self._masks[at] = mask ^ bit
                self.held[endpoint] -= 1
                if mask == bit and (words == 1 or not self.row(slot)):
                    self._delete(slot)
        if self.capacity > MIN_CAPACITY and self.size * SHRINK_DENOMINATOR < self.capacity:
            self._rebuild(_capacity_for(self.size, self.ceiling))

    def _delete(self, slot: int) -> None:
        """Empty ``slot`` and shift back each later entry of the probe chain that may move into the hole."""
        keys, masks, mask, shift, words = self._keys, self._masks, self._mask, self._shift, self.words
        hole, at = slot, slot
        while True:
            at = (at + 1) & mask
            key = keys[at]
            if not key:
                break
            home = ((key * FIBONACCI) & LOW_64) >> shift
            if (at - home) & mask >= (at - hole) & mask:  # the hole lies on the way from its home to it
                keys[hole] = key
                masks[hole * words:(hole + 1) * words] = masks[at * words:(at + 1) * words]
                hole = at
        keys[hole] = 0
        self.masks[hole] = 0
        self.size -= 1

    def drop(self, endpoint: int) -> None:
        """Unmark every block of ``endpoint``."""
        if not self.held[endpoint]:
            return
        word, bit = endpoint >> 6, np.uint64(1 << (endpoint & 63))
        marked = np.flatnonzero(self.masks[:, word] & bit)
        self.masks[marked, word] &= ~bit
        self.held[endpoint] = 0
        emptied = marked[~self.masks[marked].any(axis=1)]
        left = self.size - len(emptied)
        if len(emptied) * BULK_DELETE_DENOMINATOR > self.capacity or (
                self.capacity > MIN_CAPACITY and left * SHRINK_DENOMINATOR < self.capacity):
            self._rebuild(_capacity_for(left, self.ceiling))
            return
        for key in self.keys[emptied].tolist():
            self._delete(self._probe(key))

    def heaviest(self) -> int:
        """The endpoint slot holding the most blocks."""
        return max(range(len(self.held)), key=self.held.__getitem__)


class KVIndex:
    """Which endpoints hold which KV-cache blocks, per medium, for one model (see the module docstring).

    Endpoints are named by URL; each gets a slot (a bit of every entry's mask) when first seen, kept through
    :meth:`clear` and freed for the next new endpoint by :meth:`forget`. The blocks an endpoint holds per medium
    are counted exactly: storing a block it holds and removing one it does not change nothing.

    The cap: a medium never holds more than ``max_blocks`` distinct blocks. When a store would go past it, the
    endpoint holding the most blocks in that medium (the likeliest flooder) is cleared in every medium and
    reported once by :meth:`take_dropped`, until the store fits; then the store goes on. The router falls back to
    its approximation for a dropped endpoint until its events make its index consistent again.
    """

    def __init__(self, *, max_blocks: int = 4_000_000) -> None:
        if max_blocks < 1:
            raise InputError(f"expected a positive number of blocks, got {max_blocks}", field="max_blocks")
        self._max_blocks = max_blocks
        self._tables: dict[str, _Table] = {}
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._words = 1
        self._dropped: list[str] = []

    @property
    def max_blocks(self) -> int:
        return self._max_blocks

    @property
    def entries(self) -> int:
        """Distinct (medium, block) entries."""
        return sum(table.size for table in self._tables.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the structure: the tables' arrays and every Python container with what it holds."""
        containers = sys.getsizeof(self._tables) + sys.getsizeof(self._slots) + sys.getsizeof(self._free) + \
            sys.getsizeof(self._dropped) + sum(sys.getsizeof(medium) for medium in self._tables) + \
            sum(sys.getsizeof(url) + sys.getsizeof(slot) for url, slot in self._slots.items())
        return containers + sum(table.nbytes for table in self._tables.values())

    def _endpoint(self, url: str) -> int:
        slot = self._slots.get(url)
        if slot is None:
            slot = heapq.heappop(self._free) if self._free else len(self._slots)
            self._slots[url] = slot
            if slot >= 64 * self._words:
                self._words += 1
                for table in self._tables.values():
                    table.widen(self._words)
        return slot

    def _table(self, medium: str) -> _Table:
        table = self._tables.get(medium)
        if table is None:
            table = self._tables[medium] = _Table(limit=self._max_blocks, words=self._words)
        return table

    def stored(self, url: str, hashes: Sequence[int], medium: str = "GPU") -> None:
        """``url`` holds ``hashes`` in ``medium`` (a ``BlockStored`` event)."""
        endpoint, table = self._endpoint(url), self._table(medium)
        done = table.store(hashes, endpoint, 0)
        while done < len(hashes):
            slot = table.heaviest()
            victim = next(name for name, held in self._slots.items() if held == slot)
            self.clear(victim)
            if victim not in self._dropped:
                self._dropped.append(victim)
            done = table.store(hashes, endpoint, done)

    def removed(self, url: str, hashes: Sequence[int], medium: str = "GPU") -> None:
        """``url`` evicted ``hashes`` from ``medium`` (a ``BlockRemoved`` event); hashes it does not hold are
        ignored."""
        endpoint, table = self._slots.get(url), self._tables.get(medium)
        if endpoint is not None and table is not None:
            table.remove(hashes, endpoint)

    def clear(self, url: str) -> None:
        """Drop every block of ``url`` in every medium (``AllBlocksCleared``, a reconnect, a gap)."""
        endpoint = self._slots.get(url)
        if endpoint is not None:
            for table in self._tables.values():
                table.drop(endpoint)

    def forget(self, url: str) -> None:
        """The endpoint left: drop its blocks and free its slot."""
        self.clear(url)
        endpoint = self._slots.pop(url, None)
        if endpoint is not None:
            heapq.heappush(self._free, endpoint)

    def matches(self, hashes: Sequence[int], urls: Sequence[str], medium: str = "GPU") -> dict[str, int]:
        """For each of ``urls``, how many leading blocks of ``hashes`` it holds in ``medium`` (0 for a URL the index
        does not know)."""
        counts = dict.fromkeys(urls, 0)
        table = self._tables.get(medium)
        known = {url: self._slots[url] for url in counts if url in self._slots}
        if table is None or not known:
            return counts
        pending = sum(1 << slot for slot in known.values())
        for index, block in enumerate(hashes):
            slot = table.find(block)
            row = table.row(slot) if slot >= 0 else 0
            lost = pending & ~row
            if lost:
                for url, endpoint in known.items():
                    if lost >> endpoint & 1:
                        counts[url] = index
                pending &= row
                if not pending:
                    return counts
        for url, endpoint in known.items():
            if pending >> endpoint & 1:
                counts[url] = len(hashes)
        return counts

    def blocks(self, url: str, medium: str = "GPU") -> int:
        """Blocks ``url`` holds in ``medium``."""
        endpoint, table = self._slots.get(url), self._tables.get(medium)
        return 0 if endpoint is None or table is None else table.held[endpoint]

    def take_dropped(self) -> list[str]:
        """The URLs the cap cleared since the last call (see the class docstring)."""
        dropped, self._dropped = self._dropped, []
        return dropped
