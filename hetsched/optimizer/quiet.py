"""Keep the solver's native output off standard output.

The HiGHS bundled with SciPy prints debug lines from C++ (``HighsMipSolverData::transformNewIntegerFeasibleSolution
tmpSolver.run();``) straight to file descriptor 1 on large plans, with every display option off; they say nothing a
caller can use. Redirecting ``sys.stdout`` does not catch them, so :func:`hetsched.optimizer.solve.solve` runs with
descriptor 1 pointed at the null device: the one place every caller (the CLI, the web planner, the operator, the
autoscaler, the benchmarks) passes through, the decomposition's worker threads included.

Descriptor 1 belongs to the whole process: while any solve runs, whatever another thread writes there is lost too.
The ``hetsched`` command keeps ``sys.stdout`` on a descriptor of its own (see ``hetsched.cli``), so there only native
writes are; a program that prints from other threads while it solves sees those prints go missing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_saved: int | None = None
"""A duplicate of the real descriptor 1 while the outermost muted block runs; None when nothing is muted."""


@contextmanager
def native_stdout_muted() -> Iterator[None]:
    """Descriptor 1 on the null device for the block; nested and concurrent blocks share one redirection (the
    first in sets it up, the last out restores it), so solves on several threads never restore it early."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = _mute()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                _restore(_saved)
                _saved = None


def _mute() -> int | None:
    """Point descriptor 1 at the null device; a duplicate of what it was, or None when there is no descriptor 1."""
    _flush_python()
    _flush_c()  # what C's stdio holds for the real output goes there first
    try:
        saved = os.dup(1)
    except OSError:
        return None
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
    finally:
        os.close(null)
    return saved


def _restore(saved: int) -> None:
    """Descriptor 1 back to ``saved``; C's buffered native output is flushed to the null device first."""
    _flush_c()
    try:
        os.dup2(saved, 1)
    finally:
        os.close(saved)
    _flush_python()


def _flush_python() -> None:
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except (OSError, ValueError):  # closed or broken standard output: nothing of ours to keep in order
        pass


def _flush_c() -> None:
    """Flush every C stdio stream: HiGHS prints through ``printf``, which buffers when stdout is not a terminal."""
    libc = _libc()
    if libc is not None:
        libc.fflush(None)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library the process runs on, found when first needed."""
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):  # Windows has no process-wide symbol table; its C runtime flushes at exit
        return None
