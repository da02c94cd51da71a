"""Cost of the placement MILP against three baselines on the same inputs, in one run.

Scenarios: the example cluster files (chat-like, long-document, mixed fleet,
small models on MIG GPUs). Baselines:

* homogeneous — each model alone on the single accelerator type that serves
  it cheapest (whole GPUs; every model may use a whole pool);
* greedy — models by demand, each bucket on the whole-GPU config with the
  lowest $ per request/s that still has free GPUs, replicas rounded up;
* whole-GPU ILP — the same MILP with MIG and partitions switched off.

Figures are $/hour and ratios baseline / MILP (above 1 = the MILP is cheaper).

    .venv/bin/python benchmarks/optimizer_cost.py

``--melange``: Mélange-format files (100 generated ones and the Mélange and
AIBrix example files) read by hetsched's readers and planned with the defaults
a user gets (headroom 0, no gap set), against two exact optima of the same
grid, each a MILP solved here with ``scipy.optimize.milp``:

* Mélange's own formulation: each cell's rate cut into ``slice_factor`` equal
  slices, each slice whole on one GPU type, integer GPUs per type covering the
  load (``melange/solver.py``). Slices of one cell are interchangeable, so the
  MILP counts them per (cell, type) (an integer 0..slice_factor) instead of
  Mélange's one binary per (slice, type): the same optimum without the
  symmetry that stalls CBC on sliced cases;
* the continuous split: the same with any fraction of a cell on any type.

A file's ``count`` caps that type's GPUs in both (Mélange's format has no
caps); a throughput of 0 (AIBrix: no rate met the SLO) keeps a cell off that
type. Bars: hetsched ≤ Mélange's optimum on every case, and ≤ the continuous
optimum + 0.01 %.

    .venv/bin/python benchmarks/optimizer_cost.py --melange [--cases 100]

``--quick``: the first two scenarios, or with ``--melange`` five generated cases and the two example files: a
smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.optimize import Bounds, LinearConstraint, milp

from hetsched.catalog import load_catalog
from hetsched.optimizer.build import build_problem
from hetsched.optimizer.load import load_cluster, parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import PlanStatus
from hetsched.optimizer.spec import ClusterSpec

sys.path.insert(0, str(Path(__file__).parent))
import report  # noqa: E402

EXAMPLES = Path(__file__).parent.parent / "examples"
SCENARIOS = {"chat": "chat.yaml", "long-document": "long-document.yaml", "mixed": "mixed.yaml",
             "small models (MIG)": "mig-small-models.yaml"}
QUICK_SCENARIOS = 2
QUICK_CASES = 5


def milp_cost(spec: ClusterSpec) -> float | None:
    plan = optimize(spec)
    return plan.cost_per_hour if plan.status is not PlanStatus.INFEASIBLE else None


def whole_gpu_cost(spec: ClusterSpec) -> float | None:
    pools = [p.model_copy(update={"partition_allowed": False}) for p in spec.pools]
    return milp_cost(spec.model_copy(update={"pools": pools}))


def homogeneous_cost(spec: ClusterSpec) -> float | None:
    """Sum over models of the cheapest single-type, whole-GPU plan for that model alone."""
    total = 0.0
    for model in spec.models:
        best = math.inf
        for accelerator in sorted({p.accelerator for p in spec.pools}):
            pools = [p.model_copy(update={"partition_allowed": False}) for p in spec.pools if p.accelerator == accelerator]
            alone = spec.model_copy(update={
                "pools": pools,
                "models": [model.model_copy(update={"allowed_pools": None, "allowed_accelerators": None})],
                "capacities": [c for c in spec.capacities or [] if c.model == model.name]})
            if (model.allowed_accelerators and accelerator not in model.allowed_accelerators) or (
                    model.allowed_pools and not {p.name for p in pools} & set(model.allowed_pools)):
                continue
            cost = milp_cost(alone)
            if cost is not None:
                best = min(best, cost)
        if not math.isfinite(best):
            return None
        total += best
    return total


def greedy_cost(spec: ClusterSpec) -> float | None:
    """Per bucket, the cheapest whole-GPU config per request/s with free GPUs; replicas rounded up."""
    problem = build_problem(spec, load_catalog())
    free = {p.name: p.gpu_limit for p in problem.pools}
    price = {p.name: p.price_per_hour for p in problem.pools}
    cost = 0.0
    demand = defaultdict(dict)
    for d in problem.demands:
        demand[(d.model, d.role)][d.bucket] = d.rate_rps
    for rules in sorted(problem.models, key=lambda m: -m.demand_rps):
        for role in rules.roles:
            placed = 0
            for bucket, rate in demand[(rules.name, role)].items():
                if rate <= 0:
                    continue
                ranked = sorted((o for o in problem.options
                                 if o.model == rules.name and o.role is role and o.whole and bucket in o.capacity),
                                key=lambda o: price[o.pool] * o.tp / o.capacity[bucket])
                for option in ranked:
                    replicas = math.ceil(rate * (1 + problem.headroom) / option.capacity[bucket] - 1e-9)
                    if replicas * option.tp <= free[option.pool]:
                        free[option.pool] -= replicas * option.tp
                        cost += replicas * option.tp * price[option.pool]
                        placed += replicas
                        break
                else:
                    return None
            floor = max(rules.min_replicas, 2 if rules.spread else 0)
            if placed < floor:
                cost += (floor - placed) * min(price[o.pool] * o.tp for o in problem.options
                                               if o.model == rules.name and o.role is role and o.whole
                                               and free[o.pool] >= o.tp)
    return cost


def ratio(baseline: float | None, ours: float | None) -> str:
    return "—" if baseline is None or not ours else f"{baseline / ours:.2f}×"


@dataclass(frozen=True)
class Grid:
    """One single-model case as Mélange's solver sees it: a rate per cell, a throughput per (type, cell)."""

    costs: list[float]
    tputs: list[np.ndarray]
    rates: np.ndarray
    slices: int
    caps: list[int | None]


