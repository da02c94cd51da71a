"""Per-device constants of the analytic step model, and where each set came from.

Shipped in ``data/perf_constants.yaml``: sets calibrated from public measurements
of a device (``hetsched calibrate``), and generation defaults for devices nobody
has measured, each naming its source. A stored calibration replaces a device's
set through :meth:`hetsched.catalog.Catalog.with_perf`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from hetsched.errors import SpecError


@dataclass(frozen=True)
class GemmConstants:
    """A GEMM: a launch floor plus a smooth ridge between compute and weight streaming.

    ``time = floor + (c^p + m^p)^(1/p)`` with ``c`` the FLOPs at ``compute_efficiency`` of
    peak and ``m`` the bytes at ``memory_efficiency`` of bandwidth: a small M does not fill
    the tiles, so near the ridge both limits cost at once (``p = blend``).
    """

    floor_us: float
    compute_efficiency: float
    memory_efficiency: float
    blend: float


@dataclass(frozen=True)
class MemoryKernel:
    """A memory-bound launch: latency ``floor + per_row_ns · width`` and a transfer at the lower of two rates.

    The transfer moves ``bytes`` at ``efficiency`` of the memory bandwidth and, where
    ``bytes_per_cycle`` is set, at most that many bytes per SM (or CU) per clock cycle: on
    HBM GPUs norms, rope and gathers stay well below the memory's rate, limited by the
    units issuing loads, and that limit follows the unit count and clock, not the memory
    (see :func:`hetsched.perf.costs.memory_kernel_seconds`). Latency and transfer combine as
    ``(latency^p + transfer^p)^(1/p)`` with ``p = blend``: 1 adds them, a large blend takes the
    larger (small launches cost their latency until the transfer outgrows it). ``per_row_ns`` is
    the serial cost of one row's reduction (norms), paid even when few rows leave the device idle.
    """

    floor_us: float
    efficiency: float
    per_row_ns: float = 0.0
    blend: float = 1.0
    bytes_per_cycle: float = 0.0
    """Bytes per SM/CU per cycle the kernel reaches at most; 0: no on-chip limit (CPUs)."""


@dataclass(frozen=True)
class DecodeAttentionConstants:
    """Paged decode attention: a floor, a cost per sequence, and the KV read at a share of bandwidth.

    The share applies to a full device; one block per (sequence, query head) leaves SMs idle in a
    step's last wave, and the read slows by that wave's fill (see
    :func:`hetsched.perf.costs.decode_attention_seconds`).
    """

    floor_us: float
    per_seq_us: float
    efficiency: float


@dataclass(frozen=True)
class PrefillAttentionConstants:
    """Prefill attention: a floor, a cost per new token, and its FLOPs at a share of peak.

    The new tokens' causal triangle runs at ``efficiency``; their attention to a cached prefix
    at ``prefix_efficiency``. They differ: the triangle's diagonal blocks are half masked and
    its short rows fill the SMs less (on the A100 the triangle reaches about 23 % of peak, the
    prefix about 35 %).
    """

    floor_us: float
    per_token_ns: float
    efficiency: float
    prefix_efficiency: float


MIN_COLLECTIVE_BLEND = 0.5
"""Below this a collective's size term would outgrow its transfer at the sizes tensor parallelism moves."""


@dataclass(frozen=True)
class CollectiveConstants:
    """NCCL-style ring collectives over the link's one-way bandwidth.

    An all-reduce over ``n`` ranks of ``S`` bytes has latency ``base + 2(n-1)·step`` and transfer
    ``2(n-1)/n · S / (one-way link · bus_efficiency)``, combined as ``(latency^p + transfer^p)^(1/p)``
    with ``p = blend``. A blend above 1 overlaps a ring's steps with its transfer; one below 1 (down to
    ``MIN_COLLECTIVE_BLEND``) adds a term that grows as ``transfer^(1-p)``: NCCL spreads a larger message
    over more channels and larger chunks, so its bandwidth still rises with size long after the latency
    is paid (on the A100 an 8-GPU ring costs about 14 µs per MB from 2 to 16 MB, 8 µs per MB beyond).
    """

    base_us: float
    step_us: float
    bus_efficiency: float
    blend: float = 1.0


