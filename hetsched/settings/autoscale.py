"""The autoscaler's section of the settings: one small frozen dataclass, every field with a default and a reason."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self

from hetsched.errors import InputError


@dataclass(frozen=True)
class AutoscaleSettings:
    """How the autoscaler reads demand and how fast it moves."""

    interval_s: float = 5.0
    """Seconds between two decisions."""
    stable_window_s: float = 60.0
    """Window of the demand estimate in normal operation (Knative's stable window)."""
    panic_window_s: float = 6.0
    """Short window that catches bursts."""
    panic_threshold: float = 1.5
    """Panic when the short-window rate is this many times what the replicas are sized for (and significantly
    so); panic holds one stable window and uses the larger of both rates."""
    headroom: float = 0.1
    """Replicas cover demand × (1 + headroom)."""
    queue_drain_s: float = 10.0
    """Queued requests count as extra demand of ``waiting / queue_drain_s`` requests per second."""
    scale_down_stabilization_s: float = 300.0
    """Scale down only to the highest capacity needed over this window (no up-down-up inside it)."""
    max_scale_down_fraction: float = 0.5
    """At most this share of a model's replicas goes in one step (at least one)."""
    slo_target: float = 0.99
    """Observed share of requests meeting the SLO below which capacity is added regardless of the estimate."""
    slo_window_s: float = 30.0
    """Window of the observed latency percentiles and SLO attainment."""
    slo_min_requests: int = 20
    """Requests the SLO window needs before its attainment is trusted."""
    slo_step: float = 0.25
    """Capacity added (as a share of current capacity, at least one replica) when attainment is below target."""
    slo_cooldown_s: float = 60.0
    """Seconds between two attainment-driven scale-ups: new replicas need time to start and take load."""
    stale_after_s: float = 15.0
    """A pod whose last good scrape is older than this is excluded from the signals and counted as stale."""
    resolve_interval_s: float = 600.0
    """Seconds between full re-solves of the placement with the churn penalty; 0 turns them off."""
    drift_threshold: float = 0.15
    """Re-solve early when the placement costs this share more than the cheapest cover of the demand."""
    churn_weight: float = 0.5
    """$/hour charged per replica added or removed in a re-solve against the running placement."""
    forecast: bool = False
    """Also scale to a Holt-Winters forecast of demand ``forecast_horizon_s`` ahead."""
    forecast_horizon_s: float = 60.0
    """How far ahead the forecast looks: about the time a new replica needs to become Ready."""
    season_s: float = 86_400.0
    """Season length of the forecast (a day)."""
    learn_corrections: bool = True
    """Learn each hardware's step-model correction from the engines' metrics the rounds scrape (the operator)."""
    correction_threshold: float = 0.1
    """A learned correction re-plans once a scale moves by more than this share of the one in force."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if value < 0:
                raise InputError(f"expected a non-negative number, got {value}", field=f"autoscale.{f.name}")
        for name in ("interval_s", "stable_window_s", "panic_window_s", "slo_window_s", "season_s"):
            if getattr(self, name) <= 0:
                raise InputError(f"expected a positive number, got {getattr(self, name)}", field=f"autoscale.{name}")
        if not 0 < self.max_scale_down_fraction <= 1:
            raise InputError("expected a share in (0, 1]", field="autoscale.max_scale_down_fraction")
        if not 0 < self.correction_threshold < 1:
            raise InputError("expected a share in (0, 1)", field="autoscale.correction_threshold")
        if not 0 < self.slo_target <= 1:
            raise InputError("expected a share in (0, 1]", field="autoscale.slo_target")
        for name in ("panic_window_s", "slo_window_s"):
            if getattr(self, name) > self.stable_window_s:
                raise InputError("must not be longer than the stable window", field=f"autoscale.{name}")

    @classmethod
    def from_mapping(cls, raw: dict[str, Any] | None) -> Self:
        """Settings from a config file's ``autoscale`` mapping; unknown keys are named in the error."""
        raw = raw or {}
        if not isinstance(raw, dict):
            raise InputError("expected a mapping of settings", field="autoscale")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InputError(f"unknown settings {unknown}; known: {sorted(known)}", field="autoscale")
        for key, value in raw.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) != isinstance(getattr(cls(), key), bool):
                raise InputError(f"expected a {type(getattr(cls(), key)).__name__}, got {value!r}",
                                 field=f"autoscale.{key}")
        return cls(**raw)
