"""Placement optimizer: costs, MIG layouts, bucket split, roles, rules, churn, packing and explanations."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hetsched.catalog import Device, load_catalog
from hetsched.errors import DeadlineError, InfeasibleError, InputError
from hetsched.optimizer.build import CapacityQuery, build_problem, model_buckets
from hetsched.optimizer.capacity import SimulatedCapacity
from hetsched.optimizer.deadline import Deadline
from hetsched.partition.mig import MigPlacement, check_layout
from hetsched.partition.render import dcm_config, node_config_labels
from hetsched.partition.types import PartitionGroup
from hetsched.sim.roles import RELAXED_MS, kv_cache_bytes, kv_transfer_seconds, long_prompt_tokens, role_query
from hetsched.optimizer.load import load_cluster, parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import ConstraintKind, GpuMode, Plan, PlanStatus
from hetsched.optimizer.spec import ClusterSpec, Role
from hetsched.specs.registry import load_model

EXAMPLES = Path(__file__).parent.parent / "examples"
CATALOG = load_catalog()
SLO = {"ttft_ms": 500, "tpot_ms": 50}


def cluster(pools: list[dict[str, Any]], models: list[dict[str, Any]], capacities: list[dict[str, Any]],
            **solver: Any) -> ClusterSpec:
    return parse_cluster({"pools": pools, "models": models, "capacities": capacities, "solver": solver})


def model(name: str, rate: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "slo": SLO, "workload": {"rate_rps": rate, "input_tokens": 500, "output_tokens": 100}, **extra}


def replicas(plan: Plan) -> dict[tuple[str, str, int, Role], int]:
    return {(g.model, g.device, g.tp, g.role): g.replicas for m in plan.models for g in m.replicas}


def check_packing(plan: Plan) -> None:
    """Every node's GPUs hold what the replica groups say, MIG layouts are valid, TP groups sit in one node."""
    placed = Counter((r.model, r.device, r.tp, r.role) for node in plan.nodes for r in node.replicas)
    assert placed == Counter({k: n for k, n in replicas(plan).items()})
    for node in plan.nodes:
        accelerator = CATALOG.get(node.accelerator)
        for gpu in node.gpus:
            if gpu.mode is GpuMode.MIG:
                assert accelerator.mig is not None
                assert check_layout(accelerator.mig, [MigPlacement(i.profile, i.start) for i in gpu.instances]) is None
        for replica in node.replicas:
            assert len(replica.gpus) == replica.tp and all(0 <= g < len(node.gpus) for g in replica.gpus)
    used = Counter(p.pool for p in plan.pools for _ in range(p.gpus_used))
    for pool in plan.pools:
        assert pool.gpus_used <= pool.gpus_total
        busy = sum(1 for n in plan.nodes if n.pool == pool.pool for g in n.gpus if g.mode is not GpuMode.IDLE)
        assert busy == used[pool.pool]


def test_picks_the_cheapest_capacity_and_reports_cost() -> None:
    spec = cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "l4", "accelerator": "l4", "nodes": 2}],
                   [model("llama-3.1-8b", 9)],
                   [{"model": "llama-3.1-8b", "device": "h100-sxm", "requests_per_s": 20},
                    {"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 4}], headroom=0.0)
    plan = optimize(spec, catalog=CATALOG)
    # 3 L4 ($2.10) beat 1 H100 ($2.99) for 9 req/s
    assert plan.status is PlanStatus.OPTIMAL
    assert replicas(plan) == {("llama-3.1-8b", "l4", 1, Role.UNIFIED): 3}
    assert plan.cost_per_hour == pytest.approx(3 * 0.70)
    assert plan.cost_by_model == {"llama-3.1-8b": pytest.approx(2.10)}
    assert plan.solver.objective == pytest.approx(2.10) and plan.solver.gap is not None
    assert plan.models[0].headroom == pytest.approx(12 / 9 - 1)
    check_packing(plan)


def test_headroom_adds_replicas() -> None:
    base = dict(pools=[{"name": "l4", "accelerator": "l4", "nodes": 2}], models=[model("llama-3.1-8b", 8)],
                capacities=[{"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 4}])
    assert replicas(optimize(cluster(**base, headroom=0.0)))[("llama-3.1-8b", "l4", 1, Role.UNIFIED)] == 2
    assert replicas(optimize(cluster(**base, headroom=0.25)))[("llama-3.1-8b", "l4", 1, Role.UNIFIED)] == 3


def test_small_models_share_a_gpu_through_mig_with_valid_start_slices(tmp_path: Path) -> None:
    spec = cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "mig_allowed": True}],
                   [model("qwen3-0.6b", 8), model("llama-2-7b", 3)],
                   [{"model": "qwen3-0.6b", "device": "h100-sxm", "requests_per_s": 40},
                    {"model": "qwen3-0.6b", "device": "h100-sxm:1g.10gb", "requests_per_s": 10},
                    {"model": "llama-2-7b", "device": "h100-sxm", "requests_per_s": 15},
                    {"model": "llama-2-7b", "device": "h100-sxm:3g.40gb", "requests_per_s": 6}], headroom=0.0)
    plan = optimize(spec)
    assert plan.cost_per_hour == pytest.approx(2.99)  # one GPU, split, instead of two whole ones
    assert replicas(plan) == {("qwen3-0.6b", "h100-sxm:1g.10gb", 1, Role.UNIFIED): 1,
                              ("llama-2-7b", "h100-sxm:3g.40gb", 1, Role.UNIFIED): 1}
    (node,) = plan.nodes
    mig = [g for g in node.gpus if g.mode is GpuMode.MIG]
    assert len(mig) == 1 and {i.model for i in mig[0].instances} >= {"qwen3-0.6b", "llama-2-7b"}
    assert node.mig_config in plan.mig_configs
    groups = plan.mig_configs[node.mig_config]
    assert [g.mig_enabled for g in groups] == [True, False]
    assert sum(groups[0].mig_devices.values()) == len(mig[0].instances)
    assert plan.cost_by_model["qwen3-0.6b"] + plan.cost_by_model["llama-2-7b"] == pytest.approx(2.99)
    check_packing(plan)


def test_mig_not_allowed_uses_whole_gpus() -> None:
    spec = cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                   [model("qwen3-0.6b", 8)],
                   [{"model": "qwen3-0.6b", "device": "h100-sxm", "requests_per_s": 40},
                    {"model": "qwen3-0.6b", "device": "h100-sxm:1g.10gb", "requests_per_s": 10}])
    plan = optimize(spec)
    assert replicas(plan) == {("qwen3-0.6b", "h100-sxm", 1, Role.UNIFIED): 1}
    assert plan.mig_configs == {}


def test_buckets_split_across_accelerators() -> None:
    workload = {"rate_rps": 10, "buckets": [{"name": "short", "input_tokens": 300, "output_tokens": 100, "share": 0.5},
                                            {"name": "long", "input_tokens": 8000, "output_tokens": 300, "share": 0.5}]}
    spec = cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "l4", "accelerator": "l4", "nodes": 1}],
                   [{"name": "llama-3.1-8b", "slo": SLO, "workload": workload}],
                   [{"model": "llama-3.1-8b", "device": "h100-sxm", "bucket": "short", "requests_per_s": 25},
                    {"model": "llama-3.1-8b", "device": "h100-sxm", "bucket": "long", "requests_per_s": 5},
                    {"model": "llama-3.1-8b", "device": "l4", "bucket": "short", "requests_per_s": 5},
                    {"model": "llama-3.1-8b", "device": "l4", "bucket": "long", "requests_per_s": 0.2}], headroom=0.0)
    plan = optimize(spec)
    # long requests need an H100 (5/s); short ones fit one L4 exactly
    assert replicas(plan) == {("llama-3.1-8b", "h100-sxm", 1, Role.UNIFIED): 1, ("llama-3.1-8b", "l4", 1, Role.UNIFIED): 1}
    split = {(s.bucket, s.device): s.fraction for s in plan.models[0].split}
    assert split[("long", "h100-sxm")] == pytest.approx(1.0)
    assert sum(f for (b, _), f in split.items() if b == "short") == pytest.approx(1.0)


