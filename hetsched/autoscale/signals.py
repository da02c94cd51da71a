"""What the autoscaler reads: the replicas, one scrape of each, and the requests the router turned away.

The engine signals themselves (:class:`~hetsched.engine_metrics.types.EngineMetrics`)
are shared with the router; a pod sample adds the autoscaler's replica key.
Plain values and one interface: the shells that scrape (the operator's
reconcile pass, ``hetsched autoscale``'s loop) fill them in, and the pure
round (:func:`~hetsched.autoscale.step.scale_step`) reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hetsched.engine_metrics.types import EngineMetrics
from hetsched.specs.wire import OptionKey


@dataclass(frozen=True)
class Replica:
    """One replica of ``key``, Ready or starting; ``url`` is empty while it has no address."""

    name: str
    key: OptionKey
    url: str
    ready: bool


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


@dataclass(frozen=True)
class RouterRefusals:
    """The router's count of requests it turned away per model (a counter since it started), read at ``read_at``.

    Requests refused for lack of replicas (no endpoint, every one saturated)
    are demand no engine counted: the windows add them to their model's
    arrivals.
    """

    read_at: float
    refused: Mapping[str, float]
    queued: Mapping[str, float] = field(default_factory=dict)
    """Requests waiting in the router's flow-control queue now (classes that may add replicas): a backlog no
    engine counts yet, drained like the engines' own queues."""


class MetricsSource(Protocol):
    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        """One sample per replica; ``metrics`` None where nothing usable came back."""
        ...
