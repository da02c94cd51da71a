"""Full re-solve of the placement with the churn penalty, at the observed demand.

The incremental policy drifts from the optimum (it adds on the cheapest free
config and removes the most expensive, one model at a time). Periodically,
and when the drift passes a threshold, the optimizer's MILP is solved again
with the observed demand split into buckets by the observed mix, each option's
capacity derated by what SLO misses taught the policy, and a churn
penalty against the running placement; the policy then moves there
make-before-break (:meth:`ScaleState.following`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hetsched.autoscale.fleet import Fleet
from hetsched.autoscale.policy import Decision, ReplicaCount
from hetsched.optimizer.build import Demand
from hetsched.optimizer.solve import solve
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey


def replan(fleet: Fleet, decision: Decision, placement: Mapping[OptionKey, ReplicaCount], *,
           settings: AutoscaleSettings) -> dict[OptionKey, int] | None:
    """The cheapest placement for the decided demand with churn charged; None when infeasible or out of bounds."""
    problem = fleet.problem
    demand = {d.model: d.demand_rps for d in decision.models}
    correction = {k: c for d in decision.models for k, c in d.correction.items()}
    shares = {d.model: d.shares for d in decision.models}
    demands = []
    for planned in problem.demands:
        mix = shares.get(planned.model, {})
        total = sum(mix.values())
        share = mix.get(planned.bucket, 0.0) / total if total > 0 else 0.0
        demands.append(Demand(planned.model, planned.role, planned.bucket, demand.get(planned.model, 0.0) * share))
    options = tuple(replace(o, capacity={b: c * correction[o.key] for b, c in o.capacity.items()})
                    if o.key in correction else o for o in problem.options)
    problem = replace(problem, demands=tuple(demands), options=options,
                      models=tuple(replace(m, demand_rps=demand.get(m.name, 0.0)) for m in problem.models),
                      headroom=settings.headroom, churn_weight=settings.churn_weight,
                      current={k: c.desired for k, c in placement.items() if c.desired})
    solution = solve(problem)
    if not solution.found:
        return None
    counts = solution.counts(problem)
    for model in fleet.models:
        total = sum(n for k, n in counts.items() if k.model == model.name)
        if model.max_replicas is not None and total > model.max_replicas:
            return None
    return counts
