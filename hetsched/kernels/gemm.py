"""Tiled Triton GEMM: bf16/fp16 (or fp8 e4m3 with scales) in, fp32 accumulate.

Computes ``a @ b.T`` for activations a [m, k] and a weight b [n, k]. Output
tiles are visited in groups of ``GROUP_M`` row blocks so that neighbouring
programs share weight tiles in L2. Tile sizes follow the shape: decode-sized
m uses thin row blocks, prefill-sized m square 128-wide ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hetsched.errors import BackendUnavailableError
from hetsched.kernels.common import mma, upcast_dots
from hetsched.kernels.device import fp8_dtype, require_triton_device
from hetsched.kernels.reference import check_gemm, is_fp8


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                 stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                 UPCAST: tl.constexpr, HAS_SCALES: tl.constexpr, A_SCALE_PER_ROW: tl.constexpr, B_SCALE_PER_ROW: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rows[:, None] < M) & (ks[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(cols[None, :] < N) & (ks[:, None] + k0 < K), other=0.0)
        acc = mma(a, b, acc, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_SCALES:
        if A_SCALE_PER_ROW:
            acc *= tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
        else:
            acc *= tl.load(a_scale_ptr)
        if B_SCALE_PER_ROW:
            acc *= tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        else:
            acc *= tl.load(b_scale_ptr)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@dataclass(frozen=True)
class GemmTiles:
    """Launch configuration of one GEMM."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def gemm_tiles(m: int, n: int, k: int, *, fp8: bool, sm_count: int) -> GemmTiles:
    """Tile sizes for an m × n × k product on a device with ``sm_count`` multiprocessors.

    Decode-sized m gets thin row blocks, and narrower column blocks when wide
    ones would leave multiprocessors idle (these GEMMs stream the weight once,
    so every unit should pull on memory); prefill-sized m gets 128 × 128 tiles.
    """
    block_k = min(128 if fp8 else 64, max(16, triton.next_power_of_2(k)))
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    if m > 64:
        return GemmTiles(128, block_n, block_k, num_warps=8, num_stages=3)
    block_m = max(16, triton.next_power_of_2(m))
    if block_n > 64 and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < sm_count:
        block_n = 64
    return GemmTiles(block_m, block_n, block_k, num_warps=4, num_stages=4)


INTERPRETER_SM_COUNT = 132
"""What the tile heuristic assumes for CPU tensors under the interpreter (an H100's count)."""


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


def gemm(a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor | None = None,
         b_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b.T`` with fp32 accumulation; fp8 operands are scaled per row ([m], [n]) or per tensor ([1])."""
    out_dtype = check_gemm(a, b, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype)
    interpreting = triton.knobs.runtime.interpret
    require_triton_device(a, b, interpreting=interpreting)
    fp8 = is_fp8(a.dtype)
    if fp8 and not interpreting and fp8_dtype(a.device) != a.dtype:
        raise BackendUnavailableError(f"{a.device} has no native {a.dtype} matrix multiply; "
                                      f"supported here: {fp8_dtype(a.device) or 'no fp8'}")
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tiles = gemm_tiles(m, n, k, fp8=fp8, sm_count=_sm_count(a.device))
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    # check_gemm gave fp8 operands both scales and others none; without scales the kernel reads a, b in their place
    _gemm_kernel[grid](
        a, b, c, a if a_scale is None else a_scale, b if b_scale is None else b_scale, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        UPCAST=upcast_dots(a.dtype), HAS_SCALES=fp8,
        A_SCALE_PER_ROW=a_scale is not None and a_scale.numel() == m and m > 1,
        B_SCALE_PER_ROW=b_scale is not None and b_scale.numel() == n and n > 1,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return c
