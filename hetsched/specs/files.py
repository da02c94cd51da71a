"""The one boundary for users' files and bodies: bounded, UTF-8, shallow and finite before any schema sees them.

Every file or request body hetsched parses goes through here, in this order:

1. size: at most ``ReadLimits.max_bytes`` (checked before reading the whole file);
2. encoding: UTF-8 (a byte-order mark is dropped);
3. nesting: at most ``ReadLimits.max_depth`` levels of mappings and lists, counted without recursion before
   the parser (which recurses) runs; a YAML document also expands to at most ``ReadLimits.max_values``
   values through its aliases, and no alias may refer to itself;
4. syntax: YAML, or JSON for a name ending in ``.json``;
5. numbers: every float is finite (JSON ``1e999`` or ``NaN``, YAML ``.inf`` or ``.nan`` are refused).

Each refusal is an :class:`InputError` that names the file and the field and says what was expected; the
caller then validates the result against its schema (pydantic models with ``allow_inf_nan=False``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import yaml

from hetsched.errors import InputError


@dataclass(frozen=True)
class ReadLimits:
    """How large and how deep a file or body may be before it is refused rather than parsed."""

    max_bytes: int = 64 * 1024 * 1024
    """Largest file read, in bytes (64 MiB)."""
    max_depth: int = 64
    """Deepest nesting of mappings and lists; hetsched's own formats need fewer than ten levels."""
    max_values: int = 2_000_000
    """Most values (scalars, lists, mappings) a YAML document may hold once its aliases are expanded."""


READ_LIMITS = ReadLimits()

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def read_text(path: str | Path, *, field: str, limits: ReadLimits = READ_LIMITS) -> str:
    """A file's text; a missing, unreadable, too large or non-UTF-8 file is an InputError naming ``field``."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p} is a folder; expected a file", field=field)
    if not p.is_file():
        raise InputError(f"no such file: {p}", field=field)
    try:
        with p.open("rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror}", field=field) from exc
    if len(data) > limits.max_bytes:
        raise InputError(f"{p.name} is larger than {limits.max_bytes:,} bytes, the most hetsched reads from one file",
                         field=field)
    return decode_text(data, name=p.name, field=field)


def decode_text(data: bytes, *, name: str, field: str) -> str:
    """UTF-8 bytes as text; other bytes are an InputError that names the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{name} is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); expected UTF-8",
                         field=field) from exc


def parse_document(text: str, *, name: str, field: str, limits: ReadLimits = READ_LIMITS) -> Any:
    """YAML text, or JSON when ``name`` ends in ``.json`` (its errors then point at the JSON); see the module."""
    if name.lower().endswith(".json"):
        return parse_json(text, name=name, field=field, limits=limits)
    _check_yaml_shape(text, name=name, field=field, limits=limits)
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: a bad date, or an integer of thousands of digits
        raise InputError(f"{name} is not valid YAML: {_reason(exc)}", field=field) from exc
    check_finite(raw, name=name)
    return raw


def parse_json(text: str | bytes, *, name: str, field: str, limits: ReadLimits = READ_LIMITS) -> Any:
    """JSON text or UTF-8 bytes (a request body) through the same checks as a file."""
    if isinstance(text, bytes):
        text = decode_text(text, name=name, field=field)
    depth = max(accumulate(map(_BRACKET_STEP.__getitem__, _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)))),
                default=0)
    if depth > limits.max_depth:
        raise _too_deep(name, field, limits)
    try:
        raw = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of thousands of digits
        raise InputError(f"{name} is not valid JSON: {_reason(exc)}", field=field) from exc
    check_finite(raw, name=name)
    return raw


def read_document(path: str | Path, *, field: str, limits: ReadLimits = READ_LIMITS) -> Any:
    """Read and parse a YAML/JSON file through every check above; problems are InputErrors naming ``field``."""
    return parse_document(read_text(path, field=field, limits=limits), name=Path(path).name, field=field,
                          limits=limits)


def check_finite(raw: Any, *, name: str) -> None:
    """Refuse infinite and NaN floats (and integers past the largest float) anywhere in parsed data, naming the
    field path (``models[0].slo.ttft_ms``)."""
    stack: list[tuple[Any, str]] = [(raw, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{name}: expected a finite number, got {value}", field=path or None)
        if isinstance(value, int) and abs(value) > sys.float_info.max:
            raise InputError(f"{name}: expected a finite number, got an integer of {len(str(abs(value)))} digits",
                             field=path or None)
        if isinstance(value, dict):
            stack.extend((item, f"{path}.{key}" if path else str(key)) for key, item in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _check_yaml_shape(text: str, *, name: str, field: str, limits: ReadLimits) -> None:
    """Depth and alias-expanded size of a YAML document, from the parser's events (no recursion).

    Each open collection is a frame ``[anchor, values before it, tallest child]``; an alias adds its
    anchor's height and value count where it appears.
    """
    frames: list[list[Any]] = []
    anchors: dict[str, tuple[int, int]] = {}  # anchor → (height, values) of the node it names
    values = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                if len(frames) >= limits.max_depth:
                    raise _too_deep(name, field, limits)
                frames.append([event.anchor, values, 0])
                values += 1
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, start, tallest = frames.pop()
                if anchor is not None:
                    anchors[anchor] = (tallest + 1, values - start)
                if frames:
                    frames[-1][2] = max(frames[-1][2], tallest + 1)
            elif isinstance(event, yaml.ScalarEvent):
                values += 1
                if event.anchor is not None:
                    anchors[event.anchor] = (0, 1)
            elif isinstance(event, yaml.AliasEvent):
                assert event.anchor is not None, "an alias always names its anchor"
                if any(frame[0] == event.anchor for frame in frames):
                    raise InputError(f"{name}: the alias *{event.anchor} refers to a node that contains it; "
                                     "expected a document without cycles", field=field)
                height, count = anchors.get(event.anchor, (0, 1))
                if len(frames) + height > limits.max_depth:
                    raise _too_deep(name, field, limits)
                values += count
                if frames:
                    frames[-1][2] = max(frames[-1][2], height)
            if values > limits.max_values:
                raise InputError(f"{name} holds more than {limits.max_values:,} values once its aliases are "
                                 "expanded; expected a document without alias bombs", field=field)
    except yaml.YAMLError as exc:
        raise InputError(f"{name} is not valid YAML: {exc}", field=field) from exc


def _reason(exc: Exception) -> str:
    """A parser's complaint in the user's terms."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    if "integer string conversion" in str(exc):
        return f"an integer has more than {sys.get_int_max_str_digits()} digits"
    return str(exc)


def _too_deep(name: str, field: str, limits: ReadLimits) -> InputError:
    return InputError(f"{name} nests lists and mappings deeper than {limits.max_depth} levels, the most hetsched "
                      "reads (its own formats need fewer than ten)", field=field)
