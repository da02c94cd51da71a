"""The one exception tree of hetsched.

    HetschedError                 exit 1, HTTP 500
    ├── InputError                exit 2, HTTP 422   bad user input (file, flag, field)
    │   ├── SpecError             a model config or catalog entry is unusable
    │   └── NotFoundError         exit 3, HTTP 404   a named thing does not exist
    ├── InfeasibleError           exit 4, HTTP 409   the request is valid but cannot be met
    ├── BackendUnavailableError   exit 5, HTTP 503   a runtime or service is missing
    └── DeadlineError             exit 6, HTTP 504   a computation ran past its deadline and was stopped

Every message says what was wrong and how to fix it. Foreign errors are
translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic loads with the modules that validate, not with every error
    from pydantic import ValidationError


class HetschedError(Exception):
    """Base of every error hetsched raises on purpose."""

    exit_code = 1
    http_status = 500


class InputError(HetschedError):
    """The user's input is malformed; ``field`` names where."""

    exit_code = 2
    http_status = 422

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def invalid_input(exc: ValidationError, *, source: str) -> InputError:
    """What pydantic found wrong in ``source``: its first problem, with its location as a path like
    ``models[0].slo.ttft_ms``, then up to two more. A value no member of a union takes is one problem at the
    union's field, naming the members, not one per member."""
    problems: dict[str, list[tuple[str | None, str, object]]] = {}
    for error in exc.errors():
        loc = [part for part in error["loc"] if not _is_union_member(part)]
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
        member = next((str(part) for part in error["loc"][len(loc):] if _is_union_member(part)), None) \
            if len(loc) < len(error["loc"]) else None
        problems.setdefault(where, []).append((member, error["msg"], error.get("input")))
    described = [(where, _describe(found)) for where, found in problems.items()]
    (first, message), rest = described[0], described[1:]
    message += "".join(f"; {where}: {text}" if where else f"; {text}" for where, text in rest[:2])
    more = f" (and {len(rest) - 2} more)" if len(rest) > 2 else ""
    return InputError(f"{source}: {message}{more}", field=first or None)


def _is_union_member(part: str | int) -> bool:
    """A location step pydantic adds for a union's member (``str``, ``list[int]``), not a field or a key."""
    return isinstance(part, str) and (part in _SCALAR_TYPES or "[" in part
                                      or part.startswith(("function-", "lax-", "constrained-")))


_SCALAR_TYPES = frozenset({"str", "int", "float", "bool", "bytes", "none", "dict", "list", "tuple", "set"})


def _describe(found: list[tuple[str | None, str, object]]) -> str:
    members = [member for member, _, _ in found if member is not None]
    if len(found) > 1 and len(members) == len(found):
        listed = ", ".join(members[:-1]) + f" or {members[-1]}"
        return f"expected {listed}, got {found[0][2]!r:.60}"
    return found[0][1]


class SpecError(InputError):
    """A model config or catalog entry cannot be turned into a spec."""


class NotFoundError(InputError):
    """A named model, accelerator, profile or plan does not exist."""

    exit_code = 3
    http_status = 404

    def __init__(self, kind: str, name: str, known: Iterable[str] = (), *, hint: str = "") -> None:
        close = difflib.get_close_matches(name, list(known), n=3)
        message = f"unknown {kind} {name!r}"
        if close:
            message += f"; did you mean {', '.join(repr(c) for c in close)}?"
        if hint:
            message += f" ({hint})"
        super().__init__(message)
        self.kind = kind
        self.name = name


class InfeasibleError(HetschedError):
    """The input is valid but no answer satisfies it; the message says why."""

    exit_code = 4
    http_status = 409


class BackendUnavailableError(HetschedError):
    """A runtime (CUDA, ROCm, a database, an endpoint) is not reachable here."""

    exit_code = 5
    http_status = 503


class DeadlineError(HetschedError):
    """A computation passed its deadline and stopped between two of its steps."""

    exit_code = 6
    http_status = 504
