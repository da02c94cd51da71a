"""Synthetic fleets for the optimizer benchmarks: many models, every accelerator type, capacity tables.

Capacities come from a small closed-form model so that thousands of rows are
instant and consistent (the simulator is not what these benchmarks measure):

* a replica of a model with ``P`` billion parameters (2·P GB in bf16) fits a
  device (or a TP group / MIG instance) when the weights take at most 70 % of
  its memory; the smallest such TP degree is used, plus the next one;
* decode throughput is bandwidth-bound: tokens/s = 0.6 · bandwidth / (2·P GB)
  × batch, with a batch that grows with the memory left for KV, capped at 64;
* prefill is compute-bound: 0.5 · peak FLOP/s / (2·P·1e9 FLOP per token);
* a request of a bucket costs ``in / prefill_rate + out / decode_rate``
  replica-seconds, and a replica holds 70 % of that rate at SLO;
* every replica is also capped at ``ENGINE_CAP`` requests/s (scheduler and
  tokenizer overheads do not shrink with the GPU), which is what makes MIG
  instances pay for small models.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hetsched.catalog import Accelerator, Device, load_catalog
from hetsched.optimizer.build import build_problem
from hetsched.optimizer.explain import max_demand_scale
from hetsched.optimizer.spec import ClusterSpec
from hetsched.partition.layouts import partition_profiles
from hetsched.specs.dtypes import DType

TYPES = ("b200", "h200", "h100-sxm", "h100-pcie", "a100-80gb", "a100-40gb", "a30", "l40s", "l4", "a10g", "t4", "mi300x")
BUCKETS = ((256, 64), (512, 256), (2048, 256), (4096, 512), (16384, 512))
SIZES_B = (0.6, 1.5, 3, 7, 8, 14, 32, 70)
ENGINE_CAP = 40.0
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Fleet:
    models: int
    nodes: int
    mig_share: float = 0.5
    seed: int = 0
    utilisation: float = 0.7
    """Demand as a share of the most the inventory could serve (same mix, LP relaxation)."""


def capacity(size_b: float, device: Device, tp: int, bucket: tuple[int, int]) -> float:
    """Requests/s one replica holds at SLO for a bucket (0 when it does not fit)."""
    weights_gb = 2 * size_b
    memory = device.memory_gb * tp
    if weights_gb > 0.7 * memory:
        return 0.0
    bandwidth = device.memory_tbs * tp * 1e12
    flops = device.peak_tflops(DType.BF16) * tp * 1e12
    batch = min(64.0, max(1.0, (memory - weights_gb) / (0.0002 * size_b * (bucket[0] + bucket[1]) + 0.05)))
    decode = 0.6 * bandwidth / (weights_gb * 1e9) * batch
    prefill = 0.5 * flops / (2 * size_b * 1e9)
    seconds = bucket[0] / prefill + bucket[1] / decode
    return min(ENGINE_CAP, 0.7 / seconds)


def fleet_spec(fleet: Fleet, *, headroom: float = 0.1, time_limit_s: float = 10.0, mip_gap: float = 0.01) -> ClusterSpec:
    """``fleet.models`` models × ``len(TYPES)`` accelerator types × 5 buckets over ``fleet.nodes`` 8-GPU nodes."""
    rng = random.Random(fleet.seed)
    catalog = load_catalog()
    accelerators = [catalog.get(t) for t in TYPES]
    pools = []
    per_type = _split(fleet.nodes, len(TYPES))
    for acc, nodes in zip(accelerators, per_type):
        splittable = bool(partition_profiles(acc))
        mig_nodes = round(nodes * fleet.mig_share) if splittable else 0
        for name, count, mig in ((f"{acc.id}-mig", mig_nodes, True), (acc.id, nodes - mig_nodes, False)):
            if count:
                pools.append({"name": name, "accelerator": acc.id, "nodes": count, "gpus_per_node": GPUS_PER_NODE,
                              "partition_allowed": mig})
    sizes = [rng.choice(SIZES_B) for _ in range(fleet.models)]
    rows: list[dict[str, object]] = []
    for m, size in enumerate(sizes):
        for acc in accelerators:
            for device, tps in _configs(acc):
                fitting = [tp for tp in tps if capacity(size, device, tp, BUCKETS[0]) > 0][:2]
                for tp in fitting:
                    for b, bucket in enumerate(BUCKETS):
                        cap = capacity(size, device, tp, bucket)
                        if cap > 0:
                            rows.append({"model": f"m{m:03d}", "device": device.id, "tp": tp, "bucket": f"b{b}",
                                         "requests_per_s": round(cap, 4)})
    total_gpus = fleet.nodes * GPUS_PER_NODE
    models = []
    for m, size in enumerate(sizes):
        shares = [rng.random() + 0.2 for _ in BUCKETS]
        total = sum(shares)
        weight = min(3.0, rng.lognormvariate(0, 0.8))
        models.append({"name": f"m{m:03d}",
                       "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                       "workload": {"rate_rps": 0.0, "buckets": [
                           {"name": f"b{b}", "input_tokens": i, "output_tokens": o, "share": s / total}
                           for b, ((i, o), s) in enumerate(zip(BUCKETS, shares))]},
                       "_weight": weight, "_size": size})
    # relative demand: each model's weight in dollars at its cheapest whole GPU; the level is set below
    per_dollar = [max(capacity(md["_size"], Device.whole(a), 1, BUCKETS[1]) / a.price_per_hour for a in accelerators)
                  for md in models]
    for md, rate_per_dollar in zip(models, per_dollar):
        md["workload"]["rate_rps"] = md["_weight"] * rate_per_dollar
        del md["_weight"], md["_size"]
    spec = ClusterSpec.model_validate({
        "name": f"synthetic-{fleet.models}x{len(TYPES)}-{total_gpus}gpus", "pools": pools, "models": models,
        "capacities": rows, "solver": {"time_limit_s": time_limit_s, "mip_gap": mip_gap, "headroom": headroom}})
    # rescale every demand so that the inventory could serve 1/utilisation times it (LP relaxation)
    scale = max_demand_scale(build_problem(spec, catalog)) * fleet.utilisation
    return scaled(spec, scale)


def scaled(spec: ClusterSpec, factors: float | list[float]) -> ClusterSpec:
    """The spec with each model's request rate multiplied by its factor (one factor for all, or one per model)."""
    per_model = factors if isinstance(factors, list) else [factors] * len(spec.models)
    models = [m.model_copy(update={"workload": m.workload.model_copy(update={"rate_rps": m.workload.rate_rps * f})})
              for m, f in zip(spec.models, per_model)]
    return spec.model_copy(update={"models": models})


def _configs(acc: Accelerator) -> list[tuple[Device, list[int]]]:
    configs = [(Device.whole(acc), [1, 2, 4, 8])]
    configs += [(Device.of(acc, profile), [1]) for profile in partition_profiles(acc)]
    return configs


def _split(total: int, parts: int) -> list[int]:
    base = total // parts
    return [base + (1 if i < total - base * parts else 0) for i in range(parts)]


def percent(x: float) -> str:
    return f"{x:.1%}" if math.isfinite(x) else "—"
