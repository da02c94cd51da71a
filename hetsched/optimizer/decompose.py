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
limit, and a block stopped early still gives a valid bound (its dual bound).

The same blocks improve a plan in two ways: each model planned again on its
own, within what the other models leave of every pool (:func:`improve_blocks`);
and each model's plan at the shadow prices (:func:`priced_plans`), which alone
ignores the other models, mixed with the plans in hand by a small MILP that
picks one plan per model so that together they fit every pool
(:func:`combine`: a restricted master problem of the Dantzig–Wolfe
decomposition, solved once, in integers).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_array, csr_array, hstack, vstack

from hetsched.optimizer.build import Problem
from hetsched.optimizer.formulation import Formulation

BLOCK_SHARE_OF_GAP = 0.5
"""Share of the gap target the blocks may leave open between them, in HiGHS's gap per block."""
MIN_BLOCK_TIME_S = 0.02
"""Shortest time limit a block is given; below it HiGHS rarely gets past presolve."""
MAX_BLOCK_GAP = 0.5
"""Loosest relative gap a block is solved to (a block worth little next to the whole)."""
WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Threads bounding blocks at once (HiGHS releases the GIL while it solves)."""
CANDIDATES = 6
"""Options a block's plan may use besides those the relaxation gives it: its least reduced costs."""
COMBINE_SHARE_OF_GAP = 0.1
"""The relative gap :func:`combine` solves to, as a share of the gap target."""


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
    matrix = csr_array(constraint.A)
    lower, upper = constraint.lb, constraint.ub
    equal = np.isfinite(lower) & (lower == upper)
    at_most = np.isfinite(upper) & ~equal
    at_least = np.isfinite(lower) & ~equal
    result = linprog(form.cost, A_ub=vstack([matrix[at_most], -matrix[at_least]]),
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
    return Relaxation(np.asarray(result.x), float(result.fun), prices)


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
    return full[list(form.n_col)] + charged - lowest


def improve_blocks(problem: Problem, form: Formulation, relaxation: Relaxation, pricing: Pricing,
                   incumbent: np.ndarray, *, time_limit: float) -> np.ndarray:
    """``incumbent`` (a point of ``form``) with its blocks planned again one at a time, in passes while
    ``time_limit`` lasts and a pass still finds something cheaper; in each pass the blocks the plan pays
    the most over their LP bound go first.

    Each block gets the cheapest plan among the options it uses, those its relaxation uses, and its
    ``CANDIDATES`` options of least reduced cost (on any pool, and on pools the duals do not price),
    within what the other blocks leave of every pool row; the new plan is kept only when it costs
    less. Split layouts stay as they are: the caller covers the instances again
    (:func:`hetsched.optimizer.rounding.complete`)."""
    started = time.perf_counter()
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    by_column = matrix.tocsc()
    values = incumbent.copy()
    used = matrix @ values
    option_of = _option_of_column(form)
    replicas = np.asarray(form.n_col)
    in_relaxation = relaxation.values[replicas] > 1e-7
    on_scarce = _on_scarce_pools(form, relaxation, pricing)
    improved = True
    while improved:
        improved = False
        loss = [float(pricing.priced[p.columns] @ values[p.columns]) - pricing.lp_value[g]
                for g, p in enumerate(pricing.blocks)]
        order = [g for g in sorted(range(len(pricing.blocks)), key=lambda g: -loss[g])
                 if loss[g] > _block_tolerance(problem, relaxation, pricing)]
        for done, g in enumerate(order):
            left = time_limit - (time.perf_counter() - started)
            if left <= 0:
                return values
            part = pricing.blocks[g]
            columns = _candidate_columns(form, pricing, part, option_of, on_scarce, in_relaxation | (values[replicas] > 0.5))
            movable = part.columns
            touching = np.unique(by_column[:, movable].indices)
            shared = touching[pricing.coupling[touching]]
            before = values[movable].copy()
            room = constraint.ub[shared] - used[shared] + matrix[shared][:, movable] @ before
            rows = np.concatenate([part.rows, shared])
            sub = matrix[rows][:, columns]
            active = np.diff(sub.indptr) > 0
            lower = np.concatenate([constraint.lb[part.rows], np.full(shared.size, -np.inf)])
            upper = np.concatenate([constraint.ub[part.rows], room])
            result = milp(form.cost[columns], constraints=[LinearConstraint(sub[active], lower[active], upper[active])],
                          integrality=form.integrality[columns], bounds=Bounds(form.lower[columns], form.upper[columns]),
                          options={"time_limit": max(MIN_BLOCK_TIME_S, left / (len(order) - done)),
                                   "mip_rel_gap": _block_gap(problem, relaxation, pricing, g)})
            if result.x is None or form.cost[columns] @ result.x >= form.cost[movable] @ before - 1e-9:
                continue
            values[movable] = 0.0
            values[columns] = _integral(result.x, form.integrality[columns])
            used[shared] += matrix[shared][:, movable] @ (values[movable] - before)
            improved = True
    return values


def priced_plans(problem: Problem, form: Formulation, relaxation: Relaxation, pricing: Pricing,
                 incumbent: np.ndarray, *, time_limit: float) -> dict[int, np.ndarray]:
    """Per block, its cheapest plan at the relaxation's prices (the Lagrangian block problem) on the
    options :func:`improve_blocks` would consider, as values over the block's columns; the blocks
    ``incumbent`` pays the most over their LP bound go first, while ``time_limit`` lasts.

    Each plan is what the block would do if every pool cost its shadow price; together they may
    not fit the pools, which is what :func:`combine` settles."""
    deadline = time.perf_counter() + time_limit
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    option_of = _option_of_column(form)
    replicas = np.asarray(form.n_col)
    offered = (relaxation.values[replicas] > 1e-7) | (incumbent[replicas] > 0.5)
    on_scarce = _on_scarce_pools(form, relaxation, pricing)
    loss = [float(pricing.priced[p.columns] @ incumbent[p.columns]) - pricing.lp_value[g]
            for g, p in enumerate(pricing.blocks)]
    order = [g for g in sorted(range(len(pricing.blocks)), key=lambda g: -loss[g])
             if loss[g] > _block_tolerance(problem, relaxation, pricing)]
    pending = [len(order)]
    plans: dict[int, np.ndarray] = {}

    def plan_block(g: int) -> None:
        part = pricing.blocks[g]
        left = deadline - time.perf_counter()
        pending[0] -= 1
        if left <= 0:
            return
        columns = _candidate_columns(form, pricing, part, option_of, on_scarce, offered)
        result = milp(pricing.priced[columns],
                      constraints=[LinearConstraint(matrix[part.rows][:, columns], constraint.lb[part.rows],
                                                    constraint.ub[part.rows])] if part.rows.size else [],
                      integrality=form.integrality[columns], bounds=Bounds(form.lower[columns], form.upper[columns]),
                      options={"time_limit": max(MIN_BLOCK_TIME_S, left * WORKERS / (pending[0] + 1)),
                               "mip_rel_gap": _block_gap(problem, relaxation, pricing, g)})
        if result.x is not None:
            plan = np.zeros(part.columns.size)
            plan[np.isin(part.columns, columns)] = _integral(result.x, form.integrality[columns])
            plans[g] = plan

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(plan_block, order))
    return plans


