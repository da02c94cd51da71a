"""Endpoint health: passive ejection after consecutive failures, recovery by an active check.

A pure state machine over a clock passed in. An ejected endpoint gets no
traffic until its ejection time is over and an active check succeeds; each
ejection without a served request in between doubles the ejection time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthSettings:
    """How quickly endpoints are ejected and let back."""

    eject_after_failures: int = 3
    """Consecutive failures (connect errors, 5xx, failed checks) that eject an endpoint."""
    base_ejection_s: float = 5.0
    """Ejection time of a first ejection; doubles with each repeat."""
    max_ejection_s: float = 60.0
    check_interval_s: float = 1.0
    """Seconds between active ``/health`` checks of each endpoint."""
    check_timeout_s: float = 1.0


@dataclass
class HealthTracker:
    """Health of one endpoint."""

    settings: HealthSettings
    consecutive_failures: int = 0
    ejected_until: float | None = None
    repeat_ejections: int = 0

    def available(self, now: float) -> bool:
        """Whether traffic may go here now (not ejected)."""
        return self.ejected_until is None

    def record_success(self, now: float, *, active: bool = False) -> bool:
        """A served request or a passed check; returns True when this recovers an ejected endpoint."""
        self.consecutive_failures = 0
        if self.ejected_until is None:
            if not active:
                self.repeat_ejections = 0
            return False
        if now < self.ejected_until:
            return False
        self.ejected_until = None
        return True

    def record_failure(self, now: float) -> bool:
        """A connect error, a 5xx or a failed check; returns True when this ejects the endpoint."""
        self.consecutive_failures += 1
        if self.ejected_until is not None:
            if now >= self.ejected_until:  # failed its recovery check: eject again, for longer
                self._eject(now)
            return False
        if self.consecutive_failures >= self.settings.eject_after_failures:
            self._eject(now)
            return True
        return False

    def _eject(self, now: float) -> None:
        duration = min(self.settings.base_ejection_s * 2 ** self.repeat_ejections, self.settings.max_ejection_s)
        self.ejected_until = now + duration
        self.repeat_ejections += 1
