"""The ``hetsched`` command line: one typer app, a module per command group."""

from __future__ import annotations

import io
import os
import sys

import typer
from rich.markup import escape

from hetsched.cli import autoscale, calibrate, capacity, operator, plan, profile, route, specs, web
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
calibrate.register(app)


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

    Native libraries that write to descriptor 1 (the MIP solver of the HiGHS bundled with SciPy
    prints debug lines there on large plans, in ``hetsched plan`` and in the autoscaler's full
    re-solves alike) then cannot corrupt the JSON a script reads; what they print still shows, on
    stderr."""
    try:
        sys.stdout.flush()
        output = os.dup(1)
    except (OSError, ValueError):  # no usable standard output: nothing to keep apart
        return
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(io.FileIO(output, "w"), encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                                  line_buffering=sys.stdout.line_buffering)
