"""Every benchmark runs in its quick mode (small inputs, a few seconds each), so a benchmark that breaks fails the suite.

A quick run goes through every part of its script, as a full run would, on inputs sized down (fewer requests, a
shorter trace, fewer seeds, a smaller pool); its figures are not the benchmark's. Each run must end well and print
its headline line, which shows the script reached its end.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
NUMBER = r"-?\d+(\.\d+)?"

QUICK_RUNS: dict[tuple[str, ...], str] = {
    ("autoscale_replay.py",): rf"^targets: SLO outside burst starts {NUMBER}% .* flaps \d+ ",
    ("autoscale_live.py",): rf"^  SLO attainment: {NUMBER}% overall",
    ("closed_loop.py",): rf"^targets: TTFT and TPOT p50 predicted .* cost {NUMBER}x the run told the true speeds ",
    ("model_accuracy.py",): rf"^  chat 512→256, .*: calibrated {NUMBER} req/s, measured operators {NUMBER} req/s",
    ("online_calibration.py",): rf"^   the learning's own CPU, as the router counts it: at most {NUMBER}% of the router's ",
    ("optimizer_cost.py",): rf"^chat +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}× ",
    ("optimizer_cost.py", "--melange"): r"^\d+ cases: hetsched ≤ Mélange's optimum on \d+",
    ("optimizer_scale.py",): rf"^ +96 +2 +\d+ +\d+ +{NUMBER} +{NUMBER} ",
    ("optimizer_stability.py",): rf"^small models ×3 +\d+ +{NUMBER}% ",
    ("pd_disagg.py",): rf"^chat +disaggregated +{NUMBER} +1× ",
    ("profile_accuracy.py",): rf"^\d+ compositions; profile relative error: median {NUMBER}%",
    ("router_clients.py",): rf"^CPU per request against the router's client, h1 .*: httpx {NUMBER}x",
    ("router_overhead.py",): rf"^slo +{NUMBER}µs +{NUMBER}ms",
    ("router_peers.py",): r"^hetsched +\S+ +\d+ +\d+ +\d+ +\d+$",
    ("router_policies.py",): r"^fault run \(slo policy; .*\): \d+ requests",
    ("simulator_speed.py",): rf"^median over searches: {NUMBER} s wall",
    ("simulator_speed.py", "--all-models"): r"^total +\d+ +\d+ +\d+$",
    ("twin_vs_vllm.py",): r"^(capacity at the SLO: twin .* ratio twin/real|the real engine met the SLO at no measured rate)",
}
"""Script and flags → a line its quick run prints at its end."""
HELPERS = {"report.py", "optimizer_synthetic.py"}
"""Modules the scripts import, with no run of their own."""


def scripts() -> set[str]:
    """The benchmark scripts: every module in benchmarks/ but the shared ``_`` ones and the helpers."""
    return {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")} - HELPERS


def run_elsewhere() -> set[str]:
    """Scripts whose quick run a test module of their own makes, with its own checks."""
    found: set[str] = set()
    for module in (ROOT / "tests").glob("test_*.py"):
        if module.name != Path(__file__).name:
            found |= set(re.findall(r'"benchmarks/(\w+\.py)", "--quick"', module.read_text(encoding="utf-8")))
    return found


def test_every_benchmark_has_a_quick_run_in_the_suite() -> None:
    here, elsewhere = {args[0] for args in QUICK_RUNS}, run_elsewhere()
    assert "epp.py" in elsewhere, "the scan of the test modules finds tests/test_benchmark_epp.py's run"
    assert scripts() - here - elsewhere == set(), "add the script's --quick run to QUICK_RUNS"
    assert here - scripts() == set(), "QUICK_RUNS names a script that is gone"
    assert here & elsewhere == set(), "a script's quick run is made twice"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("args", sorted(QUICK_RUNS), ids=" ".join)
def test_quick_run_reaches_its_end(args: tuple[str, ...]) -> None:
    script, *flags = args
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(QUICK_RUNS[args], run.stdout, re.MULTILINE), run.stdout[-3000:]
