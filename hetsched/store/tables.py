"""SQLAlchemy 2.x tables. Schema changes go through Alembic migrations."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (JSON, DateTime, Dialect, Float, ForeignKey, Integer, String, Text, TypeDecorator,
                        UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAME_LENGTH = 200
"""Most characters a model or plan name takes (a VARCHAR on PostgreSQL; SQLite would store more, so the boundaries
that take names check this first, and both backends refuse alike)."""


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UtcDateTime(TypeDecorator[datetime]):
    """A UTC instant that reads back timezone-aware on every backend.

    PostgreSQL keeps the zone; SQLite keeps the wall time only, so a time is stored as UTC and read back marked
    UTC (a naive one is taken as UTC). Without this, SQLite's times would serialise without a zone and a browser
    would read them as local time.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else _in_utc(value)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else _in_utc(value)


def _in_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class ModelRow(Base):
    """A model config known to the store (bundled ones are not copied in)."""

    __tablename__ = "models"
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    config: Mapped[dict[str, Any]]
    source: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class AcceleratorSeenRow(Base):
    """A device a profile was measured on, with its telemetry at the time."""

    __tablename__ = "accelerators_seen"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    accelerator: Mapped[str] = mapped_column(String(100), index=True)
    host: Mapped[str] = mapped_column(String(200))
    details: Mapped[dict[str, Any]]
    seen_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class ProfileRow(Base):
    """A Profile: per-operator latency tables, fitted parameters and provenance."""

    __tablename__ = "profiles"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    accelerator: Mapped[str] = mapped_column(String(100), index=True)
    source: Mapped[str] = mapped_column(String(20))  # kernel | roofline | endpoint
    backend: Mapped[str] = mapped_column(String(20))
    tp: Mapped[int] = mapped_column(Integer, default=1)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    tables: Mapped[dict[str, Any]]
    fitted: Mapped[dict[str, Any]]
    provenance: Mapped[dict[str, Any]]
    sweep: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class CapacityRow(Base):
    """Cached SLO capacity, keyed by a digest of (profile, workload, SLO, engine settings)."""

    __tablename__ = "capacities"
    __table_args__ = (UniqueConstraint("key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    device: Mapped[str] = mapped_column(String(100), index=True)
    tp: Mapped[int] = mapped_column(Integer)
    profile_id: Mapped[int | None] = mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"), nullable=True)
    requests_per_s: Mapped[float] = mapped_column(Float)
    inputs: Mapped[dict[str, Any]]
    result: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class PlanRow(Base):
    """A solved placement plan with the inputs that produced it."""

    __tablename__ = "plans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    origin: Mapped[str] = mapped_column(String(20))  # cli | web | operator
    status: Mapped[str] = mapped_column(String(40))
    cost_per_hour: Mapped[float | None] = mapped_column(Float, nullable=True)
    spec: Mapped[dict[str, Any]]
    plan: Mapped[dict[str, Any]]
    note: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class CalibrationRow(Base):
    """Step-model constants fitted to measured profiles of one device, with the fit's residuals."""

    __tablename__ = "calibrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    accelerator: Mapped[str] = mapped_column(String(100), index=True)
    constants: Mapped[dict[str, Any]]
    residuals: Mapped[dict[str, Any]]
    profile_ids: Mapped[list[Any]]
    trusted: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class CorrectionRow(Base):
    """A step-model correction learned from a running fleet, with what it was learned from."""

    __tablename__ = "step_corrections"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(NAME_LENGTH), index=True)
    accelerator: Mapped[str] = mapped_column(String(100), index=True)
    tp: Mapped[int] = mapped_column(Integer)
    engine: Mapped[str] = mapped_column(String(100))
    attention_backend: Mapped[str] = mapped_column(String(100))
    correction: Mapped[dict[str, Any]]
    """prefill_scale, decode_scale, step_overhead_s, request_overhead_s."""
    sd: Mapped[dict[str, Any]]
    """The same keys: one standard deviation of each."""
    observations: Mapped[int] = mapped_column(Integer)
    sources: Mapped[int] = mapped_column(Integer)
    window_s: Mapped[float] = mapped_column(Float)
    """Seconds between the first and last observation it was learned from."""
    residuals: Mapped[dict[str, Any]]
    outliers: Mapped[list[Any]]
    origin: Mapped[str] = mapped_column(Text)
    """Who learned it from what: ``calibrate --live`` and its engines, or the operator."""
    trusted: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    tail: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, default=None)
    """The tail learned with it (:meth:`hetsched.perf.tail.Tail.to_json`): step dispersion and front end; NULL: none."""
