"""What a device can run: Triton at all, and fp8 matrix multiplies."""

from __future__ import annotations

import importlib.util

import torch

from hetsched.errors import BackendUnavailableError


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it is part of the ``profile`` extra on Linux)."""
    return importlib.util.find_spec("triton") is not None


def fp8_dtype(device: str | torch.device) -> torch.dtype | None:
    """The fp8 (e4m3) dtype the device multiplies natively, or None where it has no fp8 tensor cores.

    NVIDIA from Ada/Hopper (compute capability 8.9) up use OCP e4m3fn; AMD
    MI300 (gfx94x) uses e4m3fnuz, MI350 (gfx95x) and RDNA4 (gfx12) e4m3fn.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(dev).gcnArchName
        if arch.startswith("gfx94"):
            return torch.float8_e4m3fnuz
        return torch.float8_e4m3fn if arch.startswith(("gfx95", "gfx12")) else None
    return torch.float8_e4m3fn if torch.cuda.get_device_capability(dev) >= (8, 9) else None


def require_triton_device(*tensors: torch.Tensor, interpreting: bool) -> None:
    """Triton compiles for CUDA and ROCm devices; CPU tensors need the interpreter (``TRITON_INTERPRET=1``)."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreting:
            raise BackendUnavailableError(
                f"Triton kernels run on CUDA or ROCm devices, not {t.device.type}; "
                "set TRITON_INTERPRET=1 before the first call to interpret them on the CPU, "
                "or use the torch reference")
