"""Pure-torch reference implementations of the step operators.

Each has the same signature as its Triton kernel, runs on any device torch
supports (the CPU included), and computes in fp32 before casting back, so it
is both the correctness oracle for the kernels and a runnable operator where
Triton is not available.

Layouts (the ones vLLM-style engines use):

- GEMM: ``a`` [m, k] times ``b`` [n, k] (a weight, stored out × in) → [m, n].
- Prefill attention: varlen packed sequences, ``q`` [total_new, heads, d],
  ``k``/``v`` [total_context, kv_heads, d], with ``cu_seqlens_q`` /
  ``cu_seqlens_k`` (int32, [batch + 1]) marking where each sequence starts.
  A sequence's new tokens are the last ones of its context (chunked prefill
  over a cached prefix).
- Paged KV cache: ``k_cache``/``v_cache`` [num_blocks, block_size, kv_heads, d],
  ``block_table`` [batch, max_blocks] (int32), ``context_lens`` [batch] (int32).
- MLA latent cache: [num_blocks, block_size, kv_lora_rank + rope_dim], the
  compressed KV followed by the shared rotary key.
- MoE weights: ``w_gate_up`` [experts, 2·inter, hidden] (gate rows first),
  ``w_down`` [experts, hidden, inter], ``router_weight`` [experts, hidden].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hetsched.errors import InputError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn,
                 per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``x`` [rows, cols] into fp8 range: returns (values, fp32 scales [rows] or [1]), x ≈ values·scale."""
    amax = x.float().abs().amax(dim=-1) if per_row else x.float().abs().amax().reshape(1)
    scale = amax.clamp(min=1e-12) / torch.finfo(dtype).max
    divisor = scale[:, None] if per_row else scale
    return (x.float() / divisor).to(dtype), scale


def gemm_reference(a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor | None = None,
                   b_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b.T`` accumulated in fp32.

    fp8 inputs carry scales: ``a_scale`` is [m] (per row) or [1] (per tensor),
    ``b_scale`` is [n] or [1]; the product is ``(a·a_scale) @ (b·b_scale).T``.
    The output is ``out_dtype``, by default a's dtype (bf16 for fp8 inputs).
    """
    out_dtype = check_gemm(a, b, a_scale=a_scale, b_scale=b_scale, out_dtype=out_dtype)
    acc = a.float() @ b.float().T
    if a_scale is not None and b_scale is not None:
        acc = acc * a_scale.float().reshape(-1, 1) * b_scale.float().reshape(1, -1)
    return acc.to(out_dtype)


def check_gemm(a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor | None,
               b_scale: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.dtype:
    """Validate GEMM operands; returns the output dtype."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise InputError(f"expected a [m, k] and b [n, k], got {tuple(a.shape)} and {tuple(b.shape)}", field="b")
    if a.dtype != b.dtype:
        raise InputError(f"a is {a.dtype} but b is {b.dtype}; both must have one dtype", field="b")
    if is_fp8(a.dtype):
        if a_scale is None or b_scale is None:
            raise InputError("fp8 operands need a_scale and b_scale", field="a_scale")
        if a_scale.numel() not in (1, a.shape[0]) or b_scale.numel() not in (1, b.shape[0]):
            raise InputError(f"scales must be per tensor ([1]) or per row ([{a.shape[0]}] and [{b.shape[0]}]), "
                             f"got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}", field="a_scale")
        return out_dtype or torch.bfloat16
    if a_scale is not None or b_scale is not None:
        raise InputError(f"scales apply to fp8 operands only, not {a.dtype}", field="a_scale")
    return out_dtype or a.dtype


def _group_size(heads: int, kv_heads: int) -> int:
    if kv_heads <= 0 or heads % kv_heads:
        raise InputError(f"kv_heads ({kv_heads}) must divide heads ({heads})", field="kv_heads")
    return heads // kv_heads


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            sm_scale: float) -> torch.Tensor:
    """Softmax attention in fp32: q [heads, n, d], k [heads, c, d], v [heads, c, dv], mask [n, c]."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * sm_scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                                sm_scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context.

    New token i of a sequence with q_len new and k_len context tokens sits at
    context position ``k_len - q_len + i`` and sees positions up to it; with a
    sliding ``window`` only the last ``window`` of those (itself included).
    ``max_seqlen_q`` is a launch hint for the kernel and unused here.
    """
    heads, d = q.shape[1], q.shape[2]
    group = _group_size(heads, k.shape[1])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[s], starts_q[s + 1], starts_k[s], starts_k[s + 1]
        q_len, k_len = q1 - q0, k1 - k0
        if q_len == 0:
            continue
        pos = torch.arange(k_len - q_len, k_len, device=q.device)[:, None]
        key = torch.arange(k_len, device=q.device)[None, :]
        mask = key <= pos
        if window is not None:
            mask &= pos - key < window
        kh = k[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)
        vh = v[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0)
        out[q0:q1] = _attend(q[q0:q1].transpose(0, 1), kh, vh, mask, scale).transpose(0, 1).to(q.dtype)
    return out


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seq: int, context_len: int) -> torch.Tensor:
    """The first ``context_len`` cached tokens of sequence ``seq``, in order: [context_len, ...]."""
    block_size = cache.shape[1]
    blocks = block_table[seq, :math.ceil(context_len / block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:context_len]


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                                     block_table: torch.Tensor, context_lens: torch.Tensor,
                                     sm_scale: float | None = None) -> torch.Tensor:
    """One new token per sequence (q [batch, heads, d]) over its paged KV cache; returns [batch, heads, d]."""
    batch, heads, d = q.shape
    group = _group_size(heads, k_cache.shape[2])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    for s, context_len in enumerate(context_lens.tolist()):
        kh = gather_paged(k_cache, block_table, s, context_len).transpose(0, 1).repeat_interleave(group, dim=0)
        vh = gather_paged(v_cache, block_table, s, context_len).transpose(0, 1).repeat_interleave(group, dim=0)
        out[s] = _attend(q[s][:, None], kh, vh, None, scale)[:, 0].to(q.dtype)
    return out


