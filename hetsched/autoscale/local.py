"""A local applier: simulated vLLM workers started and stopped in this process, behind the real router.

For ``hetsched autoscale`` over a laptop-sized fleet and for the replay
benchmark. A new worker counts as starting (not Ready, not routed to) for
``startup_s`` simulated seconds, like a replica loading weights; then it is
registered with the router. A stopped worker leaves the router at once and
is shut down after ``drain_s`` so requests in flight finish.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from hetsched.autoscale.signals import Replica
from hetsched.router.app import Router, create_router_app
from hetsched.router.config import RouterConfig
from hetsched.router.types import Endpoint
from hetsched.simworker import ThreadServer, WorkerSpec, serve_in_thread, start_worker_thread
from hetsched.specs.wire import OptionKey


class _LoopCapture:
    """ASGI wrapper that remembers the event loop the app runs on (to hand it work from other threads)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.loop = self.loop or asyncio.get_running_loop()
        await self.app(scope, receive, send)


@dataclass
class _Worker:
    name: str
    key: OptionKey
    server: ThreadServer
    started_at: float
    ready: bool = False


class LocalRouter:
    """The real router app on a loopback port, whose endpoints can be replaced from any thread."""

    def __init__(self, config: RouterConfig) -> None:
        app = create_router_app(config)
        self.router: Router = app.state.router
        self._app = _LoopCapture(app)
        self.server = serve_in_thread(self._app, host=config.host, port=config.port)
        self.url = self.server.url

    def set_endpoints(self, endpoints: Mapping[str, list[Endpoint]]) -> None:
        loop = self._app.loop
        assert loop is not None, "the router has not started"
        done = threading.Event()

        def apply() -> None:
            self.router.set_endpoints(dict(endpoints))
            done.set()

        loop.call_soon_threadsafe(apply)
        done.wait(5.0)

    def stop(self) -> None:
        self.server.stop()


class LocalApplier:
    """Starts simulated workers of each option and keeps the router's endpoint lists to the Ready ones."""

    def __init__(self, router: LocalRouter, *, archs: Mapping[str, str], time_scale: float, startup_s: float,
                 drain_s: float = 5.0, max_model_len: int = 8192, min_step_wall_s: float = 0.002,
                 clock: Callable[[], float]) -> None:
        self.router = router
        self.archs = dict(archs)
        """Served model name → bundled model (or config path) the simulated engine runs."""
        self.time_scale = time_scale
        self.startup_s = startup_s
        self.drain_s = drain_s
        self.max_model_len = max_model_len
        self.min_step_wall_s = min_step_wall_s
        self.clock = clock
        self._workers: dict[str, _Worker] = {}
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self.starts = 0
        self.stops = 0

    def replicas(self) -> list[Replica]:
        now = self.clock()
        promoted = False
        with self._lock:
            for worker in self._workers.values():
                if not worker.ready and now - worker.started_at >= self.startup_s:
                    worker.ready = promoted = True
            out = [Replica(w.name, w.key, w.server.url, w.ready) for w in self._workers.values()]
        if promoted:
            self._sync_router()
        return out

    def start(self, key: OptionKey, count: int) -> None:
        for _ in range(count):
            spec = WorkerSpec(model=self.archs.get(key.model, key.model), accelerator=key.device, tp=key.tp,
                              time_scale=self.time_scale, max_model_len=self.max_model_len, served_name=key.model,
                              min_step_wall_s=self.min_step_wall_s)
            server = start_worker_thread(spec)
            name = f"{key.model}-{key.device.replace(':', '-')}-{next(self._names)}"
            with self._lock:
                self._workers[name] = _Worker(name, key, server, started_at=self.clock(),
                                              ready=self.startup_s <= 0)
            self.starts += 1
        if self.startup_s <= 0:
            self._sync_router()

    def stop(self, key: OptionKey, count: int) -> None:
        with self._lock:
            mine = [w for w in self._workers.values() if w.key == key]
            mine.sort(key=lambda w: (w.ready, w.started_at))  # not Ready first, then the oldest
            going = mine[:count]
            for worker in going:
                del self._workers[worker.name]
        self.stops += len(going)
        self._sync_router()
        for worker in going:
            threading.Timer(self.drain_s / self.time_scale, worker.server.stop).start()

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.server.stop()

    def _sync_router(self) -> None:
        with self._lock:
            endpoints: dict[str, list[Endpoint]] = {model: [] for model in self.router.router.config.models}
            for w in self._workers.values():
                if w.ready:
                    endpoints.setdefault(w.key.model, []).append(Endpoint(url=w.server.url, model=w.key.model,
                                                                          accelerator=w.key.device, tp=w.key.tp))
        self.router.set_endpoints(endpoints)


def wall_clock(time_scale: float) -> Callable[[], float]:
    """Simulated seconds since now, running ``time_scale`` times faster than the wall clock."""
    origin = time.monotonic()
    return lambda: (time.monotonic() - origin) * time_scale
