"""Reading users' files: YAML, or JSON by suffix, with errors that name the file and the option."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from hetsched.errors import InputError


def parse_document(text: str, *, name: str, field: str) -> Any:
    """YAML text, or JSON when ``name`` ends in ``.json`` (its errors then point at the JSON)."""
    is_json = name.lower().endswith(".json")
    try:
        return json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"{name} is not valid {'JSON' if is_json else 'YAML'}: {exc}", field=field) from exc


def read_document(path: str | Path, *, field: str) -> Any:
    """Read and parse a YAML/JSON file; a missing or unreadable file is an InputError naming ``field``."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no such file: {p}", field=field)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror}", field=field) from exc
    return parse_document(text, name=p.name, field=field)
