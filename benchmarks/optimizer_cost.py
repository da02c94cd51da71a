"""Cost of the placement MILP against three baselines on the same inputs, in one run.

Scenarios: the example cluster files (chat-like, long-document, mixed fleet,
small models on MIG GPUs). Baselines:

* homogeneous — each model alone on the single accelerator type that serves
  it cheapest (whole GPUs; every model may use a whole pool);
* greedy — models by demand, each bucket on the whole-GPU config with the
  lowest $ per request/s that still has free GPUs, replicas rounded up;
* whole-GPU ILP — the same MILP with MIG and partitions switched off.

Figures are $/hour and ratios baseline / MILP (above 1 = the MILP is cheaper).

    .venv/bin/python benchmarks/optimizer_cost.py
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path

from hetsched.catalog import load_catalog
from hetsched.optimizer.build import build_problem
from hetsched.optimizer.load import load_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import PlanStatus
from hetsched.optimizer.spec import ClusterSpec

EXAMPLES = Path(__file__).parent.parent / "examples"
SCENARIOS = {"chat": "chat.yaml", "long-document": "long-document.yaml", "mixed": "mixed.yaml",
             "small models (MIG)": "mig-small-models.yaml"}


def milp_cost(spec: ClusterSpec) -> float | None:
    plan = optimize(spec)
    return plan.cost_per_hour if plan.status is not PlanStatus.INFEASIBLE else None


def whole_gpu_cost(spec: ClusterSpec) -> float | None:
    pools = [p.model_copy(update={"mig_allowed": False}) for p in spec.pools]
    return milp_cost(spec.model_copy(update={"pools": pools}))


def homogeneous_cost(spec: ClusterSpec) -> float | None:
    """Sum over models of the cheapest single-type, whole-GPU plan for that model alone."""
    total = 0.0
    for model in spec.models:
        best = math.inf
        for accelerator in sorted({p.accelerator for p in spec.pools}):
            pools = [p.model_copy(update={"mig_allowed": False}) for p in spec.pools if p.accelerator == accelerator]
            alone = spec.model_copy(update={
                "pools": pools,
                "models": [model.model_copy(update={"allowed_pools": None, "allowed_accelerators": None})],
                "capacities": [c for c in spec.capacities or [] if c.model == model.name]})
            if (model.allowed_accelerators and accelerator not in model.allowed_accelerators) or (
                    model.allowed_pools and not {p.name for p in pools} & set(model.allowed_pools)):
                continue
            cost = milp_cost(alone)
            if cost is not None:
                best = min(best, cost)
        if not math.isfinite(best):
            return None
        total += best
    return total


def greedy_cost(spec: ClusterSpec) -> float | None:
    """Per bucket, the cheapest whole-GPU config per request/s with free GPUs; replicas rounded up."""
    problem = build_problem(spec, load_catalog())
    free = {p.name: p.gpu_limit for p in problem.pools}
    price = {p.name: p.price_per_hour for p in problem.pools}
    cost = 0.0
    demand = defaultdict(dict)
    for d in problem.demands:
        demand[(d.model, d.role)][d.bucket] = d.rate_rps
    for rules in sorted(problem.models, key=lambda m: -m.demand_rps):
        for role in rules.roles:
            placed = 0
            for bucket, rate in demand[(rules.name, role)].items():
                if rate <= 0:
                    continue
                ranked = sorted((o for o in problem.options
                                 if o.model == rules.name and o.role is role and o.whole and bucket in o.capacity),
                                key=lambda o: price[o.pool] * o.tp / o.capacity[bucket])
                for option in ranked:
                    replicas = math.ceil(rate * (1 + problem.headroom) / option.capacity[bucket] - 1e-9)
                    if replicas * option.tp <= free[option.pool]:
                        free[option.pool] -= replicas * option.tp
                        cost += replicas * option.tp * price[option.pool]
                        placed += replicas
                        break
                else:
                    return None
            floor = max(rules.min_replicas, 2 if rules.spread else 0)
            if placed < floor:
                cost += (floor - placed) * min(price[o.pool] * o.tp for o in problem.options
                                               if o.model == rules.name and o.role is role and o.whole
                                               and free[o.pool] >= o.tp)
    return cost


def ratio(baseline: float | None, ours: float | None) -> str:
    return "—" if baseline is None or not ours else f"{baseline / ours:.2f}×"


def main() -> None:
    print(f"{'scenario':<20} {'MILP $/h':>9} {'homog. $/h':>11} {'greedy $/h':>11} {'whole-GPU $/h':>14}"
          f" {'homog.':>7} {'greedy':>7} {'whole':>7} {'solve s':>8}")
    for name, file in SCENARIOS.items():
        spec = load_cluster(EXAMPLES / file)
        started = time.perf_counter()
        ours = milp_cost(spec)
        elapsed = time.perf_counter() - started
        homogeneous, greedy, whole = homogeneous_cost(spec), greedy_cost(spec), whole_gpu_cost(spec)
        cells = [f"{c:.2f}" if c is not None else "—" for c in (ours, homogeneous, greedy, whole)]
        print(f"{name:<20} {cells[0]:>9} {cells[1]:>11} {cells[2]:>11} {cells[3]:>14}"
              f" {ratio(homogeneous, ours):>7} {ratio(greedy, ours):>7} {ratio(whole, ours):>7} {elapsed:>8.2f}")


if __name__ == "__main__":
    main()