def test_prefill_and_decode_go_to_different_accelerators() -> None:
    spec = cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "mi300x", "accelerator": "mi300x", "nodes": 1}],
                   [model("llama-3.1-70b", 4, disaggregation="prefill_decode")],
                   [{"model": "llama-3.1-70b", "device": "h100-sxm", "tp": 2, "role": "prefill", "requests_per_s": 4},
                    {"model": "llama-3.1-70b", "device": "h100-sxm", "tp": 2, "role": "decode", "requests_per_s": 1},
                    {"model": "llama-3.1-70b", "device": "mi300x", "role": "prefill", "requests_per_s": 1},
                    {"model": "llama-3.1-70b", "device": "mi300x", "role": "decode", "requests_per_s": 2}], headroom=0.0)
    plan = optimize(spec)
    assert replicas(plan) == {("llama-3.1-70b", "h100-sxm", 2, Role.PREFILL): 1, ("llama-3.1-70b", "mi300x", 1, Role.DECODE): 2}
    check_packing(plan)


def test_tp_groups_stay_inside_one_node() -> None:
    spec = cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 3, "gpus_per_node": 6}],
                   [model("llama-3.1-70b", 10)],
                   [{"model": "llama-3.1-70b", "device": "h100-sxm", "tp": 4, "requests_per_s": 4}], headroom=0.0)
    plan = optimize(spec)
    # 3 TP4 groups; a 6-GPU node holds one, so one per node
    assert replicas(plan) == {("llama-3.1-70b", "h100-sxm", 4, Role.UNIFIED): 3}
    assert sorted(len(n.replicas) for n in plan.nodes) == [1, 1, 1]
    check_packing(plan)


def test_min_replicas_and_spread_across_nodes() -> None:
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 2}],
                   [model("qwen3-0.6b", 1, min_replicas=1, spread_across_nodes=True), model("qwen3-8b", 0.1, min_replicas=3)],
                   [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 10},
                    {"model": "qwen3-8b", "device": "l4", "requests_per_s": 2}])
    plan = optimize(spec)
    assert replicas(plan)[("qwen3-0.6b", "l4", 1, Role.UNIFIED)] == 2
    assert replicas(plan)[("qwen3-8b", "l4", 1, Role.UNIFIED)] == 3
    nodes_with_small = {n.name for n in plan.nodes for r in n.replicas if r.model == "qwen3-0.6b"}
    assert len(nodes_with_small) == 2
    kinds = {(b.kind, b.subject) for b in plan.explanation.binding}
    assert (ConstraintKind.SPREAD, "qwen3-0.6b") in kinds and (ConstraintKind.MIN_REPLICAS, "qwen3-8b") in kinds


