"""Triton kernels against their torch references (interpreted on CPU), and the references against naive math."""

from __future__ import annotations

import math
import os

import pytest

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a kernel
# module is first imported; the registry imports them lazily, on first call.
os.environ["TRITON_INTERPRET"] = "1"

torch = pytest.importorskip("torch")

from hetsched.errors import InputError, NotFoundError  # noqa: E402
from hetsched.kernels import KERNELS, KernelOp, kernels_for, reference, triton_available  # noqa: E402
from hetsched.kernels.inputs import paged_block_table  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

BF16 = {"atol": 3e-2, "rtol": 3e-2}


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


def close(actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **(tol or BF16))


def both(op: KernelOp, params: dict[str, int], dtype: torch.dtype = torch.bfloat16) -> tuple[object, object]:
    spec = KERNELS[op]
    inputs = spec.make_inputs(params, "cpu", dtype)
    return spec.triton_impl(**inputs), spec.reference(**inputs)


def test_registry_covers_every_operator_and_names_match_the_profiler() -> None:
    assert set(KERNELS) == set(KernelOp)
    assert kernels_for("moe").operator is KernelOp.FUSED_MOE
    with pytest.raises(NotFoundError, match="did you mean 'gemm'"):
        kernels_for("gem")


def test_triton_implementations_say_how_to_get_triton_when_it_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import hetsched.kernels as kernels
    from hetsched.errors import BackendUnavailableError

    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    inputs = KERNELS[KernelOp.SILU_AND_MUL].make_inputs({"m": 2, "inter": 4}, "cpu", torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="profile"):
        KERNELS[KernelOp.SILU_AND_MUL].triton_impl(**inputs)
    assert KERNELS[KernelOp.SILU_AND_MUL].reference(**inputs).shape == (2, 4)


def test_input_factories_reject_missing_and_bad_shape_parameters() -> None:
    with pytest.raises(InputError, match="params.n"):
        KERNELS[KernelOp.GEMM].make_inputs({"m": 4, "k": 8}, "cpu", torch.bfloat16)
    with pytest.raises(InputError, match="params.kv_heads"):
        KERNELS[KernelOp.DECODE_ATTENTION].make_inputs(
            {"batch": 1, "heads": 6, "kv_heads": 4, "head_dim": 16, "context": 8}, "cpu", torch.bfloat16)
    with pytest.raises(InputError, match="params.m"):
        KERNELS[KernelOp.RMSNORM].make_inputs({"m": 0, "hidden": 8}, "cpu", torch.bfloat16)


# --- references against naive math -----------------------------------------------------------------


def test_gemm_reference_fp8_dequantises_with_row_and_tensor_scales() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 32, generator=g), torch.randn(10, 32, generator=g)
    for per_row in (True, False):
        a_q, a_s = reference.quantize_fp8(a, per_row=per_row)
        b_q, b_s = reference.quantize_fp8(b, per_row=per_row)
        assert a_q.dtype == torch.float8_e4m3fn and a_s.shape == ((6,) if per_row else (1,))
        out = reference.gemm_reference(a_q, b_q, a_scale=a_s, b_scale=b_s)
        assert out.dtype == torch.bfloat16
        dequantised = (a_q.float() * a_s.reshape(-1, 1)) @ (b_q.float() * b_s.reshape(-1, 1)).T
        close(out, dequantised, atol=1e-2, rtol=1e-2)
        assert torch.linalg.norm(out.float() - a @ b.T) < 0.06 * torch.linalg.norm(a @ b.T)
    with pytest.raises(InputError, match="a_scale"):
        reference.gemm_reference(a_q, b_q)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [{"m": 5, "k": 40, "n": 24}, {"m": 70, "k": 100, "n": 130}])
def test_gemm_triton_matches_reference(dtype: torch.dtype, shape: dict[str, int]) -> None:
    out, ref = both(KernelOp.GEMM, shape, dtype)
    assert out.dtype == dtype and out.shape == (shape["m"], shape["n"])
    close(out, ref)


@needs_triton
def test_gemm_triton_takes_strided_operands_and_an_fp32_output() -> None:
    from hetsched.kernels.gemm import gemm

    a, b = torch.randn(8, 64).bfloat16(), torch.randn(64, 20).bfloat16()
    out = gemm(a[:, ::2], b.T[:, :32], out_dtype=torch.float32)
    assert out.dtype == torch.float32
    close(out, reference.gemm_reference(a[:, ::2], b.T[:, :32], out_dtype=torch.float32), atol=1e-3, rtol=1e-3)


