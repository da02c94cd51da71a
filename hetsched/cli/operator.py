"""``hetsched crds`` (render the CRDs) and ``hetsched operator`` (run the Kubernetes operator)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from hetsched.cli.output import console, console_err
from hetsched.errors import InputError
from hetsched.operator.config import EPP_SERVICE
from hetsched.operator.resources import SERVICE_NAME_PATTERN, Approval


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
                                                  "(default: HETSCHED_NAMESPACE, else hetsched)")] = None,
    peering: Annotated[str, typer.Option(help="kopf peering object for leader election")] = "hetsched",
    standalone: Annotated[bool, typer.Option(help="run without leader election (one replica only)")] = False,
    approval: Annotated[Approval, typer.Option(help="approval of the PlacementPlan the operator creates")] = Approval.AUTO,
    debounce: Annotated[float, typer.Option(help="seconds of quiet before re-planning")] = 2.0,
    liveness: Annotated[str | None, typer.Option(help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")] = None,
    mig_configmap: Annotated[str, typer.Option(help="NAMESPACE/NAME of the mig-parted ConfigMap the MIG manager reads; "
                                                    "empty: never MIG-split GPUs")]
    = "gpu-operator/hetsched-mig-parted-config",
    dcm_configmap: Annotated[str, typer.Option(help="NAMESPACE/NAME of the ConfigMap the AMD Device Config Manager reads "
                                                    "(name it in the DeviceConfig's spec.configManager.config); "
                                                    "empty: never partition AMD GPUs")] = "",
    database_url: Annotated[str | None, typer.Option(help="store applied plans in this database "
                                                          "(default: HETSCHED_DATABASE_URL)")] = None,
    autoscale: Annotated[bool | None, typer.Option("--autoscale/--no-autoscale",
                                                   help="scale replicas to the demand the engine pods' /metrics show; "
                                                   "off: run the replicas the plan says (default: HETSCHED_AUTOSCALE, "
                                                   "else on)")] = None,
    autoscale_interval: Annotated[float, typer.Option(help="seconds between two autoscaling decisions")] = 5.0,
    serve_namespace: Annotated[list[str] | None, typer.Option(
        "--serve-namespace", help="a namespace whose ModelDeployments get engines (repeatable; the chart's "
                                  "rbac.namespaces); default: every namespace")] = None,
    epp_service: Annotated[str, typer.Option(help="the Endpoint Picker Service the InferencePools of models with "
                                                  "spec.gateway.inferencePool name (the chart's epp.serviceName)")]
    = EPP_SERVICE,
) -> None:
    """Run the operator: watch nodes, pools and ModelDeployments; plan; apply."""
    from hetsched.operator.handlers import run_operator
    from hetsched.operator.kube import connection_from_kubeconfig
    from hetsched.settings import Settings

    mig_place = _namespaced(mig_configmap, "--mig-configmap")
    dcm_place = _namespaced(dcm_configmap, "--dcm-configmap")
    if autoscale_interval <= 0:
        raise InputError(f"expected a positive number of seconds, got {autoscale_interval}",
                         field="--autoscale-interval")
    if not re.fullmatch(SERVICE_NAME_PATTERN, epp_service):
        raise InputError(f"expected a Service name (lowercase letters, digits and '-'), got {epp_service!r}",
                         field="--epp-service")
    settings = Settings.from_env()
    scaling = settings.operator.autoscale is not None if autoscale is None else autoscale
    connection = connection_from_kubeconfig(kubeconfig, context=context)
    config = replace(settings.operator, namespace=namespace if namespace is not None else settings.operator.namespace,
                     default_approval=approval, debounce_s=debounce, mig_configmap=mig_place, dcm_configmap=dcm_place,
                     database_url=(database_url if database_url is not None else settings.operator.database_url) or None,
                     autoscale=replace(settings.autoscale, interval_s=autoscale_interval) if scaling else None,
                     serve_namespaces=tuple(serve_namespace or ()), epp_service=epp_service)
    console_err.print(f"hetsched operator: API server {connection.server}, namespace {config.namespace}")
    run_operator(connection, config, peering=None if standalone else peering, liveness=liveness)


def register(app: typer.Typer) -> None:
    app.command("crds")(crds_command)
    app.command("operator")(operator_command)


def _namespaced(value: str, option: str) -> tuple[str, str] | None:
    """NAMESPACE/NAME as a pair; None when empty."""
    if not value:
        return None
    namespace, _, name = value.partition("/")
    if not namespace or not name:
        raise InputError(f"expected NAMESPACE/NAME, got {value!r}", field=option)
    return namespace, name
