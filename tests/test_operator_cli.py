"""``hetsched operator``: options become the operator's settings."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import InputError
from hetsched.operator import handlers, kube
from hetsched.operator.kube import Connection

runner = CliRunner()


@pytest.fixture()
def started(monkeypatch: pytest.MonkeyPatch) -> list[handlers.OperatorConfig]:
    """The configs ``hetsched operator`` would run with (no API server is contacted)."""
    configs: list[handlers.OperatorConfig] = []

    def run(connection: Connection, config: handlers.OperatorConfig, **_: Any) -> None:
        configs.append(config)

    monkeypatch.setattr(handlers, "run_operator", run)
    monkeypatch.setattr(kube, "connection_from_kubeconfig", lambda *_, **__: Connection(server="https://k8s.test"))
    return configs


def test_autoscaling_is_on_by_default_with_the_given_interval(started: list[handlers.OperatorConfig]) -> None:
    result = runner.invoke(app, ["operator", "--autoscale-interval", "2.5"])
    assert result.exit_code == 0, result.output
    assert started[0].autoscale is not None and started[0].autoscale.interval_s == 2.5
    assert runner.invoke(app, ["operator", "--no-autoscale"]).exit_code == 0
    assert started[1].autoscale is None


def test_the_chart_turns_autoscaling_off_through_the_environment(started: list[handlers.OperatorConfig]) -> None:
    assert runner.invoke(app, ["operator"], env={"HETSCHED_AUTOSCALE": "false"}).exit_code == 0
    assert started[0].autoscale is None
    assert runner.invoke(app, ["operator"], env={"HETSCHED_AUTOSCALE": "true"}).exit_code == 0
    assert started[1].autoscale is not None


def test_a_non_positive_interval_is_refused_naming_the_option(started: list[handlers.OperatorConfig]) -> None:
    result = runner.invoke(app, ["operator", "--autoscale-interval", "0"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--autoscale-interval"
    assert not started


def test_serve_namespaces_reach_the_settings(started: list[handlers.OperatorConfig]) -> None:
    result = runner.invoke(app, ["operator", "--serve-namespace", "serving", "--serve-namespace", "batch"])
    assert result.exit_code == 0, result.output
    assert started[0].serve_namespaces == ("serving", "batch")
    assert runner.invoke(app, ["operator"]).exit_code == 0 and started[1].serve_namespaces == ()


def test_the_environment_gives_the_defaults_and_options_override_them(started: list[handlers.OperatorConfig]) -> None:
    env = {"HETSCHED_NAMESPACE": "infra", "HETSCHED_DATABASE_URL": "sqlite:///plans.sqlite", "HETSCHED_AUTOSCALE": "no"}
    assert runner.invoke(app, ["operator"], env=env).exit_code == 0
    assert (started[0].namespace, started[0].database_url, started[0].autoscale) == ("infra", "sqlite:///plans.sqlite",
                                                                                      None)
    result = runner.invoke(app, ["operator", "--namespace", "ops", "--database-url", "sqlite:///other.sqlite",
                                 "--autoscale"], env=env)
    assert result.exit_code == 0, result.output
    assert (started[1].namespace, started[1].database_url) == ("ops", "sqlite:///other.sqlite")
    assert started[1].autoscale is not None


def test_the_epp_service_reaches_the_settings_and_a_bad_name_is_refused(started: list[handlers.OperatorConfig]) -> None:
    assert runner.invoke(app, ["operator"]).exit_code == 0 and started[0].epp_service == "hetsched-epp"
    assert runner.invoke(app, ["operator", "--epp-service", "chat-epp"]).exit_code == 0
    assert started[1].epp_service == "chat-epp"
    result = runner.invoke(app, ["operator", "--epp-service", "Chat_EPP"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--epp-service"
    assert len(started) == 2
