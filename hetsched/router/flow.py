"""Flow control: which waiting request goes next while a model is saturated, and which are refused.

A request goes straight to an endpoint while its model has room. When every endpoint it could go to is at a limit
(concurrency, engine queue, KV use) or predicted to miss its class's TTFT, it waits here, per model, and leaves:

- in order of its class's priority, highest first; a class with a ``share`` whose requests in flight are under
  that share of the model's goes first whatever its priority, so a low priority is never starved of its share;
- within a priority, tenant by tenant in start-time fair queueing over tokens (prompt + expected output): a
  tenant's request is tagged ``max(virtual time, the tenant's last finish tag)`` and the least tag goes first,
  so a tenant sending ten times as much gets its share, not ten times it; within a tenant, first come first;
- refused with 429 when it cannot make its deadline (its class's TTFT, else ``max_wait_s``) or the queue is full:
  a full queue first evicts the newest request of the lowest sheddable priority below the newcomer's.

This module is the pure part, a queue of :class:`Waiting` entries on an injected clock; the picker's
:class:`~hetsched.router.picker.Picker` waits on it.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hetsched.router.types import RequestClass, RouteRequest

DRAIN_WINDOW = 64
"""Dispatches the drain rate (and so a refusal's Retry-After) is measured over."""
MAX_RETRY_AFTER_S = 60


class ShedReason(StrEnum):
    """Why a request was refused by flow control (a metric label)."""

    QUEUE_FULL = "queue-full"
    """The queue holds its most requests or bytes and nothing below the request could be evicted."""
    EVICTED = "evicted"
    """A request of higher priority took its place in a full queue."""
    DEADLINE = "deadline"
    """It waited until its class's TTFT had passed."""
    CANNOT_MEET_DEADLINE = "cannot-meet-deadline"
    """At the queue's drain rate, those ahead of it would take longer than its deadline allows."""
    TENANTS = "tenants"
    """Every tenant slot holds waiting requests, so no new tenant can be tracked."""


class Shed(Exception):
    """A request flow control refuses, with why and when to come back."""

    def __init__(self, reason: ShedReason, retry_after_s: int) -> None:
        super().__init__(reason.value)
        self.reason, self.retry_after_s = reason, retry_after_s


@dataclass(frozen=True)
class FlowLimits:
    max_requests: int
    max_bytes: int
    max_tenants: int
    max_wait_s: float
    """The deadline of a class without a TTFT SLO."""


@dataclass(eq=False)
class Waiting:
    """One queued request; ``handle`` is the waiter's own (the picker keeps its future there)."""

    route: RouteRequest
    request_class: RequestClass
    tenant: str
    size_bytes: int
    arrived: float
    deadline: float
    seq: int = 0
    start_tag: float = 0.0
    finish_tag: float = 0.0
    queued: bool = False
    handle: Any = None

    @property
    def cost(self) -> float:
        """What the request takes of its tenant's share: its tokens in and (at most) out."""
        return float(max(1, self.route.prompt_tokens + self.route.max_tokens))


@dataclass
class _Tenant:
    finish_tag: float = 0.0
    queued: int = 0


@dataclass
class _Band:
    """The classes of one priority: one virtual clock, one set of tenant tags."""

    priority: int
    virtual_time: float = 0.0
    tenants: OrderedDict[str, _Tenant] = field(default_factory=OrderedDict)
    """Least recently used first, so the oldest idle tenants are the first dropped."""


class FlowQueue:
    """One model's waiting requests (see the module docstring). ``on_forget`` hears of each tenant dropped for
    the cap, so its metric series go too."""

    def __init__(self, limits: FlowLimits, *, on_forget: Callable[[str], None] = lambda tenant: None) -> None:
        self.limits = limits
        self.length = 0
        self.bytes = 0
        self._heaps: dict[str, list[tuple[float, int, Waiting]]] = {}
        self._classes: dict[str, RequestClass] = {}
        self._bands: dict[int, _Band] = {}
        self._in_flight: dict[str, int] = {}
        self._seq = 0
        self._dispatched: deque[float] = deque(maxlen=DRAIN_WINDOW)
        self._on_forget = on_forget

    # --- in and out ---------------------------------------------------------------
    def push(self, entry: Waiting, now: float) -> list[Waiting]:
        """Queue ``entry``; the entries it evicted (refuse them). Raises :class:`Shed` when it cannot enter."""
        evicted: list[Waiting] = []
        while self.length + 1 > self.limits.max_requests or self.bytes + entry.size_bytes > self.limits.max_bytes:
            victim = self._victim(entry.request_class)
            if victim is None:
                for earlier in evicted:  # nothing is evicted for a request that does not get in
                    self._enqueue(earlier)
                raise Shed(ShedReason.QUEUE_FULL, self.retry_after(now))
            self.remove(victim)
            evicted.append(victim)
        band = self._band(entry.request_class.priority)
        tenant = self._tenant(band, entry.tenant)
        if tenant is None:
            for earlier in evicted:
                self._enqueue(earlier)
            raise Shed(ShedReason.TENANTS, self.retry_after(now))
        entry.start_tag = max(band.virtual_time, tenant.finish_tag)
        entry.finish_tag = entry.start_tag + entry.cost
        tenant.finish_tag = entry.finish_tag
        self._seq += 1
        entry.seq = self._seq
        self._enqueue(entry)
        return evicted

    def head(self) -> Waiting | None:
        """The entry to go next: a class under its share first, else the highest priority's least tag."""
        total = sum(self._in_flight.values())
        owed: tuple[float, Waiting] | None = None
        best: tuple[int, float, int, Waiting] | None = None
        for name, heap in self._heaps.items():
            top = self._top(heap)
            if top is None:
                continue
            cls = self._classes[name]
            if cls.share is not None:
                deficit = cls.share * total - self._in_flight.get(name, 0)
                if deficit > 0 and (owed is None or deficit > owed[0]):
                    owed = (deficit, top)
            key = (-cls.priority, top.start_tag, top.seq, top)
            if best is None or key[:3] < best[:3]:
                best = key
        if owed is not None:
            return owed[1]
        return None if best is None else best[3]

    def dispatched(self, entry: Waiting, now: float) -> None:
        """``entry`` left for an endpoint: its band's virtual time moves to its tag."""
        self._dequeue(entry)
        band = self._bands[entry.request_class.priority]
        band.virtual_time = max(band.virtual_time, entry.start_tag)
        self._dispatched.append(now)

    def remove(self, entry: Waiting) -> None:
        """``entry`` leaves without being served (cancelled, expired, evicted); its tenant's tag rolls back when
        it was the tenant's last."""
        if not entry.queued:
            return
        self._dequeue(entry)
        band = self._bands[entry.request_class.priority]
        tenant = band.tenants.get(entry.tenant)
        if tenant is not None and tenant.finish_tag == entry.finish_tag:
            tenant.finish_tag = entry.start_tag

    # --- what the queue knows ---------------------------------------------------------
    def started(self, request_class: str) -> None:
        """A request of ``request_class`` went to an endpoint (queued or not): its share counts it."""
        self._in_flight[request_class] = self._in_flight.get(request_class, 0) + 1

    def finished(self, request_class: str) -> None:
        left = self._in_flight.get(request_class, 0) - 1
        if left > 0:
            self._in_flight[request_class] = left
        else:
            self._in_flight.pop(request_class, None)

    def counted_dispatch(self, now: float) -> None:
        """A request that went straight to an endpoint: part of the drain rate too."""
        self._dispatched.append(now)

    def ahead(self, entry: Waiting) -> int:
        """Queued requests that go before ``entry`` at its priority and above (an estimate: tags not compared
        across tenants)."""
        priority = entry.request_class.priority
        return sum(len([1 for _tag, _seq, e in heap if e.queued]) for name, heap in self._heaps.items()
                   if self._classes[name].priority > priority) + self._ahead_in_band(entry)

    def drain_rate(self, now: float) -> float | None:
        """Requests dispatched per second over the last :data:`DRAIN_WINDOW` (None before two)."""
        if len(self._dispatched) < 2:
            return None
        span = now - self._dispatched[0]
        return (len(self._dispatched) - 1) / span if span > 0 else None

    def retry_after(self, now: float) -> int:
        """Seconds until the queue has drained once at its current rate (1 at least, 60 at most)."""
        rate = self.drain_rate(now)
        if rate is None:
            return 1
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(self.length / rate))))

    def expected_wait(self, entry: Waiting, now: float) -> float | None:
        rate = self.drain_rate(now)
        return None if rate is None else self.ahead(entry) / rate

    def queued(self) -> Iterator[Waiting]:
        for heap in self._heaps.values():
            yield from (e for _tag, _seq, e in heap if e.queued)

    def tenants(self) -> int:
        return sum(len(b.tenants) for b in self._bands.values())

    # --- inside ------------------------------------------------------------------------
    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band(priority)
        return band

    def _tenant(self, band: _Band, name: str) -> _Tenant | None:
        tenant = band.tenants.get(name)
        if tenant is not None:
            band.tenants.move_to_end(name)
            return tenant
        if self.tenants() >= self.limits.max_tenants and not self._forget_idle_tenant():
            return None
        tenant = band.tenants[name] = _Tenant(finish_tag=band.virtual_time)
        return tenant

    def _forget_idle_tenant(self) -> bool:
        """Drop the least recently used tenant with nothing queued (its tags restart at the virtual time)."""
        for band in self._bands.values():
            for name, tenant in band.tenants.items():
                if tenant.queued == 0:
                    del band.tenants[name]
                    if all(name not in b.tenants for b in self._bands.values()):
                        self._on_forget(name)
                    return True
        return False

    def _enqueue(self, entry: Waiting) -> None:
        cls = entry.request_class
        self._classes[cls.name] = cls
        heapq.heappush(self._heaps.setdefault(cls.name, []), (entry.start_tag, entry.seq, entry))
        entry.queued = True
        self.length += 1
        self.bytes += entry.size_bytes
        band = self._band(cls.priority)
        tenant = band.tenants.get(entry.tenant)
        if tenant is None:  # re-queued after its tenant was dropped: it comes back
            tenant = band.tenants[entry.tenant] = _Tenant(finish_tag=entry.finish_tag)
        tenant.queued += 1

    def _dequeue(self, entry: Waiting) -> None:
        if not entry.queued:
            return
        entry.queued = False
        self.length -= 1
        self.bytes -= entry.size_bytes
        tenant = self._bands[entry.request_class.priority].tenants.get(entry.tenant)
        if tenant is not None:
            tenant.queued -= 1
        self._top(self._heaps[entry.request_class.name])

    @staticmethod
    def _top(heap: list[tuple[float, int, Waiting]]) -> Waiting | None:
        """The heap's first queued entry, dropping the ones that left (lazy deletion)."""
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _victim(self, newcomer: RequestClass) -> Waiting | None:
        """The newest queued request of the lowest sheddable priority below ``newcomer``'s (or equal, when the
        newcomer is not sheddable itself)."""
        victim: Waiting | None = None
        for name, heap in self._heaps.items():
            cls = self._classes[name]
            below = cls.priority < newcomer.priority or (cls.priority == newcomer.priority and not newcomer.sheddable)
            if not cls.sheddable or not below:
                continue
            for _tag, _seq, entry in heap:
                if entry.queued and (victim is None or (cls.priority, -entry.seq) <
                                     (victim.request_class.priority, -victim.seq)):
                    victim = entry
        return victim

    def _ahead_in_band(self, entry: Waiting) -> int:
        priority = entry.request_class.priority
        return sum(1 for name, heap in self._heaps.items() if self._classes[name].priority == priority
                   for tag, _seq, e in heap if e.queued and e is not entry and tag <= entry.start_tag)
