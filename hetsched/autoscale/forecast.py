"""Additive Holt-Winters forecast of a model's request rate, for scaling ahead of a daily ramp.

Rates are averaged into ``slots`` per season; the level, trend and seasonal
terms update once per finished slot. The first season is collected as is and
starts the model (level = its mean, seasonal terms = deviations from it);
until then the forecast is the last finished slot.
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
        if self.finished_slots < self.slots:  # first season: collect, then start from its mean and deviations
            season = season[:position] + (value,) + season[position + 1:]
            done = self.finished_slots + 1
            if done < self.slots:
                return replace(self, season=season, finished_slots=done, level=self.level if self.level is not None
                               else value)
            mean = sum(season) / self.slots
            return replace(self, level=mean, trend=0.0, season=tuple(x - mean for x in season), finished_slots=done)
        assert self.level is not None
        s = season[position]
        level = self.alpha * (value - s) + (1 - self.alpha) * (self.level + self.trend)
        trend = self.beta * (level - self.level) + (1 - self.beta) * self.trend
        season = season[:position] + (self.gamma * (value - level) + (1 - self.gamma) * s,) + season[position + 1:]
        return replace(self, level=level, trend=trend, season=season, finished_slots=self.finished_slots + 1)

    def forecast(self, now: float, horizon_s: float) -> float | None:
        """Expected rate ``horizon_s`` after ``now``; None before the first finished slot."""
        if self.level is None:
            return None
        if self.finished_slots < self.slots:  # no season yet: the last finished slot
            return self.season[((self.slot_index or 0) - 1) % self.slots]
        ahead = (now + horizon_s) / self.slot_s - (self.slot_index or 0)
        position = math.floor((now + horizon_s) / self.slot_s) % self.slots
        return max(0.0, self.level + self.trend * max(ahead, 0.0) + self.season[position])
