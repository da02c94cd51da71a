"""hetsched's own names on the wire, defined once for the side that writes them and every side that reads them:
the role of a replica and the key replicas are counted by."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Role(StrEnum):
    """What a replica does: everything, or one phase of disaggregated serving."""

    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


class OptionKey(NamedTuple):
    """One kind of replica: how replicas are counted, in a plan, a live fleet and across plans."""

    model: str
    pool: str
    device: str
    """Device id: ``h100-sxm``, ``h100-sxm:3g.40gb``."""
    tp: int
    role: Role