def test_inventory_cap_moves_load_to_the_next_pool_and_is_reported() -> None:
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1, "max_gpus": 2},
                    {"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                   [model("llama-3.1-8b", 12)],
                   [{"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 4},
                    {"model": "llama-3.1-8b", "device": "h100-sxm", "requests_per_s": 20}], headroom=0.0)
    plan = optimize(spec)
    usage = {p.pool: p.gpus_used for p in plan.pools}
    assert usage == {"l4": 2, "h100": 1} or usage == {"l4": 0, "h100": 1}
    assert plan.cost_per_hour == pytest.approx(2.99)  # one H100 covers 12/s cheaper than 2 L4 + 1 H100
    spec2 = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1, "max_gpus": 2},
                     {"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                    [model("llama-3.1-8b", 28)],
                    [{"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 4},
                     {"model": "llama-3.1-8b", "device": "h100-sxm", "requests_per_s": 20}], headroom=0.0)
    plan2 = optimize(spec2)
    assert {p.pool: p.gpus_used for p in plan2.pools} == {"l4": 2, "h100": 1}
    assert (ConstraintKind.POOL_INVENTORY, "l4") in {(b.kind, b.subject) for b in plan2.explanation.binding}


def test_amd_partitions_serve_small_models() -> None:
    spec = cluster([{"name": "mi300x", "accelerator": "mi300x", "nodes": 1, "mig_allowed": True}],
                   [model("qwen3-0.6b", 10), model("llama-2-7b", 2)],
                   [{"model": "qwen3-0.6b", "device": "mi300x", "requests_per_s": 30},
                    {"model": "qwen3-0.6b", "device": "mi300x:cpx_nps1", "requests_per_s": 5},
                    {"model": "llama-2-7b", "device": "mi300x", "requests_per_s": 12},
                    {"model": "llama-2-7b", "device": "mi300x:cpx_nps1", "requests_per_s": 1.2}], headroom=0.0)
    plan = optimize(spec)
    assert plan.cost_per_hour == pytest.approx(4.00)
    (gpu,) = [g for n in plan.nodes for g in n.gpus if g.mode is GpuMode.PARTITIONED]
    assert gpu.partition == "cpx_nps1" and len(gpu.instances) == 8
    assert Counter(i.model for i in gpu.instances) == Counter({"qwen3-0.6b": 2, "llama-2-7b": 2, None: 4})
    (node,) = plan.nodes
    # the idle GPUs take the busy one's mode: a uniform profile, the kind AMD supports
    assert plan.partition_profiles[node.partition_profile] == [PartitionGroup(compute="CPX", memory="NPS1", gpus=8)]
    config = dcm_config(plan.partition_profiles)["gpu-config-profiles"][node.partition_profile]
    assert config == {"skippedGPUs": {"ids": []},
                      "profiles": [{"computePartition": "CPX", "memoryPartition": "NPS1", "numGPUsAssigned": 8}]}
    assert node_config_labels(plan.nodes) == {node.name: {"dcm.amd.com/gpu-config-profile": node.partition_profile}}
    assert not plan.mig_configs and node.mig_config is None


def _mi300x_fleet(*, nodes: int) -> ClusterSpec:
    """Three whole MI300X for an 8B model and one CPX-split MI300X for a small one."""
    return cluster([{"name": "mi300x", "accelerator": "mi300x", "nodes": nodes, "mig_allowed": True}],
                   [model("qwen3-0.6b", 40), model("llama-3.1-8b", 30)],
                   [{"model": "qwen3-0.6b", "device": "mi300x", "requests_per_s": 6},
                    {"model": "qwen3-0.6b", "device": "mi300x:cpx_nps1", "requests_per_s": 5},
                    {"model": "llama-3.1-8b", "device": "mi300x", "requests_per_s": 10}], headroom=0.0)


def test_amd_partition_profile_follows_gpu_order_and_notes_a_mixed_node() -> None:
    plan = optimize(_mi300x_fleet(nodes=1))
    (node,) = plan.nodes
    groups = plan.partition_profiles[node.partition_profile]
    modes = [gpu.partition or "spx_nps1" for gpu in node.gpus]
    assert [f"{g.compute}_{g.memory}".lower() for g in groups for _ in range(g.gpus)] == modes
    assert sum(g.gpus for g in groups) == 8
    assert modes.count("cpx_nps1") == 1 and len(groups) == 3  # whole GPUs, the split one, the idle ones
    assert any(f"node {node.name} mixes AMD partition modes (CPX/NPS1, SPX/NPS1)" in note
               for note in plan.explanation.notes)


def test_amd_partitions_go_to_nodes_without_whole_gpu_replicas() -> None:
    plan = optimize(_mi300x_fleet(nodes=2))
    profiles = {node.name: plan.partition_profiles[node.partition_profile] for node in plan.nodes
                if node.partition_profile}
    assert sorted(tuple((g.compute, g.gpus) for g in groups) for groups in profiles.values()) == [
        (("CPX", 8),), (("SPX", 8),)]
    assert not [note for note in plan.explanation.notes if "mixes" in note]


def test_churn_penalty_keeps_the_current_plan_after_a_small_demand_change() -> None:
    def spec(rate: float, churn: float) -> ClusterSpec:
        return cluster([{"name": "l4", "accelerator": "l4", "nodes": 2}, {"name": "a10g", "accelerator": "a10g", "nodes": 2}],
                       [model("llama-3.1-8b", rate)],
                       [{"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 2.0},
                        {"model": "llama-3.1-8b", "device": "a10g", "requests_per_s": 3.1}],
                       headroom=0.0, churn_weight=churn)

    current = optimize(spec(6.0, 0.0))
    assert replicas(current) == {("llama-3.1-8b", "a10g", 1, Role.UNIFIED): 2}
    free = optimize(spec(6.5, 0.0), current=current)  # cheapest now: 1 A10G + 2 L4, three replicas moved
    sticky = optimize(spec(6.5, 1.0), current=current)  # keep both A10G, add one L4
    assert free.replicas_moved == 3 and free.cost_per_hour == pytest.approx(1.01 + 2 * 0.70)
    assert sticky.replicas_moved == 1
    assert replicas(sticky) == {("llama-3.1-8b", "a10g", 1, Role.UNIFIED): 2, ("llama-3.1-8b", "l4", 1, Role.UNIFIED): 1}
    assert sticky.objective == pytest.approx(2 * 1.01 + 0.70 + 1.0)


def test_plan_round_trips_through_json() -> None:
    plan = optimize(load_cluster(EXAMPLES / "mixed.yaml"))
    assert Plan.model_validate(plan.model_dump(mode="json")) == plan
    check_packing(plan)


@pytest.mark.parametrize("name", ["chat.yaml", "long-document.yaml", "mixed.yaml", "mig-small-models.yaml",
                                  "melange-profile.json", "aibrix-profiles.yaml"])
def test_examples_solve(name: str) -> None:
    spec = load_cluster(EXAMPLES / name)
    plan = optimize(spec)
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour > 0
    for m in plan.models:  # Mélange's and AIBrix's files plan without headroom, as their tools do
        assert m.headroom >= spec.solver.headroom - 1e-6 or m.demand_rps == 0
    check_packing(plan)


def test_melange_profile_is_read_with_its_bucket_edges() -> None:
    spec = load_cluster(EXAMPLES / "melange-profile.json")
    (m,) = spec.models
    labels = [b.label for b in m.workload.buckets or []]
    assert "in 1-256 / out 1-128" in labels and "in 2049+ / out 513+" in labels
    assert sum(b.share for b in m.workload.buckets or []) == pytest.approx(1.0)
    assert {p.accelerator for p in spec.pools} == {"a10g", "l4", "a100-80gb", "h100-sxm"}
    h100 = next(p for p in spec.pools if p.accelerator == "h100-sxm")
    assert h100.max_gpus == 8 and h100.price_per_hour == 2.99
    # tputs[input][output], Mélange's order: the H100's 'in 2049+ / out 1-128' cell is row 2, column 0
    cap = next(c for c in spec.capacities or [] if c.device == "h100-sxm" and c.bucket == "in 2049+ / out 1-128")
    assert cap.requests_per_s == 5.5


def shared_accelerator(gpus: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A Mélange-style profile of 20 req/s over GPU entries that may share one accelerator id."""
    return {"slo": SLO, "total_request_rate": 20, "workload_distribution": [[1.0]], "gpu_info": gpus,
            "solver": {"headroom": 0, "mip_gap": 0}}


@pytest.mark.parametrize("reverse", [False, True])
def test_entries_on_one_accelerator_keep_their_own_throughput_and_price(reverse: bool) -> None:
    # on-demand A100s serve 10 req/s at $2, spot ones 5 req/s at $1.50: two on-demand GPUs ($4) are optimal
    gpus = {"on-demand": {"cost": 2.0, "tputs": [[10.0]], "accelerator": "a100-80gb"},
            "spot": {"cost": 1.5, "tputs": [[5.0]], "accelerator": "a100-80gb"}}
    plan = optimize(parse_cluster(shared_accelerator(dict(reversed(gpus.items())) if reverse else gpus)))
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour == pytest.approx(4.0)
    assert [(g.pool, g.replicas, g.capacity_rps) for m in plan.models for g in m.replicas] == [("on-demand", 2, 20.0)]


@pytest.mark.parametrize("reverse", [False, True])
def test_pools_on_one_accelerator_take_their_own_capacity_rows(reverse: bool) -> None:
    rows = [{"model": "qwen3-0.6b", "device": "a100-80gb", "requests_per_s": 10},
            {"model": "qwen3-0.6b", "device": "a100-80gb", "pool": "spot", "requests_per_s": 5}]
    spec = cluster([{"name": "on-demand", "accelerator": "a100-80gb", "nodes": 1, "price_per_hour": 2.0},
                    {"name": "spot", "accelerator": "a100-80gb", "nodes": 1, "price_per_hour": 1.5}],
                   [model("qwen3-0.6b", 20)], rows[::-1] if reverse else rows, headroom=0.0, mip_gap=0.0)
    problem = build_problem(spec, CATALOG)
    assert {o.pool: o.capacity["500x100"] for o in problem.options} == {"on-demand": 10, "spot": 5}
    plan = optimize(spec)
    assert plan.cost_per_hour == pytest.approx(4.0) and {g.pool for g in plan.models[0].replicas} == {"on-demand"}


def test_a_bucket_row_beats_a_row_for_every_bucket_whatever_the_order() -> None:
    workload = {"rate_rps": 2, "buckets": [{"name": "short", "input_tokens": 300, "output_tokens": 100, "share": 0.5},
                                           {"name": "long", "input_tokens": 3000, "output_tokens": 300, "share": 0.5}]}
    rows = [{"model": "llama-3.1-8b", "device": "l4", "bucket": "long", "requests_per_s": 1},
            {"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 4}]
    for order in (rows, rows[::-1]):
        spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1}],
                       [{"name": "llama-3.1-8b", "slo": SLO, "workload": workload}], order)
        (option,) = build_problem(spec, CATALOG).options
        assert option.capacity == {"short": 4, "long": 1}


# --- exact where exact is cheap ----------------------------------------------------------


def test_a_small_problem_gets_the_proven_optimum_by_default() -> None:
    # 383 req/s: 27 L4 ($29.97) lie within 1 % of the LP bound ($29.32); 25 L4 and one A10G ($29.78) are cheaper
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 8, "price_per_hour": 1.11},
                    {"name": "a10g", "accelerator": "a10g", "nodes": 8, "price_per_hour": 2.03}],
                   [model("qwen3-0.6b", 383)],
                   [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 14.5},
                    {"model": "qwen3-0.6b", "device": "a10g", "requests_per_s": 21.7}], headroom=0.0)
    best = min(1.11 * a + 2.03 * b for a in range(65) for b in range(65) if 14.5 * a + 21.7 * b >= 383)
    plan = optimize(spec)
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour == pytest.approx(best) == 29.78


def test_a_proven_optimum_at_gap_zero_is_labelled_optimal() -> None:
    # HiGHS proves this plan; its objective and the bound differ by float noise (2e-16)
    raw = {"slo": SLO, "total_request_rate": 153.7, "solver": {"headroom": 0, "mip_gap": 0},
           "workload_distribution": [[0.68976692, 0.63499994, 0.47910047, 0.21601435],
                                     [0.79263336, 0.8078543, 0.51245624, 0.50508415]],
           "gpu_info": {"A10G": {"cost": 1.01, "tputs": [[0.418, 0.683, 0.21, 0.158], [0.191, 0.544, 0.323, 0.294]]},
                        "L4": {"cost": 0.7, "tputs": [[1.056, 0.173, 0.235, 0.228], [0.223, 0.488, 0.188, 0.099]]},
                        "A100": {"cost": 2.1, "accelerator": "a100-80gb",
                                 "tputs": [[5.486, 0.963, 2.018, 0.903], [2.061, 1.016, 0.944, 0.449]]},
                        "H100": {"cost": 2.99, "accelerator": "h100-sxm",
                                 "tputs": [[2.706, 5.258, 1.523, 2.427], [2.161, 3.829, 2.695, 1.894]]}}}
    plan = optimize(parse_cluster(raw))
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour == pytest.approx(139.91)


def test_small_problems_are_solved_exactly_first_unless_the_spec_sets_a_gap() -> None:
    from hetsched.optimizer.build import DEFAULT_MIP_GAP

    def rule(spec: ClusterSpec, gap: float | None) -> tuple[bool, bool, float]:
        problem = build_problem(spec.model_copy(update={"solver": spec.solver.model_copy(update={"mip_gap": gap})}),
                                CATALOG)
        return problem.small, problem.exact_first, problem.mip_gap

    assert rule(tight_fleet(0), None) == (True, True, DEFAULT_MIP_GAP)  # six models, 51 integer columns
    assert rule(tight_fleet(0, models=24), None) == (False, True, DEFAULT_MIP_GAP)  # 123 integer columns
    many = tight_fleet(0, models=24)
    one = many.model_copy(update={"models": many.models[:1],
                                  "capacities": [c for c in many.capacities or [] if c.model == "m0"]})
    assert rule(one, None)[0]
    assert rule(tight_fleet(0), 0.05) == (True, False, 0.05)


# --- infeasible and degenerate inputs ------------------------------------------------


def test_demand_beyond_inventory_is_explained_with_the_computed_shortfall() -> None:
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1, "max_gpus": 4}],
                   [model("llama-3.1-8b", 20)],
                   [{"model": "llama-3.1-8b", "device": "l4", "requests_per_s": 4}], headroom=0.0)
    plan = optimize(spec)
    assert plan.status is PlanStatus.INFEASIBLE and plan.nodes == []
    (reason,) = plan.explanation.infeasible
    # 4 L4 × 4/s = 16/s of 20/s: demand exceeds supply by 25 %
    assert "demand for llama-3.1-8b exceeds everything the inventory can supply by 25%" in reason


def test_model_too_large_for_every_allowed_config_names_the_sizes() -> None:
    spec = parse_cluster({"pools": [{"name": "l40s", "accelerator": "l40s", "nodes": 1}],
                          "models": [model("llama-3.1-70b", 1, max_tp=1)]})
    problem = build_problem(spec, CATALOG, capacity_source=lambda query: 1.0)
    assert problem.options == ()
    plan = optimize(spec, capacity_source=lambda query: 1.0)
    (reason,) = plan.explanation.infeasible
    assert reason.startswith("llama-3.1-70b needs 14") and "offers 48 GB (l40s × TP1)" in reason


def test_no_config_for_one_bucket_is_explained() -> None:
    workload = {"rate_rps": 2, "buckets": [{"name": "short", "input_tokens": 300, "output_tokens": 100, "share": 0.5},
                                           {"name": "long", "input_tokens": 30000, "output_tokens": 300, "share": 0.5}]}
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1}], [{"name": "llama-3.1-8b", "slo": SLO, "workload": workload}],
                   [{"model": "llama-3.1-8b", "device": "l4", "bucket": "short", "requests_per_s": 4}])
    plan = optimize(spec)
    assert plan.explanation.infeasible == [
        "no config in the inventory meets the SLO of llama-3.1-8b for requests of bucket 'long'"]


def test_minimums_beyond_inventory_are_explained() -> None:
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1, "max_gpus": 2}],
                   [model("qwen3-0.6b", 0.5, min_replicas=3)],
                   [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 10}])
    plan = optimize(spec)
    assert plan.explanation.infeasible == ["minimum replicas need at least 3.0 GPUs; the pools have 2"]


def test_spread_with_a_single_node_is_explained() -> None:
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1}],
                   [model("qwen3-0.6b", 0.5, spread_across_nodes=True)],
                   [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 10}])
    plan = optimize(spec)
    assert plan.status is PlanStatus.INFEASIBLE
    assert "asks for replicas on two nodes" in plan.explanation.infeasible[0]


def test_zero_demand_keeps_only_minimum_replicas() -> None:
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1}, {"name": "a10g", "accelerator": "a10g", "nodes": 1}],
                   [model("qwen3-0.6b", 0.0), model("qwen3-8b", 0.0, min_replicas=0)],
                   [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 10},
                    {"model": "qwen3-0.6b", "device": "a10g", "requests_per_s": 10},
                    {"model": "qwen3-8b", "device": "l4", "requests_per_s": 2}])
    plan = optimize(spec)
    assert replicas(plan) == {("qwen3-0.6b", "l4", 1, Role.UNIFIED): 1}
    assert plan.cost_per_hour == pytest.approx(0.70)
    assert {m.name: m.headroom for m in plan.models} == {"qwen3-0.6b": 0.0, "qwen3-8b": 0.0}


# --- malformed inputs ------------------------------------------------------------------


@pytest.mark.parametrize(("patch", "field", "message"), [
    (lambda raw: raw["models"][0]["workload"].update(rate_rps=-1), "models[0].workload.rate_rps", "greater than or equal to 0"),
    (lambda raw: raw["pools"][0].update(nodes=0), "pools[0].nodes", "greater than or equal to 1"),
    (lambda raw: raw["pools"][0].update(accelerator="h1000"), "pools[0].accelerator", "'h100-sxm'?"),
    (lambda raw: raw["capacities"][0].update(device="h100-sxm:9g.99gb"), "capacities[0].device", "unknown MIG profile"),
    (lambda raw: raw["capacities"][0].update(bucket="tiny"), "capacities[0].bucket", "unknown bucket 'tiny'"),
    (lambda raw: raw["capacities"][0].update(role="decode"), "capacities[0].role", "does not apply"),
    (lambda raw: raw["models"][0]["workload"].update(buckets=[{"input_tokens": 10, "output_tokens": 10, "share": 0.5}],
                                                     input_tokens=None, output_tokens=None),
     "models[0].workload", "add up to 1"),
    (lambda raw: raw["models"][0].update(allowed_pools=["h10"]), "models[0].allowed_pools[0]", "did you mean 'h100'"),
    (lambda raw: raw["models"][0].update(allowed_accelerators=["l40"]), "models[0].allowed_accelerators[0]", "'l40s'"),
    (lambda raw: raw["capacities"][0].update(model="llama"), "capacities[0].model", "unknown model 'llama'"),
    (lambda raw: raw["models"][0].update(name="chat", model="llama-3.1-8b"), "capacities[0].model",
     "no entry of models is named 'llama-3.1-8b': models[0] serves llama-3.1-8b under the name 'chat', and a capacity "
     "row names its model entry by that name; write 'chat' here, or rename models[0]"),
    (lambda raw: raw["models"][0].update(config={"model_type": "llama", "hidden_size": 64}), "models[0].config.num_hidden_layers",
     "required field is missing in models[0].config"),
    (lambda raw: raw["capacities"][0].update(pool="h10"), "capacities[0].pool", "did you mean 'h100'"),
    (lambda raw: raw["pools"][0].update(price_per_hour=math.inf), "pools[0].price_per_hour", "finite number"),
    (lambda raw: raw["models"][0]["workload"].update(rate_rps=math.nan), "models[0].workload.rate_rps",
     "finite number"),
    (lambda raw: raw["models"][0].update(slo={**SLO, "ttft_ms": math.inf}), "models[0].slo.ttft_ms", "finite number"),
    (lambda raw: raw["capacities"][0].update(requests_per_s=-math.inf), "capacities[0].requests_per_s",
     "finite number"),
    (lambda raw: raw.update(solver={"time_limit_s": math.inf}), "solver.time_limit_s", "finite number"),
    (lambda raw: raw["pools"][1].update(nodes=10**12), "pools[1].nodes",
     "pool 'l4' brings the pools to 8,000,000,000,008 GPUs, more than solver.max_inventory_gpus (100,000)"),
    (lambda raw: raw.update(solver={"max_inventory_gpus": 9}), "pools[1].nodes", "raise solver.max_inventory_gpus"),
    (lambda raw: raw["capacities"][0].update(pool="l4"), "capacities[0].pool", "pool 'l4' holds l4, not h100-sxm"),
    (lambda raw: raw["capacities"].append(raw["capacities"][0]), "capacities[1]", "repeats capacities[0]"),
    (lambda raw: raw["capacities"][0].update(tp=3), "capacities[0]",
     "cannot run on h100-sxm at TP 3: 32 attention heads do not split evenly"),
    (lambda raw: raw["capacities"][0].update(device="l4", model="llama-3.1-70b") or raw["models"].append(
        model("llama-3.1-70b", 1)), "capacities[0]", "llama-3.1-70b cannot run on l4 at TP 1: needs"),
    (lambda raw: raw["models"][0].update(quantization="int3"), "models[0].quantization", "expected one of"),
    (lambda raw: raw["pools"][1].update(mig_allowed=True), "pools[1].partition_allowed", "neither MIG nor compute partitions"),
    (lambda raw: raw["models"].append(raw["models"][0]), None, "model names repeat"),
    (lambda raw: raw.pop("pools"), "pools", "Field required"),
])
def test_malformed_input_names_the_field(patch: Any, field: str | None, message: str) -> None:
    raw: dict[str, Any] = {
        "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "l4", "accelerator": "l4", "nodes": 1}],
        "models": [model("llama-3.1-8b", 3)],
        "capacities": [{"model": "llama-3.1-8b", "device": "h100-sxm", "bucket": "500x100", "requests_per_s": 5}],
    }
    patch(raw)
    with pytest.raises(InputError) as caught:
        optimize(parse_cluster(raw))
    assert message in str(caught.value)
    if field is not None:
        assert caught.value.field == field


def test_capacity_rows_the_tables_cannot_use_are_named_in_the_rejection() -> None:
    pools = [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}]
    rows = [{"model": "llama-3.1-8b", "device": "h100-sxm:1g.20gb", "requests_per_s": 1},
            {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 16, "requests_per_s": 50},
            {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 2, "requests_per_s": 0}]
    plan = optimize(cluster(pools, [model("llama-3.1-8b", 1)], rows))
    assert plan.status is PlanStatus.INFEASIBLE
    reason = " ".join(plan.explanation.infeasible)
    assert "partitions need a pool that allows partitioning" in reason
    assert "rows at TP 16 need more GPUs than a node of pool 'h100' holds (8)" in reason
    assert "some of its rows give 0 requests/s" in reason


def test_a_row_the_memory_model_finds_tight_is_used_as_measured_with_a_note() -> None:
    pools = [{"name": "t4", "accelerator": "t4", "nodes": 1}]
    rows = [{"model": "llama-2-7b", "device": "t4", "requests_per_s": 2}]  # 13.5 GB of weights on 16 GB: tight
    plan = optimize(cluster(pools, [model("llama-2-7b", 1)], rows))
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour > 0
    assert any(note.startswith("capacities[0]: by the memory model llama-2-7b does not fit t4")
               for note in plan.explanation.notes)


def test_missing_capacities_without_a_source_is_an_input_error() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}], "models": [model("qwen3-0.6b", 1)]})
    with pytest.raises(InputError) as caught:
        build_problem(spec, CATALOG)
    assert caught.value.field == "models[0]"


def test_malformed_melange_profile_names_the_field() -> None:
    raw = {"slo": SLO, "total_request_rate": 1, "workload_distribution": [[0.5, 0.5]],
           "gpu_info": {"A10G": {"cost": 1.0, "tputs": [[1.0]]}}}
    with pytest.raises(InputError) as caught:
        parse_cluster(raw)
    assert caught.value.field == "gpu_info.A10G.tputs"
    raw["gpu_info"] = {"B9000": {"cost": 1.0, "tputs": [[1.0, 2.0]], "accelerator": "b9000"}}
    with pytest.raises(InputError) as caught:
        parse_cluster(raw)
    assert caught.value.field == "gpu_info.B9000.accelerator" and "b9000" in str(caught.value)
    raw["gpu_info"] = {"A10G": {"cost": math.inf, "tputs": [[1.0, math.nan]]}}
    with pytest.raises(InputError) as caught:
        parse_cluster(raw)
    assert caught.value.field == "gpu_info.A10G.cost" and "finite number" in str(caught.value)


# --- capacities computed by the SLO search -----------------------------------------------


def test_computed_capacities_follow_the_search_per_device_and_role() -> None:
    calls: list[tuple[str, int, int]] = []

    def find(model, device, *, tp, workload, slo, engine, weight_dtype, correction=None):  # type: ignore[no-untyped-def]
        calls.append((device.id, tp, workload.output_len.value))
        rate = {"h100-sxm": 12.0, "l4": 2.5}.get(device.id)
        if rate is None:
            raise InfeasibleError(f"{device.id} misses the SLO")
        return SimpleNamespace(requests_per_s=rate * device.compute_fraction)

    spec = parse_cluster({
        "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}, {"name": "h100b", "accelerator": "h100-sxm", "nodes": 1},
                  {"name": "l4", "accelerator": "l4", "nodes": 1}, {"name": "a10g", "accelerator": "a10g", "nodes": 1}],
        "models": [model("llama-3.1-8b", 5, disaggregation="prefill_decode")],
        "solver": {"headroom": 0.0}})
    plan = optimize(spec, capacity_source=SimulatedCapacity(find=find))
    assert {group.role for group in plan.models[0].replicas} == {Role.PREFILL, Role.DECODE}
    assert {out for _, _, out in calls} == {1, 100}  # prefill replicas answer one token, decode replicas the rest
    unified = spec.model_copy(update={"models": [spec.models[0].model_copy(update={"disaggregation": "unified"})]})
    calls.clear()
    plan = optimize(unified, capacity_source=SimulatedCapacity(find=find))
    assert replicas(plan) == {("llama-3.1-8b", "l4", 1, Role.UNIFIED): 2}
    assert sorted(calls) == [("a10g", 1, 100), ("a10g", 2, 100), ("a10g", 4, 100), ("a10g", 8, 100),
                             ("h100-sxm", 1, 100), ("l4", 1, 100)]  # one search per device, not per pool
    assert [r.reason for r in build_problem(unified, CATALOG, capacity_source=SimulatedCapacity(find=find)).rejections
            ] == ["a10g cannot meet the SLO of llama-3.1-8b (unified) at TP 1, 2, 4, 8"]


def test_prefill_capacity_is_searched_on_one_token_outputs_under_the_ttft_target() -> None:
    seen = []

    def find(model, device, *, tp, workload, slo, engine, weight_dtype, correction=None):  # type: ignore[no-untyped-def]
        seen.append((workload.output_len.value, slo.ttft_ms, slo.tpot_ms))
        return SimpleNamespace(requests_per_s=3.0)

    source = SimulatedCapacity(find=find)
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [model("qwen3-0.6b", 1, disaggregation="prefill_decode")],
                          "capacities": [{"model": "qwen3-0.6b", "device": "l4", "role": "decode", "requests_per_s": 4}]})
    problem = build_problem(spec.model_copy(update={"capacities": None}), CATALOG, capacity_source=lambda q: 0.0)
    assert problem.options == ()
    bucket = model_buckets(spec.models[0])[0]
    arch = load_model("qwen3-0.6b")
    query = CapacityQuery(spec.models[0], arch, Device.whole(CATALOG.get("l4")), 1, Role.PREFILL, bucket, None)
    transfer_ms = 1e3 * kv_transfer_seconds(arch, long_prompt_tokens(bucket.workload),
                                            link_gbs=CATALOG.get("l4").network_gbs)
    assert source(query) == 3.0 and seen == [(1, pytest.approx(SLO["ttft_ms"] - transfer_ms), RELAXED_MS)]
    assert 0 < transfer_ms < SLO["ttft_ms"]


def test_decode_capacity_is_searched_with_the_prompt_cache_arriving_and_a_bounded_wait() -> None:
    seen = []

    def find(model, device, *, tp, workload, slo, engine, weight_dtype, correction=None):  # type: ignore[no-untyped-def]
        seen.append((workload.prefix_sharing, slo.ttft_ms, slo.tpot_ms))
        return SimpleNamespace(requests_per_s=5.0)

    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [model("qwen3-0.6b", 1, disaggregation="prefill_decode")]})
    bucket = model_buckets(spec.models[0])[0]
    query = CapacityQuery(spec.models[0], load_model("qwen3-0.6b"), Device.whole(CATALOG.get("l4")), 1, Role.DECODE,
                          bucket, None)
    assert SimulatedCapacity(find=find)(query) == 5.0 and seen == [(1.0, SLO["ttft_ms"], SLO["tpot_ms"])]


def test_a_link_too_slow_for_the_kv_cache_leaves_no_prefill_capacity() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [{**model("llama-3.1-70b", 1, disaggregation="prefill_decode"),
                                      "slo": {"ttft_ms": 50, "tpot_ms": 100},
                                      "workload": {"rate_rps": 1, "input_tokens": 8000, "output_tokens": 100}}]})
    bucket = model_buckets(spec.models[0])[0]
    arch = load_model("llama-3.1-70b")
    query = CapacityQuery(spec.models[0], arch, Device.whole(CATALOG.get("l4")), 8, Role.PREFILL, bucket, None)
    with pytest.raises(InfeasibleError, match="KV cache of llama-3.1-70b off l4 .* more than the TTFT target"):
        role_query(Role.PREFILL, model=arch, device=query.device, workload=bucket.workload, slo=spec.models[0].slo)
    assert SimulatedCapacity(find=lambda *a, **k: SimpleNamespace(requests_per_s=9.0))(query) == 0.0
    problem = build_problem(spec, CATALOG, capacity_source=lambda q: 9.0)
    assert not any(o.role is Role.PREFILL for o in problem.options)
    assert any("KV cache of llama-3.1-70b off l4" in r.reason and "more than the TTFT target of 50 ms" in r.reason
               for r in problem.rejections)


def test_simulated_capacity_plans_a_small_model_end_to_end() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 400, "tpot_ms": 40},
                                      "workload": {"rate_rps": 30, "input_tokens": 300, "output_tokens": 100}}]})
    plan = optimize(spec)
    (group,) = plan.models[0].replicas
    assert group.device == "l4" and group.replicas >= 1
    assert group.capacity_rps >= 30 * 1.1 - 1e-6


def test_lp_guided_rounding_gives_a_feasible_point_near_the_relaxation() -> None:
    from scipy.optimize import Bounds, milp

    from hetsched.optimizer.formulation import formulate
    from hetsched.optimizer.rounding import round_relaxation

    problem = build_problem(load_cluster(EXAMPLES / "mixed.yaml"), CATALOG)
    form = formulate(problem)
    relaxed = milp(form.cost, constraints=form.constraints(), bounds=Bounds(form.lower, form.upper))
    values = round_relaxation(problem, form, relaxed.x)
    assert values is not None
    rows = form.constraints()[0].A @ values
    assert (rows >= form.constraints()[0].lb - 1e-6).all() and (rows <= form.constraints()[0].ub + 1e-6).all()
    assert relaxed.fun <= form.cost @ values <= 1.5 * relaxed.fun
    integers = values[form.integrality == 1]
    assert (abs(integers - integers.round()) < 1e-9).all()


def test_rounding_past_its_deadline_skips_only_the_improvement() -> None:
    from scipy.optimize import Bounds, milp

    from hetsched.optimizer.formulation import formulate
    from hetsched.optimizer.rounding import round_relaxation

    problem = build_problem(load_cluster(EXAMPLES / "mixed.yaml"), CATALOG)
    form = formulate(problem)
    relaxed = milp(form.cost, constraints=form.constraints(), bounds=Bounds(form.lower, form.upper))
    repaired = round_relaxation(problem, form, relaxed.x, deadline=0.0)
    improved = round_relaxation(problem, form, relaxed.x)
    assert repaired is not None and improved is not None
    (constraint,) = form.constraints()
    rows = constraint.A @ repaired
    assert (rows >= constraint.lb - 1e-6).all() and (rows <= constraint.ub + 1e-6).all()
    assert form.cost @ improved <= form.cost @ repaired + 1e-9


def tight_fleet(seed: int, *, models: int = 6) -> ClusterSpec:
    """Small and large models on a MIG pool, a whole-GPU pool and a cheap pool, with demand that fills the
    cheapest capacity, so rounding the relaxation up overflows pools and must be repaired."""
    import random

    rng = random.Random(seed)
    nodes = -(-models // 6)
    pools = [{"name": "h100-mig", "accelerator": "h100-sxm", "nodes": nodes, "mig_allowed": True},
             {"name": "a100", "accelerator": "a100-80gb", "nodes": nodes},
             {"name": "l4", "accelerator": "l4", "nodes": 2 * nodes}]
    specs, capacities = [], []
    for k in range(models):
        name = f"m{k}"
        small = k % 2 == 0
        extra = {"min_replicas": 2, "spread_across_nodes": True} if k == 1 else {}
        specs.append(model(name, rng.uniform(5, 40), **extra))
        capacities += [{"model": name, "device": "h100-sxm", "requests_per_s": rng.uniform(15, 25)},
                       {"model": name, "device": "a100-80gb", "requests_per_s": rng.uniform(8, 14)},
                       {"model": name, "device": "l4", "requests_per_s": rng.uniform(2, 4)}]
        if small:
            capacities += [{"model": name, "device": "h100-sxm:1g.10gb", "requests_per_s": rng.uniform(3, 6)},
                           {"model": name, "device": "h100-sxm:3g.40gb", "requests_per_s": rng.uniform(8, 12)}]
    return cluster(pools, specs, capacities, headroom=0.2, mip_gap=0.5)


@pytest.mark.parametrize("seed", range(6))
def test_repair_rounding_gives_a_feasible_plan_on_full_pools(seed: int) -> None:
    from scipy.optimize import Bounds, milp

    from hetsched.optimizer.formulation import formulate
    from hetsched.optimizer.optimize import assemble
    from hetsched.optimizer.rounding import round_relaxation
    from hetsched.optimizer.solve import solve

    spec = tight_fleet(seed)
    problem = build_problem(spec, CATALOG)
    form = formulate(problem)
    relaxed = milp(form.cost, constraints=form.constraints(), bounds=Bounds(form.lower, form.upper))
    assert relaxed.x is not None
    values = round_relaxation(problem, form, relaxed.x)
    assert values is not None
    assert relaxed.fun - 1e-6 <= form.cost @ values
    integers = values[form.integrality == 1]
    assert (abs(integers - integers.round()) < 1e-9).all()

    solution = solve(problem)  # mip_gap 0.5: the repaired rounding is the plan
    assert solution.stats.message.startswith("repair rounding")
    plan = assemble(spec.name, problem, solution)
    check_packing(plan)  # inventory per pool, MIG layouts valid by check_layout, TP groups in one node
    for planned, rules in zip(plan.models, spec.models):
        assert sum(g.replicas for g in planned.replicas) >= max(rules.min_replicas, 2 * rules.spread_across_nodes)
        assert planned.headroom >= 0.2 - 1e-6  # every bucket covered at demand × (1 + headroom)
        if rules.spread_across_nodes:
            assert len({n.name for n in plan.nodes for r in n.replicas if r.model == rules.name}) >= 2


def test_a_plan_beyond_the_gap_target_is_improved_and_its_gap_is_backed_by_a_bound() -> None:
    from scipy.optimize import Bounds, milp

    from hetsched.optimizer.formulation import formulate
    from hetsched.optimizer.optimize import assemble
    from hetsched.optimizer.rounding import round_relaxation
    from hetsched.optimizer.solve import solve

    spec = tight_fleet(0, models=24)
    spec = spec.model_copy(update={"solver": spec.solver.model_copy(update={"mip_gap": 0.0001})})
    problem = build_problem(spec, CATALOG)
    assert not problem.small  # through the decomposition, not straight to HiGHS
    form = formulate(problem)
    relaxed = milp(form.cost, constraints=form.constraints(), bounds=Bounds(form.lower, form.upper))
    rounded = round_relaxation(problem, form, relaxed.x)
    assert rounded is not None
    solution = solve(problem)
    stats = solution.stats
    assert stats.objective is not None and stats.bound is not None and stats.gap is not None
    assert stats.objective <= form.cost @ rounded + 1e-6
    assert relaxed.fun - 1e-6 <= stats.bound <= stats.objective + 1e-6
    assert stats.gap == pytest.approx((stats.objective - stats.bound) / stats.objective)
    check_packing(assemble(spec.name, problem, solution))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("churn", [False, True])
def test_lagrangian_bound_lies_between_the_lp_bound_and_the_optimum(seed: int, churn: bool) -> None:
    from dataclasses import replace

    from scipy.optimize import Bounds, milp

    from hetsched.optimizer.decompose import lagrangian_bound, price, relax
    from hetsched.optimizer.formulation import formulate
    from hetsched.optimizer.rounding import round_relaxation
    from hetsched.optimizer.solve import solve

    problem = build_problem(tight_fleet(seed), CATALOG)
    if churn:  # a current plan one replica off here and there, and moves that cost
        current = {key: max(0, n - i % 2) for i, (key, n) in enumerate(solve(problem).counts(problem).items())}
        problem = replace(problem, current=current, churn_weight=1.0)
    form = formulate(problem)
    optimum = milp(form.cost, constraints=form.constraints(), integrality=form.integrality,
                   bounds=Bounds(form.lower, form.upper), options={"mip_rel_gap": 1e-9})
    assert optimum.status == 0
    relaxation = relax(form)
    assert relaxation is not None
    pricing = price(problem, form, relaxation)
    # the duals price the LP exactly: the blocks' LP values plus the constant give back its value
    assert pricing.constant + pricing.free_part + sum(pricing.lp_value) == pytest.approx(relaxation.bound)
    rounded = round_relaxation(problem, form, relaxation.values)
    for incumbent in (None, rounded):
        bound = lagrangian_bound(problem, form, relaxation, pricing, incumbent=incumbent, time_limit=10.0)
        assert relaxation.bound - 1e-6 <= bound <= optimum.fun + 1e-6


def test_lagrangian_bound_sees_what_integrality_costs_each_model() -> None:
    from hetsched.optimizer.decompose import lagrangian_bound, price, relax
    from hetsched.optimizer.formulation import formulate

    # one model, one accelerator: 2.5 replicas' worth of demand needs 3 whole GPUs, which the LP prices at 2.5
    spec = cluster([{"name": "a100", "accelerator": "a100-80gb", "nodes": 1}], [model("m", 25.0)],
                   [{"model": "m", "device": "a100-80gb", "requests_per_s": 10.0}], headroom=0.0)
    problem = build_problem(spec, CATALOG)
    form = formulate(problem)
    relaxation = relax(form)
    assert relaxation is not None
    price_per_gpu = CATALOG.get("a100-80gb").price_per_hour
    assert relaxation.bound == pytest.approx(2.5 * price_per_gpu)
    bound = lagrangian_bound(problem, form, relaxation, price(problem, form, relaxation), incumbent=None,
                             time_limit=5.0)
    assert bound == pytest.approx(3 * price_per_gpu)


def test_lagrangian_bound_folds_dominated_options_and_stays_below_the_optimum() -> None:
    from scipy.optimize import Bounds, milp

    from hetsched.optimizer.decompose import lagrangian_bound, price, relax
    from hetsched.optimizer.formulation import formulate

    # the same GPU in two pools, the cheaper one small, and a slower dearer one: 3.5 fast replicas' worth
    spec = cluster([{"name": "small", "accelerator": "a100-80gb", "nodes": 1, "max_gpus": 2},
                    {"name": "big", "accelerator": "a100-80gb", "nodes": 1},
                    {"name": "slow", "accelerator": "l4", "nodes": 1}],
                   [model("m", 35.0)],
                   [{"model": "m", "device": "a100-80gb", "requests_per_s": 10.0},
                    {"model": "m", "device": "l4", "requests_per_s": 4.0}], headroom=0.0)
    problem = build_problem(spec, CATALOG)
    form = formulate(problem)
    optimum = milp(form.cost, constraints=form.constraints(), integrality=form.integrality,
                   bounds=Bounds(form.lower, form.upper), options={"mip_rel_gap": 1e-9})
    relaxation = relax(form)
    assert relaxation is not None
    bound = lagrangian_bound(problem, form, relaxation, price(problem, form, relaxation), incumbent=None,
                             time_limit=5.0)
    assert relaxation.bound + 1e-6 < bound <= optimum.fun + 1e-6


def decomposed(seed: int) -> SimpleNamespace:
    """A tight fleet's problem, formulation, LP relaxation, repaired rounding and pricing."""
    from hetsched.optimizer.decompose import price, relax
    from hetsched.optimizer.formulation import formulate
    from hetsched.optimizer.rounding import round_relaxation

    problem = build_problem(tight_fleet(seed), CATALOG)
    form = formulate(problem)
    relaxation = relax(form)
    assert relaxation is not None
    rounded = round_relaxation(problem, form, relaxation.values)
    assert rounded is not None
    return SimpleNamespace(problem=problem, form=form, relaxation=relaxation, rounded=rounded,
                           pricing=price(problem, form, relaxation))


def assert_rows_hold(form: Any, values: Any, rows: Any = slice(None), columns: Any = slice(None)) -> None:
    (constraint,) = form.constraints()
    lhs = constraint.A[rows][:, columns] @ values
    assert (lhs >= constraint.lb[rows] - 1e-6).all() and (lhs <= constraint.ub[rows] + 1e-6).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_best_mix_of_each_models_plans_fits_every_pool_and_is_no_dearer(seed: int) -> None:
    from hetsched.optimizer.decompose import BlockPlans, combine, master_prices, priced_plans
    from hetsched.optimizer.rounding import complete

    d = decomposed(seed)
    problem, form, relaxation, rounded, pricing = d.problem, d.form, d.relaxation, d.rounded, d.pricing
    candidates = BlockPlans(pricing, [rounded])
    prices = None
    for _ in range(3):  # rounds at the relaxation's duals, then at the master's
        plans = priced_plans(problem, form, relaxation, pricing, rounded, prices=prices, time_limit=5.0)
        for g, plan in plans.items():
            candidates.add(g, plan)
        mixed = combine(problem, form, candidates, time_limit=5.0)
        assert mixed is not None
        for g, part in enumerate(pricing.blocks):  # every model takes one of its candidate plans
            assert any(np.array_equal(mixed[part.columns], plan) for plan in candidates.plans[g])
        values = complete(problem, form, mixed)
        assert values is not None
        assert_rows_hold(form, values)
        assert relaxation.bound - 1e-6 <= form.cost @ values <= form.cost @ rounded + 1e-6
        prices = master_prices(form, candidates, relaxation)
        assert prices is not None
        (constraint,) = form.constraints()
        assert (prices[constraint.ub < np.inf] >= 0).all() and (prices[pricing.coupling == 0] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_plans_the_bound_finds_are_each_models_own_and_mix_into_a_feasible_plan(seed: int) -> None:
    from hetsched.optimizer.decompose import BlockPlans, cheapest_mix, lagrangian_bound

    d = decomposed(seed)
    candidates = BlockPlans(d.pricing, [d.rounded])
    lagrangian_bound(d.problem, d.form, d.relaxation, d.pricing, incumbent=d.rounded, candidates=candidates,
                     time_limit=5.0)
    assert candidates.count > len(d.pricing.blocks)  # the bound found plans besides the rounded ones
    for g, plans in enumerate(candidates.plans):  # every plan holds its model's own rows and replica bounds
        part = d.pricing.blocks[g]
        for plan in plans:
            assert_rows_hold(d.form, plan, part.rows, part.columns)
            assert (plan <= d.form.upper[part.columns] + 1e-9).all()
    mixed = cheapest_mix(d.problem, d.form, candidates, d.rounded, time_limit=5.0)
    if mixed is not None:
        assert_rows_hold(d.form, mixed)
        assert d.relaxation.bound - 1e-6 <= d.form.cost @ mixed < d.form.cost @ d.rounded


def test_the_mix_takes_the_cheapest_plans_that_fit_together() -> None:
    from itertools import product

    from hetsched.optimizer.decompose import BlockPlans, combine, price, relax
    from hetsched.optimizer.formulation import formulate

    # two models that would each rather have 3 of the 4 cheap L4s than H100s: only one of them can
    spec = cluster([{"name": "l4", "accelerator": "l4", "nodes": 1, "max_gpus": 4},
                    {"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                   [model("a", 12.0), model("b", 11.0)],
                   [{"model": m, "device": d, "requests_per_s": r}
                    for m in ("a", "b") for d, r in (("l4", 4.0), ("h100-sxm", 12.0))], headroom=0.0)
    problem = build_problem(spec, CATALOG)
    form = formulate(problem)
    relaxation = relax(form)
    assert relaxation is not None
    pricing = price(problem, form, relaxation)

    def all_on(pool: str, count: int) -> np.ndarray:
        values = np.zeros(len(form.cost))
        for i, option in enumerate(problem.options):
            if option.pool == pool:
                values[form.n_col[i]] = count
                for bucket in option.capacity:
                    values[form.x_index[(i, bucket)]] = 1.0
        return values

    on_h100, on_l4 = all_on("h100", 1), all_on("l4", 3)
    mixed = combine(problem, form, BlockPlans(pricing, [on_h100, on_l4]), time_limit=5.0)
    assert mixed is not None
    (constraint,) = form.constraints()

    def mix(choices: tuple[np.ndarray, ...]) -> np.ndarray:
        values = np.zeros(len(form.cost))
        for choice, part in zip(choices, pricing.blocks):
            values[part.columns] = choice[part.columns]
        return values

    fitting = [v for v in map(mix, product((on_h100, on_l4), repeat=len(pricing.blocks)))
               if (constraint.A @ v <= constraint.ub + 1e-9).all() and (constraint.A @ v >= constraint.lb - 1e-9).all()]
    cheapest = min(float(form.cost @ v) for v in fitting)
    assert form.cost @ mixed == pytest.approx(cheapest)
    assert form.cost @ mixed == pytest.approx(3 * CATALOG.get("l4").price_per_hour + CATALOG.get("h100-sxm").price_per_hour)


def test_a_prefill_replica_serves_no_more_prompts_than_its_network_carries() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [{**model("qwen3-0.6b", 1, disaggregation="prefill_decode"),
                                      "workload": {"rate_rps": 1, "input_tokens": 4000, "output_tokens": 100}}],
                          "capacities": [{"model": "qwen3-0.6b", "device": "l4", "role": "prefill", "requests_per_s": 1000},
                                         {"model": "qwen3-0.6b", "device": "l4", "role": "decode", "requests_per_s": 50}]})
    problem = build_problem(spec, CATALOG)
    prefill = next(o for o in problem.options if o.role is Role.PREFILL)
    shipped = kv_cache_bytes(load_model("qwen3-0.6b"), 4000)
    assert prefill.capacity[next(iter(prefill.capacity))] == pytest.approx(CATALOG.get("l4").network_gbs * 1e9 / shipped)
    decode = next(o for o in problem.options if o.role is Role.DECODE)
    assert decode.capacity[next(iter(decode.capacity))] == 50


def test_a_problem_with_more_columns_than_the_solver_may_take_is_refused_naming_the_limit() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1},
                                    {"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                          "models": [model("qwen3-0.6b", 1)],
                          "capacities": [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 5},
                                         {"model": "qwen3-0.6b", "device": "h100-sxm", "requests_per_s": 50}],
                          "solver": {"max_variables": 3}})
    with pytest.raises(InputError) as caught:
        build_problem(spec, CATALOG)
    assert caught.value.field == "solver.max_variables" and "models 1, buckets 1, pools 2: 4 MILP columns" in str(caught.value)
    assert build_problem(spec.model_copy(update={"solver": spec.solver.model_copy(update={"max_variables": 4})}),
                         CATALOG).options


# --- disaggregation auto: each model planned both ways, the cheaper kept ------------------


AUTO_RATES = {("llama-3.1-8b", Role.UNIFIED): 1.0, ("llama-3.1-8b", Role.PREFILL): 10.0,
              ("llama-3.1-8b", Role.DECODE): 10.0, ("qwen3-0.6b", Role.UNIFIED): 10.0,
              ("qwen3-0.6b", Role.PREFILL): 1.0, ("qwen3-0.6b", Role.DECODE): 1.0}


def auto_cluster() -> ClusterSpec:
    return parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 4}],
                          "models": [model("llama-3.1-8b", 4, disaggregation="auto"),
                                     model("qwen3-0.6b", 4, disaggregation="auto")],
                          "solver": {"headroom": 0.0}})


