"""A memo in front of any step-latency model, keyed by a coarsened StepShape.

A simulation asks for hundreds of thousands of step times whose shapes differ
only in the last digits of their token sums. Keeping 8 significant bits of each
sum (≤ 0.4 % error, far below any model's accuracy) makes shapes repeat, so the
underlying model (the roofline costs about 20 µs a call) runs once per class. The
model is asked at the class's midpoint, so answers do not depend on call order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetsched.perf.step import OpTime, StepLatencyModel, StepShape

SIGNIFICANT_BITS = 8
MAX_ENTRIES = 500_000


def _coarse(value: int) -> tuple[int, int]:
    shift = max(0, value.bit_length() - SIGNIFICANT_BITS)
    return value >> shift, shift


def _mid(q: int, shift: int) -> int:
    return (q << shift) + ((1 << shift) >> 1)


@dataclass
class MemoizedStepModel:
    """``step_time`` of ``model`` on coarsened shapes; ``breakdown`` passes through."""

    model: StepLatencyModel
    _memo: dict[tuple[int, ...], float] = field(default_factory=dict, repr=False)

    def step_time(self, shape: StepShape) -> float:
        pt, pt_s = _coarse(shape.prefill_tokens)
        pa, pa_s = _coarse(int(shape.prefill_attention_pairs))
        pk, pk_s = _coarse(shape.prefill_kv_tokens)
        dk, dk_s = _coarse(shape.decode_kv_tokens)
        key = (pt, pt_s, shape.prefill_seqs, pa, pa_s, pk, pk_s, shape.decode_seqs, dk, dk_s)
        seconds = self._memo.get(key)
        if seconds is None:
            if len(self._memo) >= MAX_ENTRIES:
                self._memo.clear()
            seconds = self.model.step_time(StepShape(
                prefill_tokens=_mid(pt, pt_s), prefill_seqs=shape.prefill_seqs,
                prefill_attention_pairs=float(_mid(pa, pa_s)), prefill_kv_tokens=_mid(pk, pk_s),
                decode_seqs=shape.decode_seqs, decode_kv_tokens=_mid(dk, dk_s)))
            self._memo[key] = seconds
        return seconds

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        return self.model.breakdown(shape)
