"""The solver's native writes to descriptor 1 (HiGHS's debug lines) never reach standard output."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hetsched.optimizer.solve as solve_module
from hetsched.catalog import load_catalog
from hetsched.optimizer.build import build_problem
from hetsched.optimizer.load import load_cluster
from hetsched.optimizer.plan import PlanStatus
from hetsched.optimizer.quiet import native_stdout_muted
from hetsched.optimizer.rounding import round_relaxation

EXAMPLES = Path(__file__).parent.parent / "examples"
LIBC = ctypes.CDLL(None)


def native_line(text: str) -> None:
    """As HiGHS prints: C's ``printf``, buffered when standard output is a file, and a raw write to descriptor 1."""
    LIBC.printf(f"{text} (printf)\n".encode())
    os.write(1, f"{text} (write)\n".encode())


def test_native_writes_inside_the_block_are_muted_and_output_around_it_is_kept() -> None:
    # a pipe, as when a tool reads the output: C's stdio then buffers printf (unless PYTHONUNBUFFERED turns that off)
    code = ("import ctypes, os\n"
            "from hetsched.optimizer.quiet import native_stdout_muted\n"
            "libc = ctypes.CDLL(None)\n"
            "libc.printf(b'native before\\n')\n"
            "print('before')\n"
            "with native_stdout_muted():\n"
            "    libc.printf(b'HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\\n')\n"
            "    os.write(1, b'raw write\\n')\n"
            "print('after')\n"
            "libc.printf(b'native after\\n')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    # the order between Python's buffer and C's is theirs to choose; what matters is what is and is not there
    assert sorted(done.stdout.splitlines()) == ["after", "before", "native after", "native before"]


def test_overlapping_blocks_on_several_threads_keep_descriptor_1_muted_until_the_last_ends(
        capfd: pytest.CaptureFixture[str]) -> None:
    inside, first_done, second_may_end = threading.Barrier(2), threading.Event(), threading.Event()

    def first() -> None:
        with native_stdout_muted():
            inside.wait()
        first_done.set()

    def second() -> None:
        with native_stdout_muted():
            inside.wait()
            first_done.wait()
            native_line("after the first block ended")
            second_may_end.wait()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    first_done.wait()
    second_may_end.set()
    for thread in threads:
        thread.join()
    with native_stdout_muted():
        with native_stdout_muted():
            native_line("nested")
        native_line("outer")
    os.write(1, b"restored\n")
    assert capfd.readouterr().out == "restored\n"


def test_a_solve_mutes_native_writes_from_its_worker_threads(capfd: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def chatty(*args: Any, **kwargs: Any) -> np.ndarray | None:
        with ThreadPoolExecutor(max_workers=2) as pool:  # as the decomposition runs HiGHS, on worker threads
            list(pool.map(native_line, ["HighsMipSolverData::transformNewIntegerFeasibleSolution"] * 4))
        return round_relaxation(*args, **kwargs)

    monkeypatch.setattr(solve_module, "round_relaxation", chatty)
    catalog = load_catalog()
    problem = build_problem(load_cluster(EXAMPLES / "chat.yaml", catalog=catalog), catalog)
    print("plan:")
    solution = solve_module.solve(problem)
    print(solution.stats.status.value)
    LIBC.fflush(None)
    assert solution.stats.status is PlanStatus.OPTIMAL
    assert capfd.readouterr().out == "plan:\noptimal\n"
