"""Capacities the optimizer computes itself: the simulator's SLO search per (model, config, bucket)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetsched.errors import InfeasibleError, InputError
from hetsched.optimizer.build import CapacityQuery
from hetsched.optimizer.spec import Role
from hetsched.sim.capacity import CapacityFinder, find_capacity
from hetsched.specs.engine import EngineConfig
from hetsched.specs.workload import LengthDistribution

RELAXED_MS = 1e6
"""A latency target that never binds: a prefill replica's TPOT."""


@dataclass(frozen=True)
class SimulatedCapacity:
    """A CapacitySource backed by ``find`` (the roofline-driven search by default; a store-cached one plugs in).

    Unified replicas are simulated on the bucket's workload under the model's
    SLO. A prefill replica is simulated on one-token outputs under the TTFT
    target alone. Decode replicas need measured capacities (a table row): the
    simulator models engines that prefill their own prompts.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    find: CapacityFinder = find_capacity

    def __call__(self, query: CapacityQuery) -> float:
        workload, slo = query.bucket.workload, query.spec.slo
        assert slo is not None, "build_problem computes capacities only for models with an SLO"
        if query.role is Role.DECODE:
            raise InputError(f"decode capacities of {query.spec.name} on {query.device.id} must come from the "
                             "capacity table", field="capacities")
        if query.role is Role.PREFILL:
            workload = workload.model_copy(update={"output_len": LengthDistribution.fixed(1)})
            slo = slo.model_copy(update={"tpot_ms": RELAXED_MS})
        try:
            capacity = self.find(query.arch, query.device, tp=query.tp, workload=workload, slo=slo, engine=self.engine,
                                 weight_dtype=query.weight_dtype)
        except InfeasibleError:
            return 0.0
        return capacity.requests_per_s
