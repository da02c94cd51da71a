"""Compile every Triton kernel of hetsched.kernels for a GPU target, without a GPU.

Run as ``python tests/kernel_compile.py cuda 90`` (or ``hip gfx942``) with
TRITON_INTERPRET unset: the interpreter runs kernels as Python and never
checks what the compiler rejects (dot shapes, loop-carried types, layouts).
Prints one line per kernel and exits with the number of failures.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hetsched.kernels import decode, elementwise, gemm, moe, prefill

SCALARS = {"eps": "fp32", "qk_scale": "fp32"}

# kernel, pointer element types other than bf16, constexpr values as launched for a large model
KERNELS = {
    "gemm": (gemm._gemm_kernel, {"a_scale_ptr": "fp32", "b_scale_ptr": "fp32"},
             {"UPCAST": False, "HAS_SCALES": False, "A_SCALE_PER_ROW": False, "B_SCALE_PER_ROW": False,
              "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}),
    "gemm_fp8": (gemm._gemm_kernel, {"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "a_scale_ptr": "fp32",
                                     "b_scale_ptr": "fp32"},
                 {"UPCAST": False, "HAS_SCALES": True, "A_SCALE_PER_ROW": True, "B_SCALE_PER_ROW": True,
                  "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}),
    "prefill": (prefill._prefill_kernel, {"cu_q_ptr": "i32", "cu_k_ptr": "i32"},
                {"HAS_WINDOW": True, "UPCAST": False, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128}),
    "gqa_decode": (decode._gqa_decode_kernel, {"table_ptr": "i32", "lens_ptr": "i32", "mid_o_ptr": "fp32",
                                               "mid_lse_ptr": "fp32"},
                   {"UPCAST": False, "BLOCK_G": 16, "BLOCK_SIZE": 16, "BLOCK_D": 128}),
    "mla_decode": (decode._mla_decode_kernel, {"table_ptr": "i32", "lens_ptr": "i32", "mid_o_ptr": "fp32",
                                               "mid_lse_ptr": "fp32"},
                   {"UPCAST": False, "BLOCK_H": 16, "BLOCK_SIZE": 64, "BLOCK_R": 512, "BLOCK_P": 64}),
    "merge": (decode._merge_kernel, {"mid_o_ptr": "fp32", "mid_lse_ptr": "fp32"}, {"BLOCK_S": 8, "BLOCK_D": 128}),
    "route_topk": (moe._route_topk_kernel, {"logits_ptr": "fp32", "weights_ptr": "fp32", "ids_ptr": "i32"},
                   {"TOP_K": 8, "RENORMALIZE": True, "BLOCK_E": 128}),
    "grouped_gemm": (moe._grouped_gemm_kernel, {"weights_ptr": "fp32", "sorted_ids_ptr": "i32",
                                                "expert_of_block_ptr": "i32", "padded_total_ptr": "i32"},
                     {"SCALE_BY_WEIGHT": True, "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}),
    "rms_norm": (elementwise._rms_norm_kernel, {}, {"HAS_RESIDUAL": True, "BLOCK": 4096}),
    "silu_and_mul": (elementwise._silu_and_mul_kernel, {}, {"BLOCK": 1024}),
}


def signature(kernel: triton.runtime.JITFunction, pointers: dict[str, str],
              constants: dict[str, object]) -> dict[str, str]:
    """Argument types by name: ``*_ptr`` are pointers (bf16 unless listed), a few fp32 scalars, the rest i32."""
    types = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*" + pointers.get(name, "bf16")
        else:
            types[name] = SCALARS.get(name, "i32")
    missing = {n for n, t in types.items() if t == "constexpr"} - set(constants)
    if missing:
        raise ValueError(f"no constexpr values for {sorted(missing)}")
    return types


def main(backend: str, arch: str) -> int:
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, 32 if backend == "cuda" else 64)
    failures = 0
    for name, (kernel, pointers, constants) in KERNELS.items():
        try:
            triton.compile(ASTSource(kernel, signature(kernel, pointers, constants), constants), target=target)
            print(f"ok {name}")
        except Exception as exc:  # noqa: BLE001 - every compiler error is reported and counted
            failures += 1
            print(f"FAILED {name}: {type(exc).__name__}: {exc}")
    return failures


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
