"""Choose a backend: the one asked for, or the best one this machine has."""

from __future__ import annotations

from types import ModuleType

from hetsched.backends.base import Backend, BackendKind
from hetsched.errors import BackendUnavailableError


def _import_torch() -> ModuleType:
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError(
            "profiling needs torch, which is not installed (pip install 'hetsched[profile]')") from exc
    return torch


def detect_backend() -> BackendKind:
    """NVIDIA if torch sees a CUDA device, ROCm if it sees a HIP device, else the CPU."""
    torch = _import_torch()
    if torch.cuda.is_available():
        return BackendKind.ROCM if torch.version.hip else BackendKind.NVIDIA
    return BackendKind.CPU


def get_backend(kind: BackendKind | None = None, *, device: int = 0) -> Backend:
    """The backend ``kind`` on device ``device`` (auto-detected when ``kind`` is None).

    Raises BackendUnavailableError, saying what is missing, when its runtime is not here.
    """
    _import_torch()
    kind = kind or detect_backend()
    if kind is BackendKind.CPU:
        from hetsched.backends.cpu import CpuBackend

        return CpuBackend()
    from hetsched.backends.gpu import GpuBackend

    return GpuBackend(kind=kind, index=device)


def available_backends() -> dict[BackendKind, str]:
    """Each backend kind with an empty string if usable here, else the reason it is not."""
    result = {}
    for kind in BackendKind:
        try:
            get_backend(kind)
            result[kind] = ""
        except BackendUnavailableError as exc:
            result[kind] = str(exc)
    return result