def combine(problem: Problem, form: Formulation, pricing: Pricing, incumbents: list[np.ndarray],
            plans: dict[int, np.ndarray], *, time_limit: float) -> np.ndarray | None:
    """The cheapest plan that takes, for every block, its part of one of ``incumbents`` or its plan in
    ``plans``, with the split layouts chosen anew: a small MILP (one binary per block and candidate,
    plus the layouts) over the pool rows only. Each incumbent is one of its solutions; None when
    HiGHS finds none within ``time_limit``."""
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    coupling = np.flatnonzero(pricing.coupling)
    pool_rows = matrix[coupling]
    owner: list[tuple[int, np.ndarray]] = []
    for g, part in enumerate(pricing.blocks):
        candidates = [values[part.columns] for values in incumbents] + ([plans[g]] if g in plans else [])
        for candidate in candidates:
            if not any(np.array_equal(candidate, kept) for h, kept in owner if h == g):
                owner.append((g, candidate))
    free = pricing.free_columns
    chosen = len(owner)
    usage = np.column_stack([pool_rows[:, pricing.blocks[g].columns] @ candidate for g, candidate in owner])
    one_each = coo_array((np.ones(chosen), ([g for g, _ in owner], np.arange(chosen))),
                         shape=(len(pricing.blocks), chosen + free.size))
    rows = vstack([one_each, hstack([csr_array(usage), pool_rows[:, free]])]).tocsr()
    ones = np.ones(len(pricing.blocks))
    result = milp(np.concatenate([[form.cost[pricing.blocks[g].columns] @ c for g, c in owner], form.cost[free]]),
                  constraints=[LinearConstraint(rows, np.concatenate([ones, constraint.lb[coupling]]),
                                                np.concatenate([ones, constraint.ub[coupling]]))],
                  integrality=np.concatenate([np.ones(chosen), form.integrality[free]]),
                  bounds=Bounds(np.concatenate([np.zeros(chosen), form.lower[free]]),
                                np.concatenate([np.ones(chosen), form.upper[free]])),
                  options={"time_limit": max(MIN_BLOCK_TIME_S, time_limit),
                           "mip_rel_gap": COMBINE_SHARE_OF_GAP * problem.mip_gap})
    if result.x is None:
        return None
    values = np.zeros(len(form.cost))
    for j, (g, candidate) in enumerate(owner):
        if result.x[j] > 0.5:
            values[pricing.blocks[g].columns] = candidate
    values[free] = _integral(result.x[chosen:], form.integrality[free])
    return values


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
    return np.diff((by_column[:, np.asarray(form.n_col)][scarce_rows] != 0).tocsc().indptr) > 0


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
                     incumbent: np.ndarray | None, time_limit: float) -> float:
    """L(λ) at the relaxation's duals, each block bounded by HiGHS within its share of ``time_limit``.

    A block's options whose reduced cost exceeds what the incumbent pays over the block's LP bound
    are fixed at zero first (no cheaper block plan uses them), which leaves HiGHS smaller problems."""
    started = time.perf_counter()
    (constraint,) = form.constraints()
    matrix = csr_array(constraint.A)
    deadline = started + time_limit
    bounds = list(pricing.lp_value)
    if incumbent is None:
        order = sorted(range(len(pricing.blocks)), key=lambda g: -pricing.lp_value[g])
    else:  # only a block the incumbent pays more for than its LP bound can raise the bound
        loss = [float(pricing.priced[p.columns] @ incumbent[p.columns]) - pricing.lp_value[g]
                for g, p in enumerate(pricing.blocks)]
        order = [g for g in sorted(range(len(pricing.blocks)), key=lambda g: -loss[g]) if loss[g] > 1e-9]
    pending = [len(order)]

    def bound_block(g: int) -> None:
        part = pricing.blocks[g]
        left = deadline - time.perf_counter()
        pending[0] -= 1
        if left <= 0:
            return
        columns = part.columns
        upper = form.upper[columns].copy()
        if incumbent is not None:
            room = float(pricing.priced[columns] @ incumbent[columns]) - pricing.lp_value[g]
            useless = np.flatnonzero((pricing.option_reduced > room + 1e-9)
                                     & (relaxation.values[list(form.n_col)] < 1e-9))
            upper[np.isin(columns, np.asarray(form.n_col)[useless])] = 0.0
        result = milp(pricing.priced[columns],
                      constraints=[LinearConstraint(matrix[part.rows][:, columns], constraint.lb[part.rows],
                                                    constraint.ub[part.rows])] if part.rows.size else [],
                      integrality=form.integrality[columns], bounds=Bounds(form.lower[columns], upper),
                      options={"time_limit": max(MIN_BLOCK_TIME_S, left * WORKERS / (pending[0] + 1)),
                               "mip_rel_gap": _block_gap(problem, relaxation, pricing, g)})
        dual = getattr(result, "mip_dual_bound", None)
        if dual is not None and np.isfinite(dual):
            bounds[g] = max(bounds[g], float(dual))
            if incumbent is not None:
                bounds[g] = min(bounds[g], float(pricing.priced[columns] @ incumbent[columns]))

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(bound_block, order))
    return max(relaxation.bound, pricing.constant + pricing.free_part + sum(bounds))


def _block_tolerance(problem: Problem, relaxation: Relaxation, pricing: Pricing) -> float:
    """Each block's share of the gap target, in dollars per hour."""
    return BLOCK_SHARE_OF_GAP * problem.mip_gap * max(abs(relaxation.bound), 1e-9) / max(len(pricing.blocks), 1)


def _block_gap(problem: Problem, relaxation: Relaxation, pricing: Pricing, g: int) -> float:
    """The relative gap that leaves block g its share of the gap target."""
    return min(MAX_BLOCK_GAP, _block_tolerance(problem, relaxation, pricing) / max(pricing.lp_value[g], 1e-9))
