"""Model-by-model decomposition of the placement MILP: a stronger bound and a better plan than rounding.

Only the pool rows — (3) instances, (4) inventory, (5) TP groups — tie
models together. Pricing them with the LP relaxation's duals λ ≥ 0
(Lagrangian relaxation) leaves one small MILP per (model, role): its own
options, bucket shares, minimum and spread rows, each GPU charged at its
pool's shadow price. For any λ ≥ 0,

    L(λ) = Σ_blocks min_block (c + λA)·v  +  Σ_free min(0, (c + λA)_j)·u_j  −  λ·b

is a lower bound on the MILP (free columns are the split layouts, in no
block). With the LP's duals L(λ) is at least the LP bound, and it is higher
by what integrality costs each model on its own: the part of the gap the LP
bound cannot see. The blocks are solved by HiGHS with a per-block time
limit, and a block stopped early still gives a valid bound (its dual bound);
options another option of the block dominates are folded into it first, which
can only lower a block's minimum, so the bound stays valid.

The same blocks improve a plan: each model's plan at the shadow prices
(:func:`priced_plans`), which alone ignores the other models, is mixed with
the plans in hand by a small MILP that picks one plan per model so that
together they fit every pool (:func:`combine`: the restricted master problem
of the Dantzig–Wolfe decomposition, in integers). The duals of its LP
relaxation price the pools for the next round (:func:`master_prices`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, linprog, milp
from scipy.sparse import coo_array, csr_array, hstack, vstack

from hetsched.optimizer.build import Problem
from hetsched.optimizer.formulation import Formulation
from hetsched.optimizer.rounding import complete

BLOCK_SHARE_OF_GAP = 0.5
"""Share of the gap target the blocks may leave open between them, in HiGHS's gap per block."""
PLAN_GAP_FACTOR = 2.0
"""How much looser a block's priced plan is solved than its bound: plans need not be optimal, only many.

At 2 rather than 4 the benchmark fleets' 10 s plans come closer to their bounds (idle machine, three runs each):
2,504 GPUs 1.25–1.30 % against 1.53–1.62 %, 5,000 GPUs 1.86–1.96 % against 1.90–2.57 %, 10,000 GPUs
2.08–2.57 % against 2.32–2.44 %; at 1 the blocks take too long (10,000 GPUs: 2.34–2.56 %)."""
MIN_BLOCK_TIME_S = 0.02
"""Shortest time limit a block is given; below it HiGHS rarely gets past presolve."""
PASS_TIGHTENING = 0.1
"""How much tighter each further pass of the Lagrangian bound solves the blocks."""
MAX_BLOCK_GAP = 0.5
"""Loosest relative gap a block is solved to (a block worth little next to the whole)."""
WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Threads solving blocks at once (HiGHS releases the GIL while it solves)."""
CANDIDATES = 6
"""Options a block's plan may use besides those the relaxation or the plan in hand give it: its least
reduced costs."""
COMBINE_SHARE_OF_GAP = 0.1
"""The relative gap :func:`combine` solves to, as a share of the gap target."""
COMBINE_SHARE_OF_TIME = 0.3
"""Share of a round's time left that :func:`combine` may take."""
MASTER_STEP = 0.5
"""How far the next prices move from the relaxation's duals to the master's (1: all the way)."""
BLOCK_PRESOLVE = True
"""Whether HiGHS presolves a block. Within the 10 s solve it pays: on the 10,000-GPU benchmark fleet the
Lagrangian bound reaches $9,290–9,294/h with it and $9,253 without (gap 2.5 % against 2.9 %, two runs each on
an idle machine; the same at 1,000 and 5,000 GPUs); the exact bound of the 1,000-GPU fleet, solved to the end,
takes a third more CPU with it (23 s against 15)."""


@dataclass(frozen=True)
class Relaxation:
    """The LP relaxation with its duals."""

    values: np.ndarray
    bound: float
    row_prices: np.ndarray
    """λ per row, signed so that c + Aᵀλ prices the columns (≥ 0 on ≤ rows, ≤ 0 on ≥ rows)."""


@dataclass(frozen=True)
class Block:
    """The columns and rows of one (model, role)."""

    columns: np.ndarray
    rows: np.ndarray


