"""Stability: after a ±5 % change in every model's demand, how many replicas does a re-plan move?

For each scenario (an example cluster with its demand scaled up so that it
runs tens of replicas), solve once, then ten times with each model's demand
changed by a random factor in [0.95, 1.05] (seeded), against the first plan:
without the churn penalty, and with it (``--churn-weight`` in $/hour per
replica added or removed). Reports replicas moved as a share of the plan's
replicas, and what keeping replicas in place costs. "fewest" is the same
re-plan with moves priced far above any GPU (``FORCED_WEIGHT``): the moves the
new demand forces on any plan, the floor for the penalised one.

    .venv/bin/python benchmarks/optimizer_stability.py [--churn-weight 1.0]
    .venv/bin/python benchmarks/optimizer_stability.py --quick    # two re-plans per scenario: a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

from hetsched.optimizer.load import load_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.spec import ClusterSpec

sys.path.insert(0, str(Path(__file__).parent))
from optimizer_synthetic import scaled  # noqa: E402
import report  # noqa: E402

EXAMPLES = Path(__file__).parent.parent / "examples"
SCENARIOS = {"mixed ×5": ("mixed.yaml", 5.0), "chat ×4": ("chat.yaml", 4.0),
             "small models ×3": ("mig-small-models.yaml", 3.0)}
CHURN_WEIGHT = 1.0
FORCED_WEIGHT = 1000.0
"""$/hour per replica moved at which no move is worth any saving: what remains is forced."""
TRIALS = 10
QUICK_TRIALS = 2


def with_churn(spec: ClusterSpec, weight: float) -> ClusterSpec:
    return spec.model_copy(update={"solver": spec.solver.model_copy(update={"churn_weight": weight})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--churn-weight", type=float, default=CHURN_WEIGHT, help="$/hour per replica moved")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TRIALS} re-plans per scenario: a smoke run")
    args = parser.parse_args()
    weight, trials = args.churn_weight, QUICK_TRIALS if args.quick else TRIALS
    print(f"churn weight ${weight:g}/hour per replica moved")
    print(f"{'scenario':<18} {'replicas':>8} {'moved, no penalty':>18} {'moved, penalty':>15} "
          f"{'fewest':>7} {'max moved':>10} {'cost of staying':>16}")
    for name, (file, factor) in SCENARIOS.items():
        base = scaled(load_cluster(EXAMPLES / file), factor)
        current = optimize(base)
        total = sum(g.replicas for m in current.models for g in m.replicas)
        rng = random.Random(0)
        free_moves, sticky_moves, forced_moves, extra_cost = [], [], [], []
        for _ in range(trials):
            changed = scaled(base, [rng.uniform(0.95, 1.05) for _ in base.models])
            free = optimize(with_churn(changed, 0.0), current=current)
            sticky = optimize(with_churn(changed, weight), current=current)
            forced = optimize(with_churn(changed, FORCED_WEIGHT), current=current)
            free_moves.append(free.replicas_moved / total)
            sticky_moves.append(sticky.replicas_moved / total)
            forced_moves.append(forced.replicas_moved / total)
            extra_cost.append(sticky.cost_per_hour / free.cost_per_hour - 1)
        print(f"{name:<18} {total:>8} {statistics.mean(free_moves):>18.1%} {statistics.mean(sticky_moves):>15.1%} "
              f"{statistics.mean(forced_moves):>7.1%} {max(sticky_moves):>10.1%} {statistics.mean(extra_cost):>+16.1%}")


if __name__ == "__main__":
    report.main(main, section="optimizer_stability")
