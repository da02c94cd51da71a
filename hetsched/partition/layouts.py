"""The partition layouts a pool's GPUs may take: maximal MIG layouts, or one AMD compute/memory mode per share.

The optimizer prices each layout as a unit (one GPU holding its instance counts) and packs instances onto it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetsched.catalog import Accelerator
from hetsched.partition.mig import enumerate_layouts


@dataclass(frozen=True)
class PartitionLayout:
    """A way to partition one GPU: a MIG layout or an AMD partition mode, as instance counts."""

    key: str
    counts: Mapping[str, int]
    gpus: float = 1.0
    """GPUs one unit of the layout takes: 1 for a real layout; a share for a single instance priced alone."""


def partition_layouts(accelerator: Accelerator) -> tuple[PartitionLayout, ...]:
    """Maximal MIG layouts (a smaller one is a maximal one with idle instances), or one per AMD mode."""
    if accelerator.mig is not None:
        return tuple(PartitionLayout(layout.key, layout.counts)
                     for layout in enumerate_layouts(accelerator.mig, maximal_only=True)
                     if not _is_whole(accelerator, layout.counts))
    if accelerator.amd_partitions is not None:
        return tuple(PartitionLayout(f"{n}x{mode}", {mode: n}) for mode, n in amd_modes(accelerator).items())
    return ()


def partition_profiles(accelerator: Accelerator) -> list[str]:
    """Instance kinds a partitioned GPU of this type offers (full-GPU MIG profile excluded)."""
    if accelerator.mig is not None:
        return [p.name for p in accelerator.mig.profiles if p.compute_slices < accelerator.mig.compute_slices]
    if accelerator.amd_partitions is not None:
        return list(amd_modes(accelerator))
    return []


def amd_modes(accelerator: Accelerator) -> dict[str, int]:
    """One mode per partition count (modes with equal shares are the same to the optimizer), SPX excluded."""
    assert accelerator.amd_partitions is not None
    modes: dict[str, int] = {}
    for mode in accelerator.amd_partitions.valid_modes():
        n = accelerator.amd_partitions.compute_modes[mode.split("_")[0]]
        if n > 1 and n not in modes.values():
            modes[mode] = n
    return modes


def _is_whole(accelerator: Accelerator, counts: Mapping[str, int]) -> bool:
    """A layout of one full-GPU instance is the whole GPU; whole-GPU options cover it."""
    assert accelerator.mig is not None
    return len(counts) == 1 and accelerator.mig.profile(next(iter(counts))).compute_slices == accelerator.mig.compute_slices
