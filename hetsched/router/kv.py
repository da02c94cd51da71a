"""What the router knows of its engines' KV caches from their KV-cache events, per model.

Each endpoint that publishes events (:mod:`hetsched.kvcache.events`) feeds the model's :class:`KVIndex`; a
request's block hashes (:mod:`hetsched.kvcache.hashing`, computed from its tokens as the engines compute them)
then give each endpoint's longest cached prefix exactly. The index is only used for an endpoint while it is
consistent with the engine, which an unbroken run of sequence numbers proves:

- the first batch is sequence 0 (the engine just started), or a replay from 0 recovered everything before it,
  or found nothing (the engine has published nothing: its cache is empty);
- a gap is recovered from the engine's replay socket, else the endpoint's index is dropped;
- a sequence 0 after others is a restarted publisher (an engine starts with an empty cache): the index is
  cleared and follows the new run at once; other sequences seen already (a replay overlapping the
  subscription) are skipped.

A dropped index (an unrecoverable gap, a late join, a malformed frame, an unknown event, a block size that is not
the configured one, a flood, the index's cap) is cleared, refills from the events that follow, and is used again
``resync_s`` later. Until then, and for endpoints without events, the router's approximation
(:mod:`hetsched.router.prefix`) stands in; :meth:`ModelKV.source` says which is in force. Every one of these is
reported through ``on_error`` (the shell counts and logs them); none raises into a request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from hetsched.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MEDIUM_CPU, MEDIUM_GPU
from hetsched.kvcache.hashing import BlockHashing
from hetsched.kvcache.index import KVIndex

log = logging.getLogger(__name__)


class PrefixSource(StrEnum):
    """Where an endpoint's cached-prefix figure comes from."""

    EVENTS = "kv-events"
    APPROXIMATION = "approximation"


@dataclass
class _Feed:
    """One endpoint's stream of events."""

    next_sequence: int | None = None
    """The sequence number expected next; None before the first batch."""
    usable_from: float = math.inf
    """When the index becomes the endpoint's source (∞: not while nothing proves it consistent)."""
    reason: str = "no events received yet"
    """Why the approximation is in force, while it is."""
    window_start: float = -math.inf
    window_blocks: int = 0


@dataclass(frozen=True)
class Gap:
    """Batches between ``expected`` and ``received`` (exclusive) were missed: replay them from ``expected``."""

    expected: int
    received: int


