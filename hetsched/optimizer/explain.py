"""Explain: which constraints bind in a plan, and — computed, not guessed — why there is no plan."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

from scipy.optimize import Bounds, milp

from hetsched.optimizer.build import Option, Problem
from hetsched.optimizer.plan import BindingConstraint, ConstraintKind, CorrectionUsed
from hetsched.optimizer.formulation import formulate
from hetsched.optimizer.solve import Solution
from hetsched.optimizer.spec import Role

SLACK_REPLICAS = 1.0
"""A model's SLO binds when its replicas hold less than one replica of slack over the load at headroom."""


@dataclass(frozen=True)
class GroupLoad:
    """Load on one chosen option: requests/s placed and the replicas that load needs at 100 % of SLO capacity."""

    load_rps: float
    replicas_needed: float

    @property
    def replica_capacity_rps(self) -> float:
        """Requests/s one replica holds at SLO on this option's mix of buckets (0 without load)."""
        return self.load_rps / self.replicas_needed if self.replicas_needed > 0 else 0.0


def group_loads(problem: Problem, solution: Solution) -> dict[int, GroupLoad]:
    """Per option index: the load the split assigns and the (fractional) replicas it needs, without headroom."""
    demand = problem.demand_rates()
    load: dict[int, float] = defaultdict(float)
    need: dict[int, float] = defaultdict(float)
    for (i, bucket), share in solution.split.items():
        option = problem.options[i]
        rate = demand[(option.model, option.role, bucket)] * share
        load[i] += rate
        need[i] += rate / option.capacity[bucket]
    return {i: GroupLoad(load[i], need[i]) for i in set(load) | set(solution.replicas)}


def headroom(problem: Problem, solution: Solution, loads: dict[int, GroupLoad], model: str) -> float:
    """(capacity − demand) / demand of ``model`` at SLO, its tightest role; 0 without demand."""
    rules = next(m for m in problem.models if m.name == model)
    if rules.demand_rps <= 0:
        return 0.0
    worst = math.inf
    for role in rules.roles:
        chosen = [i for i, o in enumerate(problem.options) if o.model == model and o.role is role]
        capacity = sum(solution.replicas.get(i, 0) * loads[i].replica_capacity_rps for i in chosen if i in loads)
        worst = min(worst, capacity / rules.demand_rps - 1)
    return worst if math.isfinite(worst) else 0.0


def gpus_used(problem: Problem, solution: Solution, pool: str) -> tuple[int, int]:
    """GPUs of ``pool`` the plan uses: (whole GPUs of unsplit replicas, GPUs split into layouts)."""
    whole = sum(problem.options[i].tp * n for i, n in solution.replicas.items()
                if problem.options[i].pool == pool and problem.options[i].whole)
    return whole, sum(solution.layouts.get(pool, {}).values())


def binding_constraints(problem: Problem, solution: Solution, loads: dict[int, GroupLoad]) -> list[BindingConstraint]:
    """Constraints at their limit: full pools, SLO-bound models, minimums and spread that add replicas."""
    found: list[BindingConstraint] = []
    for pool in problem.pools:
        if sum(gpus_used(problem, solution, pool.name)) >= pool.gpu_limit:
            found.append(BindingConstraint(kind=ConstraintKind.POOL_INVENTORY, subject=pool.name,
                                           detail=f"all {pool.gpu_limit} {pool.accelerator.id} GPUs of {pool.name} are used"))
    for rules in problem.models:
        for role in rules.roles:
            chosen = [i for i, o in enumerate(problem.options)
                      if o.model == rules.name and o.role is role and solution.replicas.get(i)]
            replicas = sum(solution.replicas[i] for i in chosen)
            needed = sum(loads[i].replicas_needed for i in chosen if i in loads) * (1 + problem.headroom)
            label = rules.name if role is Role.UNIFIED else f"{rules.name} ({role.value})"
            floor = max(rules.min_replicas, 2 if rules.spread else 0)
            if replicas and replicas - needed < SLACK_REPLICAS and math.ceil(needed - 1e-9) >= floor:
                found.append(BindingConstraint(
                    kind=ConstraintKind.SLO_CAPACITY, subject=rules.name,
                    detail=f"the SLO sets {replicas} replica(s) of {label}: the load with "
                           f"{problem.headroom:.0%} headroom needs {needed:.2f}"))
            elif replicas == floor and needed < floor:
                kind = ConstraintKind.SPREAD if rules.spread and floor == 2 and rules.min_replicas < 2 else ConstraintKind.MIN_REPLICAS
                why = "spread across two nodes" if kind is ConstraintKind.SPREAD else f"min_replicas={rules.min_replicas}"
                found.append(BindingConstraint(kind=kind, subject=rules.name,
                                               detail=f"{why} keeps {replicas} replicas of {label}; the load needs {needed:.2f}"))
    return found


