"""MIG layouts: which sets of instances fit on one GPU, and where.

Rules (NVIDIA MIG, A100/H100/H200/B200 and A30): each instance occupies
``memory_slices`` consecutive memory slices from one of its valid start
positions; instances never overlap in memory; their compute slices add up to
at most the GPU's; no profile exceeds its max count.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hetsched.catalog.types import MigGeometry, MigProfile
from hetsched.errors import InputError


@dataclass(frozen=True)
class MigPlacement:
    """One instance at a start memory slice."""

    profile: str
    start: int


@dataclass(frozen=True)
class MigLayout:
    """A valid set of instances on one GPU, with positions that realise it."""

    placements: tuple[MigPlacement, ...]

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(p.profile for p in self.placements))

    @property
    def key(self) -> str:
        """Stable name, e.g. ``1x3g.40gb+2x2g.20gb``, largest instances first."""
        return "+".join(f"{n}x{name}" for name, n in sorted(self.counts.items(), key=lambda kv: larger_first(kv[0])))


_PROFILE_NAME = re.compile(r"(\d+)g\.(\d+)gb")


def larger_first(profile_name: str) -> tuple[int, int, str]:
    """Sort key of a MIG profile name (``3g.40gb``): more compute slices first, then more memory, then by name.

    The order the MIG manager creates instances in (``mig-parted`` sorts a GPU's instances by slices, largest
    first), so that the large ones get their few valid start positions before small ones fragment the GPU.
    """
    match = _PROFILE_NAME.search(profile_name)
    if match is None:
        return (0, 0, profile_name)
    return (-int(match.group(1)), -int(match.group(2)), profile_name)


def check_layout(geometry: MigGeometry, placements: Iterable[MigPlacement]) -> str | None:
    """Why these placements are not a valid layout, or None when they are."""
    used = [False] * geometry.memory_slices
    compute = 0
    counts: Counter[str] = Counter()
    for placement in placements:
        profile = geometry.profile(placement.profile)
        if placement.start not in profile.starts:
            return f"{profile.name} cannot start at memory slice {placement.start} (valid: {list(profile.starts)})"
        span = range(placement.start, placement.start + profile.memory_slices)
        if any(used[i] for i in span):
            return f"{profile.name} at slice {placement.start} overlaps another instance in memory"
        for i in span:
            used[i] = True
        compute += profile.compute_slices
        counts[profile.name] += 1
        if counts[profile.name] > profile.max_count:
            return f"at most {profile.max_count} × {profile.name} fit on one GPU"
    if compute > geometry.compute_slices:
        return f"{compute} compute slices requested, the GPU has {geometry.compute_slices}"
    return None


def place(geometry: MigGeometry, counts: Mapping[str, int]) -> MigLayout | None:
    """Positions for a multiset of profiles, or None when no valid placement exists.

    Largest instances are placed first (as the MIG manager creates them) and
    each at the lowest free valid start; backtracking covers the rest.
    """
    wanted = sorted(
        (geometry.profile(name) for name, n in counts.items() for _ in range(n)),
        key=lambda p: (-p.memory_slices, -p.compute_slices),
    )
    if sum(p.compute_slices for p in wanted) > geometry.compute_slices:
        return None

    def search(i: int, used: int, chosen: list[MigPlacement]) -> list[MigPlacement] | None:
        if i == len(wanted):
            return list(chosen)
        profile = wanted[i]
        for start in profile.starts:
            mask = _mask(profile, start)
            if used & mask:
                continue
            chosen.append(MigPlacement(profile.name, start))
            found = search(i + 1, used | mask, chosen)
            chosen.pop()
            if found is not None:
                return found
        return None

    found = search(0, 0, [])
    return None if found is None else MigLayout(tuple(found))


def validate_counts(geometry: MigGeometry, counts: Mapping[str, int], *, field: str = "mig_layout") -> MigLayout:
    """A user-given layout as counts; raise InputError saying why it is invalid."""
    for name, n in counts.items():
        profile = geometry.profile(name)
        if n < 0 or n > profile.max_count:
            raise InputError(f"{name}: expected 0..{profile.max_count} instances, got {n}", field=field)
    layout = place(geometry, counts)
    if layout is None:
        total = sum(geometry.profile(name).compute_slices * n for name, n in counts.items())
        reason = (f"{total} compute slices requested, the GPU has {geometry.compute_slices}"
                  if total > geometry.compute_slices else "the instances cannot be placed without overlapping in memory")
        raise InputError(f"invalid MIG layout {dict(counts)}: {reason}", field=field)
    return layout


def enumerate_layouts(geometry: MigGeometry, *, maximal_only: bool = False) -> list[MigLayout]:
    """Every distinct non-empty multiset of instances that fits one GPU.

    With ``maximal_only``, only layouts to which no further instance can be
    added; any other layout is a maximal one with instances left idle.
    """
    found: dict[tuple[tuple[str, int], ...], MigLayout] = {}
    options = [(p, s) for p in geometry.profiles for s in p.starts]

    def extend(index: int, used: int, compute: int, counts: Counter[str], chosen: list[MigPlacement]) -> None:
        if chosen:
            key = tuple(sorted(counts.items()))
            found.setdefault(key, MigLayout(tuple(chosen)))
        for j in range(index, len(options)):
            profile, start = options[j]
            mask = _mask(profile, start)
            if used & mask or compute + profile.compute_slices > geometry.compute_slices:
                continue
            if counts[profile.name] >= profile.max_count:
                continue
            counts[profile.name] += 1
            chosen.append(MigPlacement(profile.name, start))
            extend(j + 1, used | mask, compute + profile.compute_slices, counts, chosen)
            chosen.pop()
            counts[profile.name] -= 1
            if not counts[profile.name]:
                del counts[profile.name]

    extend(0, 0, 0, Counter(), [])
    layouts = sorted(found.values(), key=lambda layout: layout.key)
    if maximal_only:
        layouts = [layout for layout in layouts if not any(
            place(geometry, {**layout.counts, p.name: layout.counts.get(p.name, 0) + 1}) for p in geometry.profiles
            if layout.counts.get(p.name, 0) < p.max_count)]
    return layouts


def _mask(profile: MigProfile, start: int) -> int:
    return ((1 << profile.memory_slices) - 1) << start
