"""Interpolation of measured latencies: piecewise linear in log-log space, proportional beyond the grid.

Latency grows roughly as a power of the work, so straight lines between
neighbouring points on log-log axes follow both the flat launch-bound region
and the linear throughput-bound region. Past the largest measured point time
scales in proportion (throughput-bound); below the smallest it stays at the
smallest measurement (launch-bound).

More work never takes less time, so a point slower than a larger point after
it (a measurement disturbed by other load on the machine) is lowered to that
larger point's time: the curve is the lower monotone envelope of the data.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LogLogCurve:
    """y(x) through points with strictly increasing positive ``xs``."""

    log_xs: tuple[float, ...]
    log_ys: tuple[float, ...]

    @classmethod
    def through(cls, points: Iterable[tuple[float, float]]) -> LogLogCurve:
        """From ``(x, y)`` pairs; repeated ``x`` are averaged, non-positive values dropped."""
        grouped: dict[float, list[float]] = {}
        for x, y in points:
            if x > 0 and y > 0:
                grouped.setdefault(float(x), []).append(float(y))
        if not grouped:
            raise ValueError("no positive points to interpolate")
        xs = sorted(grouped)
        ys = [sum(grouped[x]) / len(grouped[x]) for x in xs]
        for i in range(len(ys) - 2, -1, -1):
            ys[i] = min(ys[i], ys[i + 1])
        return cls(tuple(math.log(x) for x in xs), tuple(math.log(y) for y in ys))

    def __call__(self, x: float) -> float:
        if x <= 0:
            return 0.0
        lx, xs, ys = math.log(x), self.log_xs, self.log_ys
        if lx <= xs[0]:
            return math.exp(ys[0])
        if lx >= xs[-1]:
            return math.exp(ys[-1] + lx - xs[-1])
        i = bisect.bisect_right(xs, lx)
        w = (lx - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1]))


@dataclass(frozen=True)
class LogLogSurface:
    """z(a, b) from rows of measurements at fixed ``a``: a curve in ``b`` per row, log-linear between rows."""

    log_as: tuple[float, ...]
    rows: tuple[LogLogCurve, ...]

    @classmethod
    def through(cls, points: Sequence[tuple[float, float, float]]) -> LogLogSurface:
        by_row: dict[float, list[tuple[float, float]]] = {}
        for a, b, z in points:
            if a > 0:
                by_row.setdefault(float(a), []).append((b, z))
        rows = sorted((a, LogLogCurve.through(pts)) for a, pts in by_row.items()
                      if any(b > 0 and z > 0 for b, z in pts))
        if not rows:
            raise ValueError("no positive points to interpolate")
        return cls(tuple(math.log(a) for a, _ in rows), tuple(curve for _, curve in rows))

    def __call__(self, a: float, b: float) -> float:
        if a <= 0 or b <= 0:
            return 0.0
        la, las = math.log(a), self.log_as
        if la <= las[0]:
            return self.rows[0](b)
        if la >= las[-1]:
            return self.rows[-1](b) * math.exp(la - las[-1])
        i = bisect.bisect_right(las, la)
        w = (la - las[i - 1]) / (las[i] - las[i - 1])
        low, high = self.rows[i - 1](b), self.rows[i](b)
        return math.exp((1 - w) * math.log(low) + w * math.log(high))
