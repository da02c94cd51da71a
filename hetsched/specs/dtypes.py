"""Number formats for weights, activations and the KV cache."""

from __future__ import annotations

from enum import StrEnum

from hetsched.errors import InputError


class DType(StrEnum):
    """A storage format; ``bytes_per_element`` includes block-scale overhead."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"

    @property
    def bytes_per_element(self) -> float:
        return _BYTES[self]

    @property
    def compute_dtype(self) -> "DType":
        """The tensor-core format a GEMM on these weights runs in.

        Weight-only int4/int8 are dequantised to bf16; fp8 and fp4 formats
        run natively where the accelerator has those units (the catalog
        says which; missing units fall back to bf16).
        """
        return _COMPUTE.get(self, self)


# int4 (GPTQ/AWQ style): 4 bits + one fp16 scale and zero per group of 128.
# mxfp4: 4 bits + one 8-bit scale per 32 elements; nvfp4: + one fp8 scale per 16.
_BYTES: dict[DType, float] = {
    DType.FP32: 4.0,
    DType.BF16: 2.0,
    DType.FP16: 2.0,
    DType.FP8: 1.0,
    DType.INT8: 1.0,
    DType.INT4: 0.5 + 4.0 / 128,
    DType.MXFP4: 0.5 + 1.0 / 32,
    DType.NVFP4: 0.5 + 1.0 / 16,
}

_COMPUTE: dict[DType, DType] = {
    DType.INT8: DType.BF16,
    DType.INT4: DType.BF16,
    DType.FP32: DType.BF16,
}


KV_CACHE_DTYPES = (DType.BF16, DType.FP16, DType.FP8)
"""Formats a KV cache is stored in (vLLM's ``--kv-cache-dtype``: the model's 16-bit type, or fp8)."""


def parse_dtype(value: str, *, field: str = "dtype", allowed: tuple[DType, ...] = tuple(DType)) -> DType:
    """Parse a user-supplied dtype name among ``allowed``, accepting common aliases."""
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
               "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "e4m3": "fp8"}
    name = aliases.get(value.lower(), value.lower())
    if name not in {d.value for d in allowed}:
        expected = ", ".join(d.value for d in allowed)
        raise InputError(f"expected one of {expected}, got {value!r}", field=field)
    return DType(name)
