"""Capacities the optimizer computes itself: the simulator's SLO search per (model, config, bucket)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hetsched.catalog import Device
from hetsched.errors import InfeasibleError, InputError
from hetsched.optimizer.build import CapacityQuery
from hetsched.optimizer.spec import Role
from hetsched.sim.capacity import Capacity, find_capacity
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch
from hetsched.specs.workload import SLO, LengthDistribution, Workload

RELAXED_MS = 1e6
"""A latency target that never binds: a prefill replica's TPOT."""


class CapacitySearch(Protocol):
    """``find_capacity``'s signature, as far as the optimizer uses it (a store-cached search fits too)."""

    def __call__(self, model: ModelArch, device: Device, *, tp: int, workload: Workload, slo: SLO,
                 engine: EngineConfig, weight_dtype: DType | None) -> Capacity: ...


@dataclass(frozen=True)
class SimulatedCapacity:
    """A CapacitySource backed by ``find`` (the roofline-driven search by default; a store-cached one plugs in).

    Unified replicas are simulated on the bucket's workload under the model's
    SLO. A prefill replica is simulated on one-token outputs under the TTFT
    target alone. Decode replicas need measured capacities (a table row): the
    simulator models engines that prefill their own prompts.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    find: CapacitySearch = find_capacity

    def __call__(self, query: CapacityQuery) -> float:
        workload, slo = query.bucket.workload, query.spec.slo
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
