"""``benchmarks/flow_control.py --quick`` runs every part of the flow-control benchmark end to end and prints its
headline figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PERCENT = r"-?\d+(\.\d+)?%"


@pytest.mark.timeout(300)
def test_the_quick_run_prints_every_headline() -> None:
    run = subprocess.run([sys.executable, "benchmarks/flow_control.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=290)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    for mode in ("today", "flow", "bucket"):
        assert re.search(rf"^{mode}: \d+ requests", out, re.MULTILINE), (mode, out)
    assert re.search(rf"^interactive attainment: flow {PERCENT} \(today {PERCENT}, bucket {PERCENT}", out,
                     re.MULTILINE), out
    assert re.search(r"^batch goodput of the capacity interactive leaves: flow", out, re.MULTILINE), out
    assert re.search(r"^Jain's index over backlogged tenants: flow \d\.\d+", out, re.MULTILINE), out
    assert re.search(r"^added p50 without queueing: -?\d+\.\d+ ms", out, re.MULTILINE), out
    assert re.search(r"^plan for .*: the interactive SLO for every request \$\d+\.\d+/h; each class at its own "
                     r"\$\d+\.\d+/h", out, re.MULTILINE), out
    assert "router errors" not in out
