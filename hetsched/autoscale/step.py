"""One autoscaling round, pure: ``(decision, memory') = scale_step(fleet, samples, placement, memory, now)``.

A round, in order:

1. *Observe*: fold this round's pod samples, and the router's refusals when
   it was read, into the windows (:func:`~hetsched.autoscale.window.observe`).
2. *Signals*: each model's windowed demand, length mix, latency, queue and
   KV state (:func:`~hetsched.autoscale.window.model_signals`).
3. *Decide*: replicas per option with a reason per model
   (:func:`~hetsched.autoscale.policy.decide`).
4. *Re-solve* when the decision says one is due
   (:func:`~hetsched.autoscale.replan.replan`): the policy moves to the new
   placement from the next round on.

Two shells call it and apply the decision: the operator's reconcile pass,
on the pods it listed (:mod:`hetsched.operator.autoscaler`), and
``hetsched autoscale``'s loop (:class:`hetsched.autoscale.loop.Autoscaler`).
A round may solve a MILP (step 4): shells on an event loop run it in a
worker thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from hetsched.autoscale.fleet import Fleet
from hetsched.autoscale.policy import Decision, ReplicaCount, ScaleState, decide
from hetsched.autoscale.replan import replan
from hetsched.autoscale.signals import PodSample, Replica, RouterRefusals
from hetsched.autoscale.window import History, PodCounts, model_signals, observe
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey


@dataclass(frozen=True)
class ScaleMemory:
    """What one round hands the next: the windows' history and the policy's state."""

    history: History = field(default_factory=History)
    state: ScaleState = field(default_factory=ScaleState)


def placement_of(replicas: Iterable[Replica]) -> dict[OptionKey, ReplicaCount]:
    """Replicas per option, and how many are Ready."""
    replicas = list(replicas)
    total = Counter(r.key for r in replicas)
    ready = Counter(r.key for r in replicas if r.ready)
    return {key: ReplicaCount(n, ready[key]) for key, n in total.items()}


def scale_step(fleet: Fleet, samples: Sequence[PodSample], placement: Mapping[OptionKey, ReplicaCount], *,
               settings: AutoscaleSettings, now: float, memory: ScaleMemory,
               refusals: RouterRefusals | None = None) -> tuple[Decision, ScaleMemory]:
    """This round's decision for ``placement`` (the replicas that run or start), and the memory for the next."""
    history, counts = observe(memory.history, samples, now=now, settings=settings, refusals=refusals)
    signals = {m.name: model_signals(history, m.name, samples, counts.get(m.name, PodCounts()), now=now,
                                     settings=settings) for m in fleet.models}
    decision, state = decide(signals, placement, fleet=fleet, settings=settings, now=now, state=memory.state)
    if decision.replan_due:
        target = replan(fleet, decision, placement, settings=settings)
        state = state.following(target, now=now) if target is not None else replace(state, last_replan=now)
    return decision, ScaleMemory(history, state)
