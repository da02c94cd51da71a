"""LP-guided rounding: a feasible plan fast on fleets where the MILP's root node is slow.

1. The LP relaxation's replicas give each model a *reservation* of each pool:
   whole GPUs, plus split instances at their share of a GPU (one over how many
   fit a GPU: a 3g is half a GPU, a 4g a whole one). Each split pool keeps one
   GPU per instance kind back, since covering n instances takes ⌈n·share⌉ GPUs.
2. Models, least flexible first (fewest pools), then most expensive, each
   solve a small MILP over their own options with the rows (1), (2), (6)–(8)
   of :func:`hetsched.optimizer.solve.solve` and split instances priced and
   counted at their share: first within their reservation plus the free GPUs
   (on the relaxation's support and the cheapest options, then on all), then
   on everything the models before them left. Past ``deadline``, a model
   keeps the relaxation's choice with replicas rounded up.
3. Per splittable pool, the fewest GPUs whose layouts cover the instance
   counts (a small MILP over the pool's layouts).
4. The result is checked against every row of the full MILP; anything that
   does not hold returns None, and the caller relies on HiGHS alone.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from hetsched.catalog import Accelerator
from hetsched.optimizer.build import Pool, Problem, SplitLayout
from hetsched.optimizer.formulation import Formulation, formulate

FEASIBILITY_TOLERANCE = 1e-6
SUB_TIME_LIMIT_S = 0.5
CHEAPEST_PER_BUCKET = 3
"""Options per (role, bucket) a model's sub-problem keeps besides the relaxation's support."""


def instance_share(accelerator: Accelerator, profile: str) -> float:
    """Share of a GPU one instance of ``profile`` takes at most: one over how many fit one GPU."""
    if accelerator.mig is not None:
        return 1.0 / accelerator.mig.profile(profile).max_count
    assert accelerator.amd_partitions is not None
    return 1.0 / accelerator.amd_partitions.compute_modes[profile.split("_")[0]]


def round_relaxation(problem: Problem, form: Formulation, relaxed: np.ndarray, *, deadline: float) -> np.ndarray | None:
    """A feasible point of ``form`` near the relaxation ``relaxed``, or None when rounding fails.

    Models still left at ``deadline`` (a ``time.perf_counter()`` value) keep the relaxation's
    choice with replicas rounded up."""
    pools = {p.name: p for p in problem.pools}
    usage = defaultdict(float)  # (model, pool) → GPUs reserved in the relaxation
    for i, option in enumerate(problem.options):
        usage[(option.model, option.pool)] += _gpus(pools[option.pool], option.tp, option.profile) * relaxed[form.n_col[i]]
    # a split pool keeps one GPU per instance kind back: covering n instances of a kind takes ⌈n·share⌉ GPUs
    margin = {p.name: len({k for layout in p.layouts for k in layout.counts}) for p in problem.pools}
    free = {p.name: p.gpu_limit - margin[p.name] - sum(v for (_, pool), v in usage.items() if pool == p.name)
            for p in problem.pools}
    cost_of = defaultdict(float)
    for (model, pool), gpus in usage.items():
        cost_of[model] += gpus * pools[pool].price_per_hour
    index = {option.key: i for i, option in enumerate(problem.options)}
    of_model: dict[str, list[int]] = defaultdict(list)
    for i, option in enumerate(problem.options):
        of_model[option.model].append(i)
    values = np.zeros(len(form.cost))
    used = defaultdict(float)  # GPUs taken by the models already rounded
    flexibility = {m.name: len({problem.options[i].pool for i in of_model[m.name]}) for m in problem.models}
    for rules in sorted(problem.models, key=lambda m: (flexibility[m.name], -cost_of[m.name])):
        fair = {p: max(0.0, free[p] + usage[(rules.name, p)]) for p in pools}
        greedy = {p: max(0.0, pools[p].gpu_limit - margin[p] - used[p]) for p in pools}
        chosen = None
        # within its share first (support and cheapest options, then all); then taking what later,
        # more flexible models reserved, which they replace elsewhere; past the deadline, the
        # relaxation's choice rounded up
        attempts = ((fair, _candidates(problem, pools, form, relaxed, of_model[rules.name])),
                    (fair, of_model[rules.name]), (greedy, of_model[rules.name]))
        for limits, keep in attempts if time.perf_counter() < deadline else ():
            sub = _sub_problem(problem, rules.name, limits, keep)
            sub_form = formulate(sub)
            result = milp(sub_form.cost, constraints=sub_form.constraints(), integrality=sub_form.integrality,
                          bounds=Bounds(sub_form.lower, sub_form.upper),
                          options={"time_limit": SUB_TIME_LIMIT_S, "mip_rel_gap": problem.mip_gap, "presolve": False})
            if result.x is not None:
                chosen = _from_sub(sub, sub_form, result.x, index)
                break
        if chosen is None:
            chosen = _ceil_relaxation(problem, form, relaxed, of_model[rules.name])
        for i, n, shares in chosen:
            option = problem.options[i]
            values[form.n_col[i]] = n
            taken = _gpus(pools[option.pool], option.tp, option.profile) * n
            free[option.pool] -= taken
            used[option.pool] += taken
            for bucket, share in shares.items():
                values[form.x_index[(i, bucket)]] = share
        for p in pools:
            free[p] += usage[(rules.name, p)]
    for pool in problem.pools:
        if pool.splittable and not _cover_layouts(problem, pool, form, values):
            return None
    if form.d_col:
        before = np.array([problem.current.get(o.key, 0) for o in problem.options], dtype=float)
        values[list(form.d_col)] = np.abs(values[list(form.n_col)] - before)
    return values if _feasible(form, values) else None


def _from_sub(sub: Problem, sub_form: Formulation, solved: np.ndarray,
              index: dict[object, int]) -> list[tuple[int, int, dict[str, float]]]:
    """(option index in the full problem, replicas, bucket shares) from a model's sub-MILP."""
    shares: dict[int, dict[str, float]] = defaultdict(dict)
    for (j, bucket), col in sub_form.x_index.items():
        shares[j][bucket] = float(solved[col])
    return [(index[option.key], round(solved[sub_form.n_col[j]]), shares[j]) for j, option in enumerate(sub.options)]


