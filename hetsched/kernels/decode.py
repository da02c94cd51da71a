"""Paged decode attention (GQA, and MLA over the latent cache), flash-decoding style.

Each sequence decodes one token against a KV cache stored in fixed-size
blocks that a block table maps to physical blocks. Stage one splits every
sequence's blocks into ``num_splits`` ranges and lets one program attend over
each range, writing a partial output and its log-sum-exp; stage two merges
the partials. Splitting keeps the device busy when there are few sequences
but long contexts. In the GQA kernel one program serves all query heads of a
KV head, so each cached block is read once per group; in the MLA kernel one
program serves BLOCK_H heads, which all share the single latent cache.
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
TARGET_PROGRAMS = 128
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 32


def kv_splits(programs: int, max_blocks: int) -> int:
    """How many ranges to split each sequence's blocks into so that about TARGET_PROGRAMS programs run."""
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(programs, 1))
    by_length = triton.cdiv(max_blocks, MIN_BLOCKS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@triton.jit
def _split_range(lens_ptr, seq, split, num_splits, BLOCK_SIZE: tl.constexpr):
    """The context length of ``seq`` and the block range [first, last) of its split ``split``."""
    context = tl.load(lens_ptr + seq)
    blocks = tl.cdiv(context, BLOCK_SIZE)
    per_split = tl.cdiv(blocks, num_splits)
    first = split * per_split
    return context, first, tl.minimum(first + per_split, blocks)


@triton.jit
def _gqa_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
                       qk_scale, head_dim, group, num_splits,
                       stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                       stride_table, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                       UPCAST: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context, first, last = _split_range(lens_ptr, seq, split, num_splits, BLOCK_SIZE)
    members = tl.arange(0, BLOCK_G)
    heads = kv_head * group + members
    dims = tl.arange(0, BLOCK_D)
    tokens = tl.arange(0, BLOCK_SIZE)
    head_mask = (members[:, None] < group) & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_mask, other=0.0)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for block in range(first, last):
        physical = tl.load(table_ptr + seq * stride_table + block).to(tl.int64)
        valid = block * BLOCK_SIZE + tokens < context
        kv_mask = valid[:, None] & (dims[None, :] < head_dim)
        k = tl.load(k_ptr + physical * stride_kb + tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), tl.zeros((BLOCK_G, BLOCK_SIZE), dtype=tl.float32), UPCAST) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + physical * stride_vb + tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    _store_partial(mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, seq, heads, split, members < group, dims, head_dim,
                   stride_mb, stride_mh, stride_ms, stride_lb, stride_lh)


