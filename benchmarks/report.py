"""BENCHMARKS.md sections written by the benchmark that produced them.

A section is the text between a ``<!-- BEGIN name -->`` line and an ``<!-- END name -->`` line of
BENCHMARKS.md. A benchmark run with ``--write`` replaces its section with what it printed, headed by
its command line, the commit it ran at, the date and the load average, so the figures there are the
ones a run gave, not a copy by hand. Without ``--write`` it only prints. The reading around a
section is written by people and is left as it is. A ``--quick`` run is a smoke run of every part
(what the test suite runs), and its figures are not written.

A script hands its entry point to ``main``::

    if __name__ == "__main__":
        report.main(main, section="simulator_speed")

``--write`` is taken out of ``sys.argv`` before the script parses its own flags. The section's
markers are checked before the run starts, so a long benchmark does not fail at its end. What the
script prints through ``sys.stdout`` is kept; what child processes write to the terminal is not.
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import redirect_stdout
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
WRITE_FLAG = "--write"
QUICK_FLAG = "--quick"
SOURCES = ("hetsched", "benchmarks")
"""The folders whose state a benchmark's figures depend on."""


class SectionError(ValueError):
    """BENCHMARKS.md has no single, well-ordered pair of markers for a section."""


def markers(name: str) -> tuple[str, str]:
    """The BEGIN and END marker lines of section ``name``."""
    return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def replace_section(text: str, name: str, body: str, *, source: str = "BENCHMARKS.md") -> str:
    """``text`` with the lines between section ``name``'s markers replaced by ``body``."""
    begin, end = markers(name)
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == begin]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1:
        raise SectionError(
            f"{source}: section {name!r} needs exactly one line {begin!r} and one line {end!r}; "
            f"found {len(starts)} and {len(ends)} (put them around the section's results)")
    if ends[0] < starts[0]:
        raise SectionError(f"{source}: section {name!r}: {end!r} (line {ends[0] + 1}) comes before "
                           f"{begin!r} (line {starts[0] + 1})")
    inner = body.strip("\n")
    middle = [inner + "\n"] if inner else []
    return "".join(lines[: starts[0] + 1] + middle + lines[ends[0]:])


def render(*, command: str, revision: str, when: datetime, load: tuple[float, float, float], output: str) -> str:
    """A section's text: the command, the commit, when it ran and the machine's load, then its output verbatim."""
    fence = "```"
    while fence in output:
        fence += "`"
    averages = " ".join(f"{value:.2f}" for value in load)
    return (f"`{command}` at `{revision}` — {when:%Y-%m-%d %H:%M} UTC, load average (1, 5, 15 min) {averages} "
            f"at the end\n\n{fence}\n{output.strip(chr(10))}\n{fence}")


def source_revision(root: Path = ROOT) -> str:
    """The commit the figures come from, marked when the sources it ran differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", *SOURCES], cwd=root, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no git revision"
    return f"{head} with uncommitted changes" if changed else head


def write_section(path: Path, name: str, body: str) -> None:
    """Replace section ``name`` of the file at ``path``; the file is replaced whole or not at all."""
    text = replace_section(path.read_text(encoding="utf-8"), name, body, source=path.name)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def command_line(argv: list[str]) -> str:
    """The command as a reader reruns it from the repository root (no machine's paths in it)."""
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else script.name
    return shlex.join([".venv/bin/python", shown, *argv[1:]])


class _Tee(io.TextIOBase):
    """Writes go to the terminal as before and are kept for the section."""

    def __init__(self, terminal: TextIO, kept: io.StringIO) -> None:
        self._terminal = terminal
        self._kept = kept

    def write(self, text: str) -> int:
        self._kept.write(text)
        return self._terminal.write(text)

    def flush(self) -> None:
        self._terminal.flush()


def main(run: Callable[[], object], *, section: str | Callable[[list[str]], str],
         path: Path = BENCHMARKS) -> None:
    """Run a benchmark's entry point; with ``--write``, its printed output becomes its section."""
    write = WRITE_FLAG in sys.argv[1:]
    if write and QUICK_FLAG in sys.argv[1:]:
        raise SystemExit(f"{WRITE_FLAG} writes a full run's figures; a {QUICK_FLAG} run is a smoke run (drop one flag)")
    sys.argv = [arg for arg in sys.argv if arg != WRITE_FLAG]
    name = section(sys.argv[1:]) if callable(section) else section
    if not write:
        run()
        return
    replace_section(path.read_text(encoding="utf-8"), name, "", source=path.name)
    revision = source_revision()
    kept = io.StringIO()
    with redirect_stdout(_Tee(sys.stdout, kept)):
        run()
    body = render(command=command_line(sys.argv), revision=revision, when=datetime.now(UTC),
                  load=os.getloadavg(), output=kept.getvalue())
    write_section(path, name, body)
    print(f"wrote section {name!r} of {path.name}", file=sys.stderr)
