"""The step-latency interface shared by the roofline model and measured profiles."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Protocol


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes, in aggregates a scheduler can keep cheaply.

    A prefill chunk of ``c`` new tokens after ``p`` cached tokens contributes
    ``c`` to ``prefill_tokens``, ``c·p + c·(c+1)/2`` to ``prefill_attention_pairs``
    and ``p + c`` to ``prefill_kv_tokens``. Each decoding sequence contributes
    one token and its context length to ``decode_kv_tokens``.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention_pairs: float = 0.0
    prefill_kv_tokens: int = 0
    decode_seqs: int = 0
    decode_kv_tokens: int = 0

    @classmethod
    def build(cls, *, prefill: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()) -> StepShape:
        """From ``(new_tokens, cached_tokens)`` prefill chunks and decode context lengths."""
        return cls(
            prefill_tokens=sum(c for c, _ in prefill),
            prefill_seqs=len(prefill),
            prefill_attention_pairs=sum(c * p + c * (c + 1) / 2 for c, p in prefill),
            prefill_kv_tokens=sum(c + p for c, p in prefill),
            decode_seqs=len(decode_contexts),
            decode_kv_tokens=sum(decode_contexts),
        )

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def prefill_causal_pairs(self) -> float:
        """The new tokens' pairs among themselves, the rest being pairs with a cached prefix.

        Exact for one chunk and for chunks of equal size: the shape keeps only sums.
        """
        if not self.prefill_seqs:
            return 0.0
        return min(self.prefill_attention_pairs, causal_pairs(self.prefill_tokens, self.prefill_seqs))


def causal_pairs(new_tokens: float, chunks: int = 1) -> float:
    """Attention pairs of ``new_tokens`` among themselves, cut into ``chunks`` of equal size."""
    return new_tokens * (new_tokens / chunks + 1) / 2


@dataclass(frozen=True)
class OpTime:
    """One operator's share of a step."""

    op: str
    seconds: float
    flops: float
    bytes: float
    bound: str  # "compute", "memory", "network" or "fixed"


class StepLatencyModel(Protocol):
    """Predicts how long one engine step takes on one replica."""

    def step_time(self, shape: StepShape) -> float:
        """Seconds for the step."""
        ...

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        """Per-operator times that add up to ``step_time``."""
        ...
