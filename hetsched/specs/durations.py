"""Durations as people write them, one grammar for command-line flags and custom resources alike.

A duration is one or more ``<number><unit>`` parts, summed: ``800us``, ``500ms``, ``0.5s``, ``1m30s``, ``2h``.
Units are ``us`` (or ``µs``), ``ms``, ``s``, ``m`` and ``h``; blanks around parts are allowed. A bare number is
refused: its unit would be a guess.
"""

from __future__ import annotations

import math
import re

from hetsched.errors import InputError

DURATION_PATTERN = r"^\s*(([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*(us|\u00b5s|ms|s|m|h)\s*)+$"
"""The grammar as a regular expression that Python and a CRD's OpenAPI schema (ECMA-262) read alike."""

_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(us|µs|ms|s|m|h)")
_SECONDS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_MILLISECONDS = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}


def parse_duration_s(text: str, *, field: str | None = None, positive: bool = False) -> float:
    """Seconds in ``text``; ``positive`` refuses a zero duration."""
    return _parse(text, _SECONDS, field=field, positive=positive)


def parse_duration_ms(text: str, *, field: str | None = None, positive: bool = False) -> float:
    """Milliseconds in ``text``; ``positive`` refuses a zero duration."""
    return _parse(text, _MILLISECONDS, field=field, positive=positive)


def _parse(text: str, scale: dict[str, float], *, field: str | None, positive: bool) -> float:
    """Each part in the unit of ``scale``, summed (each factor is exact or the one a single-unit parse used)."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise InputError(f"expected a duration with a unit (us, ms, s, m or h) such as 800us, 500ms, 0.5s or 1m30s, "
                         f"got {text!r}", field=field)
    value = sum(float(number) * scale[unit] for number, unit in _PART.findall(text))
    if not math.isfinite(value):
        raise InputError(f"expected a finite duration, got {text!r}", field=field)
    if positive and value <= 0:
        raise InputError(f"expected a positive duration, got {text!r}", field=field)
    return value
