"""Reference step shapes for showing a profile, and a side-by-side with another step-latency model."""

from __future__ import annotations

from hetsched.perf.step import StepLatencyModel, StepShape

REFERENCE_SHAPES: tuple[tuple[str, StepShape], ...] = (
    ("prefill 1×512", StepShape.build(prefill=[(512, 0)])),
    ("prefill 1×2048", StepShape.build(prefill=[(2048, 0)])),
    ("prefill 4×512 after 1k cached", StepShape.build(prefill=[(512, 1024)] * 4)),
    ("decode 1 @ 1k ctx", StepShape.build(decode_contexts=[1024])),
    ("decode 32 @ 1k ctx", StepShape.build(decode_contexts=[1024] * 32)),
    ("decode 128 @ 4k ctx", StepShape.build(decode_contexts=[4096] * 128)),
    ("mixed 512 + 32 @ 1k", StepShape.build(prefill=[(512, 0)], decode_contexts=[1024] * 32)),
)


def step_table(models: dict[str, StepLatencyModel]) -> list[list[object]]:
    """Rows of (shape, tokens, milliseconds per model, …) over the reference shapes."""
    return [[label, shape.tokens, *(m.step_time(shape) * 1e3 for m in models.values())]
            for label, shape in REFERENCE_SHAPES]
