"""The whole path: build the problem, solve it, pack it onto nodes, and assemble the Plan."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from hetsched.catalog import Catalog, load_catalog
from hetsched.optimizer.build import CapacitySource, Problem, build_problem
from hetsched.optimizer.capacity import SimulatedCapacity
from hetsched.optimizer.deadline import CheckedCapacity, Deadline
from hetsched.optimizer.explain import (binding_constraints, diagnose, gpus_used, group_loads, headroom,
                                       rejection_notes)
from hetsched.optimizer.pack import pack
from hetsched.optimizer.plan import (
    BucketShare,
    Explanation,
    ModelPlan,
    Plan,
    PlanStatus,
    PoolUsage,
    ReplicaGroup,
)
from hetsched.optimizer.solve import Solution, solve
from hetsched.optimizer.spec import ClusterSpec


def optimize(
    spec: ClusterSpec,
    *,
    catalog: Catalog | None = None,
    current: Plan | None = None,
    capacity_source: CapacitySource | None = None,
    deadline: Deadline | None = None,
) -> Plan:
    """The cheapest plan for ``spec``; an infeasible spec gives a Plan with status ``infeasible`` and reasons.

    Models without rows in ``spec.capacities`` get capacities from ``capacity_source``
    (default: the simulator's SLO search on the roofline step model). Past ``deadline``
    no capacity search starts and the solve does not start (DeadlineError); the solver's
    time limit is at most the time left.
    """
    source = capacity_source or SimulatedCapacity()
    if deadline is not None:
        source = CheckedCapacity(source, deadline)
    problem = build_problem(spec, catalog or load_catalog(), capacity_source=source,
                            current=current.replica_counts() if current else None)
    if deadline is not None:
        deadline.check("before solving")
        problem = replace(problem, time_limit_s=min(problem.time_limit_s, deadline.left()))
    return assemble(spec.name, problem, solve(problem))


def assemble(name: str, problem: Problem, solution: Solution) -> Plan:
    """A Plan from a solved problem: groups, split, nodes, costs, headroom and explanation."""
    notes = [*problem.notes, *rejection_notes(problem)]
    if not solution.found:
        return Plan(name=name, status=PlanStatus.INFEASIBLE, cost_per_hour=0.0, objective=None,
                    models=[ModelPlan(name=m.name, demand_rps=m.demand_rps, replicas=[], split=[], cost_per_hour=0.0,
                                      headroom=0.0) for m in problem.models],
                    nodes=[], pools=[], cost_by_model={}, solver=solution.stats,
                    explanation=Explanation(infeasible=diagnose(problem), notes=notes))
    loads = group_loads(problem, solution)
    group_cost = _group_costs(problem, solution)
    demand = problem.demand_rates()
    models = []
    for rules in problem.models:
        groups = []
        for i, n in sorted(solution.replicas.items()):
            option = problem.options[i]
            if option.model != rules.name:
                continue
            load = loads.get(i)
            capacity = n * load.replica_capacity_rps if load else 0.0
            groups.append(ReplicaGroup(
                model=option.model, pool=option.pool, accelerator=problem.pool(option.pool).accelerator.id,
                profile=option.profile, device=option.device, tp=option.tp, role=option.role, replicas=n,
                gpus_per_replica=option.gpus, capacity_rps=capacity, load_rps=load.load_rps if load else 0.0,
                cost_per_hour=group_cost[i]))
        split = [BucketShare(model=rules.name, bucket=bucket, device=problem.options[i].device,
                             pool=problem.options[i].pool, tp=problem.options[i].tp, role=problem.options[i].role,
                             fraction=share, rate_rps=share * demand[(rules.name, problem.options[i].role, bucket)])
                 for (i, bucket), share in sorted(solution.split.items()) if problem.options[i].model == rules.name]
        models.append(ModelPlan(name=rules.name, demand_rps=rules.demand_rps, replicas=groups, split=split,
                                cost_per_hour=sum(g.cost_per_hour for g in groups),
                                headroom=headroom(problem, solution, loads, rules.name)))
    packing = pack(problem, solution)
    pools = _pool_usage(problem, solution)
    counts = solution.counts(problem)
    moved = sum(abs(counts.get(k, 0) - problem.current.get(k, 0)) for k in set(counts) | set(problem.current))
    return Plan(
        name=name, status=solution.stats.status, cost_per_hour=sum(p.cost_per_hour for p in pools),
        objective=solution.stats.objective, replicas_moved=moved if problem.current else 0,
        models=models, nodes=list(packing.nodes), pools=pools,
        cost_by_model={m.name: m.cost_per_hour for m in models}, mig_configs=packing.mig_configs,
        partition_profiles=packing.partition_profiles,
        solver=solution.stats,
        explanation=Explanation(binding=binding_constraints(problem, solution, loads),
                                notes=[*packing.problems, *notes]))


def _group_costs(problem: Problem, solution: Solution) -> dict[int, float]:
    """Cost per chosen option; a split pool's GPUs are shared out by the compute the replicas use."""
    split_used: dict[str, float] = defaultdict(float)
    for i, n in solution.replicas.items():
        option = problem.options[i]
        if not option.whole:
            split_used[option.pool] += option.gpus * n
    costs = {}
    for i, n in solution.replicas.items():
        option = problem.options[i]
        pool = problem.pool(option.pool)
        if option.whole:
            costs[i] = pool.price_per_hour * option.tp * n
        else:
            split_cost = pool.price_per_hour * sum(solution.layouts.get(pool.name, {}).values())
            costs[i] = split_cost * option.gpus * n / split_used[pool.name]
    return costs


def _pool_usage(problem: Problem, solution: Solution) -> list[PoolUsage]:
    usage = []
    for pool in problem.pools:
        whole, split = gpus_used(problem, solution, pool.name)
        usage.append(PoolUsage(pool=pool.name, accelerator=pool.accelerator.id, price_per_hour=pool.price_per_hour,
                               gpus_total=pool.gpu_limit, gpus_used=whole + split, gpus_mig=split,
                               cost_per_hour=pool.price_per_hour * (whole + split)))
    return usage
