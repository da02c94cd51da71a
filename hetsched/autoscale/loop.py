"""The autoscaling loop: gather signals, decide, re-solve when due, apply through an :class:`Applier`.

The loop is a thin shell around the pure functions: the operator drives the
same :func:`~hetsched.autoscale.policy.decide` from its reconcile step, and
``hetsched autoscale`` drives this loop over a static or simulated set of
workers. Time is whatever ``clock`` says (simulated seconds on a
time-compressed replay).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import httpx

from hetsched.autoscale.fleet import Fleet
from hetsched.autoscale.policy import Decision, ReplicaCount, ScaleState, decide
from hetsched.autoscale.replan import replan
from hetsched.autoscale.signals import PodSample
from hetsched.autoscale.window import History, PodCounts, model_signals, observe
from hetsched.engine_metrics.parse import (ENGINE_SERIES_QUERY, parse_metrics_text, parse_prometheus_vector,
                                           parse_router_rejections)
from hetsched.engine_metrics.types import EngineMetrics
from hetsched.errors import InputError
from hetsched.optimizer.spec import Role
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    """One replica an applier runs (or is starting)."""

    name: str
    key: OptionKey
    url: str
    ready: bool


class Applier(Protocol):
    """Starts and stops replicas of one option; the operator's applier patches Deployments."""

    def replicas(self) -> list[Replica]:
        """Every replica, Ready or starting."""
        ...

    def start(self, key: OptionKey, count: int) -> None:
        ...

    def stop(self, key: OptionKey, count: int) -> None:
        """Stop ``count`` replicas of ``key``, not-Ready ones first."""
        ...


class MetricsSource(Protocol):
    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        """One sample per replica; ``metrics`` None where nothing usable came back."""
        ...


ROUTER_POOL = "router"
"""Pool name of the pseudo-pod that carries a router's refused requests into a model's demand."""


def router_key(model: str) -> OptionKey:
    return OptionKey(model, ROUTER_POOL, ROUTER_POOL, 1, Role.UNIFIED)


@dataclass
class EngineScraper:
    """Reads each replica's ``/metrics`` directly (vLLM or SGLang), in parallel, with a short timeout.

    With ``router_url``, the router's refused requests per model are read too
    and added to that model's arrivals (as a pseudo-pod of pool ``router``):
    requests turned away for lack of replicas are demand no engine counted.
    """

    clock: Callable[[], float]
    timeout_s: float = 1.0
    router_url: str | None = None
    client: httpx.Client = field(default_factory=lambda: httpx.Client())
    warned: set[str] = field(default_factory=set)
    """Replica URLs whose failed scrape was logged; a replica that answers again is logged anew next time."""

    def collect(self, replicas: Sequence[Replica], *, now: float) -> list[PodSample]:
        samples = []
        if replicas:
            with ThreadPoolExecutor(max_workers=min(16, len(replicas))) as pool:
                samples = list(pool.map(self._one, replicas))
        return samples + self._router()

    def _router(self) -> list[PodSample]:
        if self.router_url is None:
            return []
        try:
            response = self.client.get(f"{self.router_url}/metrics", timeout=self.timeout_s)
            response.raise_for_status()
            refused = parse_router_rejections(response.text)
        except (httpx.HTTPError, InputError):
            return []
        at = self.clock()
        return [PodSample(pod=f"{ROUTER_POOL}/{model}", key=router_key(model), ready=True, scraped_at=at,
                          metrics=EngineMetrics(completed=count, running=0, waiting=0))
                for model, count in refused.items()]

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


def placement_of(replicas: Sequence[Replica]) -> dict[OptionKey, ReplicaCount]:
    """Replicas per option, and how many are Ready."""
    total = Counter(r.key for r in replicas)
    ready = Counter(r.key for r in replicas if r.ready)
    return {key: ReplicaCount(n, ready[key]) for key, n in total.items()}


@dataclass
class Autoscaler:
    """Holds the policy's state between rounds and applies each decision."""

    fleet: Fleet
    settings: AutoscaleSettings
    applier: Applier
    source: MetricsSource
    clock: Callable[[], float] = time.monotonic
    state: ScaleState = field(default_factory=ScaleState)
    history: History = field(default_factory=History)

    def step(self) -> Decision:
        """One round: scrape, decide, maybe re-solve, apply the changes."""
        now = self.clock()
        replicas = self.applier.replicas()
        samples = self.source.collect(replicas, now=now)
        self.history, counts = observe(self.history, samples, now=now, settings=self.settings)
        signals = {m.name: model_signals(self.history, m.name, samples, counts.get(m.name, PodCounts()), now=now,
                                         settings=self.settings) for m in self.fleet.models}
        placement = placement_of(replicas)
        decision, self.state = decide(signals, placement, fleet=self.fleet, settings=self.settings, now=now,
                                      state=self.state)
        if decision.replan_due:
            target = replan(self.fleet, decision, placement, settings=self.settings)
            self.state = self.state.following(target, now=now) if target is not None else \
                replace(self.state, last_replan=now)
        for key, (before, after) in sorted(decision.changes(placement).items()):
            if after > before:
                self.applier.start(key, after - before)
            else:
                self.applier.stop(key, before - after)
        return decision


@dataclass
class StaticApplier:
    """A fixed set of endpoints: decisions are reported, nothing is started or stopped."""

    fixed: list[Replica]

    def replicas(self) -> list[Replica]:
        return list(self.fixed)

    def start(self, key: OptionKey, count: int) -> None:
        pass

    def stop(self, key: OptionKey, count: int) -> None:
        pass
