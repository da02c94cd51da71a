"""Calibrated step-model constants in the store: saved with their residuals, read back per device.

SQLAlchemy loads in the functions that go through it: the constants in use are read from a store on demand's file
where it can be (:mod:`hetsched.store.peek`), so that ``estimate`` and ``capacity`` go without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from hetsched.catalog.perf import PerfConstants, perf_constants_from_dict
from hetsched.errors import BackendUnavailableError
from hetsched.store.peek import StoreOnDemand

if TYPE_CHECKING:
    from hetsched.perf.calibrate import Calibration
    from hetsched.store.db import Store
    from hetsched.store.tables import CalibrationRow

TRUSTED_NEWEST_FIRST = "SELECT id, accelerator, constants FROM calibrations WHERE trusted ORDER BY id DESC"
"""The rows :func:`calibrated_constants` takes, as SQL a store's file answers without SQLAlchemy."""


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
    from sqlalchemy.exc import SQLAlchemyError

    from hetsched.store.db import reason
    from hetsched.store.tables import CalibrationRow

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
    from sqlalchemy import select
    from sqlalchemy.exc import SQLAlchemyError

    from hetsched.store.db import reason
    from hetsched.store.tables import CalibrationRow

    try:
        with store.transaction() as session:
            query = select(CalibrationRow).order_by(CalibrationRow.id.desc())
            if accelerator:
                query = query.where(CalibrationRow.accelerator == accelerator)
            return [_stored(row) for row in session.scalars(query)]
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot read calibrations: {reason(exc)}") from exc


def calibrated_constants(store: Store | StoreOnDemand) -> dict[str, PerfConstants]:
    """The newest trusted calibration per device: what plans and estimates use over the catalog's."""
    newest: dict[str, PerfConstants] = {}
    if isinstance(store, StoreOnDemand):
        rows = store.peek(TRUSTED_NEWEST_FIRST)
        if rows is not None:
            for row_id, accelerator, constants in rows:
                if accelerator not in newest:
                    newest[accelerator] = _in_use(row_id, perf_constants_from_dict(
                        json.loads(constants), where=f"calibrations[{row_id}]"))
            return newest
        store = store.opened()
    for stored in list_calibrations(store):
        if stored.trusted and stored.accelerator not in newest:
            newest[stored.accelerator] = _in_use(stored.id, stored.constants)
    return newest


def _in_use(row_id: int, constants: PerfConstants) -> PerfConstants:
    return constants.with_source(f"stored calibration #{row_id} ({constants.source})")
