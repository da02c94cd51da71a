"""Watching endpoints for the picker: discovery, each engine's ``/metrics``, and active health checks.

Both fronts run one :class:`EndpointWatch` beside their picker. It reads what the picker routes on (the engines'
running, waiting and KV counts, and their KV-cache events) and what it ejects on (``/health``), and feeds
discovery's endpoint sets in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from hetsched.errors import InputError
from hetsched.router.config import DiscoveryKind
from hetsched.router.discovery import PodWatcher
from hetsched.router.kv_events import KVEventFeeds
from hetsched.router.picker import Picker
from hetsched.router.signals import parse_engine_metrics
from hetsched.router.types import Endpoint
from hetsched.router.upstream import Upstream, UpstreamError, fetch

log = logging.getLogger(__name__)


class Discovery(Protocol):
    """A watcher that hands endpoint sets to the picker from a thread of its own (pods, an InferencePool)."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def stop(self) -> None: ...


class EndpointWatch:
    """The picker's eyes: polls every endpoint's metrics and health, and runs discovery.

    ``discovery`` builds the watcher that feeds endpoint sets (default: the router file's, pods labelled by
    hetsched when its kind is ``kubernetes``, none when ``static``). ``synced`` is True once discovery has
    listed (at once without one) and ``polled`` once every endpoint's metrics were read once.
    """

    def __init__(self, picker: Picker, upstream: Upstream, *,
                 discovery: Callable[[EndpointWatch], Discovery | None] | None = None) -> None:
        self.picker, self.upstream = picker, upstream
        self._discovery_factory = discovery or _router_file_discovery
        self._discovery: Discovery | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.kv_feeds: KVEventFeeds | None = None
        self.synced = False
        self.polled = False

    @property
    def ready(self) -> bool:
        """Endpoints discovered and their signals read: what a readiness probe asks."""
        return self.synced and self.polled

    def start(self) -> None:
        self._discovery = self._discovery_factory(self)
        if self._discovery is None:
            self.synced = True
        else:
            self._discovery.start(asyncio.get_running_loop())
        self.kv_feeds = KVEventFeeds(self.picker)
        self.kv_feeds.sync()
        self._tasks = [asyncio.create_task(self._poll_metrics()), asyncio.create_task(self._check_health())]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kv_feeds is not None:
            await self.kv_feeds.aclose()
        if self._discovery is not None:
            self._discovery.stop()

    def set_endpoints(self, found: dict[str, list[Endpoint]]) -> None:
        """Discovery's callback: a new endpoint set, which also means discovery has listed."""
        self.picker.set_endpoints(found)
        if self.kv_feeds is not None:
            self.kv_feeds.sync()
        self.synced = True

    def set_synced(self, synced: bool) -> None:
        self.synced = synced

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(e) for e in self.picker.state.endpoints()))
            self.picker.sync_kv_gauges()
            if self.kv_feeds is not None:
                self.kv_feeds.sync()
            self.polled = self.synced
            await asyncio.sleep(self.picker.config.metrics_interval_s)

    async def _scrape(self, endpoint: Endpoint) -> None:
        picker = self.picker
        fresh = 0
        try:
            status, text = await fetch(self.upstream, f"{endpoint.url}/metrics",
                                       timeout=picker.config.health.check_timeout_s)
            if status == 200:
                picker.state.record_signals(endpoint.url, parse_engine_metrics(text.decode(errors="replace"),
                                                                               scraped_at=picker.clock()))
                fresh = 1
        except (UpstreamError, InputError) as exc:
            log.debug("metrics of %s unreadable: %s", endpoint.url, exc)
        if endpoint.url in picker.state:  # discovery may have removed it meanwhile
            picker.metrics.signals_fresh.labels(*picker.labels(endpoint)).set(fresh)

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(e) for e in self.picker.state.endpoints()))
            await asyncio.sleep(self.picker.config.health.check_interval_s)

    async def _probe(self, endpoint: Endpoint) -> None:
        try:
            status, _ = await fetch(self.upstream, f"{endpoint.url}/health",
                                    timeout=self.picker.config.health.check_timeout_s)
            ok = status == 200
        except UpstreamError:
            ok = False
        if endpoint.url not in self.picker.state:  # discovery removed it meanwhile
            return
        if ok:
            self.picker.success(endpoint, active=True)
        else:
            self.picker.failure(endpoint)
        self.picker.sync_health(endpoint)


def _router_file_discovery(watch: EndpointWatch) -> Discovery | None:
    """Pods labelled by hetsched's operator when the router file says ``discovery: {kind: kubernetes}``."""
    config = watch.picker.config
    if config.discovery.kind is not DiscoveryKind.KUBERNETES:
        return None
    return PodWatcher(models=list(config.models), namespace=config.discovery.namespace,
                      label_selector=config.discovery.label_selector, default_port=config.discovery.port,
                      on_change=watch.set_endpoints, on_policies=watch.picker.set_policies,
                      on_objectives=watch.picker.set_objectives)
