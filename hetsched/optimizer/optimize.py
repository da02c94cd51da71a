"""The whole path: build the problem, solve it, pack it onto nodes, and assemble the Plan."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from hetsched.catalog import Catalog, load_catalog
from hetsched.errors import InputError
from hetsched.optimizer.build import CapacityMemo, CapacitySource, Problem, build_problem
from hetsched.optimizer.capacity import SimulatedCapacity
from hetsched.optimizer.deadline import CheckedCapacity, Deadline
from hetsched.optimizer.explain import (binding_constraints, corrections_used, diagnose, gpus_used, group_loads,
                                       headroom, rejection_notes)
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
from hetsched.optimizer.spec import ClusterSpec, Disaggregation, split_objectives


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
    no capacity search starts, the solve does not start and assembling the plan stops
    (DeadlineError); the solver's time limit is at most the time left. Models with
    ``disaggregation: auto`` are planned both ways (see :func:`_choose_modes`); models with objectives are
    planned one objective at a time (see :func:`~hetsched.optimizer.spec.split_objectives`).
    """
    spec = split_objectives(spec)
    source = capacity_source or SimulatedCapacity()
    if deadline is not None:
        source = CheckedCapacity(source, deadline)
    catalog = catalog or load_catalog()
    auto = [m.name for m in spec.models if m.disaggregation is Disaggregation.AUTO]
    if auto:
        return _choose_modes(spec, auto, catalog, current, CapacityMemo(source), deadline)
    return _plan(spec, catalog, current, source, deadline)


def _plan(spec: ClusterSpec, catalog: Catalog, current: Plan | None, source: CapacitySource,
          deadline: Deadline | None) -> Plan:
    problem = build_problem(spec, catalog, capacity_source=source,
                            current=current.replica_counts() if current else None)
    if deadline is not None:
        deadline.check("before solving")
        problem = replace(problem, time_limit_s=min(problem.time_limit_s, deadline.left()))
    return assemble(spec.name, problem, solve(problem), deadline=deadline)


def _choose_modes(spec: ClusterSpec, auto: list[str], catalog: Catalog, current: Plan | None,
                  source: CapacityMemo, deadline: Deadline | None) -> Plan:
    """Plan every ``auto`` model unified, then try each in turn disaggregated and keep the cheaper plan.

    One model at a time keeps the trials linear in the auto models (not 2^n); the shared memo means a
    capacity search runs once whichever trial asks first. A mode whose input is refused (e.g. capacity rows
    for the other mode only) counts as infeasible, with the reason in the notes.
    """
    modes = {name: Disaggregation.UNIFIED for name in auto}
    best, best_error = _trial(spec, modes, catalog, current, source, deadline)
    notes = []
    for name in auto:
        if deadline is not None:
            deadline.check(f"before planning {name} disaggregated")
        tried = {**modes, name: Disaggregation.PREFILL_DECODE}
        plan, error = _trial(spec, tried, catalog, current, source, deadline)
        if plan is not None and plan.status is not PlanStatus.INFEASIBLE and (
                best is None or best.status is PlanStatus.INFEASIBLE or plan.cost_per_hour < best.cost_per_hour):
            notes.append(f"{name}: disaggregation auto chose prefill_decode: the plan costs {_cost(plan, error)} "
                         f"disaggregated, {_cost(best, best_error)} unified")
            modes, best, best_error = tried, plan, None
        else:
            notes.append(f"{name}: disaggregation auto chose unified: the plan costs {_cost(best, best_error)} "
                         f"unified, {_cost(plan, error)} disaggregated")
    if best is None:
        assert best_error is not None
        raise best_error
    return best.model_copy(update={"explanation": best.explanation.model_copy(
        update={"notes": [*notes, *best.explanation.notes]})})


def _trial(spec: ClusterSpec, modes: dict[str, Disaggregation], catalog: Catalog, current: Plan | None,
           source: CapacitySource, deadline: Deadline | None) -> tuple[Plan | None, InputError | None]:
    """The plan with each auto model served as ``modes`` says, or the input error that mode meets."""
    try:
        return _plan(_resolved(spec, modes), catalog, current, source, deadline), None
    except InputError as exc:
        return None, exc


def _resolved(spec: ClusterSpec, modes: dict[str, Disaggregation]) -> ClusterSpec:
    """``spec`` with the auto models in ``modes`` served that way; their capacity rows of the other mode left out."""
    models = [m.model_copy(update={"disaggregation": modes[m.name]}) if m.name in modes else m for m in spec.models]
    roles = {m.name: m.roles() for m in models}
    rows = None if spec.capacities is None else [e for e in spec.capacities
                                                 if e.model not in modes or e.role in roles[e.model]]
    return spec.model_copy(update={"models": models, "capacities": rows})


def _cost(plan: Plan | None, error: InputError | None) -> str:
    """A trial's cost in a note: dollars per hour, or why there is none."""
    if plan is None:
        return f"nothing ({error})"
    if plan.status is PlanStatus.INFEASIBLE:
        return "nothing (infeasible)"
    return f"${plan.cost_per_hour:.2f}/h"


def assemble(name: str, problem: Problem, solution: Solution, *, deadline: Deadline | None = None) -> Plan:
    """A Plan from a solved problem: groups, split, nodes, costs, headroom and explanation.

    Past ``deadline`` it stops between models and inside packing (DeadlineError): laying out thousands of
    replicas takes far longer than the solve that chose them.
    """
    notes = [*problem.notes, *rejection_notes(problem)]
    if not solution.found:
        return Plan(name=name, status=PlanStatus.INFEASIBLE, cost_per_hour=0.0, objective=None,
                    models=[ModelPlan(name=m.name, demand_rps=m.demand_rps, replicas=[], split=[], cost_per_hour=0.0,
                                      headroom=0.0) for m in problem.models],
                    nodes=[], pools=[], cost_by_model={}, solver=solution.stats,
                    explanation=Explanation(infeasible=diagnose(problem), notes=notes,
                                            corrections=corrections_used(problem)))
    loads = group_loads(problem, solution)
    group_cost = _group_costs(problem, solution)
    demand = problem.demand_rates()
    models = []
    for rules in problem.models:
        if deadline is not None:
            deadline.check("assembling the plan")
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
    packing = pack(problem, solution, deadline=deadline)
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
                                notes=[*packing.problems, *notes], corrections=corrections_used(problem)))


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
                               gpus_total=int(pool.gpu_limit), gpus_used=whole + split, gpus_mig=split,
                               cost_per_hour=pool.price_per_hour * (whole + split)))
    return usage