def test_auto_keeps_per_model_the_cheaper_mode_and_searches_each_capacity_once() -> None:
    calls: Counter[tuple[str, str, int, Role, str]] = Counter()

    def source(query: CapacityQuery) -> float:
        calls[(query.spec.name, query.device.id, query.tp, query.role, query.bucket.label)] += 1
        return AUTO_RATES[(query.spec.name, query.role)]

    plan = optimize(auto_cluster(), catalog=CATALOG, capacity_source=source)
    # llama: 4 unified replicas ($2.80) or one prefill and one decode ($1.40); qwen: 1 unified or 8 role replicas
    assert replicas(plan) == {("llama-3.1-8b", "l4", 1, Role.PREFILL): 1, ("llama-3.1-8b", "l4", 1, Role.DECODE): 1,
                              ("qwen3-0.6b", "l4", 1, Role.UNIFIED): 1}
    assert plan.cost_per_hour == pytest.approx(3 * 0.70)
    assert plan.explanation.notes[:2] == [
        "llama-3.1-8b: disaggregation auto chose prefill_decode: the plan costs $2.10/h disaggregated, $3.50/h unified",
        "qwen3-0.6b: disaggregation auto chose unified: the plan costs $2.10/h unified, $7.00/h disaggregated"]
    assert set(calls.values()) == {1} and len(calls) == 6  # every (model, role) searched once over the four trials
    check_packing(plan)


