"""The step model of one replica as the commands use it: the catalog's, under the correction in force for it.

A correction (:mod:`hetsched.perf.correction`) is learned for one :class:`~hetsched.perf.online.CorrectionKey`: a
model on one accelerator or slice at one TP, under one engine build and attention backend when they were known.
``estimate``, ``capacity``, ``plan`` and the web planner know neither the engine build nor, unless a cluster file's
model names it, the backend a replica will run, so the correction they use is the one stored for exactly (model,
device, TP, backend or none); one learned under another backend is not applied in its place, nor one of another
TP.

The per-request overhead of a correction is not part of a step: the SLO search's simulator has no time per
request before the first step, so the per-phase scales and the time per step change a capacity, and so does the
tail learned with the correction (its step dispersion and front end, which the search runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from hetsched.catalog.types import Device
from hetsched.perf.correction import StepCorrection, corrected
from hetsched.perf.online import CorrectionKey
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.tail import Tail
from hetsched.perf.step import StepLatencyModel
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch


class NamedCorrection(Protocol):
    """A correction in force, with what a command says of it (the store's ``StoredCorrection`` is one)."""

    @property
    def id(self) -> int: ...

    @property
    def correction(self) -> StepCorrection: ...

    @property
    def tail(self) -> Tail | None:
        """The step dispersion and front end learned with it, which capacity searches run too; None: none."""
        ...

    @property
    def label(self) -> str:
        """E.g. ``correction #3 (prefill x1.4, decode x1.38, …; 412 observations, hetsched calibrate --live …)``."""
        ...


Corrections = Mapping[CorrectionKey, NamedCorrection]
"""The corrections in force, by the key each applies to."""


def correction_for(corrections: Corrections, model: ModelArch, device: Device, tp: int, *,
                   attention_backend: str = "") -> NamedCorrection | None:
    """The correction in force for a replica of ``model`` on ``device`` at ``tp``: exactly its key, with no engine
    build named and the attention backend its engines run with, when the caller knows it (a cluster file's or a
    ModelDeployment's; see the module docstring); None when there is none."""
    return corrections.get(CorrectionKey(model.name, device.id, tp, attention_backend=attention_backend))


def replica_step_model(model: ModelArch, device: Device, *, tp: int = 1, weight_dtype: DType | None = None,
                       kv_dtype: DType | None = None, engine: EngineConfig = EngineConfig(),
                       step_model: StepLatencyModel | None = None,
                       correction: NamedCorrection | None = None) -> StepLatencyModel:
    """``step_model`` (default: the catalog's roofline of the replica) under ``correction``."""
    base = step_model or RooflineModel(model, device, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                       engine=engine)
    return corrected(base, correction.correction if correction is not None else None)


def correction_json(correction: NamedCorrection | None) -> dict[str, object] | None:
    """What JSON output says of the correction a figure was computed with (None: the bare step model)."""
    if correction is None:
        return None
    c, tail = correction.correction, correction.tail
    return {"id": correction.id, "label": correction.label, "prefill_scale": c.prefill_scale,
            "decode_scale": c.decode_scale, "step_overhead_s": c.step_overhead_s,
            "request_overhead_s": c.request_overhead_s,
            "tail": tail.to_json() if tail is not None and not tail.empty else None}


def correction_line(correction: NamedCorrection) -> str:
    """What table output says of it."""
    return f"step model: corrected by {correction.label}"
