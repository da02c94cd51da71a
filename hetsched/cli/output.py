"""Printing: rich tables for people, ``-o json`` with stable field names for scripts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
console_err = Console(stderr=True)


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


def to_jsonable(value: Any) -> Any:
    """Dataclasses, pydantic models and enums as plain JSON values.

    A mapping keyed by tuples becomes a list of ``{"key": [...], "value": ...}``: JSON keys are strings, and a
    tuple's Python repr is no string a script can take apart."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        if any(isinstance(k, tuple) for k in value):
            return [{"key": to_jsonable(k), "value": to_jsonable(v)} for k, v in value.items()]
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    return value


def print_json(value: Any) -> None:
    print(json.dumps(to_jsonable(value), indent=2))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, caption: str | None = None,
                out: Console = console) -> None:
    """A table of plain text: names from users' files are shown as written, never read as rich markup.

    ``out`` is stderr where stdout carries a file a script reads (e.g. ``calibrate --export-yaml -``)."""
    table = Table(title=escape(title), caption=escape(caption) if caption else None, header_style="bold")
    for i, column in enumerate(columns):
        table.add_column(escape(column), justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    out.print(table)


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "[green]yes[/]" if value else "[red]no[/]"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return escape(str(value))
