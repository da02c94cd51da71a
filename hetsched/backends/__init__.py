"""Backends: where the profiler's operators run (NVIDIA, ROCm, CPU) and what the device reports.

Importing this package does not import torch; :func:`get_backend` does, and
says clearly when a runtime is missing.
"""

from __future__ import annotations

from hetsched.backends.base import (Backend, BackendKind, DeviceInfo, HostClock, MigInstance, Timing, TimingPolicy,
                                    summarize_samples)
from hetsched.backends.select import available_backends, detect_backend, get_backend

__all__ = [
    "Backend", "BackendKind", "DeviceInfo", "HostClock", "MigInstance", "Timing", "TimingPolicy", "available_backends",
    "detect_backend", "get_backend", "summarize_samples",
]
