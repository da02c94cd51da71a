"""``hetsched crds`` (render the CRDs) and ``hetsched operator`` (run the Kubernetes operator)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from hetsched.cli.output import console, console_err
from hetsched.cli.settings import overridden
from hetsched.errors import InputError
from hetsched.operator.resources import SERVICE_NAME_PATTERN
from hetsched.settings import AutoscaleSettings, Settings
from hetsched.settings.operator import Approval, OperatorSettings


DEFAULT_CRD_FOLDERS = [Path("crds"), Path("charts/hetsched/crds")]


def crds_command(
    out: Annotated[list[Path] | None, typer.Option("--out", help="folder to write the CRD YAML into (repeatable); "
                                                   "default: crds and charts/hetsched/crds")] = None,
    check: Annotated[bool, typer.Option("--check", help="write nothing; fail when a folder is stale")] = False,
) -> None:
    """Render the hetsched.io CustomResourceDefinitions from their pydantic types."""
    from hetsched.operator.crdgen import crd_documents

    documents = crd_documents()
    for folder in out or DEFAULT_CRD_FOLDERS:
        stale = [name for name, text in documents.items() if _written(folder / name) != text]
        if check:
            if stale:
                raise InputError(f"stale or missing in {folder}: {', '.join(stale)}; run 'hetsched crds --out {folder}'",
                                 field="--out")
            console.print(f"{len(documents)} CRDs in {folder} are up to date", markup=False)
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in documents.items():
                (folder / name).write_text(text)
        except OSError as exc:
            raise InputError(f"cannot write the CRDs to {folder}: {exc.strerror}", field="--out") from exc
        console.print(f"wrote {len(documents)} CRDs to {folder} ({len(stale)} changed)", markup=False)


def _written(path: Path) -> str | None:
    """A CRD file's text as written; None when it is missing, unreadable or not UTF-8 (so stale)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def operator_command(
    kubeconfig: Annotated[Path | None, typer.Option(help="kubeconfig for development; default: in-cluster")] = None,
    context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
    namespace: Annotated[str | None, typer.Option(help="the operator's namespace: events about cluster-scoped objects "
                                                  f"(default: HETSCHED_NAMESPACE, else {OperatorSettings.namespace})")]
    = None,
    peering: Annotated[str, typer.Option(help="kopf peering object for leader election")] = "hetsched",
    standalone: Annotated[bool, typer.Option(help="run without leader election (one replica only)")] = False,
    approval: Annotated[Approval | None, typer.Option(help="approval of the PlacementPlan the operator creates "
                                                      f"(default: {OperatorSettings.default_approval})")] = None,
    debounce: Annotated[float | None, typer.Option(min=0, help="seconds of quiet before re-planning "
                                                   f"(default: {OperatorSettings.debounce_s:g})")] = None,
    liveness: Annotated[str | None, typer.Option(help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")] = None,
    mig_configmap: Annotated[str | None, typer.Option(
        help="NAMESPACE/NAME of the mig-parted ConfigMap the MIG manager reads; empty: never MIG-split GPUs "
             f"(default: {_shown(OperatorSettings.mig_configmap)})")] = None,
    dcm_configmap: Annotated[str | None, typer.Option(
        help="NAMESPACE/NAME of the ConfigMap the AMD Device Config Manager reads (name it in the DeviceConfig's "
             f"spec.configManager.config); empty: never partition AMD GPUs (default: "
             f"{_shown(OperatorSettings.dcm_configmap)})")] = None,
    database_url: Annotated[str | None, typer.Option(help="store applied plans in this database "
                                                          "(default: HETSCHED_DATABASE_URL, else none)")] = None,
    autoscale: Annotated[bool | None, typer.Option("--autoscale/--no-autoscale",
                                                   help="scale replicas to the demand the engine pods' /metrics show; "
                                                   "off: run the replicas the plan says (default: HETSCHED_AUTOSCALE, "
                                                   f"else {'on' if OperatorSettings.autoscale else 'off'})")] = None,
    autoscale_interval: Annotated[float | None, typer.Option(
        help=f"seconds between two autoscaling decisions (default: {AutoscaleSettings.interval_s:g})")] = None,
    serve_namespace: Annotated[list[str] | None, typer.Option(
        "--serve-namespace", help="a namespace whose ModelDeployments get engines (repeatable; the chart's "
                                  "rbac.namespaces); default: every namespace")] = None,
    epp_service: Annotated[str | None, typer.Option(
        help="the Endpoint Picker Service the InferencePools of models with spec.gateway.inferencePool name (the "
             f"chart's epp.serviceName; default: {OperatorSettings.epp_service})")] = None,
) -> None:
    """Run the operator: watch nodes, pools and ModelDeployments; plan; apply.

    Settings come from the environment (HETSCHED_NAMESPACE, HETSCHED_DATABASE_URL, HETSCHED_AUTOSCALE); an option
    given replaces the setting it names.
    """
    from hetsched.operator.handlers import run_operator
    from hetsched.operator.kube import connection_from_kubeconfig

    if autoscale_interval is not None and autoscale_interval <= 0:
        raise InputError(f"expected a positive number of seconds, got {autoscale_interval}",
                         field="--autoscale-interval")
    if epp_service is not None and not re.fullmatch(SERVICE_NAME_PATTERN, epp_service):
        raise InputError(f"expected a Service name (lowercase letters, digits and '-'), got {epp_service!r}",
                         field="--epp-service")
    settings = Settings.from_env()
    operator = overridden(settings.operator, namespace=namespace, default_approval=approval, debounce_s=debounce,
                          autoscale=autoscale, serve_namespaces=tuple(serve_namespace) if serve_namespace else None,
                          epp_service=epp_service)
    if mig_configmap is not None:
        operator = replace(operator, mig_configmap=_namespaced(mig_configmap, "--mig-configmap"))
    if dcm_configmap is not None:
        operator = replace(operator, dcm_configmap=_namespaced(dcm_configmap, "--dcm-configmap"))
    settings = replace(settings, operator=operator,
                       store=overridden(settings.store, database_url=database_url),
                       autoscale=overridden(settings.autoscale, interval_s=autoscale_interval))
    connection = connection_from_kubeconfig(kubeconfig, context=context)
    console_err.print(f"hetsched operator: API server {connection.server}, namespace {settings.operator.namespace}")
    run_operator(connection, settings, peering=None if standalone else peering, liveness=liveness)


def register(app: typer.Typer) -> None:
    app.command("crds")(crds_command)
    app.command("operator")(operator_command)


def _shown(place: tuple[str, str] | None) -> str:
    return "/".join(place) if place else "none"


def _namespaced(value: str, option: str) -> tuple[str, str] | None:
    """NAMESPACE/NAME as a pair; None when empty."""
    if not value:
        return None
    namespace, _, name = value.partition("/")
    if not namespace or not name:
        raise InputError(f"expected NAMESPACE/NAME, got {value!r}", field=option)
    return namespace, name
