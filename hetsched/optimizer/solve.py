"""Solve: the placement MILP, with HiGHS through ``scipy.optimize.milp``."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import Bounds, milp

from hetsched.optimizer.build import Problem
from hetsched.optimizer.formulation import Formulation, formulate
from hetsched.optimizer.plan import PlanStatus, SolverStats
from hetsched.optimizer.quiet import native_stdout_muted
from hetsched.optimizer.decompose import (BlockPlans, cheapest_mix, lagrangian_bound, mix_priced_plans, price,
                                          relax)
from hetsched.optimizer.rounding import round_relaxation
from hetsched.specs.wire import OptionKey


NEIGHBOURHOOD = 1
"""Replicas per option the search near the best plan may add or remove."""
PRICED_PLAN_SHARE = 0.65
"""Share of the time left for rounds of planning each model at the pools' prices and mixing the plans."""
LAGRANGIAN_SHARE = 0.85
"""Share of the time left then that the Lagrangian bound may take."""
FINAL_MIX_SHARE = 0.5
"""Share of the time left then that mixing in the plans the bound found may take."""
EXACT_SHARE = 0.5
"""Share of the time left HiGHS gets first on a small problem, to prove its optimum (or reach the spec's gap)."""
ROUNDING_SHARE = 0.9
"""Share of the time limit after which repair rounding stops improving its plan (its repair runs to the end): on
an idle machine it is done long before, on a starved one the later steps keep some time."""
GAP_TOLERANCE = 1e-9
"""Relative slack on the gap target: a plan whose gap is float noise (1e-16 at target 0) meets it."""


@dataclass(frozen=True)
class Solution:
    """What the MILP decided, by option index and by pool; empty when infeasible."""

    replicas: Mapping[int, int]
    split: Mapping[tuple[int, str], float]
    layouts: Mapping[str, Mapping[str, int]]
    stats: SolverStats

    @property
    def found(self) -> bool:
        return self.stats.status is not PlanStatus.INFEASIBLE

    def counts(self, problem: Problem) -> dict[OptionKey, int]:
        return {problem.options[i].key: n for i, n in self.replicas.items() if n}


