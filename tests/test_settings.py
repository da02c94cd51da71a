"""One settings root: every component's section, the environment read in one place, each fact in one field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetsched.errors import InputError
from hetsched.settings import AutoscaleSettings, OperatorSettings, Settings, StoreSettings
from hetsched.settings.store import default_database_file
from hetsched.store import open_configured_store


def test_every_variable_lands_in_its_section() -> None:
    settings = Settings.from_env({"HETSCHED_DATABASE_URL": "sqlite:///plans.sqlite", "HETSCHED_NAMESPACE": "infra",
                                  "HETSCHED_AUTOSCALE": "off", "HETSCHED_WEB_TOKEN": "secret",
                                  "HETSCHED_PRICES": "l4=0.7"})
    assert settings.store.database_url == "sqlite:///plans.sqlite"
    assert settings.operator.namespace == "infra" and settings.operator.autoscale is False
    assert settings.web.token == "secret" and settings.web.prices == {"l4": 0.7}


def test_without_variables_each_section_has_its_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.store.database_url == "" and settings.store.resolved_url() == f"sqlite:///{default_database_file()}"
    assert settings.operator.namespace == OperatorSettings.namespace and settings.operator.autoscale is True
    assert settings.autoscale == AutoscaleSettings()


@pytest.mark.parametrize(("text", "on"), [("true", True), ("1", True), ("Yes", True), ("on", True), ("", True),
                                          ("false", False), ("0", False), ("NO", False), ("off", False)])
def test_autoscale_is_read_as_a_flag(text: str, on: bool) -> None:
    assert Settings.from_env({"HETSCHED_AUTOSCALE": text}).operator.autoscale is on


def test_a_bad_flag_names_the_variable() -> None:
    with pytest.raises(InputError, match="^HETSCHED_AUTOSCALE: expected true or false .* got 'maybe'"):
        Settings.from_env({"HETSCHED_AUTOSCALE": "maybe"})


def test_reading_the_settings_loads_no_component() -> None:
    """The settings package is a leaf: a process that only reads its settings loads no service, CRD type,
    database or HTTP library."""
    code = ("import sys; from hetsched.settings import Settings; Settings.from_env(); "
            "print(sorted(m for m in sys.modules if m.startswith('hetsched.') and not m.startswith('hetsched.settings')"
            " or m.split('.')[0] in ('pydantic', 'sqlalchemy', 'kopf', 'kubernetes', 'httpx', 'starlette')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "['hetsched.errors']"


@pytest.mark.skipif(sys.platform != "linux", reason="the user data directory follows XDG_DATA_HOME on Linux")
def test_an_unset_url_opens_the_default_file_in_a_folder_made_for_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_database_file() == tmp_path / "data" / "hetsched" / "hetsched.sqlite"
    store = open_configured_store(StoreSettings())
    try:
        assert default_database_file().is_file()
    finally:
        store.engine.dispose()
