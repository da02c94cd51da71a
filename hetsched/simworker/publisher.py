"""The simulated engine's KV events on ZMQ, published as vLLM's ``ZmqEventPublisher`` publishes them.

A PUB socket sends each batch as ``[topic, sequence, payload]`` (:func:`hetsched.kvcache.events.encode`), the
sequence counting from 0. A ROUTER socket, if asked for, answers a replay request ``[identity, b"", start]``
(the first sequence wanted, 8 bytes big-endian) with one message ``[identity, b"", topic, sequence, payload]``
per batch it still holds from there, then ``[identity, b"", b"", END_SEQUENCE, b""]``; it holds the last
:data:`REPLAY_BATCHES`. Both run on the worker's event loop (``zmq.asyncio``): a PUB socket never blocks, it drops
what a slow subscriber cannot take.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from itertools import islice

import zmq
import zmq.asyncio

from hetsched.errors import InputError
from hetsched.kvcache.events import END_SEQUENCE, KVEvent, encode

REPLAY_BATCHES = 10_000
"""Batches the replay socket keeps, as vLLM's ``buffer_steps`` default."""


class KVEventPublisher:
    """Publishes batches of KV events on ``endpoint`` (and answers replays on ``replay_endpoint``) between
    :meth:`start` and :meth:`close`."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = REPLAY_BATCHES) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.sequence = 0
        """The next batch's sequence number."""
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind the sockets (on the running event loop); InputError names the option whose address fails."""
        context = zmq.asyncio.Context()
        try:
            self._pub = self._bind(context, zmq.PUB, self.endpoint, "--kv-events")
            if self.replay_endpoint is not None:
                self._replay = self._bind(context, zmq.ROUTER, self.replay_endpoint, "--kv-events-replay")
        except InputError:
            context.destroy(linger=0)
            raise
        self._context = context
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replays(self._replay), name="kv-events-replay")

    @staticmethod
    def _bind(context: zmq.asyncio.Context, kind: int, endpoint: str, flag: str) -> zmq.asyncio.Socket:
        socket = context.socket(kind)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise InputError(f"cannot bind {endpoint!r}: {exc}; expected a free ZMQ address such as "
                             f"tcp://127.0.0.1:5557", field=flag) from exc
        return socket

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send one batch (one engine step's events) and keep it for replays."""
        frames = encode(self.topic, self.sequence, events)
        self._buffer.append((self.sequence, frames[2]))
        self.sequence += 1
        if self._pub is not None:
            self._pub.send_multipart(frames)  # completes at once: a PUB socket drops rather than blocks

    async def close(self) -> None:
        """Stop answering replays and close the sockets without waiting for unsent messages."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        if self._context is not None:
            self._context.destroy(linger=0)
        self._context = self._pub = self._replay = None

    async def _serve_replays(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:  # vLLM ignores a malformed request too
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            buffer = self._buffer
            skip = max(start - buffer[0][0], 0) if buffer else 0
            for sequence, payload in list(islice(buffer, skip, None)):  # a copy: publishing goes on meanwhile
                await socket.send_multipart([identity, b"", self.topic, sequence.to_bytes(8, "big"), payload])
            await socket.send_multipart([identity, b"", b"", END_SEQUENCE, b""])