@dataclass(frozen=True)
class Pricing:
    """The columns priced by the relaxation's duals on the coupling rows."""

    blocks: list[Block]
    coupling: np.ndarray
    priced: np.ndarray
    constant: float
    """−λ·b over the coupling rows."""
    free_columns: np.ndarray
    """The columns in no block: the split layouts."""
    free_part: float
    """Σ min(0, priced)·upper over the free columns."""
    lp_value: list[float]
    """Each block's share of the relaxation's value at the priced costs: its own LP bound."""
    option_reduced: np.ndarray
    """Per option: the least that a replica of it adds to its block's LP bound (for fixing options at zero)."""


def relax(form: Formulation) -> Relaxation | None:
    """The LP relaxation of ``form`` with its duals; None when it is infeasible."""
    bounds = np.column_stack([form.lower, form.upper])
    if not form.rows.count:
        result = linprog(form.cost, bounds=bounds, method="highs")
        return Relaxation(np.asarray(result.x), float(result.fun), np.zeros(0)) if result.status == 0 else None
    (constraint,) = form.constraints()
    solved = _lp_with_duals(form.cost, csr_array(constraint.A), constraint.lb, constraint.ub, bounds)
    return None if solved is None else Relaxation(*solved)


def _lp_with_duals(cost: np.ndarray, matrix: csr_array, lower: np.ndarray, upper: np.ndarray,
                   bounds: np.ndarray) -> tuple[np.ndarray, float, np.ndarray] | None:
    """min cost·x over lower ≤ matrix·x ≤ upper and the column bounds, by HiGHS: x, its value and
    the row duals signed as :attr:`Relaxation.row_prices`; None when infeasible."""
    equal = np.isfinite(lower) & (lower == upper)
    at_most = np.isfinite(upper) & ~equal
    at_least = np.isfinite(lower) & ~equal
    result = linprog(cost, A_ub=vstack([matrix[at_most], -matrix[at_least]]),
                     b_ub=np.concatenate([upper[at_most], -lower[at_least]]),
                     A_eq=matrix[equal], b_eq=lower[equal], bounds=bounds, method="highs")
    if result.status != 0:
        return None
    prices = np.zeros(len(lower))
    inequality = -np.asarray(result.ineqlin.marginals)
    count = int(at_most.sum())
    prices[at_most] = np.maximum(inequality[:count], 0.0)
    prices[at_least] = -np.maximum(inequality[count:], 0.0)
    prices[equal] = -np.asarray(result.eqlin.marginals)
    return np.asarray(result.x), float(result.fun), prices


def blocks(problem: Problem, form: Formulation) -> tuple[list[Block], np.ndarray]:
    """One block per (model, role), and the mask of rows that couple blocks (or touch split layouts)."""
    group_of = np.full(len(form.cost), -1)
    groups: dict[tuple[str, object], int] = {}
    for i, option in enumerate(problem.options):
        group = groups.setdefault((option.model, option.role), len(groups))
        group_of[form.n_col[i]] = group
        if form.d_col:
            group_of[form.d_col[i]] = group
    for (i, _bucket), col in form.x_index.items():
        group_of[col] = group_of[form.n_col[i]]
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    row_groups = group_of[matrix.indices]
    starts = matrix.indptr[:-1]
    nonempty = np.diff(matrix.indptr) > 0
    lowest = np.full(matrix.shape[0], -1)
    highest = np.full(matrix.shape[0], -1)
    lowest[nonempty] = np.minimum.reduceat(row_groups, starts[nonempty])
    highest[nonempty] = np.maximum.reduceat(row_groups, starts[nonempty])
    own = nonempty & (lowest == highest) & (lowest >= 0)
    columns_of = [np.flatnonzero(group_of == g) for g in range(len(groups))]
    rows_of = [np.flatnonzero(own & (lowest == g)) for g in range(len(groups))]
    return [Block(c, r) for c, r in zip(columns_of, rows_of)], nonempty & ~own