def grid_optimum(grid: Grid, *, sliced: bool) -> tuple[float, float]:
    """The cheapest integer GPUs per type, cells split in ``grid.slices`` whole slices (Mélange) or at will.

    Columns: y[g] GPUs of type g, then n[c, g] slices (or, continuous, the share × slices) of cell c on g.
    (1) every cell's slices placed: Σ_g n[c, g] = slices;
    (2) each type's load within its GPUs: Σ_c n[c, g] · rate[c] / slices / tput[g][c] − y[g] ≤ 0.
    Returns ($/hour, seconds).
    """
    cells = [c for c in range(grid.rates.size) if grid.rates.flat[c] > 0]
    types = len(grid.costs)
    width = types + len(cells) * types
    cost = np.concatenate([grid.costs, np.zeros(len(cells) * types)])
    upper = np.full(width, np.inf)
    for g, cap in enumerate(grid.caps):
        if cap is not None:
            upper[g] = cap
    place = np.zeros((len(cells), width))
    load = np.zeros((types, width))
    for k, c in enumerate(cells):
        for g in range(types):
            col = types + k * types + g
            place[k, col] = 1.0
            tput = grid.tputs[g].flat[c]
            if tput > 0:
                upper[col] = grid.slices
                load[g, col] = grid.rates.flat[c] / grid.slices / tput
            else:
                upper[col] = 0.0
    for g in range(types):
        load[g, g] = -1.0
    integrality = np.concatenate([np.ones(types), np.full(len(cells) * types, 1.0 if sliced else 0.0)])
    started = time.perf_counter()
    found = milp(cost, constraints=[LinearConstraint(place, grid.slices, grid.slices),
                                    LinearConstraint(load, -np.inf, 0.0)],
                 integrality=integrality, bounds=Bounds(np.zeros(width), upper),
                 options={"mip_rel_gap": 0.0, "time_limit": 120.0})
    elapsed = time.perf_counter() - started
    if found.status != 0:
        raise RuntimeError(f"the exact optimum was not reached: {found.message}")
    return float(found.fun), elapsed


