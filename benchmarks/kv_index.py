"""The router's KV-block index (``hetsched.kvcache.index.KVIndex``): memory, event handling and lookups.

A fleet's cached blocks are ``--blocks`` (endpoint, block) pairs: each endpoint holds an equal share, the first
10% of every share the same blocks (a common system prompt), the rest its own. Each endpoint's blocks arrive as
``BlockStored`` events of the sizes vLLM sends (half of them 1–8 hashes, blocks filled while decoding, half
9–300, prefills), then leave in ``BlockRemoved`` events of the same sizes, shuffled. Measured, each against its
target and as a ratio against a plain ``dict[int, set[str]]`` index doing the same work in the same run:

- memory: bytes per cached block per endpoint, with the fleet stored (the index's ``nbytes``; the dict's
  ``sys.getsizeof`` of itself, its int keys and its sets), over 4 endpoints and over 1;
- events: blocks per CPU second, stored then removed, through the public methods;
- ``matches`` for a 4,000-token prompt (250 blocks of 16): its first half shared blocks, its second the first
  endpoint's own, so the lookup walks all 250 and the other endpoints stop at the half: median µs;
- ``BlockHashing().block_hashes`` for the same prompt, what a request pays before its lookup (the ratio is to
  the index's ``matches``).

    .venv/bin/python benchmarks/kv_index.py [--blocks 1000000]   # about 15 s on 2 cores
    .venv/bin/python benchmarks/kv_index.py --quick              # every part on 20,000 blocks: a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetsched.kvcache.hashing import BlockHashing
from hetsched.kvcache.index import KVIndex
import report

MAX_BYTES_PER_BLOCK = 64
MIN_BLOCKS_PER_S = 100_000
MAX_MATCHES_US = 500.0
MAX_HASHING_US = 500.0
"""The same budget as a lookup: hashing is the rest of what the request path pays for the index."""
SHARED = 0.1
PROMPT_TOKENS, BLOCK_SIZE = 4000, 16
QUICK_BLOCKS = 20_000


class DictIndex:
    """The baseline: one ``dict[int, set[str]]`` per medium, with the same per-endpoint counts as the index."""

    def __init__(self) -> None:
        self.media: dict[str, dict[int, set[str]]] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def stored(self, url: str, hashes: Sequence[int], medium: str = "GPU") -> None:
        table = self.media.setdefault(medium, {})
        added = 0
        for block in hashes:
            holders = table.get(block)
            if holders is None:
                table[block] = {url}
                added += 1
            elif url not in holders:
                holders.add(url)
                added += 1
        self.counts[url, medium] = self.counts.get((url, medium), 0) + added

    def removed(self, url: str, hashes: Sequence[int], medium: str = "GPU") -> None:
        table = self.media.get(medium, {})
        dropped = 0
        for block in hashes:
            holders = table.get(block)
            if holders is not None and url in holders:
                holders.discard(url)
                dropped += 1
                if not holders:
                    del table[block]
        self.counts[url, medium] = self.counts.get((url, medium), 0) - dropped

    def matches(self, hashes: Sequence[int], urls: Sequence[str], medium: str = "GPU") -> dict[str, int]:
        table = self.media.get(medium, {})
        counts = dict.fromkeys(urls, 0)
        pending = set(counts)
        for index, block in enumerate(hashes):
            holders = table.get(block, set())
            for url in pending - holders:
                counts[url] = index
            pending &= holders
            if not pending:
                return counts
        for url in pending:
            counts[url] = len(hashes)
        return counts

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self.media) + sys.getsizeof(self.counts) + sum(
            sys.getsizeof(table) + sum(sys.getsizeof(block) + sys.getsizeof(holders)
                                       for block, holders in table.items())
            for table in self.media.values())


Index = KVIndex | DictIndex


@dataclass(frozen=True)
class Fleet:
    """What each endpoint caches and the events that store and remove it."""

    urls: tuple[str, ...]
    held: dict[str, list[int]]
    stores: list[tuple[str, list[int]]]
    removes: list[tuple[str, list[int]]]
    common: int
    """Leading blocks of every endpoint's share that all endpoints hold."""

    @property
    def pairs(self) -> int:
        return sum(len(blocks) for blocks in self.held.values())

    def prompt(self) -> list[int]:
        """Half shared blocks, half the first endpoint's own: it holds all of them, the others the first half."""
        half = PROMPT_TOKENS // BLOCK_SIZE // 2
        assert self.common >= half, "too few blocks for the prompt's shared half"
        own = self.held[self.urls[0]]
        return own[:half] + own[self.common:self.common + half]


def event_sizes(total: int, rng: random.Random) -> list[int]:
    """Sizes of the events that carry ``total`` hashes: half 1–8, half 9–300."""
    sizes: list[int] = []
    while total > 0:
        size = min(total, rng.randint(1, 8) if rng.random() < 0.5 else rng.randint(9, 300))
        sizes.append(size)
        total -= size
    return sizes


def batched(url: str, blocks: list[int], rng: random.Random) -> list[tuple[str, list[int]]]:
    events, start = [], 0
    for size in event_sizes(len(blocks), rng):
        events.append((url, blocks[start:start + size]))
        start += size
    return events


