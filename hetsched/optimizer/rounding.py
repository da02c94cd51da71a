"""Repair rounding: a feasible integer plan from the LP relaxation in seconds on any fleet.

1. Every option o keeps the relaxation's bucket shares x[o,b], so its load is
   u[o] = Σ_b λ[m,r,b]·(1+h)/c[o,b]·x[o,b] replicas, and gets ⌈u[o]⌉ replicas.
2. A pool over its inventory sheds replicas, first the one whose excess
   load u[o] − (n[o] − 1) is smallest. That load moves to the same model's
   other options: onto idle capacity of replicas it already has, then, per
   bucket, onto new replicas where its pool has free GPUs: the option that
   takes the whole share for the least added cost, else the most of it. A split pool counts the GPUs of a greedy cover of its instances by
   its layouts (repeatedly the layout that holds the largest share of a GPU
   of what is still needed).
3. Models below their minimum or spread rules get the cheapest replicas that fit.
4. Improvement: every replica, dearest per request first, is dropped when
   moving its excess load the same way lowers the MILP's objective.
5. Per splittable pool, the fewest GPUs whose layouts cover the instances
   (a small MILP over the pool's layouts, or the greedy cover if that is
   not better).
6. The result is checked against every row of the full MILP; anything that
   does not hold returns None, and the caller relies on HiGHS alone.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from hetsched.optimizer.build import Pool, Problem
from hetsched.optimizer.formulation import SPLIT_TIE_BREAK, Formulation

FEASIBILITY_TOLERANCE = 1e-7
COVER_TIME_LIMIT_S = 0.5
"""Time limit of one pool's layout-cover MILP."""


@dataclass(frozen=True)
class _Snapshot:
    """What one model's moves may change, to undo them."""

    replicas: dict[int, int]
    shares: dict[int, dict[str, float]]
    whole: dict[str, float]
    instances: dict[str, dict[str, int]]
    tie_break: float


