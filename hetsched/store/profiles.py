"""Profiles in the store: save (with the device seen), list, load as a step-latency model.

A profile and the device record it was measured on are written in one
transaction, so an interrupted save leaves neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from hetsched.errors import InputError, NotFoundError
from hetsched.profiler.profile import Profile, profile_from_dict
from hetsched.store.db import Store
from hetsched.store.tables import AcceleratorSeenRow, ProfileRow

MAX_ID = 2**31 - 1
"""The largest row id an INTEGER column holds on every backend; a larger number can only be a digest prefix."""
_DIGEST_PREFIX = re.compile(r"[0-9a-f]{6,64}")


@dataclass(frozen=True)
class ProfileSummary:
    """One row of ``hetsched profiles list``."""

    id: int
    model: str
    accelerator: str
    source: str
    backend: str
    tp: int
    digest: str
    created_at: datetime
    points: int


def _row(profile: Profile) -> ProfileRow:
    data = profile.to_dict()
    return ProfileRow(
        model=profile.model, accelerator=profile.accelerator, source=str(profile.source), backend=profile.backend,
        tp=profile.tp, digest=profile.digest, tables={"tables": data["tables"]},
        fitted={"terms": data["terms"], "step_overhead_s": profile.step_overhead_s, "dtype": profile.dtype},
        provenance=data["provenance"], sweep={"settings": data["sweep"], "failures": data["failures"]},
    )


def _profile(row: ProfileRow) -> Profile:
    return profile_from_dict({
        "model": row.model, "accelerator": row.accelerator, "source": row.source, "backend": row.backend,
        "tp": row.tp, "tables": row.tables["tables"], "terms": row.fitted["terms"],
        "step_overhead_s": row.fitted.get("step_overhead_s", 0.0), "dtype": row.fitted.get("dtype", "bf16"),
        "provenance": row.provenance, "sweep": row.sweep.get("settings", {}), "failures": row.sweep.get("failures", []),
    })


def save_profiles(store: Store, profiles: list[Profile]) -> list[int]:
    """Store profiles (and the devices they were measured on) in one transaction; ids in order.

    A profile whose digest is already stored is not duplicated: its existing id is returned.
    """
    ids = []
    with store.transaction() as session:
        for profile in profiles:
            existing = session.scalar(select(ProfileRow.id).where(ProfileRow.digest == profile.digest))
            if existing is not None:
                ids.append(existing)
                continue
            if profile.provenance.device:
                session.add(AcceleratorSeenRow(accelerator=profile.accelerator, host=profile.provenance.host,
                                               details=profile.provenance.device))
            row = _row(profile)
            session.add(row)
            session.flush()
            ids.append(row.id)
    return ids


def save_profile(store: Store, profile: Profile) -> int:
    return save_profiles(store, [profile])[0]


def list_profiles(store: Store, *, model: str | None = None, accelerator: str | None = None) -> list[ProfileSummary]:
    """Stored profiles, newest first, optionally for one model and/or accelerator."""
    query = select(ProfileRow).order_by(ProfileRow.created_at.desc(), ProfileRow.id.desc())
    if model:
        query = query.where(ProfileRow.model == model)
    if accelerator:
        query = query.where(ProfileRow.accelerator == accelerator)
    with store.sessions() as session:
        return [ProfileSummary(id=r.id, model=r.model, accelerator=r.accelerator, source=r.source, backend=r.backend,
                               tp=r.tp, digest=r.digest, created_at=r.created_at,
                               points=sum(len(t["points"]) for t in r.tables["tables"]))
                for r in session.scalars(query)]


def load_profile(store: Store, ref: str | int) -> Profile:
    """A stored profile by id or by digest prefix (at least 6 hex digits; one of digits only that is
    no id is read as a prefix)."""
    return load_profile_with_id(store, ref)[1]


def load_profile_with_id(store: Store, ref: str | int) -> tuple[int, Profile]:
    """:func:`load_profile` and the profile's row id (what cached capacities refer to)."""
    digits = isinstance(ref, int) or (ref.isascii() and ref.isdigit())
    if not digits and not _DIGEST_PREFIX.fullmatch(str(ref)):
        raise InputError(f"expected an id or at least 6 hex digits of a digest, got {ref!r}", field="profile")
    with store.sessions() as session:
        row = session.get(ProfileRow, int(ref)) if digits and 1 <= int(ref) <= MAX_ID else None
        if row is None and _DIGEST_PREFIX.fullmatch(str(ref)):
            rows = list(session.scalars(select(ProfileRow).where(ProfileRow.digest.startswith(str(ref))).limit(2)))
            if len(rows) > 1:
                raise InputError(f"digest prefix {ref!r} matches more than one profile; give more digits",
                                 field="profile")
            row = rows[0] if rows else None
        if row is None:
            known = [str(i) for i in session.scalars(select(ProfileRow.id))]
            raise NotFoundError("profile", str(ref), known, hint="see 'hetsched profiles list'")
        return row.id, _profile(row)


def latest_profile(store: Store, *, model: str, accelerator: str) -> Profile | None:
    """The newest stored profile of ``model`` on ``accelerator``, or None."""
    summaries = list_profiles(store, model=model, accelerator=accelerator)
    return load_profile(store, summaries[0].id) if summaries else None
