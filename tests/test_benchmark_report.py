"""BENCHMARKS.md sections written by the benchmarks: markers found, text replaced, errors that say why."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_report():
    spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "benchmarks" / "report.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load_report()

DOC = """# Benchmarks

## Speed
How it runs (kept).
<!-- BEGIN speed -->
old figures
more old figures
<!-- END speed -->
What it means (kept).
<!-- BEGIN other -->
other figures
<!-- END other -->
"""


def test_replace_section_changes_only_that_section() -> None:
    out = report.replace_section(DOC, "speed", "new figures\n")
    assert "old figures" not in out
    assert "<!-- BEGIN speed -->\nnew figures\n<!-- END speed -->\n" in out
    assert "How it runs (kept).\n" in out and "What it means (kept).\n" in out
    assert "other figures" in out
    assert report.replace_section(out, "speed", "old figures\nmore old figures") == DOC


def test_missing_marker_is_a_clear_error() -> None:
    with pytest.raises(report.SectionError, match=r"section 'absent' needs exactly one line "
                       r"'<!-- BEGIN absent -->' and one line '<!-- END absent -->'; found 0 and 0"):
        report.replace_section(DOC, "absent", "x")
    with pytest.raises(report.SectionError, match="found 1 and 0"):
        report.replace_section(DOC.replace("<!-- END speed -->\n", ""), "speed", "x")
    with pytest.raises(report.SectionError, match="found 2 and 2"):
        report.replace_section(DOC + DOC, "speed", "x")


def test_end_before_begin_is_refused() -> None:
    swapped = "<!-- END speed -->\nfigures\n<!-- BEGIN speed -->\n"
    with pytest.raises(report.SectionError, match=r"'<!-- END speed -->' \(line 1\) comes before"):
        report.replace_section(swapped, "speed", "x")


def test_render_names_command_commit_date_and_load_and_fences_the_output() -> None:
    text = report.render(command=".venv/bin/python benchmarks/x.py --fast", revision="abc1234",
                         when=datetime(2026, 1, 2, 3, 4, tzinfo=UTC), load=(1.0, 2.5, 3.25),
                         output="\nrow 1\nrow 2\n\n")
    assert text.splitlines() == [
        "`.venv/bin/python benchmarks/x.py --fast` at `abc1234` — 2026-01-02 03:04 UTC, load average (1, 5, 15 min) "
        "1.00 2.50 3.25 at the end", "", "```", "row 1", "row 2", "```"]
    fenced = report.render(command="c", revision="r", when=datetime(2026, 1, 1, tzinfo=UTC), load=(0, 0, 0),
                           output="```\nx\n```")
    assert fenced.splitlines()[2] == "````"


def test_source_revision_is_the_commit_marked_when_sources_differ(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    assert report.source_revision(tmp_path) == "no git revision"
    git("init", "-q")
    (tmp_path / "hetsched").mkdir()
    (tmp_path / "hetsched" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("n\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "notes.md").write_text("changed elsewhere\n")
    assert report.source_revision(tmp_path) == head
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "new.py").write_text("y = 2\n")
    assert report.source_revision(tmp_path) == f"{head} with uncommitted changes"


def test_write_flag_writes_the_printed_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(DOC, encoding="utf-8")
    seen: list[list[str]] = []

    def bench() -> None:
        seen.append(list(sys.argv[1:]))
        print("rate 5: 12,201 req/s")

    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "x.py"), "--fast", "--write"])
    report.main(bench, section=lambda args: "speed" if "--fast" in args else "other", path=target)
    assert seen == [["--fast"]]
    assert "rate 5: 12,201 req/s" in capsys.readouterr().out
    text = target.read_text(encoding="utf-8")
    section = text.split("<!-- BEGIN speed -->\n")[1].split("<!-- END speed -->")[0]
    assert re.match(r"`\.venv/bin/python benchmarks/x\.py --fast` at `[^`]+` — \d{4}-\d\d-\d\d \d\d:\d\d UTC, "
                    r"load average", section)
    assert "```\nrate 5: 12,201 req/s\n```\n" in section
    assert "old figures" not in text and "other figures" in text and "What it means (kept)." in text


def test_without_write_only_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(DOC, encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["x.py"])
    report.main(lambda: print("figures"), section="speed", path=target)
    assert target.read_text(encoding="utf-8") == DOC


def test_a_quick_run_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(DOC, encoding="utf-8")
    ran: list[bool] = []
    monkeypatch.setattr(sys, "argv", ["x.py", "--quick", "--write"])
    with pytest.raises(SystemExit, match="--write writes a full run's figures; a --quick run is a smoke run"):
        report.main(lambda: ran.append(True), section="speed", path=target)
    assert not ran
    assert target.read_text(encoding="utf-8") == DOC


def test_missing_marker_fails_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(DOC, encoding="utf-8")
    ran: list[bool] = []
    monkeypatch.setattr(sys, "argv", ["x.py", "--write"])
    with pytest.raises(report.SectionError, match="'absent'"):
        report.main(lambda: ran.append(True), section="absent", path=target)
    assert not ran
    assert target.read_text(encoding="utf-8") == DOC


def test_every_benchmark_section_has_its_markers() -> None:
    """Each section a script writes has its markers in BENCHMARKS.md, so ``--write`` cannot fail at the end."""
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    names = {name for script in sorted((ROOT / "benchmarks").glob("*.py")) if script.name != "report.py"
             for name in _sections(script)}
    assert len(names) >= 8, names
    for name in sorted(names):
        report.replace_section(text, name, "")


def _sections(script: Path) -> list[str]:
    """The section names in the ``section=`` argument of the script's ``report.main`` call (flags left out)."""
    found = re.search(r"report\.main\(.*section=(.*)\)\s*$", script.read_text(encoding="utf-8"), re.MULTILINE)
    return [name for name in re.findall(r'"([^"]+)"', found.group(1)) if not name.startswith("-")] if found else []
