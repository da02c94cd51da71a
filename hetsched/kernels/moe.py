"""Fused mixture-of-experts: top-k routing and one grouped GEMM launch over all experts.

The steps follow vLLM's fused MoE:

1. router logits (the Triton GEMM, in fp32) → softmax, top-k, renormalise
   (one routing kernel, a program per token);
2. the (token, slot) assignments are sorted by expert and each expert's run
   is padded to a multiple of BLOCK_M, so every row block of the sorted list
   belongs to one expert (``align_by_expert``, torch ops, no host sync);
3. grouped GEMM over the blocks: gate-up projection of the routed tokens,
   SiLU-and-multiply, then the down projection scaled by the routing weight;
4. the top_k rows of each token are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hetsched.kernels.common import mma, upcast_dots
from hetsched.kernels.device import require_triton_device
from hetsched.kernels.elementwise import silu_and_mul
from hetsched.kernels.gemm import gemm
from hetsched.kernels.reference import check_moe, check_top_k


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, experts, stride_l, stride_w, stride_i,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < experts
    logits = tl.load(logits_ptr + token * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    remaining = tl.where(mask, probs, -1.0)
    total = 0.0
    if RENORMALIZE:
        for _ in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=0)
            total += best
            remaining = tl.where(cols == tl.argmax(remaining, axis=0), -1.0, remaining)
        remaining = tl.where(mask, probs, -1.0)
    else:
        total = 1.0
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0)
        tl.store(weights_ptr + token * stride_w + slot, tl.max(remaining, axis=0) / total)
        tl.store(ids_ptr + token * stride_i + slot, best.to(tl.int32))
        remaining = tl.where(cols == best, -1.0, remaining)


def route_topk(logits: torch.Tensor, *, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, the best ``top_k`` (fp32 weights, int32 ids, best first), optionally renormalised."""
    check_top_k(logits, top_k)
    require_triton_device(logits, interpreting=triton.knobs.runtime.interpret)
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        _route_topk_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), weights.stride(0),
                                      ids.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
                                      BLOCK_E=triton.next_power_of_2(experts), num_warps=1)
    return weights, ids


@dataclass(frozen=True)
class ExpertBlocks:
    """(token, slot) assignments sorted by expert, each expert's run padded to a multiple of ``block_m``.

    ``sorted_ids`` holds flat assignment indices (token·top_k + slot), with
    ``num_assignments`` marking padding; ``expert_of_block[b]`` is the expert
    of rows ``b·block_m …``; ``padded_total`` (a 1-element device tensor) is
    how many rows of ``sorted_ids`` are in use. The launch grid covers an
    upper bound of blocks so nothing waits on the device.
    """

    sorted_ids: torch.Tensor
    expert_of_block: torch.Tensor
    padded_total: torch.Tensor
    block_m: int
    num_assignments: int


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the flat assignments of ``expert_ids`` [tokens, top_k] by expert and pad each run to ``block_m``."""
    flat = expert_ids.flatten().long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank_in_expert = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(padded_ends - padded)[by_expert] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    expert_of_block = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_ids=sorted_ids, expert_of_block=expert_of_block.to(torch.int32),
                        padded_total=padded_ends[-1:].to(torch.int32), block_m=block_m, num_assignments=n)


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_of_block_ptr, padded_total_ptr,
                         N, K, num_assignments, a_row_divisor,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         SCALE_BY_WEIGHT: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // blocks_n, pid % blocks_n
    if pid_m * BLOCK_M >= tl.load(padded_total_ptr):
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + slots)
    real = ids < num_assignments
    expert = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
    a_rows = (ids // a_row_divisor).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=real[:, None] & (ks[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(cols[None, :] < N) & (ks[:, None] + k0 < K), other=0.0)
        acc = mma(a, b, acc, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALE_BY_WEIGHT:
        acc *= tl.load(weights_ptr + ids, mask=real, other=0.0)[:, None]
    c_ptrs = c_ptr + ids[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols[None, :] < N))


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, blocks: ExpertBlocks, *, a_row_divisor: int,
                 routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``i`` of the result is ``a[i // a_row_divisor] @ weights[expert of i].T`` for every assignment i,
    scaled by ``routing_weights[i]`` when given; one launch over all experts."""
    _, n, k = weights.shape
    out = a.new_empty((blocks.num_assignments, n))
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (blocks.expert_of_block.numel() * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a, weights, out, routing_weights if routing_weights is not None else a, blocks.sorted_ids,
        blocks.expert_of_block, blocks.padded_total, n, k, blocks.num_assignments, a_row_divisor,
        a.stride(0), a.stride(1), weights.stride(0), weights.stride(1), weights.stride(2),
        out.stride(0), out.stride(1), SCALE_BY_WEIGHT=routing_weights is not None, UPCAST=upcast_dots(a.dtype),
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if blocks.block_m <= 32 else 8,
        num_stages=3)
    return out


def moe_block_m(assignments: int, experts: int) -> int:
    """Row block of the grouped GEMM: small when each expert sees few tokens (decode), 64 for prefill."""
    per_expert = assignments / experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
              top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Mixture-of-experts MLP of x [tokens, hidden]: route to ``top_k`` experts, sum their SiLU-gated outputs."""
    check_moe(x, router_weight, w_gate_up, w_down)
    require_triton_device(x, router_weight, w_gate_up, w_down, interpreting=triton.knobs.runtime.interpret)
    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if tokens == 0:
        return torch.empty_like(x)
    weights, ids = route_topk(gemm(x, router_weight, out_dtype=torch.float32), top_k=top_k,
                              renormalize=renormalize)
    blocks = align_by_expert(ids, experts, moe_block_m(tokens * top_k, experts))
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = grouped_gemm(x, w_gate_up, blocks, a_row_divisor=top_k)
    expert_out = grouped_gemm(silu_and_mul(gate_up), w_down, blocks, a_row_divisor=1,
                              routing_weights=weights.flatten())
    return expert_out.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