class ModelKV:
    """One model's KV index and the state of each endpoint's events (see the module docstring)."""

    def __init__(self, hashing: BlockHashing, *, max_blocks: int, resync_s: float, max_blocks_per_s: float,
                 on_error: Callable[[str, str], None] = lambda url, reason: None) -> None:
        self.hashing = hashing
        self.index = KVIndex(max_blocks=max_blocks)
        self.resync_s = resync_s
        self.max_blocks_per_s = max_blocks_per_s
        self.on_error = on_error
        self._feeds: dict[str, _Feed] = {}

    # --- endpoints ------------------------------------------------------------------
    def attach(self, url: str) -> None:
        """An endpoint that publishes events: its figures are the approximation's until its events prove out."""
        self._feeds.setdefault(url, _Feed())

    def detach(self, url: str) -> None:
        """The endpoint left (or stopped publishing): its blocks leave the index."""
        if self._feeds.pop(url, None) is not None:
            self.index.forget(url)

    def attached(self) -> list[str]:
        return list(self._feeds)

    def source(self, url: str, now: float) -> PrefixSource:
        feed = self._feeds.get(url)
        return PrefixSource.EVENTS if feed is not None and now >= feed.usable_from else PrefixSource.APPROXIMATION

    def why_approximated(self, url: str, now: float) -> str | None:
        """Why ``url``'s figures are the approximation's now (None: its events are in force)."""
        feed = self._feeds.get(url)
        if feed is None:
            return "the endpoint publishes no KV events"
        if now >= feed.usable_from:
            return None
        if math.isfinite(feed.usable_from):
            return f"{feed.reason}; the index refills until {feed.usable_from - now:.1f} s from now"
        return feed.reason

    def drop(self, url: str, code: str, detail: str, now: float) -> None:
        """Clear ``url``'s index, which is used again ``resync_s`` after ``now``; ``code`` is the counter's reason
        (``gap``, ``late_join``, a :class:`~hetsched.kvcache.events.MalformedEvents` reason, ``block_size``,
        ``flood``, ``cap``, ``connection``), ``detail`` what :meth:`why_approximated` says meanwhile."""
        feed = self._feeds.get(url)
        if feed is None:
            return
        self.index.clear(url)
        feed.usable_from = now + self.resync_s
        feed.reason = detail
        log.warning("KV index of %s dropped (%s): %s; the approximation stands in for %g s", url, code, detail,
                    self.resync_s)
        self.on_error(url, code)

    # --- events -------------------------------------------------------------------------
    def check(self, url: str, batch: EventBatch) -> Gap | None:
        """Whether ``batch`` follows what ``url`` sent before (a first batch follows nothing: it should be 0); a
        :class:`Gap` to replay when it does not. A lower sequence than expected (a restarted publisher) is no gap."""
        feed = self._feeds.get(url)
        if feed is None:
            return None
        expected = 0 if feed.next_sequence is None else feed.next_sequence
        return Gap(expected, batch.sequence) if batch.sequence > expected else None

    def start_empty(self, url: str, now: float) -> None:
        """The engine's replay socket holds no batch from 0: it has published nothing, its cache holds nothing."""
        feed = self._feeds.get(url)
        if feed is not None and feed.next_sequence is None:
            feed.next_sequence, feed.usable_from, feed.reason = 0, now, ""

    def receive(self, url: str, batch: EventBatch, now: float) -> None:
        """Apply ``batch`` (after any :class:`Gap` before it was replayed, or dropped with :meth:`drop`); a batch
        seen already (from a replay and again from the subscription) is skipped."""
        feed = self._feeds.get(url)
        if feed is None:
            return
        if feed.next_sequence is None:
            if batch.sequence == 0:
                feed.usable_from, feed.reason = now, ""
            elif not math.isfinite(feed.usable_from):
                self.drop(url, "late_join", "joined after the engine's first events", now)
        elif batch.sequence == 0 and feed.next_sequence > 0:
            self.index.clear(url)  # a restarted publisher: its engine's cache started empty
            feed.usable_from, feed.reason = min(feed.usable_from, now), ""
        elif batch.sequence < feed.next_sequence:
            return
        elif batch.sequence > feed.next_sequence:
            self.drop(url, "gap", f"missed events {feed.next_sequence}..{batch.sequence - 1}", now)
        feed.next_sequence = batch.sequence + 1
        self._apply(url, feed, batch, now)

    def _apply(self, url: str, feed: _Feed, batch: EventBatch, now: float) -> None:
        blocks = sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllBlocksCleared))
        if now - feed.window_start >= 1.0:
            feed.window_start, feed.window_blocks = now, 0
        feed.window_blocks += blocks
        if feed.window_blocks > self.max_blocks_per_s:
            if feed.window_blocks - blocks <= self.max_blocks_per_s:
                self.drop(url, "flood", f"more than {self.max_blocks_per_s:g} blocks in a second", now)
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.block_size != self.hashing.block_size:
                    self.drop(url, "block_size",
                              f"block size {event.block_size}, not the configured {self.hashing.block_size}", now)
                    return
                self.index.stored(url, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self.index.removed(url, event.block_hashes, event.medium)
            else:
                self.index.clear(url)
        for dropped in self.index.take_dropped():
            self.drop(dropped, "cap", f"over the index's cap of {self.index_cap} blocks", now)

    @property
    def index_cap(self) -> int:
        return self.index.max_blocks

    # --- requests -------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The hashes of the prompt's blocks an engine can hit: vLLM recomputes the last prompt token (its logits
        are needed), so a hit stops before it, and a prompt of whole blocks can hit all but its last."""
        return tuple(self.hashing.block_hashes(token_ids[:-1]))

    def cached_tokens(self, hashes: Sequence[int], urls: Sequence[str], now: float) -> dict[str, int]:
        """Leading prompt tokens each of ``urls`` whose events are in force holds, on GPU or offloaded to CPU."""
        using = [url for url in urls if self.source(url, now) is PrefixSource.EVENTS]
        if not hashes or not using:
            return dict.fromkeys(using, 0)
        gpu = self.index.matches(hashes, using, MEDIUM_GPU)
        cpu = self.index.matches(hashes, using, MEDIUM_CPU)
        size = self.hashing.block_size
        return {url: max(gpu.get(url, 0), cpu.get(url, 0)) * size for url in using}
