"""One duration grammar for flags (``--slo-ttft 800us``) and custom resources (``startupTimeout: 1m30s``)."""

from __future__ import annotations

import re

import pytest

from hetsched.errors import InputError
from hetsched.operator.resources import SLOSpec
from hetsched.specs.durations import DURATION_PATTERN, parse_duration_ms, parse_duration_s


@pytest.mark.parametrize(("text", "ms"), [
    # what ``hetsched capacity`` took before
    ("500ms", 500.0), ("0.5s", 500.0), ("800us", 0.8), ("250µs", 0.25), (" 50 ms ", 50.0), (".5s", 500.0),
    ("2.s", 2000.0),
    # what the operator's resources took before
    ("1m30s", 90_000.0), ("2h", 7_200_000.0), ("1h30m", 5_400_000.0), ("10m", 600_000.0), ("1.5s", 1500.0),
    # both at once
    ("1s500ms", 1500.0), ("1m 30s", 90_000.0),
])
def test_both_former_grammars_parse_to_the_same_values(text: str, ms: float) -> None:
    assert parse_duration_ms(text, field="x") == pytest.approx(ms)
    assert parse_duration_s(text, field="x") == pytest.approx(ms / 1e3)
    assert re.fullmatch(DURATION_PATTERN, text), "the CRD pattern accepts what the parser accepts"


def test_single_unit_values_are_computed_as_before() -> None:
    """The flags' milliseconds and the operator's seconds come out bit for bit as their own parsers gave them."""
    assert parse_duration_ms("800us") == 800 * 1e-3
    assert parse_duration_ms("0.5s") == 0.5 * 1e3
    assert parse_duration_s("500ms") == 500 * 1e-3
    assert parse_duration_s("1m30s") == 1 * 60.0 + 30 * 1.0


@pytest.mark.parametrize("text", ["500", "0.5", "", "ms", "5 seconds", "1d", "-1s", "1e3ms", "1m30", "s1"])
def test_a_bare_number_or_unknown_unit_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(InputError, match=r"^--slo-ttft: expected a duration with a unit \(us, ms, s, m or h\)"):
        parse_duration_ms(text, field="--slo-ttft")
    assert not re.fullmatch(DURATION_PATTERN, text)


def test_zero_is_refused_only_where_a_positive_duration_is_needed() -> None:
    assert parse_duration_s("0s", field="spec.engine.startupTimeout") == 0.0
    with pytest.raises(InputError, match="^--slo-tpot: expected a positive duration, got '0ms'"):
        parse_duration_ms("0ms", field="--slo-tpot", positive=True)


def test_an_overflowing_duration_is_refused() -> None:
    with pytest.raises(InputError, match="x: expected a finite duration"):
        parse_duration_s("9" * 400 + "h", field="x")


def test_custom_resources_accept_the_flags_units() -> None:
    assert SLOSpec(ttft="800us", tpot="1m30s").ttft == "800us"
    with pytest.raises(ValueError, match="ttft"):
        SLOSpec(ttft="500", tpot="50ms")
