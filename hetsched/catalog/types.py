"""Frozen types the catalog loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from hetsched.catalog.perf import PerfConstants
from hetsched.errors import InputError, NotFoundError
from hetsched.specs.dtypes import DType


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"
    CPU = "cpu"


PRODUCT_LABELS: dict[Vendor, str] = {Vendor.NVIDIA: "nvidia.com/gpu.product", Vendor.AMD: "amd.com/gpu.product-name",
                                     Vendor.CPU: "kubernetes.io/arch"}
"""Per vendor, the node label (set by its GPU feature discovery) whose value names the product."""


@dataclass(frozen=True)
class MigProfile:
    """One MIG instance kind on one GPU model, e.g. ``3g.40gb`` on an H100-80GB."""

    name: str
    kind: str
    compute_slices: int
    memory_slices: int
    max_count: int
    starts: tuple[int, ...]

    @property
    def memory_gb(self) -> float:
        return float(self.name.split(".")[1].removesuffix("gb"))


@dataclass(frozen=True)
class MigGeometry:
    """Slice rules of a MIG-capable GPU: profiles, slice counts and valid starts."""

    compute_slices: int
    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise NotFoundError("MIG profile", name, [p.name for p in self.profiles])


@dataclass(frozen=True)
class AmdPartitioning:
    """AMD compute/memory partition modes, e.g. MI300X SPX..CPX × NPS1/NPS4."""

    compute_modes: dict[str, int]
    memory_modes: dict[str, tuple[str, ...]]

    def valid_modes(self) -> list[str]:
        """All valid ``<compute>_<memory>`` combinations, e.g. ``cpx_nps4``."""
        return [f"{c}_{m}" for m, computes in self.memory_modes.items() for c in computes]

    def unpartitioned_mode(self) -> str:
        """The mode of a GPU that is one device (one compute partition), e.g. ``spx_nps1``."""
        return next(f"{c}_{m}" for m, computes in self.memory_modes.items() for c in computes
                    if self.compute_modes[c] == 1)


@dataclass(frozen=True)
class Accelerator:
    """One accelerator type; prices are defaults users override."""

    id: str
    name: str
    vendor: Vendor
    tflops: dict[DType, float]
    memory_gb: float
    memory_tbs: float
    interconnect_gbs: float
    """GPU-to-GPU link inside a node, the two-way total (NVLink, Infinity Fabric, PCIe)."""
    price_per_hour: float
    gpus_per_node: int
    products: tuple[str, ...] = ()
    mig: MigGeometry | None = None
    amd_partitions: AmdPartitioning | None = None
    perf: PerfConstants | None = None
    """Constants of the analytic step model (calibrated, or the generation's default)."""
    network_gbs: float = 0.0
    """This GPU's share of the node's network (RDMA/Ethernet) one way: what leaves the node, e.g. a KV cache."""
    compute_units: int = 0
    """Streaming multiprocessors (NVIDIA) or compute units (AMD); 0 where not listed (CPUs)."""
    clock_ghz: float = 0.0
    """Boost clock of those units."""

    @property
    def resource_name(self) -> str:
        return {Vendor.NVIDIA: "nvidia.com/gpu", Vendor.AMD: "amd.com/gpu", Vendor.CPU: "cpu"}[self.vendor]

    @property
    def product_label(self) -> str:
        """The node label whose value names this accelerator's product (one of :attr:`products`)."""
        return PRODUCT_LABELS[self.vendor]

    def peak_tflops(self, dtype: DType) -> float:
        """Dense peak for GEMMs in ``dtype``, falling back to the 16-bit rate where units are missing."""
        for candidate in (dtype.compute_dtype, DType.BF16, DType.FP16):
            if candidate in self.tflops:
                return self.tflops[candidate]
        return max(self.tflops.values())

    def with_price(self, price_per_hour: float) -> Accelerator:
        return replace(self, price_per_hour=price_per_hour)

    @property
    def one_way_link_gbs(self) -> float:
        """One direction of the GPU-to-GPU link: the catalog lists the two-way total."""
        return self.interconnect_gbs / 2


@dataclass(frozen=True)
class Device:
    """What one replica-unit runs on: a whole accelerator or one partition of it.

    A MIG instance gets its share of compute (compute slices / total) and of
    memory bandwidth (memory slices / total); its memory is the profile's.
    """

    accelerator: Accelerator
    profile: str | None = None
    compute_fraction: float = 1.0
    bandwidth_fraction: float = 1.0
    memory_gb: float = field(default=0.0)

    @classmethod
    def whole(cls, accelerator: Accelerator) -> Device:
        return cls(accelerator, memory_gb=accelerator.memory_gb)

    @classmethod
    def mig(cls, accelerator: Accelerator, profile_name: str) -> Device:
        if accelerator.mig is None:
            raise InputError(f"{accelerator.id} does not support MIG", field="profile")
        profile = accelerator.mig.profile(profile_name)
        geometry = accelerator.mig
        return cls(
            accelerator,
            profile=profile.name,
            compute_fraction=profile.compute_slices / geometry.compute_slices,
            bandwidth_fraction=profile.memory_slices / geometry.memory_slices,
            memory_gb=profile.memory_gb,
        )

    @classmethod
    def amd_partition(cls, accelerator: Accelerator, mode: str) -> Device:
        """One partition of an AMD GPU in ``<compute>_<memory>`` mode, e.g. ``cpx_nps4``."""
        if accelerator.amd_partitions is None:
            raise InputError(f"{accelerator.id} has no compute partitions", field="profile")
        valid = accelerator.amd_partitions.valid_modes()
        if mode not in valid:
            raise NotFoundError("AMD partition mode", mode, valid)
        share = 1.0 / accelerator.amd_partitions.compute_modes[mode.split("_")[0]]
        return cls(accelerator, profile=mode, compute_fraction=share, bandwidth_fraction=share,
                   memory_gb=accelerator.memory_gb * share)

    @classmethod
    def of(cls, accelerator: Accelerator, profile: str | None = None) -> Device:
        """A whole accelerator, or the named MIG profile / AMD partition of it."""
        if profile is None:
            return cls.whole(accelerator)
        if accelerator.amd_partitions is not None:
            return cls.amd_partition(accelerator, profile)
        return cls.mig(accelerator, profile)

    @property
    def id(self) -> str:
        return f"{self.accelerator.id}:{self.profile}" if self.profile else self.accelerator.id

    @property
    def memory_tbs(self) -> float:
        return self.accelerator.memory_tbs * self.bandwidth_fraction

    def peak_tflops(self, dtype: DType) -> float:
        return self.accelerator.peak_tflops(dtype) * self.compute_fraction

    @property
    def compute_units(self) -> int:
        """SMs/CUs this device runs blocks on (a MIG slice its share); 0 if unknown."""
        return int(round(self.accelerator.compute_units * self.compute_fraction))

    @property
    def compute_unit_cycles_per_s(self) -> float:
        """Cycles per second over this device's SMs/CUs: the on-chip limit of a memory-bound launch; 0 if unknown."""
        return self.accelerator.compute_units * self.accelerator.clock_ghz * 1e9 * self.compute_fraction
