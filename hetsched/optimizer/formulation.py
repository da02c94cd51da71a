"""The placement MILP as arrays for HiGHS: columns, bounds and sparse rows.

It builds the model stated in :func:`hetsched.optimizer.solve.solve`; the
row comments follow that docstring's numbering.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import LinearConstraint
from scipy.sparse import coo_array

from hetsched.optimizer.build import Problem
from hetsched.sim.roles import Role

SPLIT_TIE_BREAK = 1e-4
"""Cost per replica on a split GPU, as a share of its GPU-fraction price: idle instances stay idle."""

MAX_SCALE = 1e6
"""Cap on the demand growth factor the diagnostic LP looks for."""


class Rows:
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


@dataclass
class Formulation:
    """The MILP as arrays, with the column of each variable."""

    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integrality: np.ndarray
    rows: Rows
    n_col: range
    x_index: dict[tuple[int, str], int]
    y_index: dict[tuple[str, str], int]
    scale_col: int | None
    d_col: range
    moved_constant: float
    capacity_row: dict[int, int]
    """Option index → its row (2), which ties its replicas to the load on it."""

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
            upper[col] = max(pool.gpu_limit / layout.gpus * layout.counts.get(option.profile or "", 0)
                             for layout in pool.layouts)
    for (i, _bucket), col in x_index.items():
        upper[col] = np.inf if max_scale else 1.0
    layout_of = {(pool.name, layout.key): layout for pool in problem.pools for layout in pool.layouts}
    for key, col in y_index.items():
        integrality[col] = 1
        cost[col] = pools[key[0]].price_per_hour * layout_of[key].gpus
        upper[col] = pools[key[0]].gpu_limit / layout_of[key].gpus
    moved_constant = 0.0
    if churn:
        keys = {o.key for o in options}
        moved_constant = float(sum(n for key, n in problem.current.items() if key not in keys))
        for i in range(len(options)):
            cost[d_col[i]] = problem.churn_weight

    rows = Rows()
    by_demand: dict[tuple[str, Role, str], list[int]] = defaultdict(list)
    for (i, bucket), col in x_index.items():
        by_demand[(options[i].model, options[i].role, bucket)].append(col)
    # (1) demand
    for demand_key, rate in demand.items():
        if rate <= 0:
            continue
        served = [(col, 1.0) for col in by_demand.get(demand_key, [])]
        if scale_col is None:
            rows.add(served, 1.0, 1.0)
        else:
            rows.add([*served, (scale_col, -1.0)], 0.0, 0.0)
    # (2) capacity
    per_option: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (i, bucket), col in x_index.items():
        option = options[i]
        per_option[i].append((col, demand[(option.model, option.role, bucket)] * (1 + problem.headroom) / option.capacity[bucket]))
    capacity_row: dict[int, int] = {}
    for i, terms in per_option.items():
        capacity_row[i] = rows.count
        rows.add([*terms, (n_col[i], -1.0)], -np.inf, 0.0)
    # (3) instances, (4) inventory, (5) TP groups
    by_pool: dict[str, list[int]] = defaultdict(list)
    by_model: dict[tuple[str, object], list[int]] = defaultdict(list)
    for i, option in enumerate(options):
        by_pool[option.pool].append(i)
        by_model[(option.model, option.role)].append(i)
    for pool in problem.pools:
        on_pool = by_pool[pool.name]
        kinds = {options[i].profile for i in on_pool if not options[i].whole}
        for kind in sorted(k for k in kinds if k is not None):
            terms = [(n_col[i], 1.0) for i in on_pool if options[i].profile == kind]
            terms += [(y_index[(pool.name, layout.key)], -float(layout.counts.get(kind, 0)))
                      for layout in pool.layouts if layout.counts.get(kind, 0)]
            rows.add(terms, -np.inf, 0.0)
        terms = [(n_col[i], float(options[i].tp)) for i in on_pool if options[i].whole]
        terms += [(y_index[(pool.name, layout.key)], layout.gpus) for layout in pool.layouts]
        if terms:
            rows.add(terms, -np.inf, float(pool.gpu_limit))
        for tp in sorted({options[i].tp for i in on_pool if options[i].whole}):
            if pool.gpus_per_node % tp:
                rows.add([(n_col[i], 1.0) for i in on_pool if options[i].whole and options[i].tp == tp],
                         -np.inf, float(pool.nodes * (pool.gpus_per_node // tp)))
    # (6) minimum, (7) spread
    for rules in problem.models if not max_scale else ():
        for role in rules.roles:
            mine = by_model[(rules.name, role)]
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

    # whole-number bounds on integer columns (HiGHS's presolve can misjudge fractional ones as infeasible)
    whole = integrality == 1
    upper[whole] = np.floor(upper[whole] + 1e-9)
    if max_scale:
        assert scale_col is not None
        cost[:] = 0.0
        cost[scale_col] = -1.0
        upper[scale_col] = MAX_SCALE
        integrality[:] = 0
    return Formulation(cost, lower, upper, integrality, rows, n_col, x_index, y_index, scale_col, d_col, moved_constant,
                       capacity_row)
