"""GPU backends: CUDA (NVIDIA) and HIP (ROCm) through torch, timed with device events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetsched.backends.base import BackendKind, DeviceInfo, Timing, TimingPolicy, time_calls
from hetsched.backends.telemetry import AmdSmiReader, NvmlReader, describe_amd, describe_nvidia
from hetsched.errors import BackendUnavailableError, InputError


def check_gpu_runtime(kind: BackendKind, index: int) -> None:
    """Raise a clear error unless torch was built for ``kind`` and device ``index`` exists."""
    built = torch.version.hip if kind is BackendKind.ROCM else torch.version.cuda
    flavour = "ROCm (HIP)" if kind is BackendKind.ROCM else "CUDA"
    if not built:
        raise BackendUnavailableError(
            f"the {kind} backend needs a torch build with {flavour}; this torch ({torch.__version__}) has none "
            f"(install a {flavour} wheel of torch, or use --backend cpu)")
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"the {kind} backend found no usable {flavour} device (driver missing or no GPU "
                                      f"visible); use --backend cpu")
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise InputError(f"expected a device index in 0..{count - 1}, got {index}", field="--device")


@dataclass
class GpuBackend:
    """Kernels on one CUDA or HIP device; telemetry from NVML or amdsmi when they are present."""

    kind: BackendKind
    index: int = 0

    def __post_init__(self) -> None:
        check_gpu_runtime(self.kind, self.index)

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}"

    def info(self) -> DeviceInfo:
        runtime = f"torch {torch.__version__}, " + (f"HIP {torch.version.hip}" if self.kind is BackendKind.ROCM
                                                     else f"CUDA {torch.version.cuda}")
        vendor_info = self._vendor_info(runtime)
        if vendor_info is not None:
            return vendor_info
        props = torch.cuda.get_device_properties(self.index)
        return DeviceInfo(backend=self.kind, index=self.index, name=props.name, memory_gb=props.total_memory / 1e9,
                          runtime=runtime, compute_units=props.multi_processor_count,
                          extra={"telemetry": "torch only (vendor library not available)"})

    def _vendor_info(self, runtime: str) -> DeviceInfo | None:
        if self.kind is BackendKind.NVIDIA:
            try:
                import pynvml
            except ImportError:
                return None
            try:
                return describe_nvidia(NvmlReader(pynvml).read(self.index), self.index, runtime=runtime)
            except pynvml.NVMLError:
                return None
        try:
            import amdsmi
        except (ImportError, KeyError, OSError):
            return None
        try:
            return describe_amd(AmdSmiReader(amdsmi).read(self.index), self.index, runtime=runtime)
        except amdsmi.AmdSmiException:
            return None

    def time(self, call: Callable[[], object], policy: TimingPolicy) -> Timing:
        with torch.cuda.device(torch.device(self.torch_device)):
            return time_calls(call, policy, self._timed)

    @staticmethod
    def _timed(call: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
