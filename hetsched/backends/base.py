"""The interface every backend implements, and the timing summary they share."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class BackendKind(StrEnum):
    """Where kernels run: NVIDIA (CUDA), AMD (HIP/ROCm) or the host CPU (torch ops)."""

    NVIDIA = "nvidia"
    ROCM = "rocm"
    CPU = "cpu"


class HostClock(StrEnum):
    """What a CPU timing counts: elapsed wall time, or CPU time of this process.

    Wall time (``perf_counter_ns``) is what a dedicated host serves at. On a
    shared host other processes' load inflates it; CPU time of a one-thread
    process counts only the work itself and stays comparable between runs.
    """

    WALL = "wall"
    PROCESS = "process"


@dataclass(frozen=True)
class Timing:
    """Latency of one operator call over ``repeats`` timed runs after warm-up."""

    median_s: float
    p90_s: float
    repeats: int


def summarize_samples(samples_s: Sequence[float]) -> Timing:
    """Median and 90th percentile (nearest rank) of timed runs, in seconds."""
    if not samples_s:
        raise ValueError("no timing samples")
    ordered = sorted(samples_s)
    rank = max(0, min(len(ordered) - 1, -(-9 * len(ordered) // 10) - 1))
    return Timing(median_s=statistics.median(ordered), p90_s=ordered[rank], repeats=len(ordered))


@dataclass(frozen=True)
class TimingPolicy:
    """How long to time an operator: warm-up calls, then repeats until ``min_total_s`` (within bounds)."""

    warmup: int = 2
    min_repeats: int = 3
    max_repeats: int = 50
    min_total_s: float = 0.05

    def repeats_for(self, first_call_s: float) -> int:
        """Enough repeats that short operators are timed over ``min_total_s``."""
        wanted = int(self.min_total_s / max(first_call_s, 1e-9))
        return max(self.min_repeats, min(self.max_repeats, wanted))


def time_calls(call: Callable[[], object], policy: TimingPolicy, timed: Callable[[Callable[[], object]], float]
               ) -> Timing:
    """``policy``'s warm-up calls, then its repeats of ``timed(call)`` (seconds one call took), summarised."""
    for _ in range(policy.warmup):
        call()
    samples = [timed(call)]
    for _ in range(policy.repeats_for(samples[0]) - 1):
        samples.append(timed(call))
    return summarize_samples(samples)


@dataclass(frozen=True)
class MigInstance:
    """One MIG GPU instance as the driver reports it."""

    profile: str
    memory_gb: float
    uuid: str = ""


@dataclass(frozen=True)
class DeviceInfo:
    """What a backend knows about the device it times on: recorded as profile provenance."""

    backend: BackendKind
    index: int
    name: str
    memory_gb: float
    driver: str = ""
    runtime: str = ""
    compute_units: int = 0
    clocks_mhz: dict[str, float] = field(default_factory=dict)
    power_w: dict[str, float] = field(default_factory=dict)
    mig_enabled: bool | None = None
    mig_instances: tuple[MigInstance, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def product_label(self) -> str:
        """The name as a Kubernetes node label value spells it (spaces become dashes)."""
        return "-".join(self.name.split())


class Backend(Protocol):
    """Runs and times operator calls on one device."""

    kind: BackendKind
    index: int

    @property
    def torch_device(self) -> str:
        """Where tensors for this backend live, e.g. ``cpu`` or ``cuda:0``."""
        ...

    def info(self) -> DeviceInfo:
        """Telemetry: name, memory, clocks, power, partitions."""
        ...

    def time(self, call: Callable[[], object], policy: TimingPolicy) -> Timing:
        """Warm up, then time repeated calls of ``call``."""
        ...
