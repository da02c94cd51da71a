"""``hetsched plan``: solve a cluster file into a placement plan."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import ValidationError

from hetsched.cli.database import store_from_env
from hetsched.cli.output import console, console_err, print_json
from hetsched.cli.specs import calibrated_catalog
from hetsched.errors import InfeasibleError, InputError
from hetsched.optimizer.build import computed_models
from hetsched.optimizer.load import load_cluster, load_plan
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.render import plan_view, plan_yaml
from hetsched.partition.render import dcm_json, mig_parted_yaml, node_config_labels
from hetsched.store.cache import cached_capacity_source
from hetsched.store.plans import save_plan


class PlanFormat(StrEnum):
    table = "table"
    yaml = "yaml"
    json = "json"


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)


def plan_command(
    cluster: Annotated[Path, typer.Argument(help="cluster file (YAML/JSON): pools, models, capacities; or a Mélange-style profile")],
    current: Annotated[Path | None, typer.Option("--current", help="the plan in effect (-o yaml/json output), for the churn penalty")] = None,
    output: Annotated[PlanFormat, typer.Option("--output", "-o", help="table for people; yaml/json for tools")] = PlanFormat.table,
    partition_config_out: Annotated[Path | None, typer.Option("--partition-config-out", help="write mig-parted config.yaml, node-labels.yaml and (for AMD partitions) dcm-config.json here, all or none; an old dcm-config.json the plan does not need is removed")] = None,
    mig_config_out: Annotated[Path | None, typer.Option("--mig-config-out", hidden=True, help="deprecated: the former name of --partition-config-out")] = None,
    save: Annotated[bool, typer.Option("--save", help="store the plan and its input in the database")] = False,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="solver time limit in seconds (overrides the file)")] = None,
    churn_weight: Annotated[float | None, typer.Option("--churn-weight", help="$/hour per replica moved vs --current (overrides the file)")] = None,
    headroom: Annotated[float | None, typer.Option("--headroom", help="replicas cover demand × (1 + headroom) (overrides the file; default 0.1, 0 for Mélange and AIBrix files)")] = None,
    mip_gap: Annotated[float | None, typer.Option("--mip-gap", help="relative gap at which the solve may stop, 0 for the proven optimum (overrides the file)")] = None,
) -> None:
    """Cheapest placement of every model on the inventory that meets each SLO."""
    config_out = _partition_config_folder(partition_config_out, former=mig_config_out)
    catalog = calibrated_catalog()
    spec = load_cluster(cluster, catalog=catalog)
    flags = {"time_limit_s": ("--time-limit", time_limit), "churn_weight": ("--churn-weight", churn_weight),
             "headroom": ("--headroom", headroom), "mip_gap": ("--mip-gap", mip_gap)}
    overrides = {k: v for k, (_, v) in flags.items() if v is not None}
    if overrides:
        try:
            spec = spec.model_copy(update={"solver": spec.solver.model_validate({**spec.solver.model_dump(), **overrides})})
        except ValidationError as exc:
            first = exc.errors()[0]
            flag = next((flag for key, (flag, _) in flags.items() if first["loc"][:1] == (key,)), None)
            raise InputError(first["msg"], field=flag) from exc
    store = store_from_env() if computed_models(spec) else None
    source = cached_capacity_source(store) if store else None
    plan = optimize(spec, catalog=catalog, current=_current_plan(current) if current else None, capacity_source=source)
    if output is PlanFormat.json:
        print_json(plan)
    elif output is PlanFormat.yaml:
        print(plan_yaml(plan), end="")
    else:
        console.print(plan_view(plan))
        if source is not None:
            for accelerator in sorted({pool.accelerator for pool in spec.pools} - {a.id for a in spec.accelerators}):
                perf = catalog.get(accelerator).perf
                console_err.print(f"step model of {accelerator}: {perf.source if perf else 'catalog'}", markup=False)
    if plan.status is PlanStatus.INFEASIBLE:
        raise InfeasibleError("no plan meets every SLO with this inventory: " + "; ".join(plan.explanation.infeasible))
    if config_out is not None:
        _write_partition_configs(plan, config_out)
    if save:
        store = store or store_from_env()
        plan_id = save_plan(store, spec, plan, origin="cli").id
        console_err.print(f"saved as plan {plan_id}")


def _current_plan(path: Path) -> Plan:
    """The plan in effect, its problems reported against ``--current`` (and where in the file, when inside it)."""
    try:
        return load_plan(path)
    except InputError as exc:
        if exc.field == "current":  # the file itself: missing, unreadable, not YAML or JSON
            raise InputError(str(exc).removeprefix("current: "), field="--current") from exc
        raise InputError(f"{exc} (expected a plan written by 'hetsched plan -o yaml' or '-o json')",
                         field="--current") from exc


def _partition_config_folder(folder: Path | None, *, former: Path | None) -> Path | None:
    """``--partition-config-out``, or the folder given under its former name ``--mig-config-out`` (read until the
    next release, with a warning)."""
    if former is None:
        return folder
    if folder is not None:
        raise InputError("give --partition-config-out or its former name --mig-config-out, not both",
                         field="--mig-config-out")
    console_err.print("warning: --mig-config-out is deprecated and read until the next release: use "
                      "--partition-config-out", markup=False)
    return former


def partition_config_files(plan: Plan) -> dict[str, str | None]:
    """Each file ``--partition-config-out`` owns, with its text, or None where this plan has none (an old one goes)."""
    return {"config.yaml": mig_parted_yaml(plan.mig_configs),
            "node-labels.yaml": yaml.safe_dump(node_config_labels(plan.nodes), sort_keys=True),
            "dcm-config.json": dcm_json(plan.partition_profiles) if plan.partition_profiles else None}


def _write_partition_configs(plan: Plan, folder: Path) -> None:
    """Write the plan's files into ``folder`` all or nothing: on any failure the folder is left as it was."""
    files = partition_config_files(plan)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the folder {folder}: {exc.strerror}", field="--partition-config-out") from exc
    taken = [folder / name for name in files if (folder / name).is_dir()]
    if taken:
        raise InputError(f"{taken[0]} is a folder, where the plan's file of that name goes; move it away",
                         field="--partition-config-out")
    removed = _replace_files(folder, files)
    console_err.print("wrote " + ", ".join(str(folder / name) for name, text in files.items() if text is not None),
                      markup=False)
    if removed:
        console_err.print(f"removed {', '.join(map(str, removed))}, which this plan does not need", markup=False)


def _replace_files(folder: Path, files: dict[str, str | None]) -> list[Path]:
    """Put each file's text in ``folder`` (None: remove the file), all or none of it; the files removed.

    Every text is first written beside its target, and old files are moved aside and deleted only once every new
    one is in place, so a failure at any step puts the old set back."""
    staged: dict[Path, Path] = {}
    aside: dict[Path, Path] = {}
    placed: list[Path] = []
    target = folder
    try:
        for name, text in files.items():
            if text is not None:
                target, partial = folder / name, folder / f".{name}.tmp"
                partial.write_text(text)
                staged[target] = partial
        for target in (folder / name for name in files if (folder / name).exists()):
            old = folder / f".{target.name}.old"
            target.replace(old)
            aside[target] = old
        for target, partial in staged.items():
            partial.replace(target)
            placed.append(target)
    except OSError as exc:
        for path in [*placed, *staged.values()]:
            path.unlink(missing_ok=True)
        for original, old in aside.items():
            old.replace(original)
        raise InputError(f"cannot write {target}: {exc.strerror}; {folder} was left as it was",
                         field="--partition-config-out") from exc
    for old in aside.values():
        old.unlink()
    return [target for target in aside if files[target.name] is None]
