"""Input factories: the keyword arguments of one operator call at a given shape.

Every factory is ``make_inputs(params, device, dtype, *, seed=0)`` and returns
a dict to call either implementation with (``impl(**inputs)``). ``params``
are the integer shape parameters a profiler sweep point carries (``m``, ``k``,
``n``; ``heads``, ``kv_heads``, ``head_dim``, ``new``, ``cached``; ``batch``,
``context``, …); the docstring of each factory lists its required and
optional keys. Values are random but seeded, scaled like real activations and
weights so softmaxes and sums stay in a realistic range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hetsched.errors import InputError
from hetsched.kernels.reference import is_fp8, quantize_fp8

DEFAULT_BLOCK_SIZE = 16


def _need(params: Mapping[str, int], name: str, *, minimum: int = 1) -> int:
    if name not in params:
        raise InputError(f"missing shape parameter {name!r}; got {sorted(params)}", field=f"params.{name}")
    value = params[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InputError(f"expected an integer >= {minimum}, got {value!r}", field=f"params.{name}")
    return value


def _opt(params: Mapping[str, int], name: str, default: int, *, minimum: int = 0) -> int:
    return _need(params, name, minimum=minimum) if name in params else default


def _randn(shape: tuple[int, ...], g: torch.Generator, device: torch.device, dtype: torch.dtype,
           std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def _setup(device: str | torch.device, seed: int) -> tuple[torch.device, torch.Generator]:
    dev = torch.device(device)
    return dev, torch.Generator(device=dev).manual_seed(seed)


def gemm_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                seed: int = 0) -> dict[str, Any]:
    """``m`` tokens × ``k`` in → ``n`` out. For an fp8 dtype, inputs are quantised with scales per row
    (``per_row_scales``: 1, the default) or per tensor (0)."""
    m, k, n = _need(params, "m"), _need(params, "k"), _need(params, "n")
    dev, g = _setup(device, seed)
    a = _randn((m, k), g, dev, torch.float32)
    b = _randn((n, k), g, dev, torch.float32, std=1.0 / math.sqrt(k))
    if not is_fp8(dtype):
        return {"a": a.to(dtype), "b": b.to(dtype)}
    per_row = bool(_opt(params, "per_row_scales", 1))
    a_q, a_scale = quantize_fp8(a, dtype=dtype, per_row=per_row)
    b_q, b_scale = quantize_fp8(b, dtype=dtype, per_row=per_row)
    return {"a": a_q, "b": b_q, "a_scale": a_scale, "b_scale": b_scale, "out_dtype": torch.bfloat16}


def _heads(params: Mapping[str, int]) -> tuple[int, int, int]:
    heads, kv_heads, head_dim = _need(params, "heads"), _need(params, "kv_heads"), _need(params, "head_dim")
    if heads % kv_heads:
        raise InputError(f"kv_heads ({kv_heads}) must divide heads ({heads})", field="params.kv_heads")
    return heads, kv_heads, head_dim


def prefill_attention_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                             seed: int = 0) -> dict[str, Any]:
    """``batch`` (default 1) sequences of ``new`` tokens after ``cached`` ones; ``heads``, ``kv_heads``,
    ``head_dim``; ``window`` (default 0: none) for sliding-window layers."""
    heads, kv_heads, head_dim = _heads(params)
    new, cached = _need(params, "new"), _opt(params, "cached", 0)
    batch, window = _opt(params, "batch", 1, minimum=1), _opt(params, "window", 0)
    dev, g = _setup(device, seed)
    context = new + cached
    cu_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, (batch + 1) * context, context, dtype=torch.int32, device=dev)
    return {"q": _randn((batch * new, heads, head_dim), g, dev, dtype),
            "k": _randn((batch * context, kv_heads, head_dim), g, dev, dtype),
            "v": _randn((batch * context, kv_heads, head_dim), g, dev, dtype),
            "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": new,
            "sm_scale": 1.0 / math.sqrt(head_dim), "window": window or None}


def paged_block_table(context_lens: list[int], block_size: int, *, device: torch.device,
                      generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """A block table giving each sequence its own blocks in a shuffled order (as after churn in a real cache).

    Returns the table [batch, max_blocks] (int32) and the number of blocks used.
    """
    per_seq = [math.ceil(c / block_size) for c in context_lens]
    width, total = max(per_seq), sum(per_seq)
    ids = torch.randperm(total, generator=generator, device=device).to(torch.int32)
    table = torch.zeros((len(context_lens), width), dtype=torch.int32, device=device)
    start = 0
    for s, count in enumerate(per_seq):
        table[s, :count] = ids[start:start + count]
        start += count
    return table, total


def decode_attention_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                            seed: int = 0) -> dict[str, Any]:
    """``batch`` sequences, each ``context`` tokens long, over a paged cache of ``block_size`` (default 16)
    token blocks; ``heads``, ``kv_heads``, ``head_dim``."""
    heads, kv_heads, head_dim = _heads(params)
    batch, context = _need(params, "batch"), _need(params, "context")
    block_size = _opt(params, "block_size", DEFAULT_BLOCK_SIZE, minimum=1)
    dev, g = _setup(device, seed)
    table, blocks = paged_block_table([context] * batch, block_size, device=dev, generator=g)
    return {"q": _randn((batch, heads, head_dim), g, dev, dtype),
            "k_cache": _randn((blocks, block_size, kv_heads, head_dim), g, dev, dtype),
            "v_cache": _randn((blocks, block_size, kv_heads, head_dim), g, dev, dtype),
            "block_table": table, "context_lens": torch.full((batch,), context, dtype=torch.int32, device=dev),
            "sm_scale": 1.0 / math.sqrt(head_dim)}


def mla_decode_attention_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                                seed: int = 0) -> dict[str, Any]:
    """``batch`` sequences of ``context`` tokens; ``heads``, ``kv_lora_rank``, ``rope_dim``; ``block_size``
    (default 16); ``qk_head_dim`` (default kv_lora_rank + rope_dim) sets the softmax scale."""
    heads, rank, rope_dim = _need(params, "heads"), _need(params, "kv_lora_rank"), _need(params, "rope_dim")
    batch, context = _need(params, "batch"), _need(params, "context")
    block_size = _opt(params, "block_size", DEFAULT_BLOCK_SIZE, minimum=1)
    qk_head_dim = _opt(params, "qk_head_dim", rank + rope_dim, minimum=1)
    dev, g = _setup(device, seed)
    table, blocks = paged_block_table([context] * batch, block_size, device=dev, generator=g)
    return {"q": _randn((batch, heads, rank + rope_dim), g, dev, dtype),
            "latent_cache": _randn((blocks, block_size, rank + rope_dim), g, dev, dtype),
            "block_table": table, "context_lens": torch.full((batch,), context, dtype=torch.int32, device=dev),
            "kv_lora_rank": rank, "sm_scale": 1.0 / math.sqrt(qk_head_dim)}


def fused_moe_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                     seed: int = 0) -> dict[str, Any]:
    """``m`` tokens of ``hidden`` size routed to ``top_k`` of ``experts`` experts of ``inter`` size."""
    m, hidden, inter = _need(params, "m"), _need(params, "hidden"), _need(params, "inter")
    experts, top_k = _need(params, "experts"), _need(params, "top_k")
    if top_k > experts:
        raise InputError(f"top_k ({top_k}) exceeds experts ({experts})", field="params.top_k")
    dev, g = _setup(device, seed)
    return {"x": _randn((m, hidden), g, dev, dtype),
            "router_weight": _randn((experts, hidden), g, dev, dtype, std=1.0 / math.sqrt(hidden)),
            "w_gate_up": _randn((experts, 2 * inter, hidden), g, dev, dtype, std=1.0 / math.sqrt(hidden)),
            "w_down": _randn((experts, hidden, inter), g, dev, dtype, std=1.0 / math.sqrt(inter)),
            "top_k": top_k}


def rms_norm_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                    seed: int = 0) -> dict[str, Any]:
    """``m`` tokens of ``hidden`` size; ``residual`` 1 for the fused residual add (default 0)."""
    m, hidden = _need(params, "m"), _need(params, "hidden")
    dev, g = _setup(device, seed)
    inputs: dict[str, Any] = {"x": _randn((m, hidden), g, dev, dtype),
                              "weight": (1.0 + _randn((hidden,), g, dev, torch.float32, std=0.1)).to(dtype)}
    if _opt(params, "residual", 0):
        inputs["residual"] = _randn((m, hidden), g, dev, dtype)
    return inputs


def silu_and_mul_inputs(params: Mapping[str, int], device: str | torch.device, dtype: torch.dtype, *,
                        seed: int = 0) -> dict[str, Any]:
    """``m`` tokens of gate and up halves, each ``inter`` wide."""
    m, inter = _need(params, "m"), _need(params, "inter")
    dev, g = _setup(device, seed)
    return {"x": _randn((m, 2 * inter), g, dev, dtype)}
