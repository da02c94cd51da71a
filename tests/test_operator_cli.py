"""``hetsched operator``: the environment's settings, and the options given in place of the fields they name."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import InputError
from hetsched.operator import handlers, kube
from hetsched.operator.kube import Connection
from hetsched.settings import AutoscaleSettings, OperatorSettings, Settings
from hetsched.settings.operator import Approval

runner = CliRunner()


@pytest.fixture()
def started(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings ``hetsched operator`` would run with (no API server is contacted)."""
    runs: list[Settings] = []

    def run(connection: Connection, settings: Settings, **_: Any) -> None:
        runs.append(settings)

    monkeypatch.setattr(handlers, "run_operator", run)
    monkeypatch.setattr(kube, "connection_from_kubeconfig", lambda *_, **__: Connection(server="https://k8s.test"))
    return runs


def test_without_options_or_variables_the_operator_runs_on_the_settings_defaults(started: list[Settings]) -> None:
    assert runner.invoke(app, ["operator"], env={"HETSCHED_NAMESPACE": None, "HETSCHED_DATABASE_URL": None,
                                                 "HETSCHED_AUTOSCALE": None}).exit_code == 0
    ran = started[0]
    assert ran.operator == OperatorSettings(priority=ran.operator.priority)  # the priority is random per process
    assert ran.autoscale == AutoscaleSettings() and ran.store.database_url == ""


def test_autoscaling_is_on_by_default_with_the_given_interval(started: list[Settings]) -> None:
    result = runner.invoke(app, ["operator", "--autoscale-interval", "2.5"], env={"HETSCHED_AUTOSCALE": None})
    assert result.exit_code == 0, result.output
    assert started[0].operator.autoscale and started[0].autoscale.interval_s == 2.5
    assert runner.invoke(app, ["operator", "--no-autoscale"]).exit_code == 0
    assert not started[1].operator.autoscale


def test_the_chart_turns_autoscaling_off_through_the_environment(started: list[Settings]) -> None:
    assert runner.invoke(app, ["operator"], env={"HETSCHED_AUTOSCALE": "false"}).exit_code == 0
    assert not started[0].operator.autoscale
    assert runner.invoke(app, ["operator"], env={"HETSCHED_AUTOSCALE": "true"}).exit_code == 0
    assert started[1].operator.autoscale


def test_a_non_positive_interval_is_refused_naming_the_option(started: list[Settings]) -> None:
    result = runner.invoke(app, ["operator", "--autoscale-interval", "0"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--autoscale-interval"
    assert not started


def test_serve_namespaces_reach_the_settings(started: list[Settings]) -> None:
    result = runner.invoke(app, ["operator", "--serve-namespace", "serving", "--serve-namespace", "batch"])
    assert result.exit_code == 0, result.output
    assert started[0].operator.serve_namespaces == ("serving", "batch")
    assert runner.invoke(app, ["operator"]).exit_code == 0 and started[1].operator.serve_namespaces == ()


def test_the_environment_gives_the_defaults_and_options_override_them(started: list[Settings]) -> None:
    env = {"HETSCHED_NAMESPACE": "infra", "HETSCHED_DATABASE_URL": "sqlite:///plans.sqlite", "HETSCHED_AUTOSCALE": "no"}
    assert runner.invoke(app, ["operator"], env=env).exit_code == 0
    assert (started[0].operator.namespace, started[0].store.database_url, started[0].operator.autoscale) == (
        "infra", "sqlite:///plans.sqlite", False)
    result = runner.invoke(app, ["operator", "--namespace", "ops", "--database-url", "sqlite:///other.sqlite",
                                 "--autoscale"], env=env)
    assert result.exit_code == 0, result.output
    assert (started[1].operator.namespace, started[1].store.database_url) == ("ops", "sqlite:///other.sqlite")
    assert started[1].operator.autoscale


def test_options_replace_only_the_fields_they_name(started: list[Settings]) -> None:
    result = runner.invoke(app, ["operator", "--approval", "manual", "--debounce", "0.5", "--mig-configmap", "",
                                 "--dcm-configmap", "kube-amd-gpu/dcm"])
    assert result.exit_code == 0, result.output
    ran = started[0].operator
    assert (ran.default_approval, ran.debounce_s, ran.mig_configmap, ran.dcm_configmap) == (
        Approval.MANUAL, 0.5, None, ("kube-amd-gpu", "dcm"))
    assert (ran.requeue_s, ran.epp_service) == (OperatorSettings.requeue_s, OperatorSettings.epp_service)
    result = runner.invoke(app, ["operator", "--dcm-configmap", "just-a-name"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--dcm-configmap"


def test_the_epp_service_reaches_the_settings_and_a_bad_name_is_refused(started: list[Settings]) -> None:
    assert runner.invoke(app, ["operator"]).exit_code == 0 and started[0].operator.epp_service == "hetsched-epp"
    assert runner.invoke(app, ["operator", "--epp-service", "chat-epp"]).exit_code == 0
    assert started[1].operator.epp_service == "chat-epp"
    result = runner.invoke(app, ["operator", "--epp-service", "Chat_EPP"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--epp-service"
    assert len(started) == 2