@needs_triton
def test_gemm_tiles_are_thin_for_decode_and_square_for_prefill() -> None:
    from hetsched.kernels.gemm import gemm_tiles

    decode = gemm_tiles(1, 4096, 4096, fp8=False, sm_count=132)
    assert (decode.block_m, decode.block_n) == (16, 64)
    prefill = gemm_tiles(4096, 4096, 4096, fp8=False, sm_count=132)
    assert (prefill.block_m, prefill.block_n) == (128, 128)


def test_fp8_is_not_offered_on_the_cpu() -> None:
    from hetsched.kernels import fp8_dtype

    assert fp8_dtype("cpu") is None


@needs_triton
@pytest.mark.parametrize("per_row", [1, 0])
def test_gemm_triton_fp8_path_matches_reference_semantics(per_row: int) -> None:
    out, ref = both(KernelOp.GEMM, {"m": 9, "k": 64, "n": 40, "per_row_scales": per_row}, torch.float8_e4m3fn)
    assert out.dtype == torch.bfloat16
    close(out, ref)


@needs_triton
@pytest.mark.parametrize("residual", [0, 1])
def test_rms_norm_triton_matches_reference(residual: int) -> None:
    out, ref = both(KernelOp.RMSNORM, {"m": 5, "hidden": 48, "residual": residual})
    for got, want in zip(out if residual else (out,), ref if residual else (ref,), strict=True):
        close(got, want)


def test_rms_norm_reference_is_the_textbook_formula() -> None:
    x, w, r = torch.randn(3, 16), torch.rand(16) + 0.5, torch.randn(3, 16)
    out, summed = reference.rms_norm_reference(x, w, eps=1e-5, residual=r)
    h = x + r
    close(summed, h, atol=1e-6, rtol=1e-6)
    close(out, h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * w, atol=1e-5, rtol=1e-5)


@needs_triton
def test_silu_and_mul_triton_matches_reference() -> None:
    out, ref = both(KernelOp.SILU_AND_MUL, {"m": 3, "inter": 40})
    assert out.shape == (3, 40)
    close(out, ref)
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    close(reference.silu_and_mul_reference(x), torch.tensor([[1.0 / (1 + math.exp(-1)) * 3.0,
                                                              -2.0 / (1 + math.exp(2)) * 0.5]]),
          atol=1e-6, rtol=1e-6)