def price(problem: Problem, form: Formulation, relaxation: Relaxation) -> Pricing:
    (constraint,) = form.constraints()
    parts, coupling = blocks(problem, form)
    prices = np.where(coupling, relaxation.row_prices, 0.0)
    priced = form.cost + csr_array(constraint.A).T @ prices
    rhs = np.where(prices > 0, constraint.ub, np.where(prices < 0, constraint.lb, 0.0))
    in_block = np.zeros(len(form.cost), dtype=bool)
    for part in parts:
        in_block[part.columns] = True
    free = np.flatnonzero(~in_block)
    return Pricing(parts, coupling, priced, -float(prices @ rhs), free,
                   float(np.minimum(priced[free], 0.0) @ form.upper[free]) if free.size else 0.0,
                   [float(priced[p.columns] @ relaxation.values[p.columns]) for p in parts],
                   _option_reduced_costs(form, csr_array(constraint.A), relaxation))


def _option_reduced_costs(form: Formulation, matrix: csr_array, relaxation: Relaxation) -> np.ndarray:
    """Reduced cost of each option's replicas under the dual that charges its capacity row (2) the least
    the LP's bucket prices allow: c + Aᵀλ with that row's λ lowered to max_b(π_b / a_ob).

    The LP's own duals are degenerate on (2) (an unused option's row holds at 0 = 0), so its reduced
    costs are often 0 for options no cheap plan uses; this dual is just as valid and says more."""
    full = form.cost + matrix.T @ relaxation.row_prices
    by_column = matrix.tocsc()
    lowest = np.zeros(len(form.n_col))
    for (i, _bucket), col in form.x_index.items():
        cap_row = form.capacity_row[i]
        rows = by_column.indices[by_column.indptr[col]:by_column.indptr[col + 1]]
        data = by_column.data[by_column.indptr[col]:by_column.indptr[col + 1]]
        load = float(data[rows == cap_row][0])
        bucket_price = -float(sum(relaxation.row_prices[r] * a for r, a in zip(rows, data) if r != cap_row))
        lowest[i] = max(lowest[i], bucket_price / load)
    charged = np.array([relaxation.row_prices[form.capacity_row[i]] if i in form.capacity_row else 0.0
                        for i in range(len(form.n_col))])
    reduced: np.ndarray = full[list(form.n_col)] + charged - lowest  # scipy's arrays come untyped
    return reduced


class BlockPlans:
    """Candidate plans per block, as values over the block's columns, each kept once: the columns
    of the restricted master problem :func:`combine` solves."""

    def __init__(self, pricing: Pricing, points: list[np.ndarray]) -> None:
        self.pricing = pricing
        self.plans: list[list[np.ndarray]] = [[] for _ in pricing.blocks]
        for values in points:
            self.add_point(values)

    def add_point(self, values: np.ndarray) -> None:
        """Keep each block's part of ``values``, a point of the formulation."""
        for g, part in enumerate(self.pricing.blocks):
            self.add(g, values[part.columns])

    def add(self, g: int, plan: np.ndarray) -> bool:
        """Keep ``plan`` for block g; False when it is kept already."""
        if any(np.array_equal(plan, kept) for kept in self.plans[g]):
            return False
        self.plans[g].append(plan)
        return True

    @property
    def count(self) -> int:
        return sum(len(plans) for plans in self.plans)

    def owners(self) -> list[tuple[int, np.ndarray]]:
        return [(g, plan) for g, plans in enumerate(self.plans) for plan in plans]


