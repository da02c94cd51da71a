"""Causal prefill attention, flash-style: tiled over queries and keys with an online softmax.

One program owns BLOCK_M queries of one head of one sequence and streams the
sequence's keys in BLOCK_N tiles, keeping a running max and sum so the score
matrix never exists in full. Sequences are packed (varlen, ``cu_seqlens``)
and may extend a cached prefix; grouped-query heads read their shared KV head;
sliding-window layers skip tiles that fall outside every query's window.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hetsched.errors import InputError
from hetsched.kernels.common import mma, upcast_dots
from hetsched.kernels.device import require_triton_device

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, qk_scale, window, head_dim, group,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start
    kv_head = head // group

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    pos = k_len - q_len + rows
    q = tl.load(q_ptr + (q_start + rows[:, None]).to(tl.int64) * stride_qt + head * stride_qh + dims[None, :],
                mask=(rows[:, None] < q_len) & (dims[None, :] < head_dim), other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    last_pos = k_len - q_len + tl.minimum((block + 1) * BLOCK_M, q_len) - 1
    hi = last_pos + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(k_len - q_len + block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_rows = (k_start + cols).to(tl.int64)
        k_mask = (cols[None, :] < k_len) & (dims[:, None] < head_dim)
        k = tl.load(k_ptr + kv_rows[None, :] * stride_kt + kv_head * stride_kh + dims[:, None], mask=k_mask, other=0.0)
        s = mma(q, k, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST) * qk_scale
        visible = (cols[None, :] <= pos[:, None]) & (cols[None, :] < k_len)
        if HAS_WINDOW:
            visible &= pos[:, None] - cols[None, :] < window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=(cols[:, None] < k_len) & (dims[None, :] < head_dim), other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + (q_start + rows[:, None]).to(tl.int64) * stride_ot + head * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(rows[:, None] < q_len) & (dims[None, :] < head_dim))


def check_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise InputError(f"expected q [tokens, heads, d] and k, v [context, kv_heads, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}", field="k")
    if q.shape[1] % k.shape[1]:
        raise InputError(f"kv_heads ({k.shape[1]}) must divide heads ({q.shape[1]})", field="k")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise InputError("cu_seqlens_q and cu_seqlens_k must both be [batch + 1]", field="cu_seqlens_k")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                      sm_scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of packed new tokens over their contexts.

    q [total_new, heads, d]; k, v [total_context, kv_heads, d]; sequence s
    owns rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and the matching
    ``cu_seqlens_k`` rows of k and v, its new tokens last.
    """
    check_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    require_triton_device(q, k, v, interpreting=triton.knobs.runtime.interpret)
    if window is not None and window < 1:
        raise InputError(f"window must be a positive number of tokens, got {window}", field="window")
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if len(cu_seqlens_q) > 1 else 0
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or max_seqlen_q == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 128 if max_seqlen_q > 64 and block_d <= 128 else 64 if max_seqlen_q > 16 else 16
    block_n = 64 if block_d <= 128 else 32
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    grid = (triton.cdiv(max_seqlen_q, block_m), heads, batch)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * LOG2E, window or 0, head_dim, heads // k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HAS_WINDOW=window is not None, UPCAST=upcast_dots(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=8 if block_m == 128 else 4, num_stages=2)
    return out
