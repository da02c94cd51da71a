"""Prefix affinity: hashes of a prompt's leading blocks, their owner among endpoints, and who served them.

A prompt's owner is a consistent (rendezvous) hash of its prefix key over the endpoint set: every router
process and replica computes the same owner without talking to the others, and a change of endpoints moves only
the keys of the endpoint that left, or about 1/N of them to the one that came. :class:`PrefixIndex` is one
router's memory of what each endpoint served (the ``slo`` policy's cached-prompt term).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

from hetsched.router.openai import BYTES_PER_TOKEN

PREFIX_BLOCK_TOKENS = 16
MAX_PREFIX_BLOCKS = 64
PREFIX_KEY_BLOCKS = 4
"""Blocks of a prompt that pick its owner (64 tokens): prompts that share them, such as one system prompt's
conversations, share an endpoint and its cache."""


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


def prefix_key(hashes: Sequence[int]) -> int | None:
    """The chained hash of the prompt's first ``PREFIX_KEY_BLOCKS`` blocks (all of them when fewer); None: none."""
    return hashes[min(len(hashes), PREFIX_KEY_BLOCKS) - 1] if hashes else None


@lru_cache(maxsize=4096)
def _endpoint_seed(url: str) -> int:
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit hash of ``x`` that changes about half its bits for a one-bit change."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def rendezvous(key: int, urls: Sequence[str]) -> list[str]:
    """``urls`` in ``key``'s order of preference (highest random weight): the first is the key's owner.

    Each endpoint's weight depends only on the key and its own URL, so removing one leaves every other key's
    order as it was, and a new one becomes the owner of about 1/N of the keys.
    """
    return sorted(urls, key=lambda url: _mix(key ^ _endpoint_seed(url)), reverse=True)


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
