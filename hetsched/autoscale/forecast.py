"""Additive Holt-Winters forecast of a model's request rate, for scaling ahead of a daily ramp.

Rates are averaged into ``slots`` per season; the level, trend and seasonal
terms update once per finished slot. Until one full season has been seen the
seasonal terms are zero (plain Holt: level and trend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class HoltWinters:
    season_s: float
    slots: int = 48
    alpha: float = 0.5
    """Weight of a new slot in the level."""
    beta: float = 0.1
    """Weight of a new slot in the trend."""
    gamma: float = 0.3
    """Weight of a new slot in its seasonal term."""
    level: float | None = None
    trend: float = 0.0
    season: tuple[float, ...] = ()
    finished_slots: int = 0
    slot_index: int | None = None
    slot_sum: float = 0.0
    slot_count: int = 0

    @property
    def slot_s(self) -> float:
        return self.season_s / self.slots

    def update(self, now: float, rate: float) -> HoltWinters:
        """Fold in one rate observation at ``now``."""
        index = math.floor(now / self.slot_s)
        if self.slot_index is None or index == self.slot_index:
            return replace(self, slot_index=index, slot_sum=self.slot_sum + rate, slot_count=self.slot_count + 1)
        finished = self._finish(self.slot_sum / max(self.slot_count, 1))
        return replace(finished, slot_index=index, slot_sum=rate, slot_count=1)

    def _finish(self, value: float) -> HoltWinters:
        season = self.season or tuple(0.0 for _ in range(self.slots))
        position = (self.slot_index or 0) % self.slots
        seasonal_known = self.finished_slots >= self.slots
        s = season[position] if seasonal_known else 0.0
        if self.level is None:
            return replace(self, level=value, season=season, finished_slots=1)
        level = self.alpha * (value - s) + (1 - self.alpha) * (self.level + self.trend)
        trend = self.beta * (level - self.level) + (1 - self.beta) * self.trend
        new_s = self.gamma * (value - level) + (1 - self.gamma) * s if seasonal_known else value - level
        season = season[:position] + (new_s,) + season[position + 1:]
        return replace(self, level=level, trend=trend, season=season, finished_slots=self.finished_slots + 1)

    def forecast(self, now: float, horizon_s: float) -> float | None:
        """Expected rate ``horizon_s`` after ``now``; None before the first finished slot."""
        if self.level is None:
            return None
        ahead = (now + horizon_s) / self.slot_s - (self.slot_index or 0)
        position = math.floor((now + horizon_s) / self.slot_s) % self.slots
        s = self.season[position] if self.finished_slots > self.slots else 0.0
        return max(0.0, self.level + self.trend * max(ahead, 0.0) + s)