def fleet(pairs: int, endpoints: int, seed: int = 0) -> Fleet:
    rng = random.Random(seed)
    share = pairs // endpoints
    common = [rng.getrandbits(64) for _ in range(int(share * SHARED))]
    urls = tuple(f"http://10.0.0.{i}:8000" for i in range(endpoints))
    held = {url: common + [rng.getrandbits(64) for _ in range(share - len(common))] for url in urls}
    stores = [event for url in urls for event in batched(url, held[url], rng)]
    removes = [event for url in urls for event in batched(url, rng.sample(held[url], len(held[url])), rng)]
    rng.shuffle(stores)
    rng.shuffle(removes)
    return Fleet(urls, held, stores, removes, len(common))


def cpu_seconds(work: Callable[[], object]) -> float:
    started = time.process_time()
    work()
    return time.process_time() - started


def median_us(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


@dataclass(frozen=True)
class Figures:
    bytes_per_block: float
    blocks_per_s: float
    matches_us: float


def measure(index: Index, shape: Fleet, prompt: list[int], repeats: int) -> Figures:
    """Store the fleet, size it, look the prompt up, remove the fleet."""
    stored = cpu_seconds(lambda: [index.stored(url, hashes) for url, hashes in shape.stores])
    size = index.nbytes / shape.pairs
    matches = median_us(lambda: index.matches(prompt, shape.urls), repeats)
    half = len(prompt) // 2 if len(shape.urls) > 1 else len(prompt)
    assert index.matches(prompt, shape.urls) == {url: half for url in shape.urls} | {shape.urls[0]: len(prompt)}
    removed = cpu_seconds(lambda: [index.removed(url, hashes) for url, hashes in shape.removes])
    assert index.matches(prompt, shape.urls) == dict.fromkeys(shape.urls, 0)
    return Figures(size, 2 * shape.pairs / (stored + removed), matches)


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, help=f"cached (endpoint, block) pairs (default 1,000,000; --quick "
                                                   f"{QUICK_BLOCKS:,})")
    parser.add_argument("--quick", action="store_true", help="every part on small inputs: a smoke run")
    args = parser.parse_args()
    pairs = args.blocks or (QUICK_BLOCKS if args.quick else 1_000_000)
    repeats = 50 if args.quick else 1000
    tokens = list(range(1, PROMPT_TOKENS + 1))
    print(f"KV index against a dict[int, set[str]]: {pairs:,} cached blocks, {SHARED:.0%} of each endpoint's "
          f"shared by all; events of 1–300 hashes; {PROMPT_TOKENS:,}-token prompt ({PROMPT_TOKENS // BLOCK_SIZE} "
          f"blocks); CPU seconds of this process\n")
    print(f"{'endpoints':>9} {'part':24} {'index':>12} {'dict':>12} {'index/dict':>10}  target")
    figures: dict[int, Figures] = {}
    for endpoints in (4, 1):
        shape = fleet(pairs, endpoints)
        prompt = shape.prompt()
        ours = figures[endpoints] = measure(KVIndex(), shape, prompt, repeats)
        base = measure(DictIndex(), shape, prompt, repeats)
        rows = (("bytes/block/endpoint", f"{ours.bytes_per_block:,.1f}", f"{base.bytes_per_block:,.1f}",
                 ours.bytes_per_block / base.bytes_per_block,
                 f"≤ {MAX_BYTES_PER_BLOCK} {verdict(ours.bytes_per_block <= MAX_BYTES_PER_BLOCK)}"),
                ("event blocks/CPU s", f"{ours.blocks_per_s:,.0f}", f"{base.blocks_per_s:,.0f}",
                 ours.blocks_per_s / base.blocks_per_s,
                 f"≥ {MIN_BLOCKS_PER_S:,} {verdict(ours.blocks_per_s >= MIN_BLOCKS_PER_S)}"),
                ("matches µs (median)", f"{ours.matches_us:,.1f}", f"{base.matches_us:,.1f}",
                 ours.matches_us / base.matches_us,
                 f"< {MAX_MATCHES_US:g} {verdict(ours.matches_us < MAX_MATCHES_US)}"))
        for part, mine, theirs, ratio, target in rows:
            print(f"{endpoints:>9} {part:24} {mine:>12} {theirs:>12} {ratio:>9.2f}x  {target}", flush=True)
    hashing = median_us(lambda: BlockHashing(block_size=BLOCK_SIZE).block_hashes(tokens), max(repeats // 10, 5))
    memory = max(f.bytes_per_block for f in figures.values())
    rate = min(f.blocks_per_s for f in figures.values())
    lookup = figures[4].matches_us
    print(f"\nBlockHashing().block_hashes, {PROMPT_TOKENS:,} tokens: {hashing:,.0f} µs median, {hashing / lookup:.1f}x "
          f"the index's matches over 4 endpoints (target < {MAX_HASHING_US:g} µs: {verdict(hashing < MAX_HASHING_US)})")
    met = memory <= MAX_BYTES_PER_BLOCK and rate >= MIN_BLOCKS_PER_S and lookup < MAX_MATCHES_US and \
        hashing < MAX_HASHING_US
    print(f"targets: memory {memory:.1f} B/block/endpoint (≤ {MAX_BYTES_PER_BLOCK}), events {rate:,.0f} blocks/s "
          f"(≥ {MIN_BLOCKS_PER_S:,}), matches {lookup:.0f} µs (< {MAX_MATCHES_US:g}), hashing {hashing:.0f} µs "
          f"(< {MAX_HASHING_US:g}): {verdict(met)}")

if __name__ == "__main__":
    report.main(main, section="kv_index")
