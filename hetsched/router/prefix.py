"""Prefix affinity: hashes of a prompt's leading blocks, and which endpoints served them."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from hetsched.router.openai import BYTES_PER_TOKEN

PREFIX_BLOCK_TOKENS = 16
MAX_PREFIX_BLOCKS = 64


def prefix_hashes(text: str, *, block_tokens: int = PREFIX_BLOCK_TOKENS, max_blocks: int = MAX_PREFIX_BLOCKS) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks: equal leading text gives equal leading hashes."""
    data = text.encode()
    size = block_tokens * BYTES_PER_TOKEN
    hashes: list[int] = []
    previous = b""
    for start in range(0, min(len(data) // size, max_blocks) * size, size):
        digest = hashlib.blake2b(previous + data[start:start + size], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        previous = digest
    return tuple(hashes)


class PrefixIndex:
    """Which endpoints recently served which block hashes (LRU over ``capacity`` hashes)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._owners: OrderedDict[int, set[str]] = OrderedDict()

    def record(self, hashes: tuple[int, ...], url: str) -> None:
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            owners.add(url)
        while len(self._owners) > self._capacity:
            self._owners.popitem(last=False)

    def matches(self, hashes: tuple[int, ...], urls: list[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each endpoint has served."""
        counts = dict.fromkeys(urls, 0)
        alive = set(urls)
        for depth, h in enumerate(hashes, start=1):
            alive &= self._owners.get(h, set())
            if not alive:
                break
            for url in alive:
                counts[url] = depth
        return counts

    def forget(self, url: str) -> None:
        for owners in self._owners.values():
            owners.discard(url)
