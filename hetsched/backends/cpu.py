"""The CPU backend: torch ops on the host, timed with ``perf_counter_ns``."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetsched.backends.base import BackendKind, DeviceInfo, HostClock, Timing, TimingPolicy, time_calls
from hetsched.catalog.host import read_host


def time_host_call(call: Callable[[], object], policy: TimingPolicy, clock: HostClock = HostClock.WALL) -> Timing:
    """Timing of a synchronous call: warm-up, then ``policy``'s repeats."""
    now = time.perf_counter_ns if clock is HostClock.WALL else time.process_time_ns

    def timed(once: Callable[[], object]) -> float:
        start = now()
        once()
        return (now() - start) / 1e9

    return time_calls(call, policy, timed)


@dataclass
class CpuBackend:
    """Torch ops on the host CPU, with the threads torch is allowed to use."""

    index: int = 0
    kind: BackendKind = BackendKind.CPU
    clock: HostClock = HostClock.WALL

    @property
    def torch_device(self) -> str:
        return "cpu"

    def info(self) -> DeviceInfo:
        host = read_host()
        return DeviceInfo(
            backend=BackendKind.CPU, index=0, name=host.cpu_model, memory_gb=host.memory_gb,
            driver=platform.release(), runtime=f"torch {torch.__version__}", compute_units=host.cores,
            clocks_mhz={"base": host.clock_ghz * 1000},
            extra={"threads": torch.get_num_threads(), "machine": platform.machine(), "timing_clock": str(self.clock)},
        )

    def time(self, call: Callable[[], object], policy: TimingPolicy) -> Timing:
        return time_host_call(call, policy, self.clock)
