"""The profile file format (``hetsched profiles export|import``): versioned JSON, validated with pydantic.

Numbers keep their JSON type (an integer multiplier stays an integer), so a profile exported and imported
again has the digest it was stored under and is not stored twice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, model_validator
from pydantic_core import ErrorDetails

from hetsched.errors import InputError
from hetsched.specs.files import parse_json
from hetsched.profiler.profile import Profile, ProfileSource, Variable, profile_from_dict

SCHEMA_VERSION = 1
KIND = "hetsched-profiles"


Number = StrictInt | StrictFloat
"""A JSON number kept as it was written: ``2`` stays ``2``, ``2.0`` stays ``2.0``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MeasurementModel(_Strict):
    coords: list[Number] = Field(min_length=1, max_length=2)
    median_s: Annotated[Number, Field(gt=0)]
    p90_s: Annotated[Number, Field(gt=0)]


class OpTableModel(_Strict):
    op: str = Field(min_length=1)
    kernel: str
    variable: Variable
    dims: dict[str, StrictInt]
    points: list[MeasurementModel] = Field(min_length=1)

    @model_validator(mode="after")
    def _coords_match_variable(self) -> OpTableModel:
        width = 2 if self.variable is Variable.DECODE else 1
        for i, point in enumerate(self.points):
            if len(point.coords) != width:
                raise ValueError(f"points[{i}].coords: expected {width} value(s) for variable {self.variable}")
        return self


class TermModel(_Strict):
    name: str = Field(min_length=1)
    table: str
    multiplier: Annotated[Number, Field(ge=0)]
    window: StrictInt | None = Field(default=None, ge=1)


class ProvenanceModel(_Strict):
    host: str
    device: dict[str, Any]
    driver: str
    versions: dict[str, str]
    created_at: str
    duration_s: Annotated[Number, Field(ge=0)] = 0.0


class FailureModel(_Strict):
    op: str
    params: dict[str, StrictInt]
    reason: str


class ProfileModel(_Strict):
    model: str = Field(min_length=1)
    accelerator: str = Field(min_length=1)
    source: ProfileSource
    backend: str
    tables: list[OpTableModel] = Field(min_length=1)
    terms: list[TermModel] = Field(min_length=1)
    provenance: ProvenanceModel
    sweep: dict[str, Any] = Field(default_factory=dict)
    tp: StrictInt = Field(default=1, ge=1)
    dtype: str = "bf16"
    step_overhead_s: Annotated[Number, Field(ge=0)] = 0.0
    failures: list[FailureModel] = Field(default_factory=list)

    @model_validator(mode="after")
    def _terms_name_tables(self) -> ProfileModel:
        names = {t.op for t in self.tables}
        for i, term in enumerate(self.terms):
            if term.table not in names:
                raise ValueError(f"terms[{i}].table {term.table!r} is not one of the tables {sorted(names)}")
        return self


class ProfilesDocument(_Strict):
    schema_version: Literal[1]
    kind: Literal["hetsched-profiles"]
    profiles: list[ProfileModel]


def export_document(profiles: list[Profile]) -> dict[str, Any]:
    """The JSON document for ``profiles``."""
    return {"schema_version": SCHEMA_VERSION, "kind": KIND, "profiles": [p.to_dict() for p in profiles]}


def _location(error: ErrorDetails) -> str:
    return ".".join(str(part) if not isinstance(part, int) else f"[{part}]" for part in error["loc"]).replace(".[", "[")


def parse_document(text: str, *, source: str = "input") -> list[Profile]:
    """Profiles from a document; any problem raises InputError naming the field, before anything is used."""
    data = parse_json(text, name=source, field=source)
    if isinstance(data, dict) and data.get("schema_version") not in (None, SCHEMA_VERSION):
        raise InputError(f"unsupported schema version {data['schema_version']!r}; this hetsched reads "
                         f"{SCHEMA_VERSION}", field=f"{source}: schema_version")
    try:
        document = ProfilesDocument.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InputError(f"{first['msg']} (input: {str(first.get('input'))[:80]!r})",
                         field=f"{source}: {_location(first) or 'document'}") from exc
    return [profile_from_dict(p.model_dump(mode="json")) for p in document.profiles]