class _Rounding:
    """Replica counts and bucket shares of a plan being repaired, with the GPUs each pool uses."""

    def __init__(self, problem: Problem, form: Formulation, relaxed: np.ndarray) -> None:
        self.problem = problem
        self.pools = {p.name: p for p in problem.pools}
        demand = {(d.model, d.role, d.bucket): d.rate_rps for d in problem.demands}
        self.per_gpu = {p.name: _per_gpu(p) for p in problem.pools}
        self.cover_tables = {p.name: _CoverTable(p) for p in problem.pools}
        self.load: dict[int, dict[str, float]] = defaultdict(dict)  # replicas per unit share of a bucket
        self.shares: dict[int, dict[str, float]] = defaultdict(dict)
        for (i, bucket), col in form.x_index.items():
            option = problem.options[i]
            self.load[i][bucket] = (demand[(option.model, option.role, bucket)] * (1 + problem.headroom)
                                    / option.capacity[bucket])
            if relaxed[col] > FEASIBILITY_TOLERANCE:
                self.shares[i][bucket] = float(relaxed[col])
        self.of_group: dict[tuple[str, object], list[int]] = defaultdict(list)
        for i, option in enumerate(problem.options):
            self.of_group[(option.model, option.role)].append(i)
        self.replicas = {i: math.ceil(self.used_capacity(i) - 1e-6) for i in range(len(problem.options))}
        self.whole: dict[str, float] = defaultdict(float)
        self.instances: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.tp_groups: dict[tuple[str, int], int] = defaultdict(int)
        self._covers: dict[tuple[str, tuple[tuple[str, int], ...]], dict[str, int]] = {}
        self._split_gpus: dict[str, int] = {}
        self.tie_break = 0.0
        for i, n in self.replicas.items():
            self._count(i, n)

    # --- bookkeeping ---------------------------------------------------------------------------------

    def used_capacity(self, i: int) -> float:
        return sum(self.load[i][b] * x for b, x in self.shares[i].items())

    def _count(self, i: int, n: int) -> None:
        option = self.problem.options[i]
        if option.whole:
            self.whole[option.pool] += option.tp * n
            self.tp_groups[(option.pool, option.tp)] += n
        else:
            self.instances[option.pool][option.profile or ""] += n
            self._split_gpus.pop(option.pool, None)
            self.tie_break += SPLIT_TIE_BREAK * self.pools[option.pool].price_per_hour * option.gpus * n

    def set_replicas(self, i: int, n: int) -> None:
        self._count(i, n - self.replicas[i])
        self.replicas[i] = n

    def split_gpus(self, pool: str) -> int:
        if pool not in self._split_gpus:
            self._split_gpus[pool] = self._cover_gpus(pool, {})
        return self._split_gpus[pool]

    def _cover_gpus(self, pool: str, extra: dict[str, int]) -> int:
        """GPUs the greedy cover of ``pool``'s instances, plus ``extra`` ones, takes."""
        return sum(self.layouts(pool, extra).values())

    def layouts(self, pool: str, extra: dict[str, int] | None = None) -> dict[str, int]:
        """Greedy layouts (key → GPUs) for ``pool``'s instances, plus ``extra`` ones."""
        wanted = dict(self.instances[pool])
        for kind, n in (extra or {}).items():
            wanted[kind] = wanted.get(kind, 0) + n
        counts = tuple(sorted((k, n) for k, n in wanted.items() if n))
        if (pool, counts) not in self._covers:
            self._covers[(pool, counts)] = self.cover_tables[pool].cover(dict(counts))
        return self._covers[(pool, counts)]

    def used_gpus(self, pool: str) -> float:
        return self.whole[pool] + self.split_gpus(pool)

    def over(self, pool: str) -> bool:
        return self.used_gpus(pool) > self.pools[pool].gpu_limit + FEASIBILITY_TOLERANCE

    def addable(self, i: int, wanted: int) -> int:
        """How many more replicas of option i, up to ``wanted``, fit the free GPUs (and TP-group rows) of its pool."""
        option = self.problem.options[i]
        pool = self.pools[option.pool]
        free = math.floor(pool.gpu_limit - self.used_gpus(option.pool) + FEASIBILITY_TOLERANCE)
        if option.whole:
            most = free // option.tp
            if pool.gpus_per_node % option.tp:
                most = min(most, pool.nodes * (pool.gpus_per_node // option.tp) - self.tp_groups[(pool.name, option.tp)])
            return max(0, min(most, wanted))
        kind = option.profile or ""
        room = pool.gpu_limit + FEASIBILITY_TOLERANCE - self.whole[pool.name]
        # the most that fit, by bisection (greedy covers of more instances take no fewer GPUs; the plan
        # is checked row by row at the end)
        fits, too_many = 0, wanted + 1
        while too_many - fits > 1:
            middle = (fits + too_many) // 2
            if self._cover_gpus(pool.name, {kind: middle}) <= room:
                fits = middle
            else:
                too_many = middle
        return fits

    def replica_price(self, i: int) -> float:
        """$/hour of one more replica of option i: its GPUs, a split instance at its share of a layout."""
        option = self.problem.options[i]
        pool = self.pools[option.pool]
        if option.whole:
            return pool.price_per_hour * option.tp
        return pool.price_per_hour / self.per_gpu[pool.name][option.profile or ""]

    def _price_per_request(self, i: int) -> float:
        """$/hour per request/s of option i on the mix of buckets it serves (on all, when it serves none)."""
        capacity = self.problem.options[i].capacity
        served = [b for b, x in self.shares[i].items() if x > FEASIBILITY_TOLERANCE] or list(capacity)
        return self.replica_price(i) * len(served) / sum(capacity[b] for b in served)

    def cost(self) -> float:
        """The MILP's objective without churn: GPUs by pool, plus the tie-break on split instances."""
        return self.tie_break + sum(pool.price_per_hour * self.used_gpus(name) for name, pool in self.pools.items())

    def snapshot(self, group: tuple[str, object]) -> _Snapshot:
        mine = self.of_group[group]
        return _Snapshot({i: self.replicas[i] for i in mine}, {i: dict(self.shares[i]) for i in mine},
                         dict(self.whole), {p: dict(k) for p, k in self.instances.items()}, self.tie_break)

    def restore(self, saved: _Snapshot) -> None:
        for i, n in saved.replicas.items():
            option = self.problem.options[i]
            if option.whole:
                self.tp_groups[(option.pool, option.tp)] += n - self.replicas[i]
            self.replicas[i] = n
            self.shares[i] = saved.shares[i]
        self.whole = defaultdict(float, saved.whole)
        self.instances = defaultdict(lambda: defaultdict(int), {p: defaultdict(int, k) for p, k in saved.instances.items()})
        self.tie_break = saved.tie_break
        self._split_gpus.clear()

    # --- moves ---------------------------------------------------------------------------------------

    def shed(self, i: int, *, avoid: set[str]) -> bool:
        """Drop one replica of option i, moving the load it no longer holds to the model's other options
        outside the pools in ``avoid``; False (and nothing changed) when that load does not fit or the
        model's minimum and spread rules would no longer hold."""
        option = self.problem.options[i]
        group = (option.model, option.role)
        saved = self.snapshot(group)
        rules_held = self._missing(group) is None
        load = self.used_capacity(i)
        excess = load - (self.replicas[i] - 1)
        self.set_replicas(i, self.replicas[i] - 1)
        if excess > FEASIBILITY_TOLERANCE:
            fraction = min(1.0, excess / load + FEASIBILITY_TOLERANCE)
            moving = {b: x * fraction for b, x in self.shares[i].items()}
            for bucket, share in moving.items():
                self.shares[i][bucket] -= share
                if not self._place(group, bucket, share, avoid=avoid | {option.pool}, source=i):
                    self.restore(saved)
                    return False
        if rules_held and self._missing(group) is not None:
            self.restore(saved)
            return False
        return True

    def _place(self, group: tuple[str, object], bucket: str, share: float, *, avoid: set[str], source: int) -> bool:
        """Give ``share`` of ``bucket`` to options of ``group``: idle capacity first, then new replicas."""
        targets = [j for j in self.of_group[group] if j != source and bucket in self.load[j]
                   and self.problem.options[j].pool not in avoid]
        for j in sorted(targets, key=lambda j: self.replicas[j] - self.used_capacity(j), reverse=True):
            idle = self.replicas[j] - self.used_capacity(j)
            if idle <= FEASIBILITY_TOLERANCE:
                break
            taken = min(share, idle / self.load[j][bucket])
            self.shares[j][bucket] = self.shares[j].get(bucket, 0.0) + taken
            share -= taken
            if share <= FEASIBILITY_TOLERANCE:
                return True
        while share > FEASIBILITY_TOLERANCE:
            # the option whose new replicas take all of the share for the least, else the most of it
            best: tuple[float, float, int, int] | None = None
            for j in targets:
                needed = math.ceil(self.used_capacity(j) + share * self.load[j][bucket] - 1e-6) - self.replicas[j]
                added = self.addable(j, needed)
                if added <= 0:
                    continue
                taken = min(share, (self.replicas[j] + added - self.used_capacity(j)) / self.load[j][bucket])
                rank = (-taken, added * self.replica_price(j) / taken, j, added)
                if best is None or rank < best:
                    best = rank
            if best is None:
                return False
            _, _, j, added = best
            self.set_replicas(j, self.replicas[j] + added)
            taken = min(share, (self.replicas[j] - self.used_capacity(j)) / self.load[j][bucket])
            self.shares[j][bucket] = self.shares[j].get(bucket, 0.0) + taken
            share -= taken
        return share <= FEASIBILITY_TOLERANCE

    def _missing(self, group: tuple[str, object]) -> set[str] | None:
        """None when (6) and (7) hold for ``group``; else the pools a new replica must avoid."""
        rules = next(m for m in self.problem.models if m.name == group[0])
        mine = [i for i in self.of_group[group] if self.replicas[i]]
        total = sum(self.replicas[i] for i in mine)
        if total < max(rules.min_replicas, 2 if rules.spread else 0):
            return set()
        if rules.spread:
            pools = {self.problem.options[i].pool for i in mine}
            if len(pools) == 1 and self.pools[next(iter(pools))].nodes == 1:
                return pools
        return None

    def meet_rules(self) -> bool:
        """Cheapest replicas that fit, added until (6) and (7) hold for every model; False when none fits."""
        for group, mine in self.of_group.items():
            while (avoid := self._missing(group)) is not None:
                fitting = [i for i in mine if self.problem.options[i].pool not in avoid and self.addable(i, 1)]
                if not fitting:
                    return False
                cheapest = min(fitting, key=self.replica_price)
                self.set_replicas(cheapest, self.replicas[cheapest] + 1)
        return True

    def improve(self, deadline: float) -> None:
        """Drop replicas, dearest per request first, whenever moving their load elsewhere costs less, until
        ``deadline`` (a ``time.perf_counter`` instant): each step keeps the plan feasible, so stopping is safe."""
        order = sorted((i for i, n in self.replicas.items() if n), key=self._price_per_request, reverse=True)
        for i in order:
            if time.perf_counter() > deadline:
                return
            option = self.problem.options[i]
            group = (option.model, option.role)
            while self.replicas[i]:
                before = self.cost()
                saved = self.snapshot(group)
                if not self.shed(i, avoid=set()):
                    break
                if self.cost() >= before - 1e-9:
                    self.restore(saved)
                    break


def round_relaxation(problem: Problem, form: Formulation, relaxed: np.ndarray, *,
                     deadline: float = math.inf) -> np.ndarray | None:
    """A feasible point of ``form`` near the relaxation ``relaxed``, or None when repair fails; the improvement
    step (4) stops at ``deadline`` (a ``time.perf_counter`` instant), the repair itself runs to the end."""
    state = _Rounding(problem, form, relaxed)
    for pool in problem.pools:
        while state.over(pool.name):
            full = {p.name for p in problem.pools if state.over(p.name) or p.name == pool.name}
            mine = [i for i, n in state.replicas.items() if n and problem.options[i].pool == pool.name]
            by_excess = sorted(mine, key=lambda i: state.used_capacity(i) - (state.replicas[i] - 1))
            if not any(state.shed(i, avoid=full) for i in by_excess):
                return None
    if not state.meet_rules():
        return None
    state.improve(deadline)
    values = np.zeros(len(form.cost))
    for i, n in state.replicas.items():
        values[form.n_col[i]] = n
        for bucket, share in state.shares[i].items():
            values[form.x_index[(i, bucket)]] = share
    return complete(problem, form, values, greedy={p.name: state.layouts(p.name) for p in problem.pools if p.splittable})


def complete(problem: Problem, form: Formulation, values: np.ndarray, *,
             greedy: dict[str, dict[str, int]] | None = None) -> np.ndarray | None:
    """``values`` with replicas and shares set made a point of ``form``: the fewest split GPUs whose layouts
    hold the instances used, and the replicas moved; None when a row of the MILP does not hold."""
    values = values.copy()
    for pool in problem.pools:
        if pool.splittable:
            _cover_layouts(problem, pool, form, values, (greedy or {}).get(pool.name))
    if form.d_col:
        before = np.array([problem.current.get(o.key, 0) for o in problem.options], dtype=float)
        values[list(form.d_col)] = np.abs(values[list(form.n_col)] - before)
    return values if _feasible(form, values) else None


def _per_gpu(pool: Pool) -> dict[str, int]:
    """The most instances of each kind one layout of ``pool`` holds."""
    most: dict[str, int] = defaultdict(int)
    for layout in pool.layouts:
        for kind, count in layout.counts.items():
            most[kind] = max(most[kind], count)
    return dict(most)


class _CoverTable:
    """One pool's layouts as an instances-per-GPU matrix, for greedy covers."""

    def __init__(self, pool: Pool) -> None:
        per_gpu = _per_gpu(pool)
        self.kinds = sorted(per_gpu)
        self.keys = [layout.key for layout in pool.layouts]
        self.counts = np.array([[layout.counts.get(k, 0) for k in self.kinds] for layout in pool.layouts], dtype=float)
        self.per_gpu = np.array([per_gpu[k] for k in self.kinds], dtype=float)

    def cover(self, needed: dict[str, int]) -> dict[str, int]:
        """Layouts (key → GPUs) holding ``needed`` instances: repeatedly the layout that covers the largest
        share of a GPU of what is still needed, taken as often as it stays fully used."""
        left = np.array([max(needed.get(k, 0), 0) for k in self.kinds], dtype=float)
        chosen: dict[str, int] = defaultdict(int)
        while left.any():
            best = int(np.argmax((np.minimum(self.counts, left) / self.per_gpu).sum(axis=1)))
            row = self.counts[best]
            wanted = (row > 0) & (left > 0)
            repeat = max(1, int(np.min(left[wanted] // row[wanted])))
            chosen[self.keys[best]] += repeat
            left = np.maximum(left - row * repeat, 0.0)
        return dict(chosen)


def _cover_layouts(problem: Problem, pool: Pool, form: Formulation, values: np.ndarray,
                   greedy: dict[str, int] | None) -> None:
    """Fewest GPUs of ``pool`` whose layouts hold the instances the plan uses, into ``values`` (a small MILP,
    or the greedy cover when that is not worse)."""
    needed: dict[str, int] = defaultdict(int)
    for i, option in enumerate(problem.options):
        if option.pool == pool.name and not option.whole:
            needed[option.profile or ""] += int(round(values[form.n_col[i]]))
    kinds = sorted(k for k, n in needed.items() if n > 0)
    if greedy is None:
        greedy = _CoverTable(pool).cover({k: needed[k] for k in kinds})
    counts = [greedy.get(layout.key, 0) for layout in pool.layouts]
    if kinds:
        matrix = np.array([[layout.counts.get(kind, 0) for layout in pool.layouts] for kind in kinds], dtype=float)
        result = milp(np.ones(len(pool.layouts)),
                      constraints=[LinearConstraint(matrix, [needed[k] for k in kinds], np.inf)],
                      integrality=np.ones(len(pool.layouts)), bounds=Bounds(0, pool.gpu_limit),
                      options={"time_limit": COVER_TIME_LIMIT_S})
        if result.x is not None and round(result.fun) <= sum(counts):
            counts = [round(c) for c in result.x]
    for layout, count in zip(pool.layouts, counts):
        values[form.y_index[(pool.name, layout.key)]] = count


def _feasible(form: Formulation, values: np.ndarray) -> bool:
    if np.any(values < form.lower - 1e-6) or np.any(values > form.upper + 1e-6):
        return False
    (constraint,) = form.constraints() or (None,)
    if constraint is None:
        return True
    rows = constraint.A @ values
    return bool(np.all(rows >= constraint.lb - 1e-5) and np.all(rows <= constraint.ub + 1e-5))
