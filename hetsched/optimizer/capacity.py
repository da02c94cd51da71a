"""Capacities the optimizer computes itself: the simulator's SLO search per (model, config, bucket)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hetsched.errors import InfeasibleError
from hetsched.optimizer.build import CapacityQuery
from hetsched.perf.in_force import Corrections, NamedCorrection, correction_for
from hetsched.sim.capacity import CapacityFinder, find_capacity
from hetsched.sim.roles import role_query
from hetsched.specs.engine import EngineConfig


def no_corrections() -> Corrections:
    return {}


@dataclass(frozen=True)
class SimulatedCapacity:
    """A CapacitySource backed by ``find`` (the step-model-driven search by default; a store-cached one plugs in).

    Unified replicas are simulated on the bucket's workload under the model's SLO; prefill and
    decode replicas of a disaggregated model on what their phase asks (:mod:`hetsched.sim.roles`):
    prefill under the TTFT target less the KV transfer, decode with the prompt's KV arriving, under
    the TPOT target. Each search runs under the query's step-model correction, which
    :meth:`correction` names from ``corrections`` (called anew for each problem built).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    find: CapacityFinder = find_capacity
    corrections: Callable[[], Corrections] = no_corrections

    def correction(self, query: CapacityQuery) -> NamedCorrection | None:
        """The correction in force for the query's replica (its model, device, TP and attention backend)."""
        return correction_for(self.corrections(), query.arch, query.device, query.tp,
                              attention_backend=query.spec.attention_backend or "")

    def __call__(self, query: CapacityQuery) -> float:
        slo = query.spec.slo
        assert slo is not None, "build_problem computes capacities only for models with an SLO"
        try:
            asked = role_query(query.role, model=query.arch, device=query.device, workload=query.bucket.workload,
                               slo=slo)
            capacity = self.find(query.arch, query.device, tp=query.tp, workload=asked.workload, slo=asked.slo,
                                 engine=self.engine, weight_dtype=query.weight_dtype, correction=query.correction)
        except InfeasibleError:
            return 0.0
        return capacity.requests_per_s
