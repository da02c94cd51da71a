"""The settings a command runs with: the environment's, with each option given on the command line in place of
the field it names."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Section = TypeVar("Section", bound="DataclassInstance")


def overridden(section: Section, **options: object) -> Section:
    """``section`` with the options given (typer leaves the others None) in place of its fields."""
    return replace(section, **{name: value for name, value in options.items() if value is not None})