def test_auto_takes_the_mode_that_is_feasible() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [model("qwen3-0.6b", 4, disaggregation="auto")],
                          "capacities": [{"model": "qwen3-0.6b", "device": "l4", "role": "prefill", "requests_per_s": 2},
                                         {"model": "qwen3-0.6b", "device": "l4", "role": "decode", "requests_per_s": 2}]})
    plan = optimize(spec, catalog=CATALOG, capacity_source=lambda query: 0.0)
    assert {g.role for g in plan.models[0].replicas} == {Role.PREFILL, Role.DECODE}
    assert plan.explanation.notes[0].startswith("qwen3-0.6b: disaggregation auto chose prefill_decode: the plan costs $")
    assert plan.explanation.notes[0].endswith(", nothing (infeasible) unified")


def test_auto_stops_at_the_deadline() -> None:
    ticks = iter([0.0, 0.0, 5.0])
    deadline = Deadline.after(1.0, clock=lambda: next(ticks, 5.0))
    with pytest.raises(DeadlineError):
        optimize(auto_cluster(), catalog=CATALOG, capacity_source=lambda q: AUTO_RATES[(q.spec.name, q.role)],
                 deadline=deadline)


def test_auto_is_resolved_before_the_problem_is_built() -> None:
    with pytest.raises(ValueError, match="resolved to unified or prefill_decode first"):
        build_problem(auto_cluster(), CATALOG, capacity_source=lambda query: 1.0)


