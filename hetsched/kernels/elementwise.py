"""Row-wise Triton kernels: RMSNorm (with the fused residual add) and SiLU-and-multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetsched.kernels.device import require_triton_device
from hetsched.kernels.reference import check_rms_norm, check_silu_and_mul


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_ro + cols, h.to(residual_out_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [tokens, hidden]; with ``residual``, of x + residual, returning (normalised, x + residual)."""
    check_rms_norm(x, weight, residual=residual)
    require_triton_device(x, weight, interpreting=triton.knobs.runtime.interpret)
    x = x.contiguous() if x.stride(-1) != 1 else x
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    residual_in = residual if residual is not None else x
    block = triton.next_power_of_2(x.shape[-1])
    _rms_norm_kernel[(x.shape[0],)](
        x, residual_in, weight, out, residual_out, x.shape[-1], eps,
        x.stride(0), residual_in.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up for x [tokens, 2·inter] holding gate then up; returns [tokens, inter]."""
    check_silu_and_mul(x)
    require_triton_device(x, interpreting=triton.knobs.runtime.interpret)
    x = x.contiguous() if x.stride(-1) != 1 else x
    inter = x.shape[-1] // 2
    out = x.new_empty(x.shape[0], inter)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out
