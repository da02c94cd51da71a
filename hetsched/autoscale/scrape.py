"""Where the autoscaler's signals come from: each engine's ``/metrics``, a Prometheus server, the router's refusals.

The I/O both shells share: the operator's reconcile pass scrapes its engine
pods with :class:`EngineScraper`; ``hetsched autoscale``'s loop uses either
engine source and, with a local router, :class:`RouterScraper`. A source
that does not answer yields samples without metrics (stale, never blocking)
or no reading, never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from hetsched.autoscale.signals import PodSample, Replica, RouterRefusals
from hetsched.engine_metrics.parse import (ENGINE_SERIES_QUERY, parse_metrics_text, parse_prometheus_vector,
                                           parse_router_rejections)
from hetsched.errors import InputError

log = logging.getLogger(__name__)


@dataclass
class EngineScraper:
    """Reads each replica's ``/metrics`` directly (vLLM or SGLang), in parallel, with a short timeout."""

    clock: Callable[[], float]
    timeout_s: float = 1.0
    client: httpx.Client = field(default_factory=lambda: httpx.Client())
    warned: set[str] = field(default_factory=set)
    """Replica URLs whose failed scrape was logged; a replica that answers again is logged anew next time."""

    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        if not replicas:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(replicas))) as pool:
            return list(pool.map(self._one, replicas))

    def _one(self, replica: Replica) -> PodSample:
        url = f"{replica.url}/metrics"
        try:
            response = self.client.get(url, timeout=self.timeout_s)
            response.raise_for_status()
            metrics = parse_metrics_text(response.text)
            self.warned.discard(replica.url)
        except (httpx.HTTPError, InputError) as exc:
            metrics = None  # a stale pod: counted, never blocking the rest
            if replica.url not in self.warned:
                self.warned.add(replica.url)
                log.warning("%s: %s; expected a vLLM or SGLang engine's Prometheus metrics. The replica counts as "
                            "stale until it answers", url, exc or type(exc).__name__)
        return PodSample(pod=replica.name, key=replica.key, ready=replica.ready, scraped_at=self.clock(),
                         metrics=metrics)


@dataclass
class PrometheusSource:
    """Reads the engines' series from a Prometheus server's HTTP API, matched to replicas by a pod label."""

    url: str
    query: str = ENGINE_SERIES_QUERY
    pod_label: str = "pod"
    timeout_s: float = 5.0
    client: httpx.Client = field(default_factory=lambda: httpx.Client())

    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        try:
            response = self.client.get(f"{self.url.rstrip('/')}/api/v1/query", params={"query": self.query},
                                       timeout=self.timeout_s)
            found = parse_prometheus_vector(response.json(), pod_label=self.pod_label)
        except (httpx.HTTPError, ValueError, InputError):
            found = {}
        samples = []
        for replica in replicas:
            at, metrics = found.get(replica.name, (0.0, None))
            samples.append(PodSample(pod=replica.name, key=replica.key, ready=replica.ready,
                                     scraped_at=at if metrics is not None else 0.0, metrics=metrics))
        return samples


@dataclass
class RouterScraper:
    """Reads the requests the router refused and holds queued per model (``hetsched_router_rejected_total`` and
    ``hetsched_router_flow_queued_demand`` on its ``/metrics``)."""

    url: str
    clock: Callable[[], float]
    timeout_s: float = 1.0
    client: httpx.Client = field(default_factory=lambda: httpx.Client())

    def read(self) -> RouterRefusals | None:
        """This reading; None when the router did not answer with its metrics (the windows keep the last one)."""
        try:
            response = self.client.get(f"{self.url}/metrics", timeout=self.timeout_s)
            response.raise_for_status()
            refused, queued = parse_router_rejections(response.text)
        except (httpx.HTTPError, InputError):
            return None
        return RouterRefusals(read_at=self.clock(), refused=refused, queued=queued)
