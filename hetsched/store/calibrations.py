"""Calibrated step-model constants in the store: saved with their residuals, read back per device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from hetsched.catalog.perf import PerfConstants, perf_constants_from_dict
from hetsched.errors import BackendUnavailableError
from hetsched.perf.calibrate import Calibration
from hetsched.store.db import Store, reason
from hetsched.store.tables import CalibrationRow


@dataclass(frozen=True)
class StoredCalibration:
    id: int
    accelerator: str
    constants: PerfConstants
    residuals: dict[str, dict[str, float]]
    profile_ids: list[int]
    trusted: bool
    created_at: datetime


def save_calibration(store: Store, accelerator: str, calibration: Calibration, *,
                     profile_ids: Sequence[int]) -> int:
    """Store one calibration; returns its id."""
    try:
        with store.transaction() as session:
            row = CalibrationRow(accelerator=accelerator, constants=calibration.constants.to_dict(),
                                 residuals={k: asdict(v) for k, v in calibration.residuals.items()},
                                 profile_ids=list(profile_ids), trusted=calibration.trusted)
            session.add(row)
            session.flush()
            return row.id
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot store the calibration: {reason(exc)}") from exc


def _stored(row: CalibrationRow) -> StoredCalibration:
    return StoredCalibration(id=row.id, accelerator=row.accelerator,
                             constants=perf_constants_from_dict(row.constants, where=f"calibrations[{row.id}]"),
                             residuals=row.residuals, profile_ids=list(row.profile_ids), trusted=row.trusted,
                             created_at=row.created_at)


def list_calibrations(store: Store, *, accelerator: str | None = None) -> list[StoredCalibration]:
    """Stored calibrations, newest first."""
    try:
        with store.transaction() as session:
            query = select(CalibrationRow).order_by(CalibrationRow.id.desc())
            if accelerator:
                query = query.where(CalibrationRow.accelerator == accelerator)
            return [_stored(row) for row in session.scalars(query)]
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot read calibrations: {reason(exc)}") from exc


def calibrated_constants(store: Store) -> dict[str, PerfConstants]:
    """The newest trusted calibration per device: what plans and estimates use over the catalog's."""
    newest: dict[str, PerfConstants] = {}
    for stored in list_calibrations(store):
        if stored.trusted and stored.accelerator not in newest:
            newest[stored.accelerator] = stored.constants.with_source(
                f"stored calibration #{stored.id} ({stored.constants.source})")
    return newest