@native_stdout_muted()
def solve(problem: Problem) -> Solution:
    """Cheapest replica counts, bucket split and split-GPU layouts that serve every demand at its SLO.

    Notation: options o = (model m, role r, pool p, config k, TP t) with
    per-replica capacity c[o,b] > 0 req/s for bucket b; demand λ[m,r,b];
    headroom h; pool p has G[p] usable GPUs of price π[p], nodes N[p] of g[p]
    GPUs, and split layouts L (MIG layouts or AMD modes) giving a[L,q]
    instances of kind q per GPU; current replicas n0[o]; churn weight w.

    Variables: n[o] ∈ ℤ≥0 replicas; x[o,b] ∈ [0,1] share of bucket b of (m,r)
    on o; y[p,L] ∈ ℤ≥0 GPUs of p split as L; d[o] ≥ 0 replicas moved on o.

    minimise  Σ_p π[p]·(Σ_{o whole on p} t[o]·n[o] + Σ_L y[p,L])
              + ε·Σ_{o split} π[p]·gpus[o]·n[o]               (idle instances stay idle)
              + w·Σ_o d[o]
    s.t.
      (1) demand     Σ_o x[o,b] = 1                                  ∀ m,r,b with λ > 0
      (2) capacity   Σ_b λ[m,r,b]·(1+h)/c[o,b] · x[o,b] ≤ n[o]       ∀ o
      (3) instances  Σ_{o split on p, kind q} n[o] ≤ Σ_L a[L,q]·y[p,L]  ∀ p, q
      (4) inventory  Σ_{o whole on p} t[o]·n[o] + Σ_L y[p,L] ≤ G[p]  ∀ p
      (5) TP groups  Σ_{o whole on p, t[o]=t} n[o] ≤ N[p]·⌊g[p]/t⌋   ∀ p, t ∤ g[p]
      (6) minimum    Σ_{o of m,r} n[o] ≥ min_replicas[m]             ∀ m,r
      (7) spread     Σ_{o of m,r} n[o] ≥ 2, and Σ_{o of m,r not on p} n[o] ≥ 1
                     for every one-node pool p                        ∀ m,r asking for spread
      (8) churn      d[o] ≥ n[o] − n0[o],  d[o] ≥ n0[o] − n[o]       ∀ o  (only when w > 0)

    Replicas in the current plan whose option no longer exists count as moved
    (a constant). Linear mixing in (2) treats a replica serving several buckets
    as time-shared between them at each bucket's capacity.

    Strategy: the LP relaxation first, with its duals (its value is a lower
    bound; an infeasible relaxation proves the problem infeasible); then repair
    rounding of it (:mod:`hetsched.optimizer.rounding`), which gives a feasible
    plan in seconds on any fleet. A small problem (:attr:`Problem.small`: one
    model, or few integer columns) then goes straight to HiGHS's
    branch-and-cut on the full MILP for ``EXACT_SHARE`` of the time left,
    to the proven optimum when the spec sets no gap (``exact_first``), which
    it mostly reaches in well under a second. Only when the plan is still not
    within the gap target (and when the repair fails, straight to HiGHS), the
    model-by-model decomposition (:mod:`hetsched.optimizer.decompose`):

    - rounds of column generation: each model's own cheapest plan with every
      pool at a price (the relaxation's duals first, those the rounding pays
      most over their LP share first), then the cheapest mix of one plan per
      model that fits every pool, with the split layouts chosen anew, whose LP
      duals price the pools for the next round;
    - the Lagrangian bound, which adds what integrality costs each model on
      its own to the LP bound; the models' plans its HiGHS runs find on the
      way join the mix once more.

    Then HiGHS's branch-and-cut, first (half the time left) near the best plan,
    on the options the relaxation or that plan uses, each within one replica
    of the plan (a search for a better plan whose bound proves nothing); then
    on the full MILP with the rest, for a better plan or bound. The best plan
    wins and the gap is measured against the best valid bound: the
    relaxation's, the Lagrangian one or the full MILP's. The plan is
    ``optimal`` when that gap is within the target (plus ``GAP_TOLERANCE``),
    or when HiGHS proved the full MILP's optimum within it (by its own
    tolerances) and the plan is no dearer; the proven optimum of the first
    run is ``optimal`` under any target.

    Under load: the rounding's improvement step stops at ``ROUNDING_SHARE`` of
    the time limit, and once a plan is in hand no later step starts past the
    limit, so a starved machine returns its plan in hand with its gap. The LP
    relaxation and the repair run to the end: without them there is no plan.

    HiGHS's native debug lines go to the null device, not standard output
    (:mod:`hetsched.optimizer.quiet`).
    """
    started = time.perf_counter()
    form = formulate(problem)
    if not form.cost.size:
        return _without_variables(problem, started)
    relaxation = relax(form)
    if relaxation is None:
        return _finish(problem, form, None, None, started, message="the LP relaxation is infeasible")
    moved = problem.churn_weight * form.moved_constant
    bound = relaxation.bound
    best = round_relaxation(problem, form, relaxation.values,
                            deadline=started + ROUNDING_SHARE * problem.time_limit_s)
    message = "repair rounding of the LP relaxation"

    def left() -> float:
        return problem.time_limit_s - (time.perf_counter() - started)

    proven = False
    first = 0.0 if problem.exact_first else problem.mip_gap
    if problem.small and (best is None or not _within(form, best, bound, first)):
        best, bound, proven, message = _branch_and_cut(form, best, bound, message, gap=first,
                                                       time_limit=max(left() * EXACT_SHARE, 0.1))
    if proven or (best is not None and _within(form, best, bound, problem.mip_gap)):
        return _finish(problem, form, best, bound + moved, started, message=message, proven=proven)
    if form.rows.count and best is not None and left() > 0:
        pricing = price(problem, form, relaxation)
        candidates = BlockPlans(pricing, [best])
        mixed = mix_priced_plans(problem, form, relaxation, candidates, best, time_limit=left() * PRICED_PLAN_SHARE)
        if mixed is not None:
            best, message = mixed, "the best mix of each model's plans at the pools' prices"
        known = candidates.count
        bound = lagrangian_bound(problem, form, relaxation, pricing, incumbent=best, candidates=candidates,
                                 time_limit=left() * LAGRANGIAN_SHARE)
        if candidates.count > known and not _within(form, best, bound, problem.mip_gap):
            mixed = cheapest_mix(problem, form, candidates, best, time_limit=left() * FINAL_MIX_SHARE)
            if mixed is not None:
                best, message = mixed, "the best mix of each model's plans at the pools' prices"
    if best is not None and not _within(form, best, bound, problem.mip_gap) and left() > 0:
        near = _neighbourhood(problem, form, relaxation.values, best, time_limit=max(left() / 2, 0.1))
        if near is not None and form.cost @ near < form.cost @ best:
            best, message = near, "HiGHS near the best plan"
    if best is None or (not _within(form, best, bound, problem.mip_gap) and left() > 0):
        best, bound, proven, message = _branch_and_cut(form, best, bound, message, gap=problem.mip_gap,
                                                       time_limit=max(left(), 0.1))
    return _finish(problem, form, best, bound + moved, started, message=message, proven=proven)


def _branch_and_cut(form: Formulation, best: np.ndarray | None, bound: float, message: str, *, gap: float,
                    time_limit: float) -> tuple[np.ndarray | None, float, bool, str]:
    """HiGHS on the full MILP: the cheaper of its plan and ``best``, the better bound, whether HiGHS proved
    its plan within ``gap`` (then the cheaper one is within it too), and what found the plan."""
    result = milp(form.cost, constraints=form.constraints(), integrality=form.integrality,
                  bounds=Bounds(form.lower, form.upper), options={"time_limit": time_limit, "mip_rel_gap": gap})
    dual = getattr(result, "mip_dual_bound", None)
    if dual is not None and np.isfinite(dual):
        bound = max(bound, float(dual))
    if result.x is not None and (best is None or result.fun < form.cost @ best):
        best, message = result.x, f"HiGHS: {str(result.message).split('(')[0].strip()}"
    elif best is None:
        message = ("HiGHS found no plan within the time limit" if result.status == 1
                   else f"HiGHS: {str(result.message).split('(')[0].strip()}")
    return best, bound, result.status == 0 and best is not None, message


