"""Inside the worker process: build an operator's inputs on the backend's device and time it.

GEMM and MoE weights are cycled through enough copies to exceed the last-level
cache, as in a real step where every layer's weights arrive cold.
"""

from __future__ import annotations

import itertools
import json
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, TypedDict, Unpack

import torch

from hetsched.backends import Backend, BackendKind, DeviceInfo, Timing, TimingPolicy, get_backend
from hetsched.backends import torch_ops as ops
from hetsched.backends.cpu import CpuBackend, HostClock
from hetsched.profiler.plan import Kernel, SweepPoint, SweepSettings

COLD_BYTES = 256 * 2**20
MAX_COPIES = 16

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


_REUSED: dict[tuple[object, ...], object] = {}


def _reused(key: tuple[object, ...], make: Callable[[], object]) -> Any:
    """Large inputs shared by consecutive points of one operator (only the latest kept)."""
    if key not in _REUSED:
        _REUSED.clear()
        _REUSED[key] = make()
    return _REUSED[key]


class _Placement(TypedDict):
    """Where a benchmark's tensors live: the keywords of torch's factories."""

    device: str
    dtype: torch.dtype


def _cold_weights(n: int, k: int, **kw: Unpack[_Placement]) -> Callable[[], torch.Tensor]:
    """Cycle through copies of an [n, k] weight that together exceed the last-level cache."""
    size = torch.tensor([], dtype=kw["dtype"]).element_size()
    count = max(1, min(MAX_COPIES, int(COLD_BYTES // max(n * k * size, 1))))
    copies = _reused(("gemm", n, k, *kw.values()), lambda: [torch.randn(n, k, **kw) * 0.02 for _ in range(count)])
    return itertools.cycle(copies).__next__


def build_triton_call(point: SweepPoint, *, device: str, dtype: torch.dtype) -> Callable[[], object] | None:
    """The registry's Triton kernel for ``point`` on a GPU, or None for operators without one."""
    from hetsched.kernels import KERNELS, KernelOp

    if point.kernel.value not in {o.value for o in KernelOp}:
        return None
    spec = KERNELS[KernelOp(point.kernel.value)]
    inputs = spec.make_inputs(dict(point.params), device, dtype)
    return lambda: spec.triton_impl(**inputs)


def build_call(point: SweepPoint, *, device: str, dtype: torch.dtype) -> Callable[[], object]:
    """A zero-argument call that runs ``point``'s operator once: Triton kernels on GPUs, torch ops elsewhere."""
    if device != "cpu":
        call = build_triton_call(point, device=device, dtype=dtype)
        if call is not None:
            return call
    p, kw = point.params, _Placement(device=device, dtype=dtype)
    k = point.kernel
    if k is Kernel.GEMM:
        x = torch.randn(p["m"], p["k"], **kw)
        weight = _cold_weights(p["n"], p["k"], **kw)
        return lambda: ops.gemm(x, weight())
    if k is Kernel.RMSNORM:
        x, w = torch.randn(p["m"], p["hidden"], **kw), torch.ones(p["hidden"], **kw)
        return lambda: ops.rms_norm(x, w)
    if k is Kernel.SILU_MUL:
        x = torch.randn(p["m"], 2 * p["inter"], **kw)
        return lambda: ops.silu_mul(x)
    if k is Kernel.ADD:
        a, b = torch.randn(p["m"], p["hidden"], **kw), torch.randn(p["m"], p["hidden"], **kw)
        return lambda: a + b
    if k is Kernel.EMBEDDING:
        table = _reused(("embedding", p["vocab"], p["hidden"], device, dtype),
                        lambda: torch.randn(p["vocab"], p["hidden"], **kw))
        ids = torch.randint(0, p["vocab"], (p["m"],), device=device)
        return lambda: torch.nn.functional.embedding(ids, table)
    if k is Kernel.ROPE:
        q = torch.randn(p["m"], p["heads"], p["head_dim"], **kw)
        key = torch.randn(p["m"], p["kv_heads"], p["head_dim"], **kw)
        cos, sin = ops.rope_tables(torch.arange(p["m"], device=device), p["head_dim"], dtype=dtype)
        return lambda: ops.rope(q, key, cos, sin)
    if k is Kernel.KV_WRITE:
        k_cache, v_cache = (torch.zeros(p["kv_heads"], p["m"] + 16, p["head_dim"], **kw) for _ in range(2))
        k_new, v_new = (torch.randn(p["m"], p["kv_heads"], p["head_dim"], **kw) for _ in range(2))

        def write() -> None:
            k_cache[:, 8:8 + p["m"]] = k_new.transpose(0, 1)
            v_cache[:, 8:8 + p["m"]] = v_new.transpose(0, 1)
        return write
    if k is Kernel.PREFILL_ATTENTION:
        context = p["new"] + p["cached"]
        q = torch.randn(p["heads"], p["new"], p["head_dim"], **kw)
        key = torch.randn(p["kv_heads"], context, p["head_dim"], **kw)
        value = torch.randn(p["kv_heads"], context, p["head_dim"], **kw)
        return lambda: ops.prefill_attention(q, key, value, p["cached"])
    if k is Kernel.DECODE_ATTENTION:
        q = torch.randn(p["batch"], p["heads"], p["head_dim"], **kw)
        key = torch.randn(p["batch"], p["kv_heads"], p["context"], p["head_dim"], **kw)
        value = torch.randn(p["batch"], p["kv_heads"], p["context"], p["head_dim"], **kw)
        return lambda: ops.decode_attention(q, key, value)
    if k is Kernel.MLA_DECODE_ATTENTION:
        width = p["kv_lora_rank"] + p["rope_dim"]
        q = torch.randn(p["batch"], p["heads"], width, **kw)
        latent = torch.randn(p["batch"], 1, p["context"], width, **kw)
        return lambda: ops.mla_decode_attention(q, latent, p["kv_lora_rank"])
    if k is Kernel.MOE:
        x = torch.randn(p["m"], p["hidden"], **kw)
        shape_key = tuple(sorted((n, v) for n, v in p.items() if n != "m"))
        router, gate_up, down = _reused(("moe", *shape_key, device, dtype), lambda: (
            torch.randn(p["experts"], p["hidden"], **kw),
            torch.randn(p["experts"], 2 * p["inter"], p["hidden"], **kw) * 0.02,
            torch.randn(p["experts"], p["hidden"], p["inter"], **kw) * 0.02))
        return lambda: ops.fused_moe(x, router, gate_up, down, p["top_k"])
    raise ValueError(f"no inputs for kernel {k}")


@dataclass
class KernelRunner:
    """Times sweep points on one backend; created inside the worker process."""

    backend: Backend
    settings: SweepSettings

    def __call__(self, point: SweepPoint) -> Timing:
        dtype = _DTYPES.get(self.settings.dtype, torch.bfloat16)
        call = build_call(point, device=self.backend.torch_device, dtype=dtype)
        policy = TimingPolicy(warmup=self.settings.warmup, min_repeats=self.settings.min_repeats,
                              max_repeats=self.settings.max_repeats, min_total_s=self.settings.min_total_s)
        with torch.inference_mode():
            return self.backend.time(call, policy)

    def describe(self) -> dict[str, Any]:
        return {"device": to_plain(self.backend.info()), "versions": library_versions()}


def to_plain(info: DeviceInfo) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(info), default=str))


def library_versions() -> dict[str, str]:
    """Versions that change kernel timings: python, torch, its GPU runtime, triton."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if torch.version.hip:
        versions["hip"] = torch.version.hip
    for name in ("triton", "hetsched"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def kernel_runner(kind: BackendKind, device: int, settings: SweepSettings) -> KernelRunner:
    """Runner factory for the worker: opens the backend in the worker process."""
    backend = get_backend(kind, device=device)
    if isinstance(backend, CpuBackend):
        backend.clock = HostClock(settings.host_clock)
        if settings.cpu_threads:
            torch.set_num_threads(settings.cpu_threads)
    return KernelRunner(backend=backend, settings=settings)
