"""Load the accelerator catalog YAML into frozen types, and query it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import yaml

from hetsched.catalog.host import HostInfo, read_host
from hetsched.catalog.perf import PerfConstants, PerfTable, parse_perf_table
from hetsched.catalog.types import Accelerator, AmdPartitioning, Device, MigGeometry, MigProfile, Vendor
from hetsched.errors import NotFoundError, SpecError
from hetsched.specs.dtypes import DType

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class CpuTemplate:
    name: str
    fp32_flops_per_cycle_per_core: float
    bf16_speedup: float
    memory_gbs_per_core: float
    max_memory_tbs: float
    price_per_core_hour: float
    network_gbs: float = 0.0
    perf: PerfConstants | None = None

    def accelerator(self, host: HostInfo) -> Accelerator:
        """The CPU entry for this host: peaks from its cores and clock."""
        fp32 = host.cores * host.clock_ghz * self.fp32_flops_per_cycle_per_core / 1e3
        return Accelerator(
            id="cpu",
            name=f"{self.name}: {host.cpu_model}, {host.cores} cores",
            vendor=Vendor.CPU,
            tflops={DType.FP32: fp32, DType.BF16: fp32 * self.bf16_speedup, DType.FP16: fp32 * self.bf16_speedup},
            memory_gb=host.memory_gb,
            memory_tbs=min(self.max_memory_tbs, host.cores * self.memory_gbs_per_core / 1e3),
            interconnect_gbs=0.0,
            price_per_hour=host.cores * self.price_per_core_hour,
            gpus_per_node=1,
            products=("amd64", "arm64"),
            perf=self.perf,
            network_gbs=self.network_gbs,
        )


@dataclass(frozen=True)
class Catalog:
    """The GPU accelerators by id, plus the CPU template and the host it describes."""

    accelerators: dict[str, Accelerator]
    cpu: CpuTemplate
    host: HostInfo | None = None
    """The machine ``cpu`` describes; None (no host read) leaves ``cpu`` unknown, so pure code stays pure."""

    def on_host(self, host: HostInfo) -> Catalog:
        """This catalog with ``cpu`` describing ``host``, for code that takes a catalog and never reads a host."""
        return replace(self, host=host)

    def get(self, accelerator_id: str, *, host: HostInfo | None = None) -> Accelerator:
        """Look up an accelerator by id; ``cpu`` is ``host``, else the catalog's own host."""
        host = host if host is not None else self.host
        if accelerator_id == "cpu" and host is not None:
            return self.cpu.accelerator(host)
        try:
            return self.accelerators[accelerator_id]
        except KeyError:
            known = [*self.accelerators, *(["cpu"] if host is not None else [])]
            raise NotFoundError("accelerator", accelerator_id, known,
                                hint="see 'hetsched accelerators list'") from None

    def device(self, device_id: str, *, host: HostInfo | None = None) -> Device:
        """``h100-sxm``, a MIG slice ``h100-sxm:3g.40gb`` or an AMD partition ``mi300x:cpx_nps4``."""
        accelerator_id, _, profile = device_id.partition(":")
        return Device.of(self.get(accelerator_id, host=host), profile or None)

    def by_product(self, product: str) -> Accelerator | None:
        """The accelerator a node label's product value names, or None when unknown."""
        base = product.split("-MIG-")[0]  # MIG 'single' strategy suffixes the product
        return next((a for a in self.accelerators.values() if base in a.products), None)

    def with_prices(self, prices: Mapping[str, float]) -> Catalog:
        """A copy with per-hour prices overridden by accelerator id."""
        unknown = [k for k in prices if k not in self.accelerators]
        if unknown:
            raise NotFoundError("accelerator", unknown[0], list(self.accelerators))
        accs = {k: (a.with_price(prices[k]) if k in prices else a) for k, a in self.accelerators.items()}
        return replace(self, accelerators=accs)

    def with_perf(self, constants: Mapping[str, PerfConstants]) -> Catalog:
        """A copy whose step-model constants are replaced by accelerator id (``cpu`` included)."""
        unknown = [k for k in constants if k not in self.accelerators and k != "cpu"]
        if unknown:
            raise NotFoundError("accelerator", unknown[0], [*self.accelerators, "cpu"])
        accs = {k: (replace(a, perf=constants[k]) if k in constants else a) for k, a in self.accelerators.items()}
        cpu = replace(self.cpu, perf=constants["cpu"]) if "cpu" in constants else self.cpu
        return replace(self, accelerators=accs, cpu=cpu)


def _bundled(name: str) -> str:
    return (resources.files("hetsched.catalog") / "data" / name).read_text()


