"""``benchmarks/epp_transport.py --quick`` serves the ext_proc stream every way and prints what each costs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_the_quick_run_prints_each_server_and_the_transport_share() -> None:
    run = subprocess.run([sys.executable, "benchmarks/epp_transport.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for mode in ("aio no-op", "sync no-op", "hetsched epp"):
        assert re.search(rf"^{mode} +\d+\.\d+ms +\d+us$", run.stdout, re.MULTILINE), (mode, run.stdout)
    assert re.search(r"^the transport alone \(aio no-op\) is \d+% of the EPP's CPU", run.stdout, re.MULTILINE)
