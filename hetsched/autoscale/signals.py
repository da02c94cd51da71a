"""One scrape of one pod: which replica it serves and what its engine said.

The engine signals themselves (:class:`~hetsched.engine_metrics.types.EngineMetrics`)
are shared with the router; a pod sample adds the autoscaler's replica key.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetsched.engine_metrics.types import EngineMetrics
from hetsched.specs.wire import OptionKey


@dataclass(frozen=True)
class PodSample:
    """One scrape of one pod serving one replica of ``key``.

    ``metrics`` None means the scrape failed (or the pod reported nothing
    usable); ``scraped_at`` is when the metrics were taken.
    """

    pod: str
    key: OptionKey
    ready: bool
    scraped_at: float
    metrics: EngineMetrics | None

    @property
    def model(self) -> str:
        return self.key.model
