"""Step-model corrections in the store: each saved with what it was learned from, the newest trusted one per key
read back to be used.

Like :mod:`hetsched.store.calibrations`, the corrections in use are read from a store on demand's file where it can
be (:mod:`hetsched.store.peek`), so that ``estimate`` and ``capacity`` go without SQLAlchemy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from hetsched.errors import BackendUnavailableError
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate
from hetsched.perf.tail import Tail
from hetsched.store.peek import StoreOnDemand

if TYPE_CHECKING:
    from hetsched.store.db import Store
    from hetsched.store.tables import CorrectionRow

_FIELDS = ("prefill_scale", "decode_scale", "step_overhead_s", "request_overhead_s")

TRUSTED_NEWEST_FIRST = ("SELECT id, model, accelerator, tp, engine, attention_backend, correction, observations, "
                        "origin, tail FROM step_corrections WHERE trusted ORDER BY id DESC")
"""The rows :func:`corrections_in_force` takes, as SQL a store's file answers without SQLAlchemy."""


@dataclass(frozen=True)
class StoredCorrection:
    id: int
    key: CorrectionKey
    correction: StepCorrection
    observations: int
    origin: str
    trusted: bool = True
    sd: dict[str, float] | None = None
    sources: int = 0
    window_s: float = 0.0
    residuals: dict[str, float] | None = None
    outliers: list[dict[str, Any]] | None = None
    created_at: datetime | None = None
    tail: Tail | None = None
    """The step dispersion and front end learned with it, if any."""

    @property
    def label(self) -> str:
        """How a command says which correction it used."""
        c = self.correction
        return (f"correction #{self.id} (prefill x{c.prefill_scale:.3g}, decode x{c.decode_scale:.3g}, "
                f"{c.step_overhead_s * 1e3:.3g} ms a step, {c.request_overhead_s * 1e3:.3g} ms a request; "
                f"{self.observations} observations, {self.origin})")


def _correction(values: dict[str, Any], *, where: str) -> StepCorrection:
    try:
        return StepCorrection.of([float(values[name]) for name in _FIELDS])
    except (KeyError, TypeError, ValueError) as exc:
        raise BackendUnavailableError(f"{where} holds no readable correction: {exc}") from exc


def save_correction(store: Store, estimate: Estimate, *, origin: str, tail: Tail | None = None) -> int:
    """Store one estimate with its provenance (and the tail learned with it); returns its id."""
    from sqlalchemy.exc import SQLAlchemyError

    from hetsched.store.db import reason
    from hetsched.store.tables import CorrectionRow

    key = estimate.key
    window = (estimate.last_at - estimate.first_at) if estimate.first_at is not None and estimate.last_at is not None \
        else 0.0
    try:
        with store.transaction() as session:
            row = CorrectionRow(
                model=key.model, accelerator=key.accelerator, tp=key.tp, engine=key.engine,
                attention_backend=key.attention_backend,
                correction=dict(zip(_FIELDS, estimate.correction.vector(), strict=True)),
                sd=dict(zip(_FIELDS, estimate.sd, strict=True)), observations=estimate.observations,
                sources=estimate.sources, window_s=window,
                residuals={"median_abs": estimate.residual_median, "p90_abs": estimate.residual_p90},
                outliers=[{"source": o.source, "ratio": o.ratio, "observations": o.observations}
                          for o in estimate.outliers],
                origin=origin, trusted=estimate.trusted,
                tail=tail.to_json() if tail is not None and not tail.empty else None)
            session.add(row)
            session.flush()
            return row.id
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot store the correction: {reason(exc)}") from exc


def _stored(row: CorrectionRow) -> StoredCorrection:
    return StoredCorrection(
        id=row.id, key=CorrectionKey(row.model, row.accelerator, row.tp, row.engine, row.attention_backend),
        correction=_correction(row.correction, where=f"step_corrections[{row.id}]"), observations=row.observations,
        origin=row.origin, trusted=row.trusted, sd=row.sd, sources=row.sources, window_s=row.window_s,
        residuals=row.residuals, outliers=list(row.outliers), created_at=row.created_at,
        tail=Tail.from_json(row.tail))


def list_corrections(store: Store, *, model: str | None = None,
                     accelerator: str | None = None) -> list[StoredCorrection]:
    """Stored corrections, newest first."""
    from sqlalchemy import select
    from sqlalchemy.exc import SQLAlchemyError

    from hetsched.store.db import reason
    from hetsched.store.tables import CorrectionRow

    try:
        with store.transaction() as session:
            query = select(CorrectionRow).order_by(CorrectionRow.id.desc())
            if model:
                query = query.where(CorrectionRow.model == model)
            if accelerator:
                query = query.where(CorrectionRow.accelerator == accelerator)
            return [_stored(row) for row in session.scalars(query)]
    except SQLAlchemyError as exc:
        raise BackendUnavailableError(f"cannot read corrections: {reason(exc)}") from exc


def corrections_in_force(store: Store | StoreOnDemand) -> dict[CorrectionKey, StoredCorrection]:
    """The newest trusted correction per key: what estimates, capacities and plans use over the bare step model."""
    newest: dict[CorrectionKey, StoredCorrection] = {}
    if isinstance(store, StoreOnDemand):
        rows = store.peek(TRUSTED_NEWEST_FIRST)
        if rows is not None:
            for row_id, model, accelerator, tp, engine, backend, correction, observations, origin, tail in rows:
                key = CorrectionKey(model, accelerator, tp, engine, backend)
                if key not in newest:
                    newest[key] = StoredCorrection(row_id, key, _correction(
                        json.loads(correction), where=f"step_corrections[{row_id}]"), observations, origin,
                        tail=Tail.from_json(json.loads(tail)) if tail else None)
            return newest
        store = store.opened()
    for stored in list_corrections(store):
        if stored.trusted and stored.key not in newest:
            newest[stored.key] = stored
    return newest
