"""The operators of a transformer step as torch ops: what the CPU backend times and runs.

The accuracy benchmark builds a whole model from these same functions, so a
measured profile and a real step time the same code paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``: x is [tokens, k], weight is [n, k]."""
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up, with gate and up side by side in the last dimension."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def rope_tables(positions: torch.Tensor, head_dim: int, *, theta: float = 1e6,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [tokens, head_dim/2], for rotary embeddings at ``positions``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [tokens, heads, d] and k [tokens, kv_heads, d]."""
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context.

    q is [heads, new, d]; k and v are [kv_heads, cached + new, d] (grouped-query
    attention when kv_heads < heads). New token i sees context positions up to
    ``cached + i``.
    """
    new, context = q.shape[1], k.shape[1]
    if cached == 0:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
    else:
        mask = torch.ones(new, context, dtype=torch.bool, device=q.device).tril(diagonal=cached)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
    return out[0]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One new token per sequence over its cache: q [batch, heads, d], k/v [batch, kv_heads, context, d]."""
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def mla_decode_attention(q_latent: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA decode: q [batch, heads, r + rope] over the shared latent cache [batch, 1, context, r + rope]."""
    values = latent[..., :kv_lora_rank]
    scale = q_latent.shape[-1] ** -0.5
    return F.scaled_dot_product_attention(q_latent[:, :, None], latent, values, scale=scale, enable_gqa=True)[:, :, 0]


def fused_moe(x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int) -> torch.Tensor:
    """Top-k routing, then each expert's SiLU-gated MLP over the tokens routed to it.

    router is [experts, hidden]; w_gate_up [experts, 2·inter, hidden]; w_down [experts, hidden, inter].
    """
    weights, experts = torch.topk(torch.softmax(F.linear(x, router).float(), dim=-1), top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    flat = experts.flatten()
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    token_of = order // top_k
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        tokens = token_of[start:start + count]
        start += count
        hidden = F.linear(silu_mul(F.linear(x[tokens], w_gate_up[expert])), w_down[expert])
        out.index_add_(0, tokens, hidden * weights.flatten()[rows, None])
    return out