@pytest.mark.parametrize(("pool", "device"), [
    ({"name": "x", "accelerator": "opaque-x", "nodes": 200}, "opaque-x"),
    ({"name": "h100", "accelerator": "h100-sxm", "nodes": 30, "partition_allowed": True}, "h100-sxm:1g.10gb"),
])
def test_packing_a_large_fleet_stops_at_the_deadline(pool: dict[str, Any], device: str) -> None:
    """Laying out ~1,500 replicas takes far longer than solving for them: past the deadline packing stops too."""
    spec = parse_cluster({"pools": [pool], "models": [model("qwen3-0.6b", 1.4)],
                          "capacities": [{"model": "qwen3-0.6b", "device": device, "requests_per_s": 0.001}],
                          "accelerators": [{"id": "opaque-x", "price_per_hour": 1.0, "gpus_per_node": 8}]})
    calls = iter(range(10**6))
    deadline = Deadline.after(100.0, clock=lambda: float(next(calls)))  # each look at the clock is a second later
    with pytest.raises(DeadlineError, match="stopped packing replicas onto"):
        optimize(spec, catalog=CATALOG, deadline=deadline)


def _capacity_by_slo(query: CapacityQuery) -> float:
    """A replica holds 10 req/s on an h100 and 2 on an l4 at a 300 ms TTFT; three times that at a loose one."""
    base = {"h100-sxm": 10.0, "l4": 2.0}.get(query.device.id, 0.0) if query.tp == 1 else 0.0
    assert query.spec.slo is not None
    return base * (3 if query.spec.slo.ttft_ms > 1000 else 1)


