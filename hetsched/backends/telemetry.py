"""Device telemetry: thin readers over pynvml / amdsmi, and pure functions that interpret what they return.

The readers take the vendor module as an argument (the real ``pynvml`` or
``amdsmi``, or any object with the same functions), collect raw values and
turn each failing call into ``None``; :func:`describe_nvidia` and
:func:`describe_amd` turn those raw values into a :class:`DeviceInfo`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hetsched.backends.base import BackendKind, DeviceInfo, MigInstance

T = TypeVar("T")

_MIG_NAME = re.compile(r"MIG\s+(\d+g\.\d+gb)", re.IGNORECASE)


@dataclass(frozen=True)
class NvidiaRaw:
    """What NVML said about one GPU (``None`` where the call failed or is unsupported)."""

    name: str | bytes | None
    memory_total_bytes: int | None
    driver_version: str | bytes | None
    cuda_driver_version: int | None
    sm_clock_mhz: int | None
    sm_max_clock_mhz: int | None
    mem_max_clock_mhz: int | None
    power_mw: int | None
    power_limit_mw: int | None
    mig_mode: tuple[int, int] | None
    mig_devices: list[tuple[str | bytes | None, int | None, str | bytes | None]] = field(default_factory=list)


@dataclass(frozen=True)
class AmdRaw:
    """What amdsmi said about one GPU (``None`` where the call failed)."""

    asic: dict[str, Any] | None
    vram: dict[str, Any] | None
    driver: dict[str, Any] | None
    gfx_clock: dict[str, Any] | None
    power: dict[str, Any] | None
    compute_partition: str | None
    memory_partition: str | None


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_nvidia(raw: NvidiaRaw, index: int, *, runtime: str = "") -> DeviceInfo:
    """Interpret NVML values: units to GB/W/MHz, MIG mode and instance profiles from device names."""
    clocks = {k: float(v) for k, v in (("sm", raw.sm_clock_mhz), ("sm_max", raw.sm_max_clock_mhz),
                                        ("memory_max", raw.mem_max_clock_mhz)) if v is not None}
    power = {k: v / 1000.0 for k, v in (("draw", raw.power_mw), ("limit", raw.power_limit_mw)) if v is not None}
    instances = []
    for name, memory, uuid in raw.mig_devices:
        match = _MIG_NAME.search(_text(name))
        instances.append(MigInstance(profile=match.group(1) if match else _text(name),
                                     memory_gb=(memory or 0) / 1e9, uuid=_text(uuid)))
    cuda = raw.cuda_driver_version
    extra = {"cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}"} if cuda else {}
    return DeviceInfo(
        backend=BackendKind.NVIDIA, index=index, name=_text(raw.name) or f"NVIDIA GPU {index}",
        memory_gb=(raw.memory_total_bytes or 0) / 1e9, driver=_text(raw.driver_version), runtime=runtime,
        clocks_mhz=clocks, power_w=power, mig_enabled=None if raw.mig_mode is None else bool(raw.mig_mode[0]),
        mig_instances=tuple(instances), extra=extra,
    )


def describe_amd(raw: AmdRaw, index: int, *, runtime: str = "") -> DeviceInfo:
    """Interpret amdsmi values: VRAM in MB, power in W, clocks in MHz, compute/memory partition."""
    asic, vram, clock, power = raw.asic or {}, raw.vram or {}, raw.gfx_clock or {}, raw.power or {}
    clocks = {k: float(clock[src]) for k, src in (("gfx", "clk"), ("gfx_max", "max_clk"))
              if isinstance(clock.get(src), int | float)}
    watts = {}
    for key, sources in (("draw", ("current_socket_power", "average_socket_power")), ("limit", ("power_limit",))):
        value = next((power[s] for s in sources if isinstance(power.get(s), int | float)), None)
        if value is not None:
            watts[key] = float(value) / (1e6 if key == "limit" and value > 1e5 else 1.0)  # limit may be in µW
    partition = "_".join(p.lower() for p in (raw.compute_partition, raw.memory_partition) if p)
    extra: dict[str, Any] = {"partition": partition} if partition else {}
    if asic.get("device_id"):
        extra["device_id"] = str(asic["device_id"])
    return DeviceInfo(
        backend=BackendKind.ROCM, index=index, name=str(asic.get("market_name") or f"AMD GPU {index}"),
        memory_gb=float(vram.get("vram_size", 0) or 0) * 2**20 / 1e9,
        driver=str((raw.driver or {}).get("driver_version", "")),
        runtime=runtime, compute_units=int(asic.get("num_compute_units", 0) or 0), clocks_mhz=clocks, power_w=watts,
        extra=extra,
    )


class NvmlReader:
    """Reads NVML through a pynvml-like module; each unsupported query becomes ``None``."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def _try(self, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except self.nvml.NVMLError:
            return None

    def read(self, index: int) -> NvidiaRaw:
        n = self.nvml
        n.nvmlInit()
        try:
            handle = n.nvmlDeviceGetHandleByIndex(index)
            mig = self._try(lambda: tuple(n.nvmlDeviceGetMigMode(handle)))
            devices = []
            if mig and mig[0]:
                for i in range(self._try(lambda: n.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):
                    sub = self._try(functools.partial(n.nvmlDeviceGetMigDeviceHandleByIndex, handle, i))
                    if sub is None:
                        continue
                    memory = self._try(functools.partial(n.nvmlDeviceGetMemoryInfo, sub))
                    devices.append((self._try(functools.partial(n.nvmlDeviceGetName, sub)),
                                    memory.total if memory is not None else None,
                                    self._try(functools.partial(n.nvmlDeviceGetUUID, sub))))
            memory = self._try(lambda: n.nvmlDeviceGetMemoryInfo(handle))
            return NvidiaRaw(
                name=self._try(lambda: n.nvmlDeviceGetName(handle)),
                memory_total_bytes=memory.total if memory is not None else None,
                driver_version=self._try(n.nvmlSystemGetDriverVersion),
                cuda_driver_version=self._try(n.nvmlSystemGetCudaDriverVersion),
                sm_clock_mhz=self._try(lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_SM)),
                sm_max_clock_mhz=self._try(lambda: n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_SM)),
                mem_max_clock_mhz=self._try(lambda: n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_MEM)),
                power_mw=self._try(lambda: n.nvmlDeviceGetPowerUsage(handle)),
                power_limit_mw=self._try(lambda: n.nvmlDeviceGetEnforcedPowerLimit(handle)),
                mig_mode=mig, mig_devices=devices,
            )
        finally:
            n.nvmlShutdown()


class AmdSmiReader:
    """Reads amdsmi through an amdsmi-like module; each failing query becomes ``None``."""

    def __init__(self, amdsmi: Any) -> None:
        self.amdsmi = amdsmi

    def _try(self, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except self.amdsmi.AmdSmiException:
            return None

    def read(self, index: int) -> AmdRaw:
        a = self.amdsmi
        a.amdsmi_init()
        try:
            handle = a.amdsmi_get_processor_handles()[index]
            return AmdRaw(
                asic=self._try(lambda: a.amdsmi_get_gpu_asic_info(handle)),
                vram=self._try(lambda: a.amdsmi_get_gpu_vram_info(handle)),
                driver=self._try(lambda: a.amdsmi_get_gpu_driver_info(handle)),
                gfx_clock=self._try(lambda: a.amdsmi_get_clock_info(handle, a.AmdSmiClkType.GFX)),
                power=self._try(lambda: a.amdsmi_get_power_info(handle)),
                compute_partition=self._try(lambda: a.amdsmi_get_gpu_compute_partition(handle)),
                memory_partition=self._try(lambda: a.amdsmi_get_gpu_memory_partition(handle)),
            )
        finally:
            a.amdsmi_shut_down()
