"""The ``hetsched`` command line: one typer app, a module per command group, each imported only when it runs.

``hetsched --help`` lists every command from ``COMMANDS`` (its module and one-line help) without importing a
command module: those pull in the store (SQLAlchemy, Alembic), SciPy, the web stack or the Kubernetes client,
which together cost seconds of start-up that ``--help`` and ``fit`` do not need.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import sys
from typing import Any

import typer
from rich.markup import escape
from typer import _click
from typer.core import TyperCommand, TyperGroup

from hetsched.cli.output import console_err
from hetsched.errors import HetschedError

COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("specs", "Memory breakdown of MODEL on each accelerator: weights, KV capacity, smallest TP."),
    "estimate": ("specs", "Roofline step latency of one engine step, with a per-operator breakdown."),
    "capacity": ("capacity", "Per-replica SLO capacity of MODEL on ACCELERATOR (simulated continuous batching), "
                             "or over the catalog."),
    "crds": ("operator", "Render the hetsched.io CustomResourceDefinitions from their pydantic types."),
    "operator": ("operator", "Run the operator: watch nodes, pools and ModelDeployments; plan; apply."),
    "plan": ("plan", "Cheapest placement of every model on the inventory that meets each SLO."),
    "profile": ("profile", "Measure (or estimate) MODEL's step latency and store it as a Profile."),
    "route": ("route", "Run the OpenAI-compatible router over the endpoints in CONFIG (or discovered in Kubernetes)."),
    "epp": ("epp", "Serve the router's picker to a Gateway API gateway as its endpoint picker (Envoy ext_proc over "
                   "gRPC)."),
    "sim-worker": ("route", "Serve the OpenAI API like one vLLM replica of MODEL on ACCELERATOR, timed by the "
                            "step-latency model."),
    "sim-pool": ("route", "Start one simulated worker per loopback endpoint of a router CONFIG; Ctrl-C stops them all."),
    "web": ("web", "Serve the web placement planner: choose models, load, SLOs and inventory; solve; compare "
                   "what-ifs; export."),
    "autoscale": ("autoscale", "Scale each model's replicas to live demand on the cheapest accelerators, without "
                               "flapping."),
    "calibrate": ("calibrate", "Fit ACCELERATOR's step-model constants to measured operator profiles, the twin to a "
                               "running engine, or (--live) learn a model's step-model correction on ACCELERATOR "
                               "from running engines."),
    "calibrations": ("calibrate", "Stored calibrations, newest first; the newest trusted one per device is in use."),
    "models": ("specs", "Bundled and local model configs."),
    "accelerators": ("specs", "The accelerator catalog."),
    "profiles": ("profile", "Stored profiles: list, show, export, import, import-vidur."),
}
"""Every top-level command: the ``hetsched.cli`` module whose ``register`` adds it, and its one-line help
(the first paragraph of the command's docstring; a test holds the two equal)."""


class _Listed(TyperCommand):
    """A command as ``--help`` lists it: name and one-line help, its module not yet imported."""

    def __init__(self, name: str, module: str, help: str) -> None:
        super().__init__(name, help=help, rich_markup_mode="rich")
        self.module = module


@functools.cache
def loaded_commands(module: str) -> dict[str, _click.Command]:
    """The commands the ``hetsched.cli`` module ``module`` registers, built as the root app would build them."""
    registry = typer.Typer(rich_markup_mode="rich")
    importlib.import_module(f"hetsched.cli.{module}").register(registry)
    return dict(typer.main.get_group(registry).commands)


class LazyGroup(TyperGroup):
    """The root group: lists ``COMMANDS`` as they are, loads the one a command line names."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for name, (module, help_text) in COMMANDS.items():
            self.commands.setdefault(name, _Listed(name, module, help_text))

    def resolve_command(self, ctx: _click.Context,
                        args: list[str]) -> tuple[str | None, _click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if isinstance(command, _Listed):
            command = loaded_commands(command.module)[command.name or ""]
        return name, command, rest


app = typer.Typer(
    name="hetsched",
    cls=LazyGroup,
    help="Serve LLMs on heterogeneous accelerators at the lowest cost that meets every SLO.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Serve LLMs on heterogeneous accelerators at the lowest cost that meets every SLO."""


def main() -> None:
    """Entry point: run the app, turning hetsched errors into a message and an exit code."""
    keep_stdout_for_output()
    try:
        app()
    except HetschedError as exc:
        console_err.print(f"[bold red]error:[/] {escape(str(exc))}")
        sys.exit(exc.exit_code)


def keep_stdout_for_output() -> None:
    """Point file descriptor 1 at stderr and keep ``sys.stdout`` on the real standard output.

    Native libraries that write to descriptor 1 then cannot corrupt the JSON a script reads; what
    they print still shows, on stderr. (The debug lines of the HiGHS bundled with SciPy do not
    reach even that: :func:`hetsched.optimizer.solve.solve` mutes descriptor 1 while it runs, and
    with ``sys.stdout`` on a descriptor of its own nothing of the command's is muted with them.)"""
    try:
        sys.stdout.flush()
        output = os.dup(1)
    except (OSError, ValueError):  # no usable standard output: nothing to keep apart
        return
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(io.FileIO(output, "w"), encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                                  line_buffering=bool(sys.stdout.line_buffering))
