"""``hetsched autoscale``'s loop: replicas from an :class:`Applier`, scrapes, one pure round, starts and stops.

This loop drives the ``hetsched autoscale`` command (simulated workers
behind a local router, or a fixed set of endpoints) and the replay
benchmark. Each :meth:`Autoscaler.step` asks the applier for the replicas,
scrapes them (and the router's refusals, when there is a router), calls the
pure :func:`~hetsched.autoscale.step.scale_step`, and starts or stops
replicas through the applier. Time is whatever ``clock`` says (simulated
seconds on a time-compressed replay).

The operator does not run this loop: its reconcile pass calls ``scale_step``
on the pods it listed and scales its Deployments itself
(:mod:`hetsched.operator.autoscaler`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hetsched.autoscale.fleet import Fleet
from hetsched.autoscale.policy import Decision
from hetsched.autoscale.scrape import RouterScraper
from hetsched.autoscale.signals import MetricsSource, Replica
from hetsched.autoscale.step import ScaleMemory, placement_of, scale_step
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey


class Applier(Protocol):
    """Starts and stops replicas of one option."""

    def replicas(self) -> list[Replica]:
        """Every replica, Ready or starting."""
        ...

    def start(self, key: OptionKey, count: int) -> None:
        ...

    def stop(self, key: OptionKey, count: int) -> None:
        """Stop ``count`` replicas of ``key``, not-Ready ones first."""
        ...


@dataclass
class Autoscaler:
    """Holds the memory between rounds and applies each decision."""

    fleet: Fleet
    settings: AutoscaleSettings
    applier: Applier
    source: MetricsSource
    clock: Callable[[], float] = time.monotonic
    router: RouterScraper | None = None
    """Where the router's refusals are read; None: no router in front of the replicas."""
    memory: ScaleMemory = field(default_factory=ScaleMemory)

    def step(self) -> Decision:
        """One round: scrape, decide (and re-solve when due), apply the changes."""
        now = self.clock()
        replicas = self.applier.replicas()
        samples = self.source.collect(replicas, now=now)
        refusals = self.router.read() if self.router is not None else None
        placement = placement_of(replicas)
        decision, self.memory = scale_step(self.fleet, samples, placement, settings=self.settings, now=now,
                                           memory=self.memory, refusals=refusals)
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
