"""Triton kernels for the operators of a transformer step, with torch references.

The profiler times these on a device for the shapes of a model. ``KERNELS``
maps each ``KernelOp`` to an ``OperatorKernels``: the Triton implementation,
the torch reference with the same signature, and an input factory::

    spec = KERNELS[KernelOp.GEMM]
    inputs = spec.make_inputs({"m": 64, "k": 4096, "n": 6144}, "cuda", torch.bfloat16)
    out = spec.triton_impl(**inputs)            # or spec.reference(**inputs)

Triton is imported only when a Triton implementation is first called, so the
references and input factories work where Triton is not installed. Triton
kernels need a CUDA or ROCm device, or ``TRITON_INTERPRET=1`` (set before
the first call) to run on CPU tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hetsched.errors import BackendUnavailableError, NotFoundError
from hetsched.kernels import inputs, reference
from hetsched.kernels.device import fp8_dtype, triton_available


class KernelOp(StrEnum):
    """Operators with a Triton kernel; values match the profiler's kernel names."""

    GEMM = "gemm"
    PREFILL_ATTENTION = "prefill_attention"
    DECODE_ATTENTION = "decode_attention"
    MLA_DECODE_ATTENTION = "mla_decode_attention"
    FUSED_MOE = "moe"
    RMSNORM = "rmsnorm"
    SILU_AND_MUL = "silu_mul"


InputFactory = Callable[..., dict[str, Any]]
"""``make_inputs(params: Mapping[str, int], device, dtype, *, seed=0) -> dict`` of keyword arguments."""


@dataclass(frozen=True)
class TritonImpl:
    """A Triton implementation, imported on first call so that importing this package needs no Triton."""

    module: str
    function: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not triton_available():
            raise BackendUnavailableError("Triton is not installed; install the profile extra "
                                          "(pip install 'hetsched[profile]') or use the torch reference")
        return getattr(importlib.import_module(f"hetsched.kernels.{self.module}"), self.function)(*args, **kwargs)


@dataclass(frozen=True)
class OperatorKernels:
    """The two implementations of one operator and how to build inputs for them."""

    operator: KernelOp
    triton_impl: Callable[..., Any]
    reference: Callable[..., Any]
    make_inputs: InputFactory


KERNELS: Mapping[KernelOp, OperatorKernels] = {
    spec.operator: spec for spec in (
        OperatorKernels(KernelOp.GEMM, TritonImpl("gemm", "gemm"), reference.gemm_reference, inputs.gemm_inputs),
        OperatorKernels(KernelOp.PREFILL_ATTENTION, TritonImpl("prefill", "prefill_attention"),
                        reference.prefill_attention_reference, inputs.prefill_attention_inputs),
        OperatorKernels(KernelOp.DECODE_ATTENTION, TritonImpl("decode", "paged_decode_attention"),
                        reference.paged_decode_attention_reference, inputs.decode_attention_inputs),
        OperatorKernels(KernelOp.MLA_DECODE_ATTENTION, TritonImpl("decode", "mla_decode_attention"),
                        reference.mla_decode_attention_reference, inputs.mla_decode_attention_inputs),
        OperatorKernels(KernelOp.FUSED_MOE, TritonImpl("moe", "fused_moe"), reference.fused_moe_reference,
                        inputs.fused_moe_inputs),
        OperatorKernels(KernelOp.RMSNORM, TritonImpl("elementwise", "rms_norm"), reference.rms_norm_reference,
                        inputs.rms_norm_inputs),
        OperatorKernels(KernelOp.SILU_AND_MUL, TritonImpl("elementwise", "silu_and_mul"),
                        reference.silu_and_mul_reference, inputs.silu_and_mul_inputs),
    )
}


def kernels_for(operator: KernelOp | str) -> OperatorKernels:
    """The registry entry of ``operator`` (a KernelOp or its name, e.g. ``"gemm"``)."""
    try:
        return KERNELS[KernelOp(operator)]
    except ValueError as exc:
        raise NotFoundError("operator", str(operator), [o.value for o in KernelOp]) from exc


__all__ = ["KERNELS", "InputFactory", "KernelOp", "OperatorKernels", "TritonImpl", "fp8_dtype", "kernels_for",
           "triton_available"]
