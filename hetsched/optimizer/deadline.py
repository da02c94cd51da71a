"""A deadline a long solve checks between its steps, so that one past it stops instead of running on unseen."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hetsched.errors import DeadlineError
from hetsched.optimizer.build import CapacityQuery, CapacitySource, source_correction
from hetsched.perf.in_force import NamedCorrection


@dataclass(frozen=True)
class Deadline:
    """The instant ``at`` (on ``clock``) by which work must stop; ``seconds`` is the budget it was set from."""

    at: float
    seconds: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @classmethod
    def after(cls, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(clock() + seconds, seconds, clock)

    def left(self) -> float:
        return self.at - self.clock()

    def check(self, doing: str) -> None:
        """DeadlineError when the deadline has passed; ``doing`` says what stopped."""
        if self.left() <= 0:
            raise DeadlineError(f"stopped {doing}: past the deadline of {self.seconds:g} s")


@dataclass(frozen=True)
class CheckedCapacity:
    """A CapacitySource that checks ``deadline`` before each query: a search never starts past it, and one that
    started finishes (and is cached whole) before the next check."""

    source: CapacitySource
    deadline: Deadline

    def __call__(self, query: CapacityQuery) -> float:
        self.deadline.check("computing capacities")
        return self.source(query)

    def correction(self, query: CapacityQuery) -> NamedCorrection | None:
        return source_correction(self.source, query)
