"""``benchmarks/kv_index.py --quick`` measures every part of the KV index benchmark against its baseline and ends
with the targets line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d[\d,]*(\.\d+)?"


@pytest.mark.timeout(120)
def test_the_quick_run_prints_each_part_and_the_targets() -> None:
    run = subprocess.run([sys.executable, "benchmarks/kv_index.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    for endpoints in (4, 1):
        for part in ("bytes/block/endpoint", "event blocks/CPU s", r"matches µs \(median\)"):
            assert re.search(rf"^ +{endpoints} {part} +{NUMBER} +{NUMBER} +{NUMBER}x  [≤≥<] ", out, re.MULTILINE), \
                (endpoints, part, out)
    assert re.search(rf"^BlockHashing\(\)\.block_hashes, 4,000 tokens: {NUMBER} µs median", out, re.MULTILINE), out
    assert re.search(rf"^targets: memory {NUMBER} B/block/endpoint \(≤ 64\), events {NUMBER} blocks/s", out,
                     re.MULTILINE), out