def _finish(problem: Problem, form: Formulation, values: np.ndarray | None, bound: float | None, started: float, *,
            message: str, proven: bool = False) -> Solution:
    """The Solution of ``values``; ``proven``: HiGHS proved the full MILP's optimum within the target, and
    ``values`` is no dearer."""
    objective = None if values is None else float(form.cost @ values) + problem.churn_weight * form.moved_constant
    gap = None if objective is None or bound is None else _gap(objective, bound)
    status = (PlanStatus.INFEASIBLE if objective is None else
              PlanStatus.OPTIMAL if proven or (gap is not None and gap <= problem.mip_gap + GAP_TOLERANCE)
              else PlanStatus.FEASIBLE)
    stats = SolverStats(
        status=status, message=message, objective=objective, bound=bound, gap=gap,
        time_s=time.perf_counter() - started, variables=len(form.cost),
        integer_variables=int(form.integrality.sum()), constraints=form.rows.count,
    )
    if values is None:
        return Solution({}, {}, {}, stats)
    replicas = {i: int(round(values[col])) for i, col in enumerate(form.n_col) if round(values[col]) > 0}
    split = {key: float(values[col]) for key, col in form.x_index.items() if values[col] > 1e-9}
    layouts: dict[str, dict[str, int]] = defaultdict(dict)
    for (pool_name, key), col in form.y_index.items():
        if round(values[col]) > 0:
            layouts[pool_name][key] = int(round(values[col]))
    return Solution(replicas, split, dict(layouts), stats)


def _neighbourhood(problem: Problem, form: Formulation, relaxed: np.ndarray, rounded: np.ndarray, *,
                   time_limit: float) -> np.ndarray | None:
    """The best plan near ``rounded``, as a point of ``form``: the MILP on the options with replicas in
    ``relaxed`` or ``rounded`` only, each within one replica of ``rounded`` (or up to ``relaxed`` rounded
    up); None when HiGHS finds none within ``time_limit``."""
    keep = [i for i, col in enumerate(form.n_col) if relaxed[col] > 1e-7 or rounded[col] > 0.5]
    sub = replace(problem, options=tuple(problem.options[i] for i in keep))
    sub_form = formulate(sub)
    lower, upper = sub_form.lower.copy(), sub_form.upper.copy()
    for j, i in enumerate(keep):
        col, near = sub_form.n_col[j], rounded[form.n_col[i]]
        lower[col] = max(0.0, near - NEIGHBOURHOOD)
        upper[col] = min(upper[col], max(near + NEIGHBOURHOOD, np.ceil(relaxed[form.n_col[i]] - 1e-9)))
    result = milp(sub_form.cost, constraints=sub_form.constraints(), integrality=sub_form.integrality,
                  bounds=Bounds(lower, upper),
                  options={"time_limit": time_limit, "mip_rel_gap": problem.mip_gap})
    if result.x is None:
        return None
    values = np.zeros(len(form.cost))
    for j, i in enumerate(keep):
        values[form.n_col[i]] = round(result.x[sub_form.n_col[j]])
    for (j, bucket), col in sub_form.x_index.items():
        values[form.x_index[(keep[j], bucket)]] = result.x[col]
    for key, col in sub_form.y_index.items():
        values[form.y_index[key]] = round(result.x[col])
    if form.d_col:
        before = np.array([problem.current.get(o.key, 0) for o in problem.options], dtype=float)
        values[list(form.d_col)] = np.abs(values[list(form.n_col)] - before)
    return values


def _within(form: Formulation, values: np.ndarray, bound: float, gap: float) -> bool:
    """Whether the plan ``values`` is within ``gap`` of ``bound``, float noise aside."""
    return _gap(float(form.cost @ values), bound) <= gap + GAP_TOLERANCE


def _gap(objective: float, bound: float) -> float:
    """Relative gap as HiGHS reports it: (objective − bound) / |objective|."""
    return max(0.0, objective - bound) / max(abs(objective), 1e-9)


def _without_variables(problem: Problem, started: float) -> Solution:
    """No option exists at all: empty and optimal when nothing is asked for, else infeasible."""
    asked = any(d.rate_rps > 0 for d in problem.demands) or any(m.min_replicas or m.spread for m in problem.models)
    status = PlanStatus.INFEASIBLE if asked else PlanStatus.OPTIMAL
    stats = SolverStats(status=status, message="no configuration can serve any model", objective=None if asked else 0.0,
                        bound=None if asked else 0.0, gap=None if asked else 0.0, time_s=time.perf_counter() - started,
                        variables=0, integer_variables=0, constraints=0)
    return Solution({}, {}, {}, stats)