def mla_decode_attention_reference(q: torch.Tensor, latent_cache: torch.Tensor, *, block_table: torch.Tensor,
                                   context_lens: torch.Tensor, kv_lora_rank: int,
                                   sm_scale: float | None = None) -> torch.Tensor:
    """Absorbed multi-head latent attention decode.

    q [batch, heads, kv_lora_rank + rope_dim] is the query with the key
    up-projection absorbed; every head scores the shared latent cache entries
    (compressed KV and rotary key) and takes the compressed KV itself as the
    value. Returns [batch, heads, kv_lora_rank], still to be up-projected.
    """
    if q.shape[-1] != latent_cache.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise InputError(f"q width {q.shape[-1]} and cache width {latent_cache.shape[-1]} must both be "
                         f"kv_lora_rank ({kv_lora_rank}) + rope_dim", field="kv_lora_rank")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for s, context_len in enumerate(context_lens.tolist()):
        latent = gather_paged(latent_cache, block_table, s, context_len)[None]
        out[s] = _attend(q[s][:, None], latent, latent[..., :kv_lora_rank], None, scale)[:, 0].to(q.dtype)
    return out


def route_topk_reference(logits: torch.Tensor, *, top_k: int,
                         renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, keep the top ``top_k``, optionally rescale them to sum to one.

    Returns fp32 weights [tokens, top_k] and int32 expert ids [tokens, top_k], best first.
    """
    check_top_k(logits, top_k)
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def check_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    experts, hidden = router_weight.shape
    inter = w_down.shape[-1]
    if x.shape[-1] != hidden:
        raise InputError(f"x has hidden size {x.shape[-1]}, router_weight {hidden}", field="router_weight")
    if tuple(w_gate_up.shape) != (experts, 2 * inter, hidden):
        raise InputError(f"expected w_gate_up [{experts}, {2 * inter}, {hidden}], got {tuple(w_gate_up.shape)}",
                         field="w_gate_up")
    if tuple(w_down.shape) != (experts, hidden, inter):
        raise InputError(f"expected w_down [{experts}, {hidden}, {inter}], got {tuple(w_down.shape)}",
                         field="w_down")


def fused_moe_reference(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor, *, top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Mixture-of-experts MLP: route each token to ``top_k`` experts and sum their SiLU-gated outputs.

    x is [tokens, hidden]; each expert computes ``down(silu(gate·x) · up·x)``
    and the results are weighted by the routing weights.
    """
    check_moe(x, router_weight, w_gate_up, w_down)
    weights, ids = route_topk_reference(x.float() @ router_weight.float().T, top_k=top_k, renormalize=renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = ids.flatten().long()
    for expert in torch.unique(flat_ids).tolist():
        rows = (flat_ids == expert).nonzero().flatten()
        tokens = rows // top_k
        hidden = silu_and_mul_reference(x[tokens].float() @ w_gate_up[expert].float().T)
        out.index_add_(0, tokens, (hidden @ w_down[expert].float().T) * weights.flatten()[rows, None])
    return out.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of x [tokens, hidden].

    With ``residual``, normalises ``x + residual`` and returns
    (normalised, x + residual): the fused add-and-norm between layers.
    """
    check_rms_norm(x, weight, residual=residual)
    h = x.float() if residual is None else x.float() + residual.float()
    out = (h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, h.to(x.dtype))


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up for x [tokens, 2·inter] holding gate then up; returns [tokens, inter]."""
    check_silu_and_mul(x)
    half = x.shape[-1] // 2
    return (F.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise InputError(f"expected x [tokens, hidden], got {tuple(x.shape)}", field="x")
    if weight.shape != (x.shape[-1],):
        raise InputError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}", field="weight")
    if residual is not None and residual.shape != x.shape:
        raise InputError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}", field="residual")


def check_silu_and_mul(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[-1] % 2:
        raise InputError(f"expected x [tokens, 2·inter] (gate then up), got {tuple(x.shape)}", field="x")


def check_top_k(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise InputError(f"expected router logits [tokens, experts], got {tuple(logits.shape)}", field="logits")
    if not 0 < top_k <= logits.shape[-1]:
        raise InputError(f"top_k must be in 1..{logits.shape[-1]} (the number of experts), got {top_k}",
                         field="top_k")