def corrections_used(problem: Problem) -> list[CorrectionUsed]:
    """Each replica config (model, device, TP) whose capacities were computed under a step-model correction, with
    it: chosen or not, an option's capacities decided what the plan could be."""
    used: dict[tuple[str, str, int], CorrectionUsed] = {}
    for o in problem.options:
        if o.correction is not None and (o.model, o.device, o.tp) not in used:
            used[(o.model, o.device, o.tp)] = CorrectionUsed(model=o.model, device=o.device, tp=o.tp,
                                                             correction_id=o.correction.id, label=o.correction.label)
    return [used[key] for key in sorted(used)]


def diagnose(problem: Problem) -> list[str]:
    """Why no plan exists: missing configs, demand beyond supply, minimums beyond inventory, or integrality."""
    reasons = _missing_configs(problem)
    if reasons:
        return reasons
    for rules in problem.models:
        alone = _restrict(problem, rules.name)
        scale = max_demand_scale(alone)
        if scale < 1 - 1e-6:
            reasons.append(f"demand for {rules.name} exceeds everything the inventory can supply by "
                           f"{_excess(scale)} (it could serve {max(0.0, scale) * rules.demand_rps:.3g} of "
                           f"{rules.demand_rps:.3g} req/s at its SLO with {problem.headroom:.0%} headroom)")
    if reasons:
        return reasons
    scale = max_demand_scale(problem)
    if scale < 1 - 1e-6:
        return [f"together, the models' demand exceeds what the inventory can supply by {_excess(scale)}; "
                f"each fits alone, so add GPUs or lower a demand"]
    reasons = _minimums(problem)
    if reasons:
        return reasons
    return [f"the relaxed problem fits (every demand could grow ×{scale:.2f}), but whole replicas, TP groups "
            "within a node and MIG layouts do not; add GPUs, allow MIG, or lower min_replicas"]


def max_demand_scale(problem: Problem) -> float:
    """The largest factor every demand of ``problem`` can be multiplied by and still be served (LP relaxation)."""
    form = formulate(problem, max_scale=True)
    result = milp(form.cost, constraints=form.constraints(), integrality=form.integrality,
                  bounds=Bounds(form.lower, form.upper))
    if result.x is None or form.scale_col is None:
        return 0.0
    return float(result.x[form.scale_col])


def rejection_notes(problem: Problem) -> list[str]:
    """One line per model and pool the memory model rules out, with its reason."""
    return [f"{r.model} on {r.pool}: {r.reason}" for r in problem.rejections if r.memory]


def _missing_configs(problem: Problem) -> list[str]:
    reasons = []
    by_model: dict[str, list[Option]] = defaultdict(list)
    for option in problem.options:
        by_model[option.model].append(option)
    for rules in problem.models:
        options = by_model.get(rules.name, [])
        if not options:
            reasons.append(_no_config(problem, rules.name))
            continue
        for demand in problem.demands:
            if demand.model != rules.name or demand.rate_rps <= 0:
                continue
            if not any(o.role is demand.role and demand.bucket in o.capacity for o in options):
                role = "" if demand.role is Role.UNIFIED else f" ({demand.role.value})"
                reasons.append(f"no config in the inventory meets the SLO of {rules.name}{role} "
                               f"for requests of bucket {demand.bucket!r}")
    return reasons


def _no_config(problem: Problem, model: str) -> str:
    rejected = [r for r in problem.rejections if r.model == model]
    sized = [r for r in rejected if r.memory and r.needed_gb is not None and r.offered_gb is not None]
    if sized and len(sized) == len(rejected):
        best = max(sized, key=lambda r: r.offered_gb or 0.0)
        return (f"{model} needs {best.needed_gb:.0f} GB per replica (weights, activations and runtime); "
                f"the largest config it may use offers {best.offered_gb:.0f} GB ({best.offered_by})")
    if rejected:
        return f"{model} fits no config in the inventory: " + "; ".join(sorted({r.reason for r in rejected}))
    return (f"{model} may use none of the pools ({', '.join(p.name for p in problem.pools)}): check its "
            "allowed_pools / allowed_accelerators and the capacity table's devices")


def _minimums(problem: Problem) -> list[str]:
    reasons = []
    total = sum(p.gpu_limit for p in problem.pools)
    needed = 0.0
    for rules in problem.models:
        floor = max(rules.min_replicas, 2 if rules.spread else 0)
        options = [o for o in problem.options if o.model == rules.name]
        if rules.spread:
            nodes = sum(problem.pool(p).nodes for p in {o.pool for o in options})
            if nodes < 2:
                reasons.append(f"{rules.name} asks for replicas on two nodes; the pools it may use have one node")
        if options and floor:
            needed += floor * len(rules.roles) * min(o.gpus for o in options)
    if needed > total:
        reasons.append(f"minimum replicas need at least {needed:.1f} GPUs; the pools have {total}")
    return reasons


def _restrict(problem: Problem, model: str) -> Problem:
    return replace(problem,
                   options=tuple(o for o in problem.options if o.model == model),
                   demands=tuple(d for d in problem.demands if d.model == model),
                   models=tuple(m for m in problem.models if m.name == model))


def _excess(scale: float) -> str:
    return "far more than it has" if scale <= 1e-9 else f"{1 / scale - 1:.0%}"
