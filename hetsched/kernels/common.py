"""Pieces shared by the Triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether matrix products of ``dtype`` operands must be taken in fp32.

    Triton's interpreter multiplies bf16 operands as their raw 16-bit patterns
    (it holds them as uint16), so under ``TRITON_INTERPRET=1`` bf16 tiles are
    converted to fp32 first; compiled kernels keep bf16 tensor-core products.
    """
    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation (see ``upcast_dots``)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)
