"""Backends: timing summaries, telemetry interpretation over fake vendor libraries, availability errors."""

from __future__ import annotations

import pytest

from hetsched.backends import BackendKind, TimingPolicy, get_backend, summarize_samples
from hetsched.backends.telemetry import AmdSmiReader, NvmlReader, describe_amd, describe_nvidia
from hetsched.errors import BackendUnavailableError
from hetsched.profiler.driver import accelerator_id


def test_timing_summary_keeps_median_and_p90() -> None:
    timing = summarize_samples([5.0, 1.0, 2.0, 4.0, 3.0, 10.0, 6.0, 7.0, 8.0, 9.0])
    assert timing.median_s == 5.5
    assert timing.p90_s == 9.0
    assert timing.repeats == 10
    with pytest.raises(ValueError):
        summarize_samples([])


def test_short_operators_get_more_repeats_within_bounds() -> None:
    policy = TimingPolicy(min_repeats=3, max_repeats=50, min_total_s=0.1)
    assert policy.repeats_for(1.0) == 3
    assert policy.repeats_for(0.01) == 10
    assert policy.repeats_for(1e-7) == 50


class FakeNvml:
    """The subset of pynvml the reader uses, for an H100 in MIG mode with two instances."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    class NVMLError(Exception):
        pass

    class _Memory:
        def __init__(self, total: int) -> None:
            self.total = total

    def __init__(self) -> None:
        self.initialised = 0

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes | str:
        return {"gpu0": b"NVIDIA H100 80GB HBM3", "mig0": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                "mig1": "NVIDIA H100 80GB HBM3 MIG 1g.10gb"}[handle]

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> _Memory:
        return self._Memory({"gpu0": 80_000_000_000, "mig0": 40_000_000_000, "mig1": 10_000_000_000}[handle])

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return f"MIG-{handle}"

    def nvmlSystemGetDriverVersion(self) -> str:
        return "560.35.03"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12060

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return 1755

    def nvmlDeviceGetMaxClockInfo(self, handle: str, clock: int) -> int:
        return 1980 if clock == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: str) -> int:
        return 700_000

    def nvmlDeviceGetMigMode(self, handle: str) -> list[int]:
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, index: int) -> str:
        if index == 2:
            raise self.NVMLError("Not Found")
        return f"mig{index}"


def test_nvidia_telemetry_from_nvml() -> None:
    nvml = FakeNvml()
    info = describe_nvidia(NvmlReader(nvml).read(0), 0, runtime="torch 2.x")
    assert nvml.initialised == 0  # shut down again
    assert info.backend is BackendKind.NVIDIA
    assert info.name == "NVIDIA H100 80GB HBM3"
    assert info.memory_gb == pytest.approx(80.0)
    assert info.driver == "560.35.03"
    assert info.extra["cuda_driver"] == "12.6"
    assert info.clocks_mhz == {"sm": 1755.0, "sm_max": 1980.0, "memory_max": 2619.0}
    assert info.power_w == {"limit": 700.0}  # the draw is unsupported on this device: left out, not zero
    assert info.mig_enabled is True
    assert [(m.profile, m.memory_gb) for m in info.mig_instances] == [("3g.40gb", 40.0), ("1g.10gb", 10.0)]
    assert info.product_label == "NVIDIA-H100-80GB-HBM3"


def test_nvidia_device_maps_to_catalog_ids() -> None:
    device = {"backend": "nvidia", "name": "NVIDIA H100 80GB HBM3", "mig_enabled": False, "mig_instances": []}
    assert accelerator_id(device) == "h100-sxm"
    mig = {**device, "mig_enabled": True, "mig_instances": [{"profile": "3g.40gb", "memory_gb": 40.0}]}
    assert accelerator_id(mig) == "h100-sxm:3g.40gb"
    assert accelerator_id({"backend": "nvidia", "name": "NVIDIA Future GPU"}) == "nvidia-future-gpu"
    assert accelerator_id({"backend": "cpu", "name": "AMD EPYC"}) == "cpu"


class FakeAmdSmi:
    """The subset of amdsmi the reader uses, for an MI300X in CPX/NPS4."""

    class AmdSmiException(Exception):
        pass

    class AmdSmiClkType:
        GFX = "gfx"

    def amdsmi_init(self) -> None:
        pass

    def amdsmi_shut_down(self) -> None:
        pass

    def amdsmi_get_processor_handles(self) -> list[str]:
        return ["h0"]

    def amdsmi_get_gpu_asic_info(self, handle: str) -> dict[str, object]:
        return {"market_name": "AMD Instinct MI300X", "num_compute_units": 38, "device_id": "0x74a1"}

    def amdsmi_get_gpu_vram_info(self, handle: str) -> dict[str, object]:
        return {"vram_size": 49152}

    def amdsmi_get_gpu_driver_info(self, handle: str) -> dict[str, object]:
        return {"driver_version": "6.8.5"}

    def amdsmi_get_clock_info(self, handle: str, kind: str) -> dict[str, object]:
        return {"clk": 2100, "max_clk": 2100}

    def amdsmi_get_power_info(self, handle: str) -> dict[str, object]:
        return {"current_socket_power": "N/A", "average_socket_power": 350, "power_limit": 750}

    def amdsmi_get_gpu_compute_partition(self, handle: str) -> str:
        return "CPX"

    def amdsmi_get_gpu_memory_partition(self, handle: str) -> str:
        raise self.AmdSmiException("not supported")


def test_amd_telemetry_from_amdsmi() -> None:
    info = describe_amd(AmdSmiReader(FakeAmdSmi()).read(0), 0)
    assert info.backend is BackendKind.ROCM
    assert info.name == "AMD Instinct MI300X"
    assert info.memory_gb == pytest.approx(49152 * 2**20 / 1e9)
    assert info.compute_units == 38
    assert info.clocks_mhz == {"gfx": 2100.0, "gfx_max": 2100.0}
    assert info.power_w == {"draw": 350.0, "limit": 750.0}
    assert info.extra["partition"] == "cpx"
    assert info.driver == "6.8.5"


def test_cpu_backend_reports_the_host_and_times_calls() -> None:
    backend = get_backend(BackendKind.CPU)
    info = backend.info()
    assert info.backend is BackendKind.CPU and info.compute_units >= 1 and info.memory_gb > 0
    calls = []
    timing = backend.time(lambda: calls.append(1), TimingPolicy(warmup=2, min_repeats=3, max_repeats=5, min_total_s=0))
    assert timing.repeats == 3 and len(calls) == 5
    assert 0 < timing.median_s <= timing.p90_s


@pytest.mark.parametrize("kind", [BackendKind.NVIDIA, BackendKind.ROCM])
def test_missing_gpu_runtime_is_a_clear_error(kind: BackendKind) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runtime is present")
    with pytest.raises(BackendUnavailableError, match=f"the {kind} backend .*--backend cpu"):
        get_backend(kind)


def test_process_clock_counts_work_not_waiting() -> None:
    import time

    from hetsched.backends.cpu import HostClock, time_host_call

    policy = TimingPolicy(warmup=0, min_repeats=3, max_repeats=3, min_total_s=0)
    wall = time_host_call(lambda: time.sleep(0.02), policy, HostClock.WALL)
    cpu = time_host_call(lambda: time.sleep(0.02), policy, HostClock.PROCESS)
    assert wall.median_s >= 0.02
    assert cpu.median_s < 0.01
