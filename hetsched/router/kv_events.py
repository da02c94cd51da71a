"""Following each engine's KV-cache events over ZMQ (the I/O shell of :mod:`hetsched.router.kv`).

One task per endpoint that names a ``kv_events`` address: a SUB socket connected to it, every topic; with a replay
socket, what the engine published before is asked of it first. Each batch is decoded and handed to its model's :class:`~hetsched.router.kv.ModelKV`; a gap in the sequence numbers (and a
first batch after 0) is asked of the engine's replay socket, when it has one, before the batch is applied. Every
router process and replica subscribes on its own, so all of them see the same caches without talking. ZMQ
reconnects by itself; a silence is not an error (an idle engine publishes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from hetsched.kvcache.events import END_SEQUENCE, AllBlocksCleared, BlockStored, EventBatch, MalformedEvents, decode
from hetsched.router.picker import Picker
from hetsched.router.types import Endpoint

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 1.0
"""How long a replay may take before the gap counts as unrecoverable."""
RECEIVE_HWM = 100_000
"""Batches ZMQ queues for a slow router before it drops (which the sequence numbers then show as a gap)."""


class KVEventFeeds:
    """The subscriptions of one router process, kept in step with the picker's endpoints by :meth:`sync`."""

    def __init__(self, picker: Picker, *, context: zmq.asyncio.Context | None = None) -> None:
        self.picker = picker
        self._context = context or zmq.asyncio.Context.instance()
        self._tasks: dict[tuple[str, str, str], asyncio.Task[None]] = {}

    def sync(self) -> None:
        """Follow every endpoint with a ``kv_events`` address (again, where its socket failed), and stop following
        those gone or changed."""
        wanted = {(e.url, e.kv_events, e.kv_events_replay): e for e in self.picker.state.endpoints() if e.kv_events}
        for key in set(self._tasks) - set(wanted):
            self._tasks.pop(key).cancel()
        for key, endpoint in wanted.items():
            if key not in self._tasks or self._tasks[key].done():
                self._tasks[key] = asyncio.create_task(self._follow(endpoint), name=f"kv-events {endpoint.url}")

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, endpoint: Endpoint) -> None:
        picker, url = self.picker, endpoint.url
        kv = picker.state.kv(endpoint.model)
        blocks = picker.metrics.kv_blocks
        stored, removed, cleared = (blocks.labels(endpoint.model, url, kind) for kind in ("stored", "removed",
                                                                                             "cleared"))
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            socket.connect(endpoint.kv_events)
            if endpoint.kv_events_replay:  # what the engine published before this subscription
                history = await self._replay(endpoint, 0)
                if history == []:
                    kv.start_empty(url, picker.clock())
                for earlier in history or []:
                    kv.receive(url, earlier, picker.clock())
            while True:
                frames = await socket.recv_multipart()
                try:
                    _, batch = decode(frames)
                except MalformedEvents as exc:
                    kv.drop(url, exc.reason, str(exc), picker.clock())
                    continue
                gap = kv.check(url, batch)
                if gap is not None and endpoint.kv_events_replay:
                    for missed in await self._replay(endpoint, gap.expected) or []:
                        if gap.expected <= missed.sequence < gap.received:
                            kv.receive(url, missed, picker.clock())
                kv.receive(url, batch, picker.clock())
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        stored.inc(len(event.block_hashes))
                    elif isinstance(event, AllBlocksCleared):
                        cleared.inc()
                    else:
                        removed.inc(len(event.block_hashes))
        except (zmq.ZMQError, ValueError) as exc:  # the next sync follows it again
            kv.drop(url, "connection", f"the event socket at {endpoint.kv_events} failed: {exc}", picker.clock())
        finally:
            socket.close(linger=0)

    async def _replay(self, endpoint: Endpoint, start: int) -> list[EventBatch] | None:
        """The batches the engine's replay socket still holds from ``start`` on; None when it does not answer in
        time (a gap then stands)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        found: list[EventBatch] = []
        try:
            socket.connect(endpoint.kv_events_replay)
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await socket.recv_multipart()
                    if len(frames) == 4 and frames[2] == END_SEQUENCE:
                        return found
                    with contextlib.suppress(MalformedEvents):
                        found.append(decode(frames[1:])[1])
        except (TimeoutError, zmq.ZMQError) as exc:
            log.info("KV event replay from %s at %s failed: %s", start, endpoint.kv_events_replay, exc or "timeout")
            return None
        finally:
            socket.close(linger=0)