def _ceil_relaxation(problem: Problem, form: Formulation, relaxed: np.ndarray,
                     mine: list[int]) -> list[tuple[int, int, dict[str, float]]]:
    """The relaxation's choice for one model with replicas rounded up: the fallback when its sub-MILP fails."""
    chosen = []
    for i in mine:
        option = problem.options[i]
        shares = {b: float(relaxed[form.x_index[(i, b)]]) for b in option.capacity if (i, b) in form.x_index}
        chosen.append((i, math.ceil(relaxed[form.n_col[i]] - FEASIBILITY_TOLERANCE), shares))
    return chosen


def _gpus(pool: Pool, tp: int, profile: str | None) -> float:
    return float(tp) if profile is None else instance_share(pool.accelerator, profile)


def _candidates(problem: Problem, pools: dict[str, Pool], form: Formulation, relaxed: np.ndarray,
                mine: list[int]) -> list[int]:
    """The model's options in the relaxation's support, plus its cheapest per request on each bucket."""
    keep = {i for i in mine if relaxed[form.n_col[i]] > 1e-7}
    cheapest: dict[tuple[object, str], list[tuple[float, int]]] = defaultdict(list)
    for i in mine:
        option = problem.options[i]
        price = pools[option.pool].price_per_hour * _gpus(pools[option.pool], option.tp, option.profile)
        for bucket, capacity in option.capacity.items():
            cheapest[(option.role, bucket)].append((price / capacity, i))
    for ranked in cheapest.values():
        keep.update(i for _, i in sorted(ranked)[:CHEAPEST_PER_BUCKET])
    return sorted(keep)


def _sub_problem(problem: Problem, model: str, limits: dict[str, float], keep: list[int]) -> Problem:
    """One model alone on pools cut to ``limits`` GPUs, split instances as single-instance layouts at their share."""
    pools = []
    for pool in problem.pools:
        layouts: tuple[SplitLayout, ...] = ()
        if pool.splittable:
            kinds = sorted({k for layout in pool.layouts for k in layout.counts})
            layouts = tuple(SplitLayout(kind, {kind: 1}, gpus=instance_share(pool.accelerator, kind)) for kind in kinds)
        pools.append(replace(pool, gpu_limit=limits[pool.name] + FEASIBILITY_TOLERANCE, layouts=layouts))
    options = tuple(problem.options[i] for i in keep)
    return replace(problem, pools=tuple(pools), options=options,
                   demands=tuple(d for d in problem.demands if d.model == model),
                   models=tuple(m for m in problem.models if m.name == model),
                   current={k: n for k, n in problem.current.items() if k[0] == model})


def _cover_layouts(problem: Problem, pool: Pool, form: Formulation, values: np.ndarray) -> bool:
    """Fewest GPUs of ``pool`` whose layouts hold the instances the models chose; False when they do not fit."""
    needed: dict[str, float] = defaultdict(float)
    whole = 0.0
    for i, option in enumerate(problem.options):
        if option.pool != pool.name:
            continue
        if option.whole:
            whole += option.tp * values[form.n_col[i]]
        else:
            needed[option.profile or ""] += values[form.n_col[i]]
    if not any(needed.values()):
        return whole <= pool.gpu_limit + FEASIBILITY_TOLERANCE
    kinds = sorted(k for k, n in needed.items() if n > 0)
    matrix = np.array([[layout.counts.get(kind, 0) for layout in pool.layouts] for kind in kinds], dtype=float)
    result = milp(np.ones(len(pool.layouts)), constraints=[LinearConstraint(matrix, [needed[k] for k in kinds], np.inf)],
                  integrality=np.ones(len(pool.layouts)), bounds=Bounds(0, pool.gpu_limit),
                  options={"time_limit": SUB_TIME_LIMIT_S})
    if result.x is None or whole + round(result.fun) > pool.gpu_limit + FEASIBILITY_TOLERANCE:
        return False
    for layout, count in zip(pool.layouts, result.x):
        values[form.y_index[(pool.name, layout.key)]] = round(count)
    return True


def _feasible(form: Formulation, values: np.ndarray) -> bool:
    if np.any(values < form.lower - FEASIBILITY_TOLERANCE) or np.any(values > form.upper + FEASIBILITY_TOLERANCE):
        return False
    (constraint,) = form.constraints() or (None,)
    if constraint is None:
        return True
    rows = constraint.A @ values
    return bool(np.all(rows >= constraint.lb - 1e-5) and np.all(rows <= constraint.ub + 1e-5))
