"""Unified against prefill/decode-disaggregated placement on a heterogeneous fleet, in one run.

    .venv/bin/python benchmarks/pd_disagg.py [--rate 24]

For each workload shape (long prompt with a short answer, RAG, chat, long answer) the optimizer plans
Llama-3.1-8B at the same SLO twice on the same fleet (H100 SXM, A100 80GB, L40S, L4 pools), once with
unified replicas and once disaggregated, every capacity from the simulator's SLO search on the calibrated
step model (prefill replicas under the TTFT target less the KV transfer off the node; decode replicas with
the prompt's KV arriving; prefill capped by the network). Prints $/hour of both, the ratio unified /
disaggregated (above 1: disaggregation is cheaper), and where each plan put its replicas.
"""

from __future__ import annotations

import argparse
import time

from hetsched.catalog import load_catalog
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import Plan, PlanStatus
from hetsched.optimizer.spec import ClusterSpec

SHAPES = {  # name: (prompt tokens, answer tokens)
    "long prompt, short answer": (4000, 100),
    "RAG": (2000, 300),
    "chat": (512, 256),
    "long answer": (256, 1500),
}
POOLS = [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "a100", "accelerator": "a100-80gb", "nodes": 1},
         {"name": "l40s", "accelerator": "l40s", "nodes": 2}, {"name": "l4", "accelerator": "l4", "nodes": 4}]
SLO = {"ttft_ms": 1500, "tpot_ms": 60}


def spec(shape: tuple[int, int], rate: float, disaggregation: str) -> ClusterSpec:
    return parse_cluster({"pools": POOLS, "solver": {"headroom": 0.1, "time_limit_s": 30},
                          "models": [{"name": "llama-3.1-8b", "slo": SLO, "disaggregation": disaggregation,
                                      "workload": {"rate_rps": rate, "input_tokens": shape[0],
                                                   "output_tokens": shape[1]}}]})


def placement(plan: Plan) -> str:
    groups = [g for m in plan.models for g in m.replicas]
    return ", ".join(f"{g.replicas}×{g.device}{'' if g.tp == 1 else f'/tp{g.tp}'} {g.role}" for g in groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=24.0, help="requests per second of the model")
    args = parser.parse_args()
    catalog = load_catalog()
    started = time.perf_counter()
    print(f"llama-3.1-8b at {args.rate:g} req/s, P99 TTFT ≤ {SLO['ttft_ms']} ms, TPOT ≤ {SLO['tpot_ms']} ms; "
          f"pools: {', '.join(p['accelerator'] + '×' + str(p['nodes'] * catalog.get(p['accelerator']).gpus_per_node) for p in POOLS)}\n")
    print(f"{'workload':28} {'unified $/h':>12} {'disagg. $/h':>12} {'unified/disagg.':>16}")
    details = []
    for name, shape in SHAPES.items():
        unified = optimize(spec(shape, args.rate, "unified"), catalog=catalog)
        split = optimize(spec(shape, args.rate, "prefill_decode"), catalog=catalog)
        costs = [p.cost_per_hour if p.status is not PlanStatus.INFEASIBLE else None for p in (unified, split)]
        ratio = f"{costs[0] / costs[1]:16.2f}" if None not in costs else f"{'—':>16}"
        print(f"{name:28} {costs[0] or float('nan'):12.2f} {costs[1] or float('nan'):12.2f} {ratio}")
        details.append((name, placement(unified), placement(split)))
    print()
    for name, unified, split in details:
        print(f"{name}:\n  unified: {unified}\n  disaggregated: {split}")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
