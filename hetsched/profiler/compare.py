"""Reference step shapes for showing a profile, and a side-by-side with another step-latency model."""

from __future__ import annotations

from dataclasses import dataclass

from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.profiler.profile import Profile

REFERENCE_SHAPES: tuple[tuple[str, StepShape], ...] = (
    ("prefill 1×512", StepShape.build(prefill=[(512, 0)])),
    ("prefill 1×2048", StepShape.build(prefill=[(2048, 0)])),
    ("prefill 4×512 after 1k cached", StepShape.build(prefill=[(512, 1024)] * 4)),
    ("decode 1 @ 1k ctx", StepShape.build(decode_contexts=[1024])),
    ("decode 32 @ 1k ctx", StepShape.build(decode_contexts=[1024] * 32)),
    ("decode 128 @ 4k ctx", StepShape.build(decode_contexts=[4096] * 128)),
    ("mixed 512 + 32 @ 1k", StepShape.build(prefill=[(512, 0)], decode_contexts=[1024] * 32)),
)


@dataclass(frozen=True)
class StepTimes:
    """One reference shape's step time under each model, in milliseconds, in the models' order."""

    label: str
    tokens: int
    ms: tuple[float, ...]


def step_table(models: dict[str, StepLatencyModel]) -> list[StepTimes]:
    """Each reference shape's step time under each of ``models``."""
    return [StepTimes(label, shape.tokens, tuple(m.step_time(shape) * 1e3 for m in models.values()))
            for label, shape in REFERENCE_SHAPES]


def extrapolation(profile: Profile, shape: StepShape) -> str | None:
    """Why ``profile`` only extrapolates at ``shape``, or None where it measured that far.

    A load-tested profile states how far its test reached (``sweep["measured"]``): a step with more sequences
    decoding, a longer prefill or a longer context than that is a guess from a curve, however exact it prints.
    """
    measured = profile.sweep.get("measured")
    if not measured:
        return None
    reasons = []
    if shape.decode_seqs > measured["decode_seqs"]:
        reasons.append(f"{shape.decode_seqs} sequences decoding, measured up to {measured['decode_seqs']:g}")
    if shape.prefill_tokens > measured["prefill_tokens"]:
        reasons.append(f"{shape.prefill_tokens} prefill tokens, measured up to {measured['prefill_tokens']:g}")
    longest = max(shape.prefill_kv_tokens / max(shape.prefill_seqs, 1),
                  shape.decode_kv_tokens / max(shape.decode_seqs, 1))
    if longest > measured["context_tokens"]:
        reasons.append(f"context of {longest:g} tokens, measured up to {measured['context_tokens']:g}")
    return "; ".join(reasons) or None