def melange_grid(file: dict[str, Any]) -> Grid:
    """A Mélange file as its solver reads it (rows and columns as they come: the optimum does not care)."""
    gpus = list(file["gpu_info"].values())
    return Grid(costs=[g["cost"] for g in gpus], tputs=[np.array(g["tputs"], dtype=float) for g in gpus],
                rates=np.array(file["workload_distribution"], dtype=float) * file["total_request_rate"],
                slices=int(file.get("slice_factor") or 1), caps=[g.get("count") for g in gpus])


def aibrix_grid(path: Path) -> Grid:
    """An AIBrix file (its profiles from a folder) as the same sliced ILP, one slice per cell."""
    file = yaml.safe_load(path.read_text())
    profiles = []
    for ref in file["aibrix_profiles"]:
        where = path.parent / (ref if isinstance(ref, str) else ref["path"])
        profiles += [json.loads(f.read_text()) for f in sorted(where.glob("*.json"))] if where.is_dir() else [
            json.loads(where.read_text())]
    return Grid(costs=[p["cost"] for p in profiles], tputs=[np.array(p["tputs"], dtype=float) for p in profiles],
                rates=np.array(file["workload_distribution"], dtype=float) * file["total_request_rate"],
                slices=1, caps=[None] * len(profiles))


GPUS = {"A10G": (1.01, 1.0), "L4": (0.70, 0.62), "L40S": (1.86, 1.9), "A100-80GB": (3.67, 4.1),
        "H100": (4.76, 6.6), "Gaudi2": (2.40, 3.2)}
"""Name: (list $/GPU-hour, relative throughput): Mélange's GPUs, and one name no catalog knows (an opaque type)."""


def random_melange(seed: int) -> dict[str, Any]:
    """A Mélange-style file: throughput falls with input and output size, more steeply on smaller GPUs."""
    rng = random.Random(seed)
    inputs, outputs = rng.randint(1, 5), rng.randint(1, 4)
    names = rng.sample(sorted(GPUS), rng.randint(2, 5))
    gpu_info: dict[str, Any] = {}
    for name in names:
        price, speed = GPUS[name]
        steep = 1.0 / speed ** 0.5  # a small GPU slows down more on long requests
        tputs = [[round(8 * speed / ((1 + i * steep) * (1 + 0.6 * o * steep)) * rng.uniform(0.8, 1.2), 2)
                  for o in range(outputs)] for i in range(inputs)]
        gpu_info[name] = {"cost": round(price * rng.uniform(0.8, 1.2), 2), "tputs": tputs}
    shares = [[0.0 if rng.random() < 0.2 else rng.random() for _ in range(outputs)] for _ in range(inputs)]
    if not any(map(any, shares)):
        shares[0][0] = 1.0
    total = sum(map(sum, shares))
    rate = round(math.exp(rng.uniform(math.log(2), math.log(500))), 1)
    if rng.random() < 0.2:  # a capped type: the one with the most throughput per dollar, at half of its solo fleet
        name = max(names, key=lambda n: gpu_info[n]["tputs"][0][0] / gpu_info[n]["cost"])
        gpu_info[name]["count"] = max(1, math.ceil(rate / gpu_info[name]["tputs"][0][0] / 2))
    return {"gpu_info": gpu_info, "workload_distribution": [[s / total for s in row] for row in shares],
            "total_request_rate": rate, "slice_factor": rng.choice([1, 1, 2, 4, 8])}


