"""Facts about the host CPU, for the catalog's CPU entry."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostInfo:
    cores: int
    memory_gb: float
    cpu_model: str
    clock_ghz: float


def read_host() -> HostInfo:
    """Read cores (usable by this process), memory and CPU model of this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    model, mhz = platform.processor() or platform.machine(), 0.0
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "cpu MHz" and not mhz:
                mhz = float(value)
    return HostInfo(cores=cores, memory_gb=memory_gb, cpu_model=model, clock_ghz=(mhz / 1000) or 2.5)
