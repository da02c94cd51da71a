"""``benchmarks/kv_routing.py --quick`` runs hetsched's routers and the oracle over twins that publish KV events,
prints a row of figures for each, and ends with the targets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d[\d,]*(\.\d+)?"


@pytest.mark.timeout(240)
def test_the_quick_run_prints_each_router_and_the_targets() -> None:
    run = subprocess.run([sys.executable, "benchmarks/kv_routing.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=230)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(rf"^multi-turn chat: mean prompt {NUMBER} tokens, .* each twin {NUMBER} KV blocks", out,
                     re.MULTILINE), out
    for router, events in (("hetsched kv-aware", "4/4"), ("hetsched slo", "4/4"),  # 2 twins × 2 router replicas
                           ("hetsched prefix", "-"), ("hetsched round-robin", "-"), ("oracle", "-")):
        assert re.search(rf"^multi-turn chat +{router} +90% +{NUMBER}% +{NUMBER}ms +{NUMBER}ms +{NUMBER} +{NUMBER}% "
                         rf"+\d+ +{re.escape(events)}  \d+/\d+$", out, re.MULTILINE), (router, out)
    for policy in ("kv-aware", "slo"):
        assert re.search(rf"^  multi-turn chat: hetsched {policy} hit rate {NUMBER}% = {NUMBER}% of the oracle's",
                         out, re.MULTILINE), out
    assert "multi-turn chat: against the peers' cache_aware: no peer ran" in out
    assert re.search(rf"^  KV index \(20,000 blocks over 4 endpoints; .*\): memory {NUMBER} B/block/endpoint", out,
                     re.MULTILINE), out
