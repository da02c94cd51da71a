"""``benchmarks/epp.py --quick`` runs every part of the EPP benchmark end to end and prints its headline figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+\.\d+"


@pytest.mark.timeout(150)
def test_the_quick_run_prints_every_headline() -> None:
    run = subprocess.run([sys.executable, "benchmarks/epp.py", "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=140)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(rf"^decision latency p50/p99: 100/s {NUMBER}/{NUMBER} ms, 500/s {NUMBER}/{NUMBER} ms \(target",
                     out, re.MULTILINE), out
    assert re.search(rf"^goodput epp / route: {NUMBER}x .*epp / round-robin: {NUMBER}x", out, re.MULTILINE), out
    assert re.search(rf"^CPU per request epp / route: {NUMBER}x", out, re.MULTILINE), out
    for run_name in ("epp (slo)", "round-robin", "route (slo)"):
        assert re.search(rf"^{re.escape(run_name)} +{NUMBER} ", out, re.MULTILINE), (run_name, out)
    assert "epp errors" not in out and "router errors" not in out
