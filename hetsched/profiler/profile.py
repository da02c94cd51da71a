"""The Profile: measured (or estimated) per-operator latency tables that answer the step-latency interface.

A profile is a set of *tables* (latency against the variable that drives an
operator) and *terms* (how many times per step each table counts, and on
which aggregate of the step). ``step_time`` adds the terms up, so a measured
profile stands in for :class:`hetsched.perf.roofline.RooflineModel` wherever
a :class:`hetsched.perf.step.StepLatencyModel` is expected.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from functools import cached_property
from importlib import metadata
from typing import Any

from hetsched.perf.step import OpTime, StepShape
from hetsched.profiler.interp import LogLogCurve, LogLogSurface


class ProfileSource(StrEnum):
    """Where the numbers came from."""

    KERNEL = "kernel"      # operators timed on the device
    ROOFLINE = "roofline"  # catalog peaks × efficiencies
    ENDPOINT = "endpoint"  # load test of a live OpenAI-compatible server


class Variable(StrEnum):
    """The aggregate of a step a table is indexed by."""

    TOKENS = "tokens"                  # every token of the step (prefill chunks + one per decode)
    SAMPLED = "sampled"                # sequences that sample a token this step
    PREFILL_TOKENS = "prefill_tokens"  # prefill tokens only
    PREFILL_PAIRS = "prefill_pairs"    # attention pairs per prefill sequence; the term counts once per sequence
    DECODE = "decode"                  # (decoding sequences, mean context length)
    DECODE_SEQS = "decode_seqs"        # decoding sequences


@dataclass(frozen=True)
class Measurement:
    """One timed point: coordinates along the table's variable(s), median and p90 seconds."""

    coords: tuple[float, ...]
    median_s: float
    p90_s: float


@dataclass(frozen=True)
class OpTable:
    """Latency of one operator at the model's shapes over a sweep of its variable."""

    op: str
    kernel: str
    variable: Variable
    dims: dict[str, int]
    points: tuple[Measurement, ...]


@dataclass(frozen=True)
class Term:
    """``multiplier`` × ``table`` evaluated on the step, shown as ``name`` in a breakdown.

    ``window`` caps the context a sliding-window layer attends over.
    """

    name: str
    table: str
    multiplier: float
    window: int | None = None


@dataclass(frozen=True)
class PointFailure:
    """A sweep point that did not produce a timing, and why (crash, timeout, error)."""

    op: str
    params: dict[str, int]
    reason: str


@dataclass(frozen=True)
class Provenance:
    """Where and when a profile was made."""

    host: str
    device: dict[str, Any]
    driver: str
    versions: dict[str, str]
    created_at: str
    duration_s: float = 0.0

    @classmethod
    def made_here(cls, *, device: dict[str, Any], versions: dict[str, str], driver: str = "",
                  duration_s: float = 0.0) -> Provenance:
        """A profile made on this host, now."""
        return cls(host=platform.node(), device=device, driver=driver, versions=versions,
                   created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), duration_s=duration_s)


def hetsched_version() -> str:
    """The installed hetsched version, ``unknown`` when the package metadata is missing."""
    try:
        return metadata.version("hetsched")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Profile:
    """Per-operator latency tables for ``model`` on ``accelerator``; a :class:`StepLatencyModel`."""

    model: str
    accelerator: str
    source: ProfileSource
    backend: str
    tables: tuple[OpTable, ...]
    terms: tuple[Term, ...]
    provenance: Provenance
    sweep: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    dtype: str = "bf16"
    step_overhead_s: float = 0.0
    failures: tuple[PointFailure, ...] = ()

    # --- the StepLatencyModel interface --------------------------------------
    def step_time(self, shape: StepShape) -> float:
        return sum(op.seconds for op in self.breakdown(shape))

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        if shape.tokens == 0:
            return []
        totals: dict[str, float] = {}
        for term in self.terms:
            seconds = term.multiplier * self._evaluate(term, shape)
            if seconds > 0:
                totals[term.name] = totals.get(term.name, 0.0) + seconds
        ops = [OpTime(name, seconds, 0.0, 0.0, str(self.source)) for name, seconds in totals.items()]
        if self.step_overhead_s:
            ops.append(OpTime("step overhead", self.step_overhead_s, 0.0, 0.0, "fixed"))
        return ops

    # --- helpers ------------------------------------------------------------
    def table(self, op: str) -> OpTable:
        for table in self.tables:
            if table.op == op:
                return table
        raise KeyError(op)

    @cached_property
    def _curves(self) -> dict[str, LogLogCurve]:
        """The one-variable tables as curves."""
        return {table.op: LogLogCurve.through([(p.coords[0], p.median_s) for p in table.points])
                for table in self.tables if table.points and table.variable is not Variable.DECODE}

    @cached_property
    def _surfaces(self) -> dict[str, LogLogSurface]:
        """The decode tables (sequences × context) as surfaces."""
        return {table.op: LogLogSurface.through([(p.coords[0], p.coords[1], p.median_s) for p in table.points])
                for table in self.tables if table.points and table.variable is Variable.DECODE}

    @cached_property
    def _variables(self) -> dict[str, Variable]:
        return {table.op: table.variable for table in self.tables}

    def _evaluate(self, term: Term, shape: StepShape) -> float:
        variable = self._variables[term.table]
        if variable is Variable.DECODE:
            surface = self._surfaces[term.table]
            if not shape.decode_seqs:
                return 0.0
            context = shape.decode_kv_tokens / shape.decode_seqs
            if term.window:
                context = min(context, term.window)
            return surface(shape.decode_seqs, max(context, 1.0))
        curve = self._curves[term.table]
        if variable is Variable.PREFILL_PAIRS:
            if not shape.prefill_seqs:
                return 0.0
            pairs = shape.prefill_attention_pairs / shape.prefill_seqs
            if term.window:
                pairs = min(pairs, shape.prefill_tokens / shape.prefill_seqs * term.window)
            return shape.prefill_seqs * curve(pairs)
        x = {Variable.TOKENS: shape.tokens, Variable.SAMPLED: shape.prefill_seqs + shape.decode_seqs,
             Variable.PREFILL_TOKENS: shape.prefill_tokens, Variable.DECODE_SEQS: shape.decode_seqs}[variable]
        return curve(x)

    # --- identity and serialisation -------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (the store's columns and the export format build on it)."""
        return json.loads(json.dumps(asdict(self), default=str))

    @property
    def digest(self) -> str:
        """sha256 of the profile's content: the same measurements give the same digest."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def profile_from_dict(data: dict[str, Any]) -> Profile:
    """Inverse of :meth:`Profile.to_dict` (input already validated by the caller)."""
    tables = tuple(
        OpTable(op=t["op"], kernel=t["kernel"], variable=Variable(t["variable"]), dims=dict(t["dims"]),
                points=tuple(Measurement(tuple(float(c) for c in p["coords"]), p["median_s"], p["p90_s"])
                            for p in t["points"]))
        for t in data["tables"])
    return Profile(
        model=data["model"], accelerator=data["accelerator"], source=ProfileSource(data["source"]),
        backend=data["backend"], tables=tables, terms=tuple(Term(**t) for t in data["terms"]),
        provenance=Provenance(**data["provenance"]), sweep=dict(data.get("sweep", {})), tp=data.get("tp", 1),
        dtype=data.get("dtype", "bf16"), step_overhead_s=data.get("step_overhead_s", 0.0),
        failures=tuple(PointFailure(**f) for f in data.get("failures", ())),
    )