def priced_plans(problem: Problem, form: Formulation, relaxation: Relaxation, pricing: Pricing,
                 incumbent: np.ndarray, *, prices: np.ndarray | None = None,
                 time_limit: float) -> dict[int, np.ndarray]:
    """Per block, its cheapest plan with every pool row at its price in ``prices`` (by default the
    relaxation's duals: the Lagrangian block problem), as values over the block's columns; the
    blocks ``incumbent`` pays the most over their LP bound go first, while ``time_limit`` lasts.

    A block may use the options the relaxation or ``incumbent`` use, and at the relaxation's duals
    its ``CANDIDATES`` options of least reduced cost (on any pool, and on pools the duals do not
    price), a small problem HiGHS solves fast for every block; at other prices, which no reduced
    costs describe, every option no other dominates (:func:`_dominators`).

    Each plan is what the block would do if every pool cost its price; together they may not fit
    the pools, which is what :func:`combine` settles."""
    deadline = time.perf_counter() + time_limit
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    costs = pricing.priced if prices is None else form.cost + matrix.T @ np.where(pricing.coupling, prices, 0.0)
    option_of = _option_of_column(form)
    replicas = np.asarray(form.n_col)
    offered = (relaxation.values[replicas] > 1e-7) | (incumbent[replicas] > 0.5)
    on_scarce = _on_scarce_pools(form, relaxation, pricing)
    loss = _losses(pricing, incumbent)
    order = [g for g in sorted(range(len(pricing.blocks)), key=lambda g: -loss[g])
             if loss[g] > _block_tolerance(problem, relaxation, pricing)]
    plans: dict[int, np.ndarray] = {}

    def plan_block(g: int, time_limit: float) -> None:
        part = pricing.blocks[g]
        if prices is not None:
            options = np.unique(option_of[part.columns])
            options = options[options >= 0]
            keep = options[(_dominators(problem, form, costs, options) < 0) | offered[options]]
            columns = part.columns[np.isin(option_of[part.columns], keep)]
        else:
            columns = _candidate_columns(form, pricing, part, option_of, on_scarce, offered)
        result = _solve_block(form, matrix, constraint, part, columns, costs, form.upper[columns],
                              time_limit=time_limit,
                              gap=min(MAX_BLOCK_GAP, PLAN_GAP_FACTOR * _block_gap(problem, relaxation, pricing, g)))
        if result.x is not None:
            plan = np.zeros(part.columns.size)
            plan[np.isin(part.columns, columns)] = _integral(result.x, form.integrality[columns])
            plans[g] = plan

    _for_each_block(order, deadline, plan_block)
    return plans


def _for_each_block(order: list[int], deadline: float, solve_block: Callable[[int, float], None]) -> None:
    """``solve_block(g, time_limit)`` for the blocks in ``order`` on ``WORKERS`` threads, none started
    after ``deadline``; each gets its share of the time left (split over the blocks not yet started,
    across the workers)."""
    pending = [len(order)]

    def run(g: int) -> None:
        left = deadline - time.perf_counter()
        pending[0] -= 1
        if left > 0:
            solve_block(g, max(MIN_BLOCK_TIME_S, left * WORKERS / (pending[0] + 1)))

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(run, order))


def _solve_block(form: Formulation, matrix: csr_array, constraint: LinearConstraint, part: Block,
                 columns: np.ndarray, costs: np.ndarray, upper: np.ndarray, *, time_limit: float,
                 gap: float) -> OptimizeResult:
    """HiGHS on one block's rows, restricted to ``columns`` with their ``upper`` bounds, at ``costs``."""
    return milp(costs[columns],
                constraints=[LinearConstraint(matrix[part.rows][:, columns], constraint.lb[part.rows],
                                              constraint.ub[part.rows])] if part.rows.size else [],
                integrality=form.integrality[columns], bounds=Bounds(form.lower[columns], upper),
                options={"time_limit": time_limit, "mip_rel_gap": gap, "presolve": BLOCK_PRESOLVE})


@dataclass(frozen=True)
class _Master:
    """The restricted master problem over ``candidates``: one column per (block, plan), then the free
    columns; rows: one plan per block, then the pool rows."""

    owners: list[tuple[int, np.ndarray]]
    cost: np.ndarray
    rows: csr_array
    lower: np.ndarray
    upper: np.ndarray
    column_upper: np.ndarray
    integrality: np.ndarray
    coupling: np.ndarray


def _master(form: Formulation, candidates: BlockPlans) -> _Master:
    pricing = candidates.pricing
    (constraint,) = form.constraints()
    coupling = np.flatnonzero(pricing.coupling)
    pool_rows = csr_array(constraint.A)[coupling]
    owners = candidates.owners()
    free = pricing.free_columns
    chosen = len(owners)
    usage = np.column_stack([pool_rows[:, pricing.blocks[g].columns] @ plan for g, plan in owners])
    one_each = coo_array((np.ones(chosen), ([g for g, _ in owners], np.arange(chosen))),
                         shape=(len(pricing.blocks), chosen + free.size))
    ones = np.ones(len(pricing.blocks))
    return _Master(owners,
                   np.concatenate([[form.cost[pricing.blocks[g].columns] @ plan for g, plan in owners],
                                   form.cost[free]]),
                   vstack([one_each, hstack([csr_array(usage), pool_rows[:, free]])]).tocsr(),
                   np.concatenate([ones, constraint.lb[coupling]]), np.concatenate([ones, constraint.ub[coupling]]),
                   np.concatenate([np.ones(chosen), form.upper[free]]),
                   np.concatenate([np.ones(chosen), form.integrality[free]]), coupling)


