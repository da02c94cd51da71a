"""Run a sweep in a child process, so a crash, out-of-memory or hang of one point costs only that point.

The parent starts a worker (multiprocessing *spawn*: no inherited CUDA or
thread state), which builds its runner, reports the device, then times the
points one by one, announcing each before it starts. The parent waits for
each point at most ``point_timeout_s``. A point that raises is reported and
the worker carries on; a point that kills the worker (segfault, OOM kill) or
hangs is reported, the worker is killed if needed, and a fresh worker resumes
with the next point.
"""

from __future__ import annotations

import importlib
import multiprocessing
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from hetsched.backends.base import Timing
from hetsched.errors import BackendUnavailableError, HetschedError
from hetsched.profiler.plan import SweepPoint


class PointRunner(Protocol):
    """Times one sweep point in the worker process."""

    def __call__(self, point: SweepPoint) -> Timing: ...

    def describe(self) -> dict[str, Any]:
        """Device telemetry and library versions, for the profile's provenance."""
        ...


RunnerFactory = Callable[[], PointRunner]


@dataclass(frozen=True)
class PointResult:
    """The outcome of one point: a timing, or why there is none."""

    point: SweepPoint
    timing: Timing | None
    error: str | None = None


@dataclass(frozen=True)
class SweepOutcome:
    results: tuple[PointResult, ...]
    device: dict[str, Any]
    restarts: int


def import_and_call(module: str, function: str, *args: Any) -> Any:
    """Call ``module.function(*args)``, importing the module where this runs (in the worker)."""
    return getattr(importlib.import_module(module), function)(*args)


def _worker_main(conn: Connection, factory: RunnerFactory, points: Sequence[SweepPoint]) -> None:
    try:
        runner = factory()
        conn.send(("ready", runner.describe()))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as a message
        kind = "unavailable" if isinstance(exc, BackendUnavailableError) else "fatal"
        conn.send((kind, f"{exc}" if isinstance(exc, HetschedError) else f"{type(exc).__name__}: {exc}"))
        return
    for index, point in enumerate(points):
        conn.send(("start", index))
        try:
            conn.send(("done", index, runner(point)))
        except Exception as exc:  # noqa: BLE001 - one failing point must not stop the sweep
            last = traceback.extract_tb(exc.__traceback__)[-1:]
            where = f" at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno}" if last else ""
            conn.send(("error", index, f"{type(exc).__name__}: {exc}{where}"))
    conn.send(("end",))


def _death_reason(process: multiprocessing.process.BaseProcess) -> str:
    process.join(timeout=5)
    code = process.exitcode
    if code is None:
        return "worker stopped answering"
    if code < 0:
        return f"worker killed by signal {-code}"
    return f"worker exited with status {code}"


def run_sweep(points: Sequence[SweepPoint], factory: RunnerFactory, *, point_timeout_s: float,
              startup_timeout_s: float = 300.0, on_result: Callable[[PointResult], None] | None = None,
              on_device: Callable[[dict[str, Any]], None] | None = None) -> SweepOutcome:
    """Time every point in child processes; one result per point, in order.

    ``factory`` must be picklable (a module-level function or a ``functools.partial``
    of one): it is called in the worker to build the runner.
    Raises BackendUnavailableError when the worker cannot even start.
    """
    context = multiprocessing.get_context("spawn")
    results: list[PointResult] = []
    device: dict[str, Any] = {}
    remaining = list(points)
    starts = 0

    def record(result: PointResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    while remaining:
        starts += 1
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_worker_main, args=(send, factory, remaining), daemon=True)
        process.start()
        send.close()
        done = 0
        current: int | None = None
        try:
            timeout = startup_timeout_s
            while True:
                if not receive.poll(timeout):
                    if current is None:
                        raise BackendUnavailableError(
                            f"the profiling worker did not start within {startup_timeout_s:.0f} s")
                    record(PointResult(remaining[current], None, f"timeout after {point_timeout_s:g} s"))
                    done = current + 1
                    break
                try:
                    message = receive.recv()
                except EOFError:
                    reason = _death_reason(process)
                    if current is None:
                        raise BackendUnavailableError(f"the profiling worker died while starting ({reason})") from None
                    record(PointResult(remaining[current], None, f"crashed: {reason}"))
                    done = current + 1
                    break
                tag = message[0]
                if tag == "ready":
                    device = message[1]
                    if on_device is not None and starts == 1:
                        on_device(device)
                elif tag in ("unavailable", "fatal"):
                    raise BackendUnavailableError(message[1] if tag == "unavailable"
                                                  else f"the profiling worker could not start: {message[1]}")
                elif tag == "start":
                    current = message[1]
                    timeout = point_timeout_s
                elif tag == "done":
                    record(PointResult(remaining[message[1]], message[2]))
                    current = None
                elif tag == "error":
                    record(PointResult(remaining[message[1]], None, message[2]))
                    current = None
                elif tag == "end":
                    done = len(remaining)
                    break
        finally:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
            receive.close()
        remaining = remaining[done:]
    return SweepOutcome(results=tuple(results), device=device, restarts=starts - 1)