def test_objectives_are_planned_each_at_its_own_slo_and_cost_less_than_the_strictest_for_all() -> None:
    strict, loose = {"ttft_ms": 300, "tpot_ms": 50}, {"ttft_ms": 20000, "tpot_ms": 200}
    pools = [{"name": "h100", "accelerator": "h100-sxm", "nodes": 2}, {"name": "l4", "accelerator": "l4", "nodes": 4}]
    one = model("llama-3.1-8b", 60, slo=strict)
    split = {**one, "objectives": [{"name": "interactive", "demand_share": 0.3, "slo": strict},
                                   {"name": "batch", "demand_share": 0.7, "slo": loose},
                                   {"name": "eval", "demand_share": 0.0001, "slo": loose, "best_effort": True}]}
    together = optimize(cluster(pools, [one], []), capacity_source=_capacity_by_slo)
    apart = optimize(cluster(pools, [split], []), capacity_source=_capacity_by_slo)
    assert together.status is PlanStatus.OPTIMAL and apart.status is PlanStatus.OPTIMAL
    assert {m.name: m.demand_rps for m in apart.models} == pytest.approx(
        {"llama-3.1-8b/interactive": 18.0, "llama-3.1-8b/batch": 42.0})  # the best-effort class has no replicas
    assert apart.cost_per_hour < together.cost_per_hour


@pytest.mark.parametrize(("objectives", "message"), [
    ([{"name": "a", "demand_share": 0.5, "slo": SLO}], "add up to 1"),
    ([{"name": "a", "demand_share": 0.5, "slo": SLO}, {"name": "a", "demand_share": 0.5, "slo": SLO}], "appears twice"),
    ([{"name": "A b", "demand_share": 1, "slo": SLO}], "objectives[0].name"),
    ([{"name": "a", "demand_share": 1.5, "slo": SLO}], "objectives[0].demand_share"),
])
def test_bad_objectives_are_refused_at_their_field(objectives: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(InputError) as error:
        cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                [model("llama-3.1-8b", 1, objectives=objectives)], [])
    assert message in str(error.value)


def test_objectives_and_capacity_rows_for_one_model_are_refused() -> None:
    with pytest.raises(InputError, match="objectives and capacity rows"):
        cluster([{"name": "h100", "accelerator": "h100-sxm", "nodes": 1}],
                [model("m", 1, objectives=[{"name": "a", "demand_share": 1, "slo": SLO}])],
                [{"model": "m", "device": "h100-sxm", "requests_per_s": 5}])