def combine(problem: Problem, form: Formulation, candidates: BlockPlans, *, time_limit: float) -> np.ndarray | None:
    """The cheapest plan that takes one of its ``candidates`` for every block, with the split layouts
    chosen anew: a small MILP (one binary per block and candidate, plus the layouts) over the pool
    rows only. A plan whose parts are all candidates is one of its solutions; None when HiGHS finds
    none within ``time_limit``."""
    master = _master(form, candidates)
    result = milp(master.cost, constraints=[LinearConstraint(master.rows, master.lower, master.upper)],
                  integrality=master.integrality, bounds=Bounds(0.0, master.column_upper),
                  options={"time_limit": max(MIN_BLOCK_TIME_S, time_limit),
                           "mip_rel_gap": COMBINE_SHARE_OF_GAP * problem.mip_gap})
    if result.x is None:
        return None
    pricing = candidates.pricing
    values = np.zeros(len(form.cost))
    chosen = len(master.owners)
    for j, (g, plan) in enumerate(master.owners):
        if result.x[j] > 0.5:
            values[pricing.blocks[g].columns] = plan
    values[pricing.free_columns] = _integral(result.x[chosen:], form.integrality[pricing.free_columns])
    return values


def master_prices(form: Formulation, candidates: BlockPlans, relaxation: Relaxation) -> np.ndarray | None:
    """Prices for the pool rows at which the blocks should be planned next: the duals of the LP
    relaxation of :func:`combine`'s problem, halfway to the relaxation's duals (a smoothed column
    generation step: the master's duals alone swing far while it has few candidates); None when
    that LP is infeasible."""
    master = _master(form, candidates)
    solved = _lp_with_duals(master.cost, master.rows, master.lower, master.upper,
                            np.column_stack([np.zeros(master.cost.size), master.column_upper]))
    if solved is None:
        return None
    duals = solved[2]
    prices = np.zeros(len(relaxation.row_prices))
    prices[master.coupling] = duals[len(candidates.plans):]
    return MASTER_STEP * prices + (1 - MASTER_STEP) * np.where(candidates.pricing.coupling, relaxation.row_prices, 0.0)


def mix_priced_plans(problem: Problem, form: Formulation, relaxation: Relaxation, candidates: BlockPlans,
                     incumbent: np.ndarray, *, time_limit: float) -> np.ndarray | None:
    """A plan cheaper than ``incumbent`` from rounds of column generation while ``time_limit`` lasts
    and they find new plans: every block planned at the pools' prices (the relaxation's duals first,
    then :func:`master_prices`) and kept in ``candidates``, then :func:`cheapest_mix` of them; None
    when no round finds one."""
    deadline = time.perf_counter() + time_limit
    current: np.ndarray = incumbent
    best: np.ndarray | None = None
    prices = None
    last_round = 0.0
    while (left := deadline - time.perf_counter()) > last_round / 2:  # a round cut short is time lost
        started = time.perf_counter()
        plans = priced_plans(problem, form, relaxation, candidates.pricing, current, prices=prices, time_limit=left)
        if not [g for g, plan in plans.items() if candidates.add(g, plan)]:
            break
        mixed = cheapest_mix(problem, form, candidates, current,
                             time_limit=max(deadline - time.perf_counter(), 0.0) * COMBINE_SHARE_OF_TIME)
        if mixed is not None:
            current = best = mixed
        prices = master_prices(form, candidates, relaxation)
        if prices is None:
            break
        last_round = time.perf_counter() - started
    return best


def cheapest_mix(problem: Problem, form: Formulation, candidates: BlockPlans, incumbent: np.ndarray, *,
                 time_limit: float) -> np.ndarray | None:
    """:func:`combine` made a point of the formulation (:func:`~hetsched.optimizer.rounding.complete`)
    when it is cheaper than ``incumbent``, which joins the candidates; else None."""
    mixed = combine(problem, form, candidates, time_limit=time_limit)
    mixed = None if mixed is None else complete(problem, form, mixed)
    if mixed is None or form.cost @ mixed >= form.cost @ incumbent - 1e-9:
        return None
    candidates.add_point(mixed)
    return mixed


