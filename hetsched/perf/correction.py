"""A step model corrected per phase: what the fleet observed, laid over what the catalog predicts.

A correction scales the prefill and the decode share of a step on their own (a device's compute and its memory
bandwidth can each be off), adds a fixed time per step (the engine's scheduler and sampler) and a fixed time per
request before its first step (the API server). Predicted times stay linear in these four numbers, which is what
lets :mod:`hetsched.perf.online` estimate them with a Kalman filter.

A step's *prefill share* is the base model's step time × ``T(prefill part) / (T(prefill part) + T(decode part))``,
the decode share the rest: a pure prefill or pure decode step is scaled by its phase's factor alone, a mixed one by
the blend of both.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetsched.perf.step import OpTime, StepLatencyModel, StepShape

PHASE_PARTS = 4
"""Length of a :data:`Parts` vector: prefill seconds, decode seconds, steps, requests."""

Parts = tuple[float, float, float, float]
"""A predicted time as the base model's prefill seconds, its decode seconds, the number of steps and of requests
it spans: the corrected time is their dot product with :meth:`StepCorrection.vector`."""


@dataclass(frozen=True)
class StepCorrection:
    """Per-phase factors over a base step model, and the fixed times it does not model."""

    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0

    def vector(self) -> Parts:
        return (self.prefill_scale, self.decode_scale, self.step_overhead_s, self.request_overhead_s)

    @classmethod
    def of(cls, vector: tuple[float, ...] | list[float]) -> StepCorrection:
        prefill, decode, step, request = vector
        return cls(float(prefill), float(decode), float(step), float(request))

    def seconds(self, parts: Parts) -> float:
        """The corrected time of a prediction given as parts."""
        return (self.prefill_scale * parts[0] + self.decode_scale * parts[1] + self.step_overhead_s * parts[2]
                + self.request_overhead_s * parts[3])

    @property
    def identity(self) -> bool:
        return self == IDENTITY


IDENTITY = StepCorrection()


def phase_split(model: StepLatencyModel, shape: StepShape) -> tuple[float, float]:
    """The base step time of ``shape`` as (prefill share, decode share) seconds."""
    total = model.step_time(shape)
    if not shape.decode_seqs:
        return total, 0.0
    if not shape.prefill_tokens:
        return 0.0, total
    prefill = model.step_time(StepShape(prefill_tokens=shape.prefill_tokens, prefill_seqs=shape.prefill_seqs,
                                        prefill_attention_pairs=shape.prefill_attention_pairs,
                                        prefill_kv_tokens=shape.prefill_kv_tokens))
    decode = model.step_time(StepShape(decode_seqs=shape.decode_seqs, decode_kv_tokens=shape.decode_kv_tokens))
    share = prefill / (prefill + decode) if prefill + decode > 0 else 0.0
    return total * share, total * (1.0 - share)


def step_parts(model: StepLatencyModel, shape: StepShape) -> Parts:
    """One step of ``shape`` as parts: its base prefill and decode shares, one step, no request."""
    prefill, decode = phase_split(model, shape)
    return prefill, decode, 1.0, 0.0


@dataclass(frozen=True)
class CorrectedStepModel:
    """``base`` with ``correction`` applied to every step (the per-request overhead is not a step's: callers add
    it where a request starts)."""

    base: StepLatencyModel
    correction: StepCorrection

    def step_time(self, shape: StepShape) -> float:
        prefill, decode = phase_split(self.base, shape)
        c = self.correction
        return c.prefill_scale * prefill + c.decode_scale * decode + c.step_overhead_s

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        prefill, decode = phase_split(self.base, shape)
        total = prefill + decode
        c = self.correction
        factor = (c.prefill_scale * prefill + c.decode_scale * decode) / total if total > 0 else 1.0
        ops = [OpTime(op.op, op.seconds * factor, op.flops, op.bytes, op.bound) for op in self.base.breakdown(shape)]
        if c.step_overhead_s:
            ops.append(OpTime("step_overhead", c.step_overhead_s, 0.0, 0.0, "fixed"))
        return ops


def corrected(model: StepLatencyModel, correction: StepCorrection | None) -> StepLatencyModel:
    """``model`` under ``correction``; the model itself when there is none."""
    if correction is None or correction.identity:
        return model
    return CorrectedStepModel(model, correction)
