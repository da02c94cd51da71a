"""Solve: the placement MILP, with HiGHS through ``scipy.optimize.milp``."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from hetsched.optimizer.build import OptionKey, Problem
from hetsched.optimizer.plan import PlanStatus, SolverStats

SPLIT_TIE_BREAK = 1e-4
"""Cost per replica on a split GPU, as a share of its GPU-fraction price: idle instances stay idle."""


MAX_SCALE = 1e6
"""Cap on the demand growth factor the diagnostic LP looks for."""


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


class _Rows:
    """Sparse constraint rows collected as (row, column, value) triplets."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    @property
    def count(self) -> int:
        return len(self.lower)

    def add(self, terms: Mapping[int, float] | list[tuple[int, float]], lower: float, upper: float) -> None:
        row = len(self.lower)
        for col, val in (terms.items() if isinstance(terms, Mapping) else terms):
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lower)
        self.upper.append(upper)

    def constraint(self, columns: int) -> LinearConstraint:
        matrix = coo_array((self.vals, (self.rows, self.cols)), shape=(len(self.lower), columns)).tocsr()
        return LinearConstraint(matrix, np.array(self.lower), np.array(self.upper))


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
    """
    started = time.perf_counter()
    form = formulate(problem)
    if not form.cost.size:
        return _without_variables(problem, started)
    result = milp(form.cost, constraints=form.constraints(), integrality=form.integrality,
                  bounds=Bounds(form.lower, form.upper),
                  options={"time_limit": problem.time_limit_s, "mip_rel_gap": problem.mip_gap, "presolve": True})
    elapsed = time.perf_counter() - started
    has_solution = result.x is not None
    status = (PlanStatus.OPTIMAL if result.status == 0 else
              PlanStatus.FEASIBLE if has_solution else PlanStatus.INFEASIBLE)
    moved = problem.churn_weight * form.moved_constant
    objective = float(result.fun) + moved if has_solution else None
    bound = getattr(result, "mip_dual_bound", None)
    bound = float(bound) + moved if bound is not None and np.isfinite(bound) else None
    gap = getattr(result, "mip_gap", None)
    stats = SolverStats(
        status=status, message=str(result.message), objective=objective, bound=bound,
        gap=float(gap) if gap is not None and np.isfinite(gap) else None, time_s=elapsed,
        variables=len(form.cost), integer_variables=int(form.integrality.sum()), constraints=form.rows.count,
    )
    if not has_solution:
        return Solution({}, {}, {}, stats)
    values = result.x
    replicas = {i: int(round(values[col])) for i, col in enumerate(form.n_col) if round(values[col]) > 0}
    split = {key: float(values[col]) for key, col in form.x_index.items() if values[col] > 1e-9}
    layouts: dict[str, dict[str, int]] = defaultdict(dict)
    for (pool_name, key), col in form.y_index.items():
        if round(values[col]) > 0:
            layouts[pool_name][key] = int(round(values[col]))
    return Solution(replicas, split, dict(layouts), stats)


def _without_variables(problem: Problem, started: float) -> Solution:
    """No option exists at all: empty and optimal when nothing is asked for, else infeasible."""
    asked = any(d.rate_rps > 0 for d in problem.demands) or any(m.min_replicas or m.spread for m in problem.models)
    status = PlanStatus.INFEASIBLE if asked else PlanStatus.OPTIMAL
    stats = SolverStats(status=status, message="no configuration can serve any model", objective=None if asked else 0.0,
                        bound=None if asked else 0.0, gap=None if asked else 0.0, time_s=time.perf_counter() - started,
                        variables=0, integer_variables=0, constraints=0)
    return Solution({}, {}, {}, stats)


@dataclass
class Formulation:
    """The MILP as arrays, with the column of each variable."""

    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integrality: np.ndarray
    rows: _Rows
    n_col: range
    x_index: dict[tuple[int, str], int]
    y_index: dict[tuple[str, str], int]
    scale_col: int | None
    moved_constant: float

    def constraints(self) -> list[LinearConstraint]:
        return [self.rows.constraint(len(self.cost))] if self.rows.count else []


def formulate(problem: Problem, *, max_scale: bool = False) -> Formulation:
    """The MILP of :func:`solve`; with ``max_scale``, instead the LP relaxation of (1)–(5) that
    maximises the factor s by which every demand can grow: (1) becomes Σ_o x[o,b] = s."""
    options = problem.options
    demand = {(d.model, d.role, d.bucket): d.rate_rps for d in problem.demands}
    columns = 0

    def new_columns(count: int) -> range:
        nonlocal columns
        block = range(columns, columns + count)
        columns += count
        return block

    n_col = new_columns(len(options))
    x_index: dict[tuple[int, str], int] = {}
    for i, option in enumerate(options):
        for bucket in option.capacity:
            if demand.get((option.model, option.role, bucket), 0.0) > 0:
                x_index[(i, bucket)] = new_columns(1)[0]
    y_index: dict[tuple[str, str], int] = {}
    for pool in problem.pools:
        for layout in pool.layouts:
            y_index[(pool.name, layout.key)] = new_columns(1)[0]
    churn = problem.churn_weight > 0 and not max_scale
    scale_col = new_columns(1)[0] if max_scale else None
    d_col = new_columns(len(options)) if churn else range(0)

    cost = np.zeros(columns)
    lower = np.zeros(columns)
    upper = np.full(columns, np.inf)
    integrality = np.zeros(columns)
    pools = {p.name: p for p in problem.pools}
    for i, option in enumerate(options):
        pool = pools[option.pool]
        col = n_col[i]
        integrality[col] = 1
        if option.whole:
            cost[col] = pool.price_per_hour * option.tp
            upper[col] = pool.gpu_limit // option.tp
        else:
            cost[col] = SPLIT_TIE_BREAK * pool.price_per_hour * option.gpus
            upper[col] = pool.gpu_limit * max(layout.counts.get(option.profile or "", 0) for layout in pool.layouts)
    for (i, _bucket), col in x_index.items():
        upper[col] = np.inf if max_scale else 1.0
    for (pool_name, _key), col in y_index.items():
        integrality[col] = 1
        cost[col] = pools[pool_name].price_per_hour
        upper[col] = pools[pool_name].gpu_limit
    moved_constant = 0.0
    if churn:
        keys = {o.key for o in options}
        moved_constant = float(sum(n for key, n in problem.current.items() if key not in keys))
        for i in range(len(options)):
            cost[d_col[i]] = problem.churn_weight

    rows = _Rows()
    by_demand: dict[tuple[str, object, str], list[int]] = defaultdict(list)
    for (i, bucket), col in x_index.items():
        by_demand[(options[i].model, options[i].role, bucket)].append(col)
    # (1) demand
    for key, rate in demand.items():
        if rate > 0 and scale_col is None:
            rows.add([(col, 1.0) for col in by_demand.get(key, [])], 1.0, 1.0)
        elif rate > 0:
            rows.add([*((col, 1.0) for col in by_demand.get(key, [])), (scale_col, -1.0)], 0.0, 0.0)
    # (2) capacity
    per_option: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (i, bucket), col in x_index.items():
        option = options[i]
        per_option[i].append((col, demand[(option.model, option.role, bucket)] * (1 + problem.headroom) / option.capacity[bucket]))
    for i, terms in per_option.items():
        rows.add([*terms, (n_col[i], -1.0)], -np.inf, 0.0)
    # (3) instances, (4) inventory, (5) TP groups
    for pool in problem.pools:
        on_pool = [i for i, o in enumerate(options) if o.pool == pool.name]
        kinds = {options[i].profile for i in on_pool if not options[i].whole}
        for kind in sorted(k for k in kinds if k is not None):
            terms = [(n_col[i], 1.0) for i in on_pool if options[i].profile == kind]
            terms += [(y_index[(pool.name, layout.key)], -float(layout.counts.get(kind, 0)))
                      for layout in pool.layouts if layout.counts.get(kind, 0)]
            rows.add(terms, -np.inf, 0.0)
        terms = [(n_col[i], float(options[i].tp)) for i in on_pool if options[i].whole]
        terms += [(y_index[(pool.name, layout.key)], 1.0) for layout in pool.layouts]
        if terms:
            rows.add(terms, -np.inf, float(pool.gpu_limit))
        for tp in sorted({options[i].tp for i in on_pool if options[i].whole}):
            if pool.gpus_per_node % tp:
                rows.add([(n_col[i], 1.0) for i in on_pool if options[i].whole and options[i].tp == tp],
                         -np.inf, float(pool.nodes * (pool.gpus_per_node // tp)))
    # (6) minimum, (7) spread
    for rules in problem.models if not max_scale else ():
        for role in rules.roles:
            mine = [i for i, o in enumerate(options) if o.model == rules.name and o.role is role]
            need = max(rules.min_replicas, 2 if rules.spread else 0)
            if need:
                rows.add([(n_col[i], 1.0) for i in mine], float(need), np.inf)
            if rules.spread:
                for pool in problem.pools:
                    if pool.nodes == 1:
                        rows.add([(n_col[i], 1.0) for i in mine if options[i].pool != pool.name], 1.0, np.inf)
    # (8) churn
    if churn:
        for i, option in enumerate(options):
            before = float(problem.current.get(option.key, 0))
            rows.add([(d_col[i], 1.0), (n_col[i], -1.0)], -before, np.inf)
            rows.add([(d_col[i], 1.0), (n_col[i], 1.0)], before, np.inf)

    if max_scale:
        assert scale_col is not None
        cost[:] = 0.0
        cost[scale_col] = -1.0
        upper[scale_col] = MAX_SCALE
        integrality[:] = 0
    return Formulation(cost, lower, upper, integrality, rows, n_col, x_index, y_index, scale_col, moved_constant)
