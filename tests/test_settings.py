"""One settings root: every component's section, the environment read in one place."""

from __future__ import annotations

import pytest

from hetsched.autoscale.settings import AutoscaleSettings
from hetsched.errors import InputError
from hetsched.operator.config import OperatorConfig
from hetsched.settings import Settings


def test_every_variable_lands_in_its_section() -> None:
    settings = Settings.from_env({"HETSCHED_DATABASE_URL": "sqlite:///plans.sqlite", "HETSCHED_NAMESPACE": "infra",
                                  "HETSCHED_AUTOSCALE": "off", "HETSCHED_WEB_TOKEN": "secret",
                                  "HETSCHED_PRICES": "l4=0.7"})
    assert settings.store.database_url == settings.operator.database_url == "sqlite:///plans.sqlite"
    assert settings.operator.namespace == "infra" and settings.operator.autoscale is None
    assert settings.web.token == "secret" and settings.web.prices == {"l4": 0.7}


def test_without_variables_each_section_has_its_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.store.database_url == "" and settings.operator.database_url is None
    assert settings.operator.namespace == OperatorConfig.namespace
    assert settings.operator.autoscale == settings.autoscale == AutoscaleSettings()


@pytest.mark.parametrize(("text", "on"), [("true", True), ("1", True), ("Yes", True), ("on", True), ("", True),
                                          ("false", False), ("0", False), ("NO", False), ("off", False)])
def test_autoscale_is_read_as_a_flag(text: str, on: bool) -> None:
    assert (Settings.from_env({"HETSCHED_AUTOSCALE": text}).operator.autoscale is not None) is on


def test_a_bad_flag_names_the_variable() -> None:
    with pytest.raises(InputError, match="^HETSCHED_AUTOSCALE: expected true or false .* got 'maybe'"):
        Settings.from_env({"HETSCHED_AUTOSCALE": "maybe"})
