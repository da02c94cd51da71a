"""Scale: solve time and gap as the fleet grows to 200 models × 12 accelerator types × 5 buckets on 10,000 GPUs.

Fleets come from ``optimizer_synthetic`` (capacity tables, so the simulator is
not what is timed): 8-GPU nodes split evenly over the 12 types, half of the
nodes of every MIG- or partition-capable type in MIG-allowed pools, and one
model per 50 GPUs. Demand is set to a share (``--utilisation``, default 0.5)
of the most the inventory could serve with the same mix (LP relaxation), so
every size is equally loaded. The solver runs with a 10 s limit and a 1 %
gap target; "build" is the cluster spec → typed problem step, "solve" the
staged solve (LP bound, repair rounding, HiGHS) on top, as wall-clock time
and as this process's CPU time (the two differ when the machine is shared).

    .venv/bin/python benchmarks/optimizer_scale.py [--utilisation 0.5]
    .venv/bin/python benchmarks/optimizer_scale.py --quick    # the two smallest fleets, 1 s limit: a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hetsched.catalog import load_catalog
from hetsched.optimizer.build import build_problem
from hetsched.optimizer.solve import solve

sys.path.insert(0, str(Path(__file__).parent))
from optimizer_synthetic import Fleet, fleet_spec  # noqa: E402
import report  # noqa: E402

SIZES = ((12, 2), (125, 20), (313, 50), (625, 100), (1250, 200))
"""(8-GPU nodes, models): 96 → 10,000 GPUs."""
QUICK_SIZES = SIZES[:2]
QUICK_TIME_LIMIT_S = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utilisation", type=float, default=0.5)
    parser.add_argument("--time-limit", type=float, help=f"solver limit, s (default 10; --quick {QUICK_TIME_LIMIT_S:g})")
    parser.add_argument("--quick", action="store_true", help="the two smallest fleets: a smoke run")
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    time_limit = args.time_limit or (QUICK_TIME_LIMIT_S if args.quick else 10.0)
    catalog = load_catalog()
    print(f"{'GPUs':>6} {'models':>6} {'variables':>9} {'integer':>8} {'build s':>8} {'solve s':>8} "
          f"{'CPU s':>6} {'status':>10} {'gap':>7} {'$/hour':>9}  found by")
    for nodes, models in sizes:
        spec = fleet_spec(Fleet(models=models, nodes=nodes, utilisation=args.utilisation), time_limit_s=time_limit)
        started = time.perf_counter()
        problem = build_problem(spec, catalog)
        built = time.perf_counter() - started
        cpu = time.process_time()
        stats = solve(problem).stats
        cpu = time.process_time() - cpu
        gap = f"{stats.gap:.2%}" if stats.gap is not None else "—"
        cost = f"{stats.objective:,.0f}" if stats.objective is not None else "—"
        print(f"{nodes * 8:>6} {models:>6} {stats.variables:>9} {stats.integer_variables:>8} {built:>8.2f} "
              f"{stats.time_s:>8.2f} {cpu:>6.2f} {stats.status.value:>10} {gap:>7} {cost:>9}  {stats.message}", flush=True)


if __name__ == "__main__":
    report.main(main, section="optimizer_scale")