def _candidate_columns(form: Formulation, pricing: Pricing, part: Block, option_of: np.ndarray,
                       on_scarce: np.ndarray, offered: np.ndarray) -> np.ndarray:
    """The block's columns of its ``offered`` options and of its ``CANDIDATES`` options of least reduced
    cost, on any pool and on pools the duals do not price."""
    options = np.unique(option_of[part.columns])
    spare = options[~on_scarce[options]]
    keep = np.union1d(
        np.union1d(options[np.argsort(pricing.option_reduced[options], kind="stable")[:CANDIDATES]],
                   spare[np.argsort(pricing.option_reduced[spare], kind="stable")[:CANDIDATES]]),
        options[offered[options]])
    return part.columns[np.isin(option_of[part.columns], keep)]


def _on_scarce_pools(form: Formulation, relaxation: Relaxation, pricing: Pricing) -> np.ndarray:
    """Per option: whether a pool row the duals price holds its replicas."""
    (constraint,) = form.constraints()
    by_column = csr_array(constraint.A).tocsc()
    scarce_rows = pricing.coupling & (relaxation.row_prices != 0)
    scarce: np.ndarray = np.diff((by_column[:, np.asarray(form.n_col)][scarce_rows] != 0).tocsc().indptr) > 0
    return scarce


def _losses(pricing: Pricing, incumbent: np.ndarray) -> list[float]:
    """What ``incumbent`` pays for each block over the block's LP bound, at the relaxation's prices."""
    return [float(pricing.priced[p.columns] @ incumbent[p.columns]) - pricing.lp_value[g]
            for g, p in enumerate(pricing.blocks)]


def _integral(values: np.ndarray, integrality: np.ndarray) -> np.ndarray:
    """HiGHS's values with its integer columns rounded to the whole numbers they stand for."""
    return np.where(integrality == 1, np.round(values), values)


def _option_of_column(form: Formulation) -> np.ndarray:
    """The option each replica, share and moved column belongs to (−1 for split layouts)."""
    option_of = np.full(len(form.cost), -1)
    option_of[list(form.n_col)] = np.arange(len(form.n_col))
    if form.d_col:
        option_of[list(form.d_col)] = np.arange(len(form.d_col))
    for (i, _bucket), col in form.x_index.items():
        option_of[col] = i
    return option_of


def lagrangian_bound(problem: Problem, form: Formulation, relaxation: Relaxation, pricing: Pricing, *,
                     incumbent: np.ndarray | None, time_limit: float,
                     candidates: BlockPlans | None = None) -> float:
    """L(λ) at the relaxation's duals, each block bounded by HiGHS within its share of ``time_limit``;
    the plans HiGHS finds on the way that keep every option's replica bound join ``candidates``.

    A block's options whose reduced cost exceeds what the incumbent pays over the block's LP bound
    are fixed at zero first (no cheaper block plan uses them), which leaves HiGHS smaller problems.
    Time left after every block is bounded goes to passes at tighter gaps (``PASS_TIGHTENING``)."""
    started = time.perf_counter()
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    deadline = started + time_limit
    bounds = list(pricing.lp_value)
    loss = [np.inf] * len(pricing.blocks) if incumbent is None else _losses(pricing, incumbent)
    uppers = [lp + extra for lp, extra in zip(pricing.lp_value, loss)]
    if incumbent is None:
        order = sorted(range(len(pricing.blocks)), key=lambda g: -pricing.lp_value[g])
    else:  # only a block the incumbent pays more for than its LP bound can raise the bound
        order = [g for g in sorted(range(len(pricing.blocks)), key=lambda g: -loss[g]) if loss[g] > 1e-9]
    tightening = 1.0
    found: dict[int, np.ndarray] = {}
    option_of = _option_of_column(form)
    spread = {rules.name for rules in problem.models if rules.spread}

    def bound_block(g: int, time_limit: float) -> None:
        part = pricing.blocks[g]
        columns = part.columns
        upper = form.upper[columns].copy()
        if incumbent is not None:
            useless = np.flatnonzero((pricing.option_reduced > loss[g] + 1e-9)
                                     & (relaxation.values[list(form.n_col)] < 1e-9))
            upper[np.isin(columns, np.asarray(form.n_col)[useless])] = 0.0
        options = np.unique(option_of[columns])
        if not form.d_col and problem.options[options[0]].model not in spread:
            _fold_dominated(problem, form, pricing, part, options, upper)
        result = _solve_block(form, matrix, constraint, part, columns, pricing.priced, upper, time_limit=time_limit,
                              gap=tightening * _block_gap(problem, relaxation, pricing, g))
        if result.x is not None:
            uppers[g] = min(uppers[g], float(result.fun))
            plan = _integral(result.x, form.integrality[columns])
            if (plan <= form.upper[columns] + 1e-9).all():
                found[g] = plan
        dual = getattr(result, "mip_dual_bound", None)
        if dual is not None and np.isfinite(dual):
            bounds[g] = min(max(bounds[g], float(dual)), uppers[g])

    while order and time.perf_counter() < deadline:
        _for_each_block(order, deadline, bound_block)
        tightening *= PASS_TIGHTENING  # again where a block's bound is short of its best plan
        order = [g for g in order
                 if uppers[g] - bounds[g] > tightening * _block_tolerance(problem, relaxation, pricing)]
    if candidates is not None:
        for g, plan in found.items():
            candidates.add(g, plan)
    return max(relaxation.bound, pricing.constant + pricing.free_part + sum(bounds))