@dataclass(frozen=True)
class PerfConstants:
    """Everything device-specific the analytic step model needs, with its provenance."""

    source: str
    gemm: GemmConstants
    norm: MemoryKernel
    rope: MemoryKernel
    activation: MemoryKernel
    residual_add: MemoryKernel
    embedding: MemoryKernel
    decode_attention: DecodeAttentionConstants
    prefill_attention: PrefillAttentionConstants
    collective: CollectiveConstants
    step_overhead_ms: float
    """Host-side time per engine step (scheduling, sampling, launches), for vLLM-style engines."""
    seq_overhead_us: float = 0.0
    """Host-side time per sequence in a step (its sampling, output processing, detokenizing)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scaled(self, factor: float) -> PerfConstants:
        """Every kernel ``factor`` times as long: floors and per-item costs times it, shares of peak over it.

        Each cost function is homogeneous of degree one in these terms, so this scales every kernel exactly.
        """
        def scale(group: Any) -> Any:
            values = {}
            for f in fields(group):
                value = getattr(group, f.name)
                if f.name == "blend":
                    values[f.name] = value
                elif "efficiency" in f.name or f.name == "bytes_per_cycle":
                    values[f.name] = value / factor
                else:
                    values[f.name] = value * factor
            return type(group)(**values)

        return replace(self, **{name: scale(getattr(self, name)) for name in _GROUPS})

    def with_source(self, source: str) -> PerfConstants:
        return perf_constants_from_dict({**self.to_dict(), "source": source}, where="constants")


_GROUPS: dict[str, type] = {
    "gemm": GemmConstants, "norm": MemoryKernel, "rope": MemoryKernel, "activation": MemoryKernel,
    "residual_add": MemoryKernel, "embedding": MemoryKernel, "decode_attention": DecodeAttentionConstants,
    "prefill_attention": PrefillAttentionConstants, "collective": CollectiveConstants,
}


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SpecError(f"expected a finite number >= 0, got {value!r}", field=where)
    return float(value)


def perf_constants_from_dict(data: Mapping[str, Any], *, where: str) -> PerfConstants:
    """Parse one constants set (YAML, the store, an export), naming the field that is wrong."""
    if not isinstance(data, Mapping):
        raise SpecError("expected a mapping of constants", field=where)
    missing = [name for name in (*_GROUPS, "source", "step_overhead_ms") if name not in data]
    if missing:
        raise SpecError("required field is missing", field=f"{where}.{missing[0]}")
    groups: dict[str, Any] = {}
    for name, cls in _GROUPS.items():
        entry = data[name]
        if not isinstance(entry, Mapping):
            raise SpecError("expected a mapping", field=f"{where}.{name}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(entry) - names)
        if unknown:
            raise SpecError(f"unknown field; expected one of {sorted(names)}", field=f"{where}.{name}.{unknown[0]}")
        try:
            groups[name] = cls(**{k: _number(v, f"{where}.{name}.{k}") for k, v in entry.items()})
        except TypeError as exc:
            raise SpecError(f"incomplete constants: {exc}", field=f"{where}.{name}") from exc
        if any(getattr(groups[name], f) == 0 for f in ("efficiency", "compute_efficiency", "memory_efficiency",
                                                        "bus_efficiency", "prefix_efficiency")
               if hasattr(groups[name], f)):
            raise SpecError("efficiencies must be > 0", field=f"{where}.{name}")
        lowest = MIN_COLLECTIVE_BLEND if cls is CollectiveConstants else 1.0
        if getattr(groups[name], "blend", 1.0) < lowest:
            raise SpecError(f"expected a blend >= {lowest:g}", field=f"{where}.{name}.blend")
    return PerfConstants(source=str(data["source"]),
                         step_overhead_ms=_number(data["step_overhead_ms"], f"{where}.step_overhead_ms"),
                         seq_overhead_us=_number(data.get("seq_overhead_us", 0.0), f"{where}.seq_overhead_us"),
                         **groups)


@dataclass(frozen=True)
class PerfTable:
    """The shipped constants: per calibrated device, and per vendor generation for the rest."""

    devices: dict[str, PerfConstants]
    generations: dict[str, PerfConstants]
    members: dict[str, str]
    """accelerator id → generation."""
    vendor_defaults: dict[str, str]
    """vendor → generation used for an accelerator no generation lists."""

    def for_accelerator(self, accelerator_id: str, vendor: str) -> PerfConstants:
        if accelerator_id in self.devices:
            return self.devices[accelerator_id]
        generation = self.members.get(accelerator_id) or self.vendor_defaults[vendor]
        return self.generations[generation]


def parse_perf_table(raw: Mapping[str, Any]) -> PerfTable:
    """``perf_constants.yaml``: ``devices`` (calibrated sets), ``generations`` (defaults and their members)."""
    devices = {acc: perf_constants_from_dict(entry, where=f"devices.{acc}")
               for acc, entry in (raw.get("devices") or {}).items()}
    generations: dict[str, PerfConstants] = {}
    members: dict[str, str] = {}
    for name, entry in (raw.get("generations") or {}).items():
        where = f"generations.{name}"
        if not isinstance(entry, Mapping):
            raise SpecError("expected a mapping", field=where)
        if "like" in entry:
            base = devices.get(entry["like"])
            if base is None:
                raise SpecError(f"unknown calibrated device {entry['like']!r}", field=f"{where}.like")
            overrides = {k: v for k, v in entry.items() if k not in ("like", "members", "note")}
            data = {**base.to_dict(), **overrides,
                    "source": f"{name} generation default, no measurements: {entry.get('note', '')}".strip()}
            generations[name] = perf_constants_from_dict(data, where=where)
        else:
            generations[name] = perf_constants_from_dict({k: v for k, v in entry.items() if k != "members"},
                                                         where=where)
        for member in entry.get("members", ()):
            members[str(member)] = name
    vendor_defaults = dict(raw.get("vendor_defaults") or {})
    for vendor, generation in vendor_defaults.items():
        if generation not in generations:
            raise SpecError(f"unknown generation {generation!r}", field=f"vendor_defaults.{vendor}")
    return PerfTable(devices=devices, generations=generations, members=members, vendor_defaults=vendor_defaults)
