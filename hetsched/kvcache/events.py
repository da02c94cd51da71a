"""vLLM's KV-cache events on the wire: decoding what an engine publishes, encoding what the simulated worker
publishes.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``
sends each batch as a ZMQ multipart message ``[topic, sequence, payload]``: the sequence is an 8-byte big-endian
counter from 0, the payload a msgpack ``EventBatch`` array ``[ts, events, data_parallel_rank]`` (the rank left
out when unset). Each event is a msgpack map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) with the fields below; earlier vLLM versions sent events as arrays ``[tag, *fields]`` in
field order, which :func:`decode` reads too. A replay socket (ROUTER) answers a request ``[b"", start]`` (the
first sequence wanted, 8 bytes big-endian) with every batch it still holds from there, each ``[b"", topic,
sequence, payload]``, then ``[b"", b"", END_SEQUENCE, b""]``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from hetsched.kvcache.hashing import LOW_64, external

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's marker after the last batch it holds."""

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
REMOVED_FIELDS = ("block_hashes", "medium")


class MalformedEvents(ValueError):
    """A message that is not a KV-event batch; ``reason`` is the counter it is filed under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    sequence: int
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & LOW_64
    if isinstance(value, bytes):
        return external(value)
    raise MalformedEvents("schema", f"expected a block hash (int or bytes), got {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise MalformedEvents("schema", f"expected a list of block hashes, got {type(value).__name__}")
    if value and all(type(h) is int for h in value):
        return tuple(h & LOW_64 for h in value)
    return tuple(_hash(h) for h in value)


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """The event's tag and its fields by name, from either wire form."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        return (tag if isinstance(tag, str) else ""), raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:]))
    raise MalformedEvents("schema", f"expected an event (a map or an array), got {type(raw).__name__}")


def _event(raw: Any) -> KVEvent:
    tag = raw.get("type") if isinstance(raw, dict) else raw[0] if isinstance(raw, list) and raw else None
    if tag == "BlockStored":
        _, f = _fields(raw, STORED_FIELDS)
        size, parent, tokens = f.get("block_size"), f.get("parent_block_hash"), f.get("token_ids", [])
        if not isinstance(size, int) or size < 1:
            raise MalformedEvents("schema", f"BlockStored.block_size: expected a positive int, got {size!r}")
        if not isinstance(tokens, list):
            raise MalformedEvents("schema", "BlockStored.token_ids: expected a list")
        lora = f.get("lora_name")
        return BlockStored(_hashes(f.get("block_hashes")), None if parent is None else _hash(parent),
                           tuple(tokens), size, f.get("medium") or MEDIUM_GPU, lora if isinstance(lora, str) else None)
    if tag == "BlockRemoved":
        _, f = _fields(raw, REMOVED_FIELDS)
        return BlockRemoved(_hashes(f.get("block_hashes")), f.get("medium") or MEDIUM_GPU)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvents("unknown_tag", f"unknown KV event tag {tag!r}")


def decode(frames: Sequence[bytes]) -> tuple[bytes, EventBatch]:
    """The topic and batch of one published message ``[topic, sequence, payload]``."""
    if len(frames) != 3:
        raise MalformedEvents("frames", f"expected 3 frames (topic, sequence, payload), got {len(frames)}")
    topic, sequence, payload = frames
    if len(sequence) != 8:
        raise MalformedEvents("frames", f"expected an 8-byte sequence number, got {len(sequence)} bytes")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedEvents("msgpack", f"undecodable msgpack payload: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedEvents("schema", "expected an EventBatch array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return topic, EventBatch(int.from_bytes(sequence, "big"), float(ts) if isinstance(ts, (int, float)) else 0.0,
                             tuple(_event(e) for e in events), rank)


def _wire(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode(topic: bytes, sequence: int, events: Sequence[KVEvent], *, ts: float | None = None,
           data_parallel_rank: int | None = None) -> list[bytes]:
    """One message as vLLM publishes it (see the module docstring)."""
    batch: list[Any] = [time.time() if ts is None else ts, [_wire(e) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return [topic, sequence.to_bytes(8, "big"), msgpack.packb(batch, use_bin_type=True)]