def melange_suite(cases: int) -> None:
    """hetsched through its Mélange/AIBrix readers against both exact optima, one line per case."""
    generated = [random_melange(seed) for seed in range(cases)]
    runs: list[tuple[str, dict[str, Any] | Path, Grid]] = [
        (f"generated #{seed}", file, melange_grid(file)) for seed, file in enumerate(generated)]
    runs.append(("melange-profile.json", EXAMPLES / "melange-profile.json",
                 melange_grid(json.loads((EXAMPLES / "melange-profile.json").read_text()))))
    runs.append(("aibrix-profiles.yaml", EXAMPLES / "aibrix-profiles.yaml", aibrix_grid(EXAMPLES / "aibrix-profiles.yaml")))
    print(f"{'case':<22} {'cells':>5} {'types':>5} {'slices':>6} {'hetsched':>9} {'Mélange':>9} {'continuous':>10}"
          f" {'vs Mélange':>10} {'vs cont.':>9} {'ours s':>7} {'Mél. s':>7}")
    meets_melange = meets_continuous = cheaper = 0
    savings: list[float] = []
    over_continuous: list[float] = []
    ours_s: list[float] = []
    for name, source, grid in runs:
        spec = load_cluster(source) if isinstance(source, Path) else parse_cluster(source)
        started = time.perf_counter()
        plan = optimize(spec)
        elapsed = time.perf_counter() - started
        ours_s.append(elapsed)
        ours = plan.cost_per_hour if plan.status is not PlanStatus.INFEASIBLE else math.inf
        melange, melange_s = grid_optimum(grid, sliced=True)
        continuous, _ = grid_optimum(grid, sliced=False)
        meets_melange += ours <= melange + 1e-6
        meets_continuous += ours <= continuous * 1.0001 + 1e-6
        cheaper += ours < melange - 1e-6
        savings.append(1 - ours / melange)
        over_continuous.append(ours / continuous - 1)
        print(f"{name:<22} {int((grid.rates > 0).sum()):>5} {len(grid.costs):>5} {grid.slices:>6} {ours:>9.2f} "
              f"{melange:>9.2f} {continuous:>10.2f} {_noise_free(ours / melange - 1):>+10.2%} "
              f"{_noise_free(ours / continuous - 1):>+9.3%} "
              f"{elapsed:>7.2f} {melange_s:>7.2f}", flush=True)
    total = len(runs)
    print(f"\n{total} cases: hetsched ≤ Mélange's optimum on {meets_melange}, cheaper on {cheaper} "
          f"(by up to {max(savings):.1%}); ≤ the continuous optimum + 0.01 % on {meets_continuous} "
          f"(most above it: {_noise_free(max(over_continuous)):+.4%}); "
          f"plan time median {sorted(ours_s)[total // 2]:.2f} s, max {max(ours_s):.2f} s")


def _noise_free(ratio: float) -> float:
    """A relative difference with float noise (below 1e-9) shown as 0, not as −0.00 %."""
    return 0.0 if abs(ratio) < 1e-9 else ratio


def baselines(scenarios: dict[str, str]) -> None:
    print(f"{'scenario':<20} {'MILP $/h':>9} {'homog. $/h':>11} {'greedy $/h':>11} {'whole-GPU $/h':>14}"
          f" {'homog.':>7} {'greedy':>7} {'whole':>7} {'solve s':>8}")
    for name, file in scenarios.items():
        spec = load_cluster(EXAMPLES / file)
        started = time.perf_counter()
        ours = milp_cost(spec)
        elapsed = time.perf_counter() - started
        homogeneous, greedy, whole = homogeneous_cost(spec), greedy_cost(spec), whole_gpu_cost(spec)
        cells = [f"{c:.2f}" if c is not None else "—" for c in (ours, homogeneous, greedy, whole)]
        print(f"{name:<20} {cells[0]:>9} {cells[1]:>11} {cells[2]:>11} {cells[3]:>14}"
              f" {ratio(homogeneous, ours):>7} {ratio(greedy, ours):>7} {ratio(whole, ours):>7} {elapsed:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--melange", action="store_true", help="the Mélange-format suite instead of the baselines")
    parser.add_argument("--cases", type=int, help=f"generated Mélange-style cases (--melange; default 100, --quick "
                                                     f"{QUICK_CASES})")
    parser.add_argument("--quick", action="store_true", help="a few scenarios or cases: a smoke run")
    args = parser.parse_args()
    if args.melange:
        melange_suite(args.cases or (QUICK_CASES if args.quick else 100))
    else:
        baselines(dict(list(SCENARIOS.items())[:QUICK_SCENARIOS]) if args.quick else SCENARIOS)


if __name__ == "__main__":
    report.main(main, section=lambda argv: "optimizer_cost_melange" if "--melange" in argv else "optimizer_cost")