def _parse_yaml(text: str | None, shipped: str) -> Any:
    """``text``, or the shipped file ``shipped`` when it is None, parsed as YAML.

    The shipped files go through libyaml where PyYAML has it: the same documents, parsed several times faster,
    which is most of what a quick command such as ``hetsched fit`` spends. Other text keeps the pure-Python
    parser, whose errors quote the offending line."""
    if text is None:
        return yaml.load(_bundled(shipped), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return yaml.safe_load(text)


def load_perf_table(text: str | None = None) -> PerfTable:
    """Parse the step-model constants YAML (the bundled file when ``text`` is None)."""
    try:
        raw = _parse_yaml(text, "perf_constants.yaml")
    except yaml.YAMLError as exc:
        raise SpecError(f"perf constants are not valid YAML: {exc}") from exc
    if not isinstance(raw, Mapping) or raw.get("schema_version") != SCHEMA_VERSION:
        raise SpecError(f"expected schema_version {SCHEMA_VERSION}", field="schema_version")
    return parse_perf_table(raw)


def load_catalog(text: str | None = None, *, perf: PerfTable | None = None) -> Catalog:
    """Parse catalog YAML (the bundled file when ``text`` is None), with each device's step-model constants."""
    perf = perf or load_perf_table()
    try:
        raw = _parse_yaml(text, "accelerators.yaml")
    except yaml.YAMLError as exc:
        raise SpecError(f"catalog is not valid YAML: {exc}") from exc
    if not isinstance(raw, Mapping) or raw.get("schema_version") != SCHEMA_VERSION:
        raise SpecError(f"expected schema_version {SCHEMA_VERSION}", field="schema_version")
    geometries = raw.get("partition_geometries", {})
    accelerators = {}
    for acc_id, entry in raw["accelerators"].items():
        accelerator = _parse_accelerator(acc_id, entry, geometries)
        accelerators[acc_id] = replace(accelerator, perf=perf.for_accelerator(acc_id, str(accelerator.vendor)))
    cpu = raw.get("cpu")
    if not isinstance(cpu, Mapping):
        raise SpecError("the catalog needs a cpu template", field="cpu")
    return Catalog(accelerators=accelerators, cpu=CpuTemplate(**cpu, perf=perf.for_accelerator("cpu", "cpu")))


def host_catalog() -> Catalog:
    """The bundled catalog with ``cpu`` describing this machine: what a shell that plans or serves here passes on.

    It reads the host, so only shells (CLI commands, servers) call it; core code takes the catalog it is given.
    """
    return load_catalog().on_host(read_host())


def _parse_accelerator(acc_id: str, entry: Mapping[str, Any], geometries: Mapping[str, Any]) -> Accelerator:
    where = f"accelerators.{acc_id}"
    try:
        tflops = {DType(k): float(v) for k, v in entry["tflops"].items()}
        mig, amd = _parse_partition(entry.get("partition"), geometries, where)
        return Accelerator(
            id=acc_id,
            name=entry["name"],
            vendor=Vendor(entry["vendor"]),
            tflops=tflops,
            memory_gb=float(entry["memory_gb"]),
            memory_tbs=float(entry["memory_tbs"]),
            interconnect_gbs=float(entry["interconnect_gbs"]),
            network_gbs=float(entry["network_gbs"]),
            price_per_hour=float(entry["price_per_hour"]),
            gpus_per_node=int(entry["gpus_per_node"]),
            products=tuple(entry.get("products", ())),
            **_compute_units(entry, where),
            mig=mig,
            amd_partitions=amd,
        )
    except KeyError as exc:
        raise SpecError("required field is missing", field=f"{where}.{exc.args[0]}") from exc
    except ValueError as exc:
        raise SpecError(str(exc), field=where) from exc


def _compute_units(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``compute_units`` and ``clock_ghz`` come together: the step model needs their product."""
    units, clock = entry.get("compute_units"), entry.get("clock_ghz")
    if units is None and clock is None:
        return {}
    for name, value in (("compute_units", units), ("clock_ghz", clock)):
        if value is None:
            raise SpecError("required with compute_units/clock_ghz", field=f"{where}.{name}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise SpecError(f"expected a finite number > 0, got {value!r}", field=f"{where}.{name}")
    assert clock is not None, "refused above"
    if not isinstance(units, int):
        raise SpecError(f"expected a whole number of SMs/CUs, got {units!r}", field=f"{where}.compute_units")
    return {"compute_units": units, "clock_ghz": float(clock)}


def _parse_partition(
    entry: Mapping[str, Any] | None, geometries: Mapping[str, Any], where: str
) -> tuple[MigGeometry | None, AmdPartitioning | None]:
    if entry is None:
        return None, None
    geometry = geometries.get(entry["geometry"])
    if geometry is None:
        raise SpecError(f"unknown geometry {entry['geometry']!r}", field=f"{where}.partition.geometry")
    if geometry["kind"] == "amd":
        return None, AmdPartitioning(
            compute_modes=dict(geometry["compute_modes"]),
            memory_modes={k: tuple(v) for k, v in geometry["memory_modes"].items()},
        )
    names = entry["names"]
    profiles = tuple(
        MigProfile(name=names[kind], kind=kind, compute_slices=p["compute"], memory_slices=p["memory"],
                   max_count=p["max_count"], starts=tuple(p["starts"]))
        for kind, p in geometry["profiles"].items()
    )
    return MigGeometry(geometry["compute_slices"], geometry["memory_slices"], profiles), None