@triton.jit
def _store_partial(mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, seq, heads, split, head_mask, dims, width,
                   stride_mb, stride_mh, stride_ms, stride_lb, stride_lh):
    """Write one split's normalised output and its log2-sum-exp (-inf for an empty split)."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(mid_o_ptr + seq * stride_mb + heads[:, None] * stride_mh + split * stride_ms + dims[None, :], out,
             mask=head_mask[:, None] & (dims[None, :] < width))
    tl.store(mid_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _merge_kernel(mid_o_ptr, mid_lse_ptr, o_ptr, width, num_splits,
                  stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(mid_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=splits < num_splits,
                  other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(mid_o_ptr + seq * stride_mb + head * stride_mh + splits[:, None] * stride_ms + dims[None, :],
                    mask=(splits[:, None] < num_splits) & (dims[None, :] < width), other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + dims, out.to(o_ptr.dtype.element_ty), mask=dims < width)


def _merge(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    batch, heads, splits, width = mid_o.shape
    _merge_kernel[(batch, heads)](
        mid_o, mid_lse, out, width, splits, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(width), num_warps=4)
    return out


def _check_pages(block_table: torch.Tensor, context_lens: torch.Tensor, batch: int, block_size: int) -> None:
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise InputError(f"expected block_table [{batch}, max_blocks], got {tuple(block_table.shape)}",
                         field="block_table")
    if context_lens.shape != (batch,):
        raise InputError(f"expected context_lens [{batch}], got {tuple(context_lens.shape)}", field="context_lens")
    if block_size < 16 or block_size & (block_size - 1):
        raise InputError(f"the Triton kernel needs a power-of-two block size of at least 16, got {block_size}",
                         field="block_size")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           sm_scale: float | None = None) -> torch.Tensor:
    """One new token per sequence over its paged KV cache.

    q [batch, heads, d]; k_cache, v_cache [num_blocks, block_size, kv_heads, d];
    block_table [batch, max_blocks] and context_lens [batch] (int32). Returns [batch, heads, d].
    """
    batch, heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise InputError(f"expected k_cache and v_cache [num_blocks, block_size, kv_heads, {head_dim}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}", field="k_cache")
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if heads % kv_heads:
        raise InputError(f"kv_heads ({kv_heads}) must divide heads ({heads})", field="k_cache")
    _check_pages(block_table, context_lens, batch, block_size)
    require_triton_device(q, k_cache, v_cache, interpreting=triton.knobs.runtime.interpret)
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    group = heads // kv_heads
    splits = kv_splits(batch * kv_heads, block_table.shape[1])
    mid_o = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    _gqa_decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_table, context_lens, mid_o, mid_lse, scale * LOG2E, head_dim, group, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        UPCAST=upcast_dots(q.dtype), BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4, num_stages=2)
    return _merge(mid_o, mid_lse, torch.empty_like(q))


@triton.jit
def _mla_decode_kernel(q_ptr, c_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
                       qk_scale, heads, rank, rope_dim, num_splits,
                       stride_qb, stride_qh, stride_cb, stride_ct, stride_table,
                       stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                       UPCAST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context, first, last = _split_range(lens_ptr, seq, split, num_splits, BLOCK_SIZE)
    heads_here = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    latent_dims = tl.arange(0, BLOCK_R)
    rope_dims = tl.arange(0, BLOCK_P)
    tokens = tl.arange(0, BLOCK_SIZE)
    head_mask = heads_here < heads
    q_row = q_ptr + seq * stride_qb + heads_here[:, None] * stride_qh
    q_latent = tl.load(q_row + latent_dims[None, :], mask=head_mask[:, None] & (latent_dims[None, :] < rank),
                       other=0.0)
    q_rope = tl.load(q_row + rank + rope_dims[None, :], mask=head_mask[:, None] & (rope_dims[None, :] < rope_dim),
                     other=0.0)

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for block in range(first, last):
        physical = tl.load(table_ptr + seq * stride_table + block).to(tl.int64)
        valid = block * BLOCK_SIZE + tokens < context
        row = c_ptr + physical * stride_cb + tokens[:, None] * stride_ct
        latent = tl.load(row + latent_dims[None, :], mask=valid[:, None] & (latent_dims[None, :] < rank), other=0.0)
        rope_key = tl.load(row + rank + rope_dims[None, :], mask=valid[:, None] & (rope_dims[None, :] < rope_dim),
                           other=0.0)
        s = mma(q_latent, tl.trans(latent), tl.zeros((BLOCK_H, BLOCK_SIZE), dtype=tl.float32), UPCAST)
        s = mma(q_rope, tl.trans(rope_key), s, UPCAST) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(latent.dtype), latent, acc * alpha[:, None], UPCAST)
        m_i = m_new
    _store_partial(mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, seq, heads_here, split, head_mask, latent_dims, rank,
                   stride_mb, stride_mh, stride_ms, stride_lb, stride_lh)


MLA_BLOCK_H = 16


def mla_decode_attention(q: torch.Tensor, latent_cache: torch.Tensor, *, block_table: torch.Tensor,
                         context_lens: torch.Tensor, kv_lora_rank: int,
                         sm_scale: float | None = None) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache.

    q [batch, heads, kv_lora_rank + rope_dim]; latent_cache [num_blocks,
    block_size, kv_lora_rank + rope_dim]; scores use the whole width, values
    are the first kv_lora_rank columns. Returns [batch, heads, kv_lora_rank].
    """
    batch, heads, width = q.shape
    if latent_cache.dim() != 3 or latent_cache.shape[2] != width or not 0 < kv_lora_rank < width:
        raise InputError(f"expected latent_cache [num_blocks, block_size, {width}] with {width} = kv_lora_rank "
                         f"({kv_lora_rank}) + rope_dim, got {tuple(latent_cache.shape)}", field="latent_cache")
    block_size = latent_cache.shape[1]
    _check_pages(block_table, context_lens, batch, block_size)
    require_triton_device(q, latent_cache, interpreting=triton.knobs.runtime.interpret)
    q, latent_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, latent_cache))
    rope_dim = width - kv_lora_rank
    head_blocks = triton.cdiv(heads, MLA_BLOCK_H)
    splits = kv_splits(batch * head_blocks, block_table.shape[1])
    mid_o = torch.empty((batch, heads, splits, kv_lora_rank), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(width)
    _mla_decode_kernel[(batch, head_blocks, splits)](
        q, latent_cache, block_table, context_lens, mid_o, mid_lse, scale * LOG2E, heads, kv_lora_rank, rope_dim,
        splits, q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        UPCAST=upcast_dots(q.dtype), BLOCK_H=MLA_BLOCK_H, BLOCK_SIZE=block_size,
        BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)), BLOCK_P=max(16, triton.next_power_of_2(rope_dim)),
        num_warps=4, num_stages=2)
    return _merge(mid_o, mid_lse, q.new_empty(batch, heads, kv_lora_rank))
