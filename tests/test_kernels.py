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
from hetsched.kernels import KERNELS, Operator, kernels_for, reference  # noqa: E402
from hetsched.kernels.inputs import paged_block_table  # noqa: E402

needs_triton = pytest.mark.skipif(not __import__("hetsched.kernels").kernels.triton_available(),
                                  reason="triton is not installed")

BF16 = {"atol": 3e-2, "rtol": 3e-2}


def close(actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **(tol or BF16))


def both(op: Operator, params: dict[str, int], dtype: torch.dtype = torch.bfloat16) -> tuple[object, object]:
    spec = KERNELS[op]
    inputs = spec.make_inputs(params, "cpu", dtype)
    return spec.triton_impl(**inputs), spec.reference(**inputs)


def test_registry_covers_every_operator_and_names_match_the_profiler() -> None:
    assert set(KERNELS) == set(Operator)
    assert kernels_for("moe").operator is Operator.FUSED_MOE
    with pytest.raises(NotFoundError, match="did you mean 'gemm'"):
        kernels_for("gem")


def test_input_factories_reject_missing_and_bad_shape_parameters() -> None:
    with pytest.raises(InputError, match="params.n"):
        KERNELS[Operator.GEMM].make_inputs({"m": 4, "k": 8}, "cpu", torch.bfloat16)
    with pytest.raises(InputError, match="params.kv_heads"):
        KERNELS[Operator.DECODE_ATTENTION].make_inputs(
            {"batch": 1, "heads": 6, "kv_heads": 4, "head_dim": 16, "context": 8}, "cpu", torch.bfloat16)
    with pytest.raises(InputError, match="params.m"):
        KERNELS[Operator.RMSNORM].make_inputs({"m": 0, "hidden": 8}, "cpu", torch.bfloat16)


# --- references against naive math -----------------------------------------------------------------


def test_gemm_reference_fp8_dequantises_with_row_and_tensor_scales() -> None:
    a, b = torch.randn(6, 32), torch.randn(10, 32)
    for per_row in (True, False):
        a_q, a_s = reference.quantize_fp8(a, per_row=per_row)
        b_q, b_s = reference.quantize_fp8(b, per_row=per_row)
        assert a_q.dtype == torch.float8_e4m3fn and a_s.shape == ((6,) if per_row else (1,))
        out = reference.gemm_reference(a_q, b_q, a_scale=a_s, b_scale=b_s)
        assert out.dtype == torch.bfloat16
        close(out, a @ b.T, atol=0.35, rtol=0.1)
    with pytest.raises(InputError, match="a_scale"):
        reference.gemm_reference(a_q, b_q)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [{"m": 5, "k": 40, "n": 24}, {"m": 70, "k": 100, "n": 130}])
def test_gemm_triton_matches_reference(dtype: torch.dtype, shape: dict[str, int]) -> None:
    out, ref = both(Operator.GEMM, shape, dtype)
    assert out.dtype == dtype and out.shape == (shape["m"], shape["n"])
    close(out, ref)


@needs_triton
@pytest.mark.parametrize("per_row", [1, 0])
def test_gemm_triton_fp8_path_matches_reference_semantics(per_row: int) -> None:
    out, ref = both(Operator.GEMM, {"m": 9, "k": 64, "n": 40, "per_row_scales": per_row}, torch.float8_e4m3fn)
    assert out.dtype == torch.bfloat16
    close(out, ref)


@needs_triton
@pytest.mark.parametrize("residual", [0, 1])
def test_rms_norm_triton_matches_reference(residual: int) -> None:
    out, ref = both(Operator.RMSNORM, {"m": 5, "hidden": 48, "residual": residual})
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
    out, ref = both(Operator.SILU_AND_MUL, {"m": 3, "inter": 40})
    assert out.shape == (3, 40)
    close(out, ref)
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    close(reference.silu_and_mul_reference(x), torch.tensor([[1.0 / (1 + math.exp(-1)) * 3.0,
                                                              -2.0 / (1 + math.exp(2)) * 0.5]]),
          atol=1e-6, rtol=1e-6)
