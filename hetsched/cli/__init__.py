"""The ``hetsched`` command line: one typer app, a module per command group."""

from __future__ import annotations

import sys

import typer

from hetsched.cli import autoscale, capacity, operator, plan, profile, route, specs, web
from hetsched.cli.output import console_err
from hetsched.errors import HetschedError

app = typer.Typer(
    name="hetsched",
    help="Serve LLMs on heterogeneous accelerators at the lowest cost that meets every SLO.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
specs.register(app)
capacity.register(app)
operator.register(app)
plan.register(app)
profile.register(app)
route.register(app)
web.register(app)
autoscale.register(app)


def main() -> None:
    """Entry point: run the app, turning hetsched errors into a message and an exit code."""
    try:
        app()
    except HetschedError as exc:
        console_err.print(f"[bold red]error:[/] {exc}")
        sys.exit(exc.exit_code)