# --- attention ---------------------------------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, offset: int, window: int | None,
                    scale: float) -> torch.Tensor:
    """Query by query, head by head: q [n, heads, d] at positions offset.., k/v [c, kv_heads, d]."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(q.shape[0]):
        pos = offset + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            keys, values = k[lo:pos + 1, h // group].float(), v[lo:pos + 1, h // group].float()
            out[i, h] = torch.softmax(keys @ q[i, h].float() * scale, dim=0) @ values
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_prefill_reference_matches_naive_causal_attention(window: int | None) -> None:
    q, k, v = torch.randn(5, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 12], dtype=torch.int32)
    out = reference.prefill_attention_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sm_scale=0.3,
                                                window=window)
    close(out[:2], naive_attention(q[:2], k[:4], v[:4], offset=2, window=window, scale=0.3), atol=1e-5, rtol=1e-5)
    close(out[2:], naive_attention(q[2:], k[4:], v[4:], offset=5, window=window, scale=0.3), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("params", [
    {"heads": 4, "kv_heads": 2, "head_dim": 16, "new": 5, "cached": 3, "batch": 2},
    {"heads": 4, "kv_heads": 1, "head_dim": 24, "new": 70, "cached": 0},
    {"heads": 2, "kv_heads": 2, "head_dim": 32, "new": 40, "cached": 100, "batch": 2, "window": 30},
    {"heads": 2, "kv_heads": 1, "head_dim": 16, "new": 150, "cached": 10, "window": 20},
])
def test_prefill_triton_matches_reference(params: dict[str, int]) -> None:
    out, ref = both(KernelOp.PREFILL_ATTENTION, params)
    close(out, ref)


@needs_triton
def test_prefill_triton_handles_sequences_of_different_lengths() -> None:
    from hetsched.kernels.prefill import prefill_attention

    q, k = torch.randn(13, 4, 16).bfloat16(), torch.randn(24, 2, 16).bfloat16()
    v = torch.randn_like(k)
    cu = {"cu_seqlens_q": torch.tensor([0, 3, 12, 12, 13], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 3, 23, 23, 24], dtype=torch.int32)}
    close(prefill_attention(q, k, v, **cu), reference.prefill_attention_reference(q, k, v, **cu))
    with pytest.raises(InputError, match="window"):
        prefill_attention(q, k, v, window=0, **cu)


def scatter_paged(dense: list[torch.Tensor], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache holding each sequence's dense [context, ...] rows, and its block table."""
    table, blocks = paged_block_table([len(d) for d in dense], block_size, device=torch.device("cpu"),
                                      generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(blocks, block_size, *dense[0].shape[1:], dtype=dense[0].dtype)
    for s, rows in enumerate(dense):
        for t in range(len(rows)):
            cache[table[s, t // block_size], t % block_size] = rows[t]
    return cache, table


def test_paged_decode_reference_matches_dense_attention_over_the_gathered_context() -> None:
    lens = [1, 16, 37]
    keys = [torch.randn(n, 2, 8) for n in lens]
    values = [torch.randn(n, 2, 8) for n in lens]
    k_cache, table = scatter_paged(keys, 16)
    v_cache, _ = scatter_paged(values, 16)
    q = torch.randn(3, 6, 8)
    out = reference.paged_decode_attention_reference(q, k_cache, v_cache, block_table=table,
                                                     context_lens=torch.tensor(lens, dtype=torch.int32))
    for s, n in enumerate(lens):
        dense = torch.nn.functional.scaled_dot_product_attention(
            q[s][:, None], keys[s].transpose(0, 1), values[s].transpose(0, 1), enable_gqa=True)[:, 0]
        close(out[s], dense, atol=1e-5, rtol=1e-5)


def test_mla_reference_scores_the_whole_latent_and_returns_its_compressed_part() -> None:
    rank, rope, lens = 12, 4, [5, 33]
    latents = [torch.randn(n, rank + rope) for n in lens]
    cache, table = scatter_paged(latents, 16)
    q = torch.randn(2, 3, rank + rope)
    out = reference.mla_decode_attention_reference(q, cache, block_table=table, kv_lora_rank=rank, sm_scale=0.2,
                                                   context_lens=torch.tensor(lens, dtype=torch.int32))
    assert out.shape == (2, 3, rank)
    for s in range(2):
        weights = torch.softmax(q[s] @ latents[s].T * 0.2, dim=-1)
        close(out[s], weights @ latents[s][:, :rank], atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("params", [
    {"batch": 3, "heads": 4, "kv_heads": 1, "head_dim": 16, "context": 40},
    {"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 24, "context": 150},
    {"batch": 1, "heads": 2, "kv_heads": 2, "head_dim": 64, "context": 300, "block_size": 32},
])
def test_paged_decode_triton_matches_reference(params: dict[str, int]) -> None:
    out, ref = both(KernelOp.DECODE_ATTENTION, params)
    close(out, ref)


@needs_triton
def test_paged_decode_triton_splits_long_contexts_and_handles_ragged_lengths() -> None:
    from hetsched.kernels.decode import kv_splits, paged_decode_attention

    lens = torch.tensor([1, 16, 17, 130], dtype=torch.int32)
    table, blocks = paged_block_table(lens.tolist(), 16, device=torch.device("cpu"),
                                      generator=torch.Generator().manual_seed(2))
    assert kv_splits(4 * 2, table.shape[1]) > 1
    q = torch.randn(4, 4, 32).bfloat16()
    k_cache, v_cache = torch.randn(blocks, 16, 2, 32).bfloat16(), torch.randn(blocks, 16, 2, 32).bfloat16()
    kw = {"block_table": table, "context_lens": lens}
    close(paged_decode_attention(q, k_cache, v_cache, **kw),
          reference.paged_decode_attention_reference(q, k_cache, v_cache, **kw))
    with pytest.raises(InputError, match="block_size"):
        paged_decode_attention(q, k_cache[:, :8], v_cache[:, :8], **kw)


@needs_triton
@pytest.mark.parametrize("params", [
    {"batch": 2, "heads": 4, "kv_lora_rank": 32, "rope_dim": 16, "context": 20},
    {"batch": 2, "heads": 20, "kv_lora_rank": 64, "rope_dim": 16, "context": 150, "qk_head_dim": 48},
])
def test_mla_decode_triton_matches_reference(params: dict[str, int]) -> None:
    out, ref = both(KernelOp.MLA_DECODE_ATTENTION, params)
    assert out.shape == (params["batch"], params["heads"], params["kv_lora_rank"])
    close(out, ref)


@needs_triton
def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    from hetsched.errors import BackendUnavailableError
    from hetsched.kernels.gemm import gemm

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        gemm(torch.randn(2, 4), torch.randn(3, 4))


# --- mixture of experts ------------------------------------------------------------------------------


def test_fused_moe_reference_matches_a_per_token_loop() -> None:
    x, router = torch.randn(6, 16), torch.randn(5, 16)
    w_gate_up, w_down = torch.randn(5, 2 * 8, 16) * 0.2, torch.randn(5, 16, 8) * 0.2
    out = reference.fused_moe_reference(x, router, w_gate_up, w_down, top_k=2)
    for t in range(6):
        probs = torch.softmax(router @ x[t], dim=0)
        chosen = sorted(range(5), key=lambda e: -probs[e])[:2]
        total = sum(probs[e] for e in chosen)
        expected = torch.zeros(16)
        for e in chosen:
            gate, up = w_gate_up[e, :8] @ x[t], w_gate_up[e, 8:] @ x[t]
            expected += probs[e] / total * (w_down[e] @ (gate * torch.sigmoid(gate) * up))
        close(out[t], expected, atol=1e-5, rtol=1e-5)


def test_moe_inputs_reject_inconsistent_expert_weights() -> None:
    with pytest.raises(InputError, match="params.top_k"):
        KERNELS[KernelOp.FUSED_MOE].make_inputs({"m": 2, "hidden": 8, "inter": 4, "experts": 2, "top_k": 3},
                                                "cpu", torch.bfloat16)
    x, router = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(InputError, match="w_gate_up"):
        reference.fused_moe_reference(x, router, torch.randn(4, 6, 8), torch.randn(4, 8, 4), top_k=2)


@needs_triton
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_triton_matches_reference(renormalize: bool) -> None:
    from hetsched.kernels.moe import route_topk

    logits = torch.randn(9, 10)
    weights, ids = route_topk(logits, top_k=3, renormalize=renormalize)
    ref_weights, ref_ids = reference.route_topk_reference(logits, top_k=3, renormalize=renormalize)
    assert torch.equal(ids, ref_ids)
    close(weights, ref_weights, atol=1e-6, rtol=1e-6)


@needs_triton
def test_align_by_expert_gives_each_row_block_one_expert_and_every_assignment_once() -> None:
    from hetsched.kernels.moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 0]], dtype=torch.int32)
    blocks = align_by_expert(ids, 5, 4)
    used = int(blocks.padded_total.item())
    assert used == 4 + 4 + 4 + 8  # experts 0, 1, 2, 3 route 3, 1, 1 and 5 assignments
    rows = blocks.sorted_ids[:used].view(-1, 4)
    flat = ids.flatten()
    for block, expert in zip(rows, blocks.expert_of_block[:used // 4].tolist(), strict=True):
        real = block[block < ids.numel()]
        assert len(real) and all(int(flat[i]) == expert for i in real)
    assert sorted(blocks.sorted_ids[blocks.sorted_ids < ids.numel()].tolist()) == list(range(ids.numel()))


@needs_triton
@pytest.mark.parametrize("params", [
    {"m": 7, "hidden": 32, "inter": 16, "experts": 8, "top_k": 2},
    {"m": 1, "hidden": 48, "inter": 40, "experts": 6, "top_k": 3},
    {"m": 40, "hidden": 32, "inter": 24, "experts": 4, "top_k": 2},
])
def test_fused_moe_triton_matches_reference(params: dict[str, int]) -> None:
    out, ref = both(KernelOp.FUSED_MOE, params)
    assert out.shape == (params["m"], params["hidden"])
    close(out, ref)