def _fold_dominated(problem: Problem, form: Formulation, pricing: Pricing, part: Block, options: np.ndarray,
                    upper: np.ndarray) -> None:
    """Close every option of the block that another dominates (:func:`_dominators`) and add its replica
    bound to an undominated one that dominates it; ``upper`` holds the bounds of ``part.columns`` and
    is changed in place.

    Any plan of the block maps onto one no dearer that uses only undominated options, so the
    block's minimum can only fall: the bound stays valid, and HiGHS has fewer options to branch on.
    (Without spread rules and churn, which tell pools and options apart.)"""
    at = np.searchsorted(part.columns, np.asarray(form.n_col)[options])
    open_ = upper[at] > 0
    options, at = options[open_], at[open_]
    into = _dominators(problem, form, pricing.priced, options)
    for j in np.flatnonzero(into >= 0):
        upper[at[into[j]]] += upper[at[j]]
        upper[at[j]] = 0.0


def _dominators(problem: Problem, form: Formulation, costs: np.ndarray, options: np.ndarray) -> np.ndarray:
    """Per option of one block, the position in ``options`` of an undominated option that dominates
    it — no dearer at ``costs`` and at least its capacity for every bucket the block serves, ties
    going to the first — or −1 when none does."""
    if options.size < 2:
        return np.full(options.size, -1)
    buckets = sorted({b for i in options for b in problem.options[i].capacity if (i, b) in form.x_index})
    capacity = np.array([[problem.options[i].capacity.get(b, 0.0) if (i, b) in form.x_index else 0.0
                          for b in buckets] for i in options])
    cost = costs[np.asarray(form.n_col)[options]]
    no_less = (capacity[:, None, :] >= capacity[None, :, :]).all(axis=2)
    better = (cost[:, None] < cost[None, :]) | (capacity[:, None, :] > capacity[None, :, :]).any(axis=2)
    first = np.arange(options.size)[:, None] < np.arange(options.size)[None, :]
    dominates = (cost[:, None] <= cost[None, :]) & no_less & (better | first)
    np.fill_diagonal(dominates, False)
    undominated = ~dominates.any(axis=0)
    return np.where(undominated, -1, np.argmax(dominates & undominated[:, None], axis=0))


def _block_tolerance(problem: Problem, relaxation: Relaxation, pricing: Pricing) -> float:
    """Each block's share of the gap target, in dollars per hour."""
    return BLOCK_SHARE_OF_GAP * problem.mip_gap * max(abs(relaxation.bound), 1e-9) / max(len(pricing.blocks), 1)


def _block_gap(problem: Problem, relaxation: Relaxation, pricing: Pricing, g: int) -> float:
    """The relative gap that leaves block g its share of the gap target."""
    return min(MAX_BLOCK_GAP, _block_tolerance(problem, relaxation, pricing) / max(pricing.lp_value[g], 1e-9))
