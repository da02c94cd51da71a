"""The console examples in README.md and docs/*.md run as they are shown.

A fenced block whose info string is ``console`` holds commands, each on a line starting with ``$ hetsched``,
each followed by the output it shows. Every command of a document runs in order, in-process, in a temporary
folder that holds the repository's ``examples/`` and ``data/``, on one fresh SQLite store per document, with
100 columns. Its exit code must be 0, or N where the command line ends with ``# exit N``; every output line
shown must appear in what it printed, in the same order (lines left out are fine; runs of spaces compare as
one; ``...`` stands for any text, such as a solve time). A block whose first line is ``# not run: REASON``
is shown only; docs/README.md says so for readers.
"""

from __future__ import annotations

import importlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console
from rich.markup import escape
from typer.testing import CliRunner

from hetsched.cli import COMMANDS, app
from hetsched.errors import HetschedError

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run:"
WIDTH = 100
EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")


@dataclass(frozen=True)
class Example:
    """One command of a console block and the output lines it shows."""

    line: int
    command: str
    exit_code: int
    shown: tuple[str, ...]


def console_blocks(text: str, source: str = "text") -> list[tuple[int, list[str]]]:
    """(line number of the opening fence, lines inside) of every ``console`` block."""
    blocks: list[tuple[int, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```console":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{source}:{start}: the console block is not closed with ```")
            blocks.append((start, body))
        i += 1
    return blocks


def examples(text: str, source: str = "text") -> list[Example]:
    """The commands to run in ``text``, in order; blocks marked ``# not run:`` are left out."""
    found: list[Example] = []
    for start, body in console_blocks(text, source):
        if body and body[0].startswith(NOT_RUN):
            continue
        if not body or not body[0].startswith("$ "):
            raise ValueError(f"{source}:{start}: a console block starts with '$ hetsched ...' or '{NOT_RUN} REASON'")
        current: tuple[int, str, int] | None = None
        shown: list[str] = []
        for offset, line in enumerate([*body, "$ "]):
            if not line.startswith("$ "):
                shown.append(line)
                continue
            if current:
                found.append(Example(current[0], current[1], current[2], tuple(s for s in shown if s.strip())))
            if offset == len(body):
                break
            command = line.removeprefix("$ ")
            code = EXIT.search(command)
            command = EXIT.sub("", command) if code else command
            if not command.startswith("hetsched "):
                raise ValueError(f"{source}:{start + offset + 1}: only hetsched commands run, got {command!r}")
            current, shown = (start + offset + 1, command, int(code.group(1)) if code else 0), []
    return found


def _pattern(shown: str) -> re.Pattern[str]:
    parts = [re.escape(" ".join(part.split())) for part in shown.split("...")]
    return re.compile(r"\s*" + ".*".join(parts) + r"\s*")


def unmatched(shown: tuple[str, ...], output: str) -> str | None:
    """The first shown line that does not appear, in order, in ``output``; None when all do."""
    actual = [" ".join(line.split()) for line in output.splitlines()]
    at = 0
    for line in shown:
        pattern = _pattern(line)
        while at < len(actual) and not pattern.fullmatch(actual[at]):
            at += 1
        if at == len(actual):
            return line
        at += 1
    return None


def run(example: Example) -> tuple[int, str]:
    """Exit code and output of the command, as ``hetsched`` prints an error and exits."""
    result = CliRunner().invoke(app, shlex.split(example.command, comments=True)[1:], env={"COLUMNS": str(WIDTH)})
    if isinstance(result.exception, HetschedError):  # as hetsched.cli.main prints it
        shown = io.StringIO()
        Console(file=shown, width=WIDTH).print(f"[bold red]error:[/] {escape(str(result.exception))}")
        return result.exception.exit_code, result.output + shown.getvalue()
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


DOCUMENTED = [path for path in DOCUMENTS if examples(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())]


@pytest.mark.parametrize("document", DOCUMENTED, ids=[p.relative_to(ROOT).as_posix() for p in DOCUMENTED])
def test_console_examples_run_as_shown(document: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for folder in ("examples", "data"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{tmp_path / 'hetsched.sqlite'}")
    name = document.relative_to(ROOT).as_posix()
    for example in examples(document.read_text(encoding="utf-8")):
        code, output = run(example)
        assert code == example.exit_code, (f"{name}:{example.line}: `{example.command}` exited {code}, the document "
                                           f"says {example.exit_code}\n{output}")
        missing = unmatched(example.shown, output)
        assert missing is None, f"{name}:{example.line}: `{example.command}` did not print\n  {missing}\n{output}"


def test_the_documents_have_run_examples() -> None:
    assert len(DOCUMENTED) >= 4, [p.name for p in DOCUMENTED]


TEXT = """intro
```console
$ hetsched fit qwen3-8b l4
│ l4 │ 1 │ yes ...
$ hetsched capacity m l4 --slo-tpot 30ms   # exit 4
error: TPOT target 30 ms is below ...
```
```console
# not run: about a minute
$ hetsched profile qwen3-0.6b --backend cpu
```
```yaml
$ not a command
```
"""


def test_examples_are_read_as_documented() -> None:
    found = examples(TEXT)
    assert [(e.line, e.command, e.exit_code) for e in found] == [
        (3, "hetsched fit qwen3-8b l4", 0), (5, "hetsched capacity m l4 --slo-tpot 30ms", 4)]
    assert found[0].shown == ("│ l4 │ 1 │ yes ...",)
    assert unmatched(found[0].shown, "head\n│ l4   │  1 │  yes │  16.38 │\n") is None
    assert unmatched(found[1].shown, "error: TPOT target 30 ms is above") == "error: TPOT target 30 ms is below ..."
    assert unmatched(("b", "a"), "a\nb\n") == "a"
    with pytest.raises(ValueError, match="only hetsched commands run"):
        examples("```console\n$ curl localhost\n```\n")
    with pytest.raises(ValueError, match="not closed"):
        examples("```console\n$ hetsched fit x\n")


NAME = re.compile(r"`(hetsched(?:\.\w+)+(?::\w+(?:\.\w+)*)?|:\w+(?:\.\w+)*)[`(]")
PATH = re.compile(r"`((?:hetsched|tests|benchmarks|examples|charts|crds)/[\w/.-]+)`")


def cited_names(text: str) -> list[str]:
    """Every ``hetsched.module:attribute`` (or dotted ``hetsched.module.attribute``) a document cites in code
    spans; a bare ``:attribute`` belongs to the module cited last on its line."""
    names: list[str] = []
    for line in text.splitlines():
        module = None
        for token in NAME.findall(line):
            if token.startswith(":"):
                if module:
                    names.append(module + token)
                continue
            module = token.partition(":")[0]
            names.append(token)
    return names


def resolves(name: str) -> bool:
    """Whether ``name`` is an importable module, or an attribute path inside one."""
    module, _, attributes = name.partition(":")
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name != ".".join(parts[:cut]):  # the module exists and fails to import: say so
                raise
            continue
        for attribute in [*parts[cut:], *(attributes.split(".") if attributes else [])]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


@pytest.mark.parametrize("document", DOCUMENTS, ids=[p.relative_to(ROOT).as_posix() for p in DOCUMENTS])
def test_cited_modules_functions_and_files_exist(document: Path) -> None:
    """The documents name functions and files that exist: the architecture's decision map above all."""
    text = document.read_text(encoding="utf-8")
    missing = [name for name in cited_names(text) if not resolves(name)]
    missing += [path for path in PATH.findall(text) if not (ROOT / path).exists()]
    assert not missing, f"{document.relative_to(ROOT)} cites what does not exist: {missing}"


def test_cited_names_are_read_with_their_module() -> None:
    line = "| `hetsched.perf.memory:fit`, `:smallest_fit` | `hetsched.router.state:RouterState.decide` and `hetsched.x.y(a)` |"
    assert cited_names(line) == ["hetsched.perf.memory:fit", "hetsched.perf.memory:smallest_fit",
                                 "hetsched.router.state:RouterState.decide", "hetsched.x.y"]
    assert resolves("hetsched.perf.memory:smallest_fit") and resolves("hetsched.router.state:RouterState.decide")
    assert resolves("hetsched.autoscale.policy.decide") and resolves("hetsched.sim")
    assert not resolves("hetsched.perf.memory:no_such_function") and not resolves("hetsched.no_such_package")


COMMAND = re.compile(r"(?:^|`|\$ |\.venv/bin/)hetsched ([a-z][\w-]*)")


def named_commands(text: str) -> set[str]:
    """The top-level commands a document runs: at the start of a code span or of a line in a fenced block."""
    names: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            names.update(COMMAND.findall(line.strip()))
        else:
            names.update(re.findall(r"`(?:\.venv/bin/)?hetsched ([a-z][\w-]*)", line))
    return names


@pytest.mark.parametrize("document", DOCUMENTS, ids=[p.relative_to(ROOT).as_posix() for p in DOCUMENTS])
def test_documented_commands_exist(document: Path) -> None:
    unknown = sorted(named_commands(document.read_text(encoding="utf-8")) - set(COMMANDS))
    assert not unknown, f"{document.relative_to(ROOT)} runs commands hetsched does not have: {unknown}"


def test_named_commands_are_read_from_code_only() -> None:
    text = "hetsched plans ahead.\n`hetsched fit x` and `hetsched` alone\n```shell\nhetsched bogus --x   # hetsched web\n```\n"
    assert named_commands(text) == {"fit", "bogus"}
