"""Schema-based fuzzing of the planner API: whatever the request, no 5xx other than a declared solve timeout.

Bounded: a few examples per operation (plus the OpenAPI examples, which
reach a real solve), a short solve deadline, a fast deterministic capacity
source, and a fresh SQLite store in a temporary folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from hetsched.settings import Settings, StoreSettings, WebSettings
from hetsched.web import create_app
from web_support import scaled_capacity

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[dev]')")
from schemathesis.checks import not_a_server_error  # noqa: E402

_STORE = Path(tempfile.mkdtemp(prefix="hetsched-fuzz-")) / "fuzz.sqlite"
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(
    Settings(store=StoreSettings(database_url=f"sqlite:///{_STORE}"),
             web=WebSettings(solve_timeout_s=3.0, max_body_bytes=200_000)),
    capacity_source=scaled_capacity))


@schema.parametrize()
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case) -> None:
    response = case.call()
    if response.status_code == 504:  # the documented solve timeout: a clear answer, not a crash
        assert "did not finish" in response.json()["detail"]
        return
    case.validate_response(response, checks=[not_a_server_error])
