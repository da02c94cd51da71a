"""Peers' files: Mélange's solver input and AIBrix's GPU profiles load as their tools mean them and plan at least
as cheaply as Mélange's own formulation."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from scipy.optimize import linprog

from hetsched.catalog import load_catalog
from hetsched.errors import InputError
from hetsched.optimizer.interop import resolve_gpu
from hetsched.optimizer.load import load_cluster, parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import PlanStatus

CATALOG = load_catalog()
MELANGE_EXAMPLE: dict[str, Any] = {  # melange/config/example.json of Mélange's repository, as it ships
    "gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 2]]},
                 "A100-80GB": {"cost": 3.67, "tputs": [[20, 20], [40, 20]]}},
    "workload_distribution": [[0.2, 0.1], [0.5, 0.2]],
    "total_request_rate": 30.0,
    "slice_factor": 1,
}


def melange_sliced_optimum(file: dict[str, Any]) -> float:
    """Mélange's ILP by enumeration: each of ``slice_factor`` slices per cell goes whole to one GPU type."""
    gpus = list(file["gpu_info"].values())
    rate, factor = file["total_request_rate"], file.get("slice_factor", 1)
    slices = [(r, c, share * rate / factor) for r, row in enumerate(file["workload_distribution"])
              for c, share in enumerate(row) for _ in range(factor)]
    best = math.inf
    for assignment in itertools.product(range(len(gpus)), repeat=len(slices)):
        loads = [0.0] * len(gpus)
        for g, (r, c, size) in zip(assignment, slices):
            loads[g] += size / gpus[g]["tputs"][r][c]
        best = min(best, sum(math.ceil(load - 1e-9) * gpu["cost"] for load, gpu in zip(loads, gpus)))
    return best


def continuous_optimum(file: dict[str, Any]) -> float:
    """The cheapest GPU counts whose capacity holds the demand when each cell may be split at will (an LP each)."""
    gpus = list(file["gpu_info"].values())
    cells = [(r, c, share * file["total_request_rate"]) for r, row in enumerate(file["workload_distribution"])
             for c, share in enumerate(row) if share > 0]
    alone = [math.ceil(sum(rate / gpu["tputs"][r][c] for r, c, rate in cells)) for gpu in gpus]
    for counts in sorted(itertools.product(*(range(n + 1) for n in alone)),
                         key=lambda n: sum(k * gpu["cost"] for k, gpu in zip(n, gpus))):
        # x[cell, gpu]: share of the cell on that type; each cell whole, each type within its GPUs
        a_eq = np.kron(np.eye(len(cells)), np.ones(len(gpus)))
        a_ub = np.array([[rate / gpus[g]["tputs"][r][c] if h == g else 0.0 for r, c, rate in cells for h in
                          range(len(gpus))] for g in range(len(gpus))])
        found = linprog(np.zeros(len(cells) * len(gpus)), A_ub=a_ub, b_ub=np.array(counts, dtype=float),
                        A_eq=a_eq, b_eq=np.ones(len(cells)), bounds=(0, None), method="highs")
        if found.status == 0:
            return sum(k * gpu["cost"] for k, gpu in zip(counts, gpus))
    raise AssertionError("no count is feasible")


def random_melange(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    names = rng.sample(["A10G", "L4", "A100-80GB", "H100", "L40S"], rng.choice([2, 3]))
    shares = [[rng.random() for _ in range(2)] for _ in range(2)]
    total = sum(map(sum, shares))
    return {"gpu_info": {n: {"cost": round(rng.uniform(0.5, 4.0), 2),
                             "tputs": [[round(rng.uniform(0.5, 12.0), 1) for _ in range(2)] for _ in range(2)]}
                         for n in names},
            "workload_distribution": [[s / total for s in row] for row in shares],
            "total_request_rate": round(rng.uniform(2, 16), 1), "slice_factor": rng.choice([1, 2])}


# --- Mélange -----------------------------------------------------------------------------


def test_melanges_own_example_plans_unchanged_below_its_solvers_cost() -> None:
    spec = parse_cluster(MELANGE_EXAMPLE)
    assert spec.solver.headroom == 0 and spec.models[0].slo is None
    # rows are input sizes: the A10G's 'in #1 / out #0' cell is row 1, column 0
    a10g = {c.bucket: c.requests_per_s for c in spec.capacities or [] if c.pool == "a10g"}
    assert a10g["in #1 / out #0"] == 5 and a10g["in #0 / out #1"] == 1
    plan = optimize(spec)
    # Mélange answers 3 A10G + 1 A100-80GB ($6.70, its README); moving a third of one cell to an A10G is $4.68
    assert melange_sliced_optimum(MELANGE_EXAMPLE) == pytest.approx(6.70)
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour == pytest.approx(3.67 + 1.01)
    assert plan.cost_per_hour == pytest.approx(continuous_optimum(MELANGE_EXAMPLE))
    assert any("no SLO given" in note for note in plan.explanation.notes)


@pytest.mark.parametrize("seed", range(6))
def test_melange_cases_cost_the_continuous_optimum_never_more_than_melanges(seed: int) -> None:
    file = random_melange(seed)
    plan = optimize(parse_cluster(file))
    assert plan.status is PlanStatus.OPTIMAL
    assert plan.cost_per_hour == pytest.approx(continuous_optimum(file), abs=1e-6)
    assert plan.cost_per_hour <= melange_sliced_optimum(file) + 1e-6


def test_one_cell_costs_what_melange_pays() -> None:
    # one bucket, 9 req/s: three A10Gs ($3.03) beat one A100 ($3.67) whole or in part, as in Mélange
    file = {"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[3.0]]}, "A100-80GB": {"cost": 3.67, "tputs": [[10.0]]}},
            "workload_distribution": [[1.0]], "total_request_rate": 9.0}
    assert optimize(parse_cluster(file)).cost_per_hour == pytest.approx(melange_sliced_optimum(file)) == 3.03


@pytest.mark.parametrize(("name", "accelerator"), [
    ("H100", "h100-sxm"), ("h100", "h100-sxm"), ("H100-80GB", "h100-sxm"), ("A100-80GB", "a100-80gb"),
    ("a100-80g", "a100-80gb"), ("A10G", "a10g"), ("L4", "l4"), ("L40S", "l40s"), ("h100-pcie", "h100-pcie"),
])
def test_melange_gpu_names_resolve_in_any_case(name: str, accelerator: str) -> None:
    found = resolve_gpu(name, CATALOG)
    assert found is not None and found.id == accelerator
    file = {"gpu_info": {name: {"cost": 1.0, "tputs": [[1.0]]}}, "workload_distribution": [[1.0]],
            "total_request_rate": 1}
    assert [p.accelerator for p in parse_cluster(file).pools] == [accelerator]


def test_unknown_gpu_names_plan_as_opaque_types_priced_by_the_file() -> None:
    # 30 req/s: the L40 serves 4 at $1.00, the Gaudi2 13 at $2.50, the A10G 3 at $1.01 (catalog names resolve)
    file = {"gpu_info": {"L40": {"cost": 1.0, "tputs": [[4.0]]}, "Gaudi2": {"cost": 2.5, "tputs": [[13.0]]},
                         "A10G": {"cost": 1.01, "tputs": [[3.0]]}},
            "workload_distribution": [[1.0]], "total_request_rate": 30}
    spec = parse_cluster(file)
    assert [(p.name, p.accelerator, p.price_per_hour) for p in spec.pools] == [
        ("l40", "l40", 1.0), ("gaudi2", "gaudi2", 2.5), ("a10g", "a10g", 1.01)]
    assert [(a.id, a.name, a.price_per_hour) for a in spec.accelerators] == [("l40", "L40", 1.0),
                                                                            ("gaudi2", "Gaudi2", 2.5)]
    plan = optimize(spec)
    # two Gaudi2s and one L40 (26 + 4 req/s) for $6.00: cheaper than any plan on one type
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour == pytest.approx(6.0)
    assert plan.cost_per_hour == pytest.approx(continuous_optimum(file))
    assert {(g.pool, g.accelerator, g.replicas) for m in plan.models for g in m.replicas} == {
        ("gaudi2", "gaudi2", 2), ("l40", "l40", 1)}
    notes = " ".join(plan.explanation.notes)
    assert "L40 is no catalog accelerator" in notes and "if it is l40s" in notes and "Gaudi2 is no catalog" in notes
    file["gpu_info"]["L40"]["accelerator"] = "h100-sxm"  # the file may still say what a name means
    assert parse_cluster(file).pools[0].accelerator == "h100-sxm"


def test_an_opaque_accelerator_in_a_cluster_file_needs_rows_and_a_name_of_its_own() -> None:
    base = {"pools": [{"name": "g", "accelerator": "gaudi2", "nodes": 2}],
            "accelerators": [{"id": "gaudi2", "price_per_hour": 3.0, "gpus_per_node": 8}],
            "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 500, "tpot_ms": 50},
                        "workload": {"rate_rps": 25, "input_tokens": 100, "output_tokens": 10}}],
            "solver": {"headroom": 0}}
    rows = [{"model": "qwen3-0.6b", "device": "gaudi2", "requests_per_s": 10}]
    plan = optimize(parse_cluster({**base, "capacities": rows}))
    assert plan.cost_per_hour == pytest.approx(9.0) and plan.pools[0].gpus_total == 16
    # without rows nothing can be simulated on it: the model is infeasible there, and the plan says why
    plan = optimize(parse_cluster(base), capacity_source=lambda query: 1.0)
    assert plan.status is PlanStatus.INFEASIBLE
    assert "opaque accelerator" in " ".join(plan.explanation.infeasible)
    with pytest.raises(InputError) as caught:
        optimize(parse_cluster({**base, "accelerators": [{"id": "l4", "price_per_hour": 1.0}], "capacities": rows}))
    assert caught.value.field == "accelerators[0].id" and "catalog accelerator" in str(caught.value)


@pytest.mark.parametrize("reverse", [False, True])
def test_two_entries_on_one_device_type_mix_at_the_exact_optimum(reverse: bool) -> None:
    # 25 req/s; on-demand A100s 10 req/s at $2, spot ones 5 req/s at $1.50: 2 + 1 ($5.50) beats 3 on-demand ($6)
    gpus = {"on-demand": {"cost": 2.0, "tputs": [[10.0]], "accelerator": "a100-80gb"},
            "spot": {"cost": 1.5, "tputs": [[5.0]], "accelerator": "a100-80gb"}}
    file = {"gpu_info": dict(reversed(gpus.items())) if reverse else gpus, "workload_distribution": [[1.0]],
            "total_request_rate": 25}
    plan = optimize(parse_cluster(file))
    assert plan.status is PlanStatus.OPTIMAL and plan.cost_per_hour == pytest.approx(5.5)
    assert plan.cost_per_hour == pytest.approx(continuous_optimum(file))
    assert melange_sliced_optimum(file) == pytest.approx(6.0)  # one slice goes whole to one entry
    assert sorted((g.pool, g.replicas) for m in plan.models for g in m.replicas) == [("on-demand", 2), ("spot", 1)]


def test_matrix_order_follows_melange_unless_the_file_says_otherwise() -> None:
    # two input sizes (rows) × three output sizes (columns)
    file = {"gpu_info": {"L4": {"cost": 0.7, "tputs": [[6, 5, 4], [3, 2, 1]]}}, "input_edges": [512],
            "output_edges": [64, 256], "workload_distribution": [[1, 1, 1], [1, 1, 1]], "total_request_rate": 1}
    rows = {c.bucket: c.requests_per_s for c in parse_cluster(file).capacities or []}
    assert rows["in 1-512 / out 257+"] == 4 and rows["in 513+ / out 1-64"] == 3
    turned = {**file, "matrix_order": "output_input", "workload_distribution": [[1, 1], [1, 1], [1, 1]],
              "gpu_info": {"L4": {"cost": 0.7, "tputs": [[6, 3], [5, 2], [4, 1]]}}}
    assert {c.bucket: c.requests_per_s for c in parse_cluster(turned).capacities or []} == rows


def test_headroom_is_zero_for_a_melange_file_unless_it_sets_one() -> None:
    base = {"gpu_info": {"L4": {"cost": 0.7, "tputs": [[1.0]]}}, "workload_distribution": [[1.0]],
            "total_request_rate": 1}
    assert parse_cluster({**base, "solver": {"time_limit_s": 5}}).solver.headroom == 0
    assert parse_cluster({**base, "solver": {"headroom": 0.2}}).solver.headroom == 0.2
    own = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                         "models": [{"name": "m", "workload": {"rate_rps": 1, "input_tokens": 1, "output_tokens": 1}}],
                         "capacities": [{"model": "m", "device": "l4", "requests_per_s": 1}]})
    assert own.solver.headroom == 0.1


def test_a_model_without_slo_or_capacity_rows_is_refused_at_its_slo() -> None:
    spec = parse_cluster({"pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
                          "models": [{"name": "qwen3-0.6b", "workload": {"rate_rps": 1, "input_tokens": 100,
                                                                        "output_tokens": 10}}]})
    with pytest.raises(InputError) as caught:
        optimize(spec, capacity_source=lambda query: 1.0)
    assert caught.value.field == "models[0].slo"


@pytest.mark.parametrize(("change", "field"), [
    ({"workload_distribution": [[0.5, 0.5]]}, "gpu_info.A10G.tputs"),
    ({"gpu_info": {"A10G": {"cost": 1.0, "tputs": [[1.0, -2.0]]}}}, "gpu_info.A10G.tputs[0][1]"),
    ({"gpu_info": {"A10G": {"cost": 1.0, "tputs": [[1.0]], "accelerator": "a10"}}}, "gpu_info.A10G.accelerator"),
    ({"gpu_info": {"A10G": {"cost": 1.0, "tputs": [[1.0]]}, "a10g": {"cost": 1.0, "tputs": [[1.0]]}}}, "gpu_info.a10g"),
    ({"workload_distribution": [[0.0]]}, "workload_distribution"),
])
def test_malformed_melange_files_name_the_field(change: dict[str, Any], field: str) -> None:
    file = {"gpu_info": {"A10G": {"cost": 1.0, "tputs": [[1.0]]}}, "workload_distribution": [[1.0]],
            "total_request_rate": 1, **change}
    with pytest.raises(InputError) as caught:
        parse_cluster(file)
    assert caught.value.field == field


# --- AIBrix ------------------------------------------------------------------------------

TICKS = [[64, 256], [256, 1024, 4096]]  # [output ticks, input ticks]


def aibrix_profile(gpu: str, cost: float, tputs: list[list[float]], **extra: Any) -> dict[str, Any]:
    """A profile as AIBrix's gen_profile.py writes it (its key order; e2e and slos as it adds them)."""
    return {"gpu": gpu, "cost": cost, "tputs": tputs, "indexes": TICKS, "created": 1748888478.258241,
            "e2e": [[0.5] * 3, [1.5] * 3], "slos": {"percentile": 99, "e2e": 5.0}, **extra}


A10G = aibrix_profile("llama2-7b-a10g", 1.01, [[4.0, 2.0, 0.5], [2.0, 1.0, 0.0]])
A100 = aibrix_profile("llama2-7b-a100-80gb", 2.10, [[16.0, 8.0, 2.0], [8.0, 4.0, 1.0]])


def aibrix_file(tmp_path: Path, profiles: list[Any], *, shares: list[list[float]] | None = None) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"model": "llama2-7b", "aibrix_profiles": profiles, "total_request_rate": 8,
                                    "workload_distribution": shares or [[1, 0, 0], [0, 0, 0]]}))
    return path


def test_aibrix_profiles_in_a_folder_load_as_capacities(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    for profile in (A10G, A100):
        (tmp_path / "profiles" / f"{profile['gpu']}.json").write_text(json.dumps(profile))
    (tmp_path / "profiles" / "llama2-7b-a10g.jsonl").write_text('{"metric": "E2E"}\n')  # benchmark output, not read
    spec = load_cluster(aibrix_file(tmp_path, ["profiles/"], shares=[[3, 1, 0], [0, 0, 0]]))
    assert [(p.name, p.accelerator, p.price_per_hour) for p in spec.pools] == [
        ("llama2-7b-a100-80gb", "a100-80gb", 2.10), ("llama2-7b-a10g", "a10g", 1.01)]
    # tputs[output][input]: the A10G's 1024-token prompts with 64-token outputs are row 0, column 1
    assert {(c.pool, c.bucket): c.requests_per_s for c in spec.capacities or []}[
        ("llama2-7b-a10g", "in 1024 / out 64")] == 2.0
    (m,) = spec.models
    assert [(b.label, b.input_tokens, b.output_tokens, b.share) for b in m.workload.buckets or []] == [
        ("in 256 / out 64", 256, 64, 0.75), ("in 1024 / out 64", 1024, 64, 0.25)]
    assert spec.solver.headroom == 0
    plan = optimize(spec)
    # 6 req/s of short and 2 of longer prompts: 3.5 A10G-loads or 0.625 A100-loads; one A100 holds it all
    assert plan.cost_per_hour == pytest.approx(2.10)
    assert any("AIBrix profiles: llama2-7b-a100-80gb: P99 e2e < 5 s" in n for n in plan.explanation.notes)


def test_aibrix_zero_throughput_means_the_gpu_cannot_serve_that_size(tmp_path: Path) -> None:
    (tmp_path / "a10g.json").write_text(json.dumps(A10G))
    (tmp_path / "a100.json").write_text(json.dumps(A100))
    spec = load_cluster(aibrix_file(tmp_path, ["a10g.json", "a100.json"], shares=[[0, 0, 0], [0, 0, 1]]))
    plan = optimize(spec)  # 8 req/s of 4096-token prompts with 256-token outputs: the A10G has 0 there
    assert {g.pool for m in plan.models for g in m.replicas} == {"llama2-7b-a100-80gb"}
    assert plan.cost_per_hour == pytest.approx(8 * 2.10)


def test_aibrix_lists_lines_overrides_and_inline_profiles(tmp_path: Path) -> None:
    sim = aibrix_profile("simulator-llama2-7b-a100", 1.0, A100["tputs"])
    (tmp_path / "both.json").write_text(json.dumps([A10G, A100]))
    (tmp_path / "lines.jsonl").write_text(json.dumps(sim) + "\n\n")
    spec = load_cluster(aibrix_file(tmp_path, ["both.json", {"path": "lines.jsonl", "accelerator": "a100-40gb",
                                                              "count": 3}]))
    assert [(p.accelerator, p.max_gpus) for p in spec.pools][2] == ("a100-40gb", 3)
    inline = parse_cluster({"aibrix_profiles": [{"profile": A10G}], "total_request_rate": 1,
                            "workload_distribution": [[1, 0, 0], [0, 0, 0]]})
    assert [p.accelerator for p in inline.pools] == ["a10g"]


def test_an_aibrix_deployment_naming_no_known_gpu_is_its_own_opaque_type() -> None:
    sim = aibrix_profile("simulator-llama2-7b-a100", 0.5, A100["tputs"])
    spec = parse_cluster({"aibrix_profiles": [{"profile": A10G}, {"profile": sim}], "total_request_rate": 8,
                          "workload_distribution": [[1, 0, 0], [0, 0, 0]]})
    assert [(p.accelerator, p.price_per_hour) for p in spec.pools] == [("a10g", 1.01),
                                                                       ("simulator-llama2-7b-a100", 0.5)]
    plan = optimize(spec)  # 8 req/s of short prompts: half of one simulated A100 at $0.50
    assert plan.cost_per_hour == pytest.approx(0.5)
    assert {g.accelerator for m in plan.models for g in m.replicas} == {"simulator-llama2-7b-a100"}


@pytest.mark.parametrize(("profiles", "field", "words"), [
    (["missing.json"], "aibrix_profiles[0].path", "no such file: missing.json"),
    (["p/"], "aibrix_profiles[0].path", "no *.json profiles in p/"),
    ([aibrix_profile("llama2-7b-a10g", 1.0, [[1.0, 2.0]])], "aibrix_profiles[0].tputs", "p.json: expected 2 rows"),
    ([aibrix_profile("llama2-7b-a10g", 1.0, [[1.0, -2.0, 1.0], [1.0] * 3])], "aibrix_profiles[0].tputs[0][1]",
     "p.json: Input should be greater than or equal to 0"),
    ([{"gpu": "llama2-7b-a10g", "cost": 1.0, "tputs": [[1.0]]}], "aibrix_profiles[0].indexes",
     "p.json: Field required"),
    ([A10G, aibrix_profile("llama2-7b-l4", 1.0, [[1.0]], indexes=[[64], [256]])], "aibrix_profiles[1].indexes",
     "differ from the first profile's"),
])
def test_bad_aibrix_profiles_name_the_entry_field_and_file(tmp_path: Path, profiles: list[Any], field: str,
                                                           words: str) -> None:
    (tmp_path / "p").mkdir()
    refs: list[Any] = []
    for i, profile in enumerate(profiles):
        if isinstance(profile, dict):
            name = "p.json" if i == 0 else f"p{i}.json"
            (tmp_path / name).write_text(json.dumps(profile))
            refs.append(name)
        else:
            refs.append(profile)
    with pytest.raises(InputError) as caught:
        load_cluster(aibrix_file(tmp_path, refs))
    assert caught.value.field == field and words in str(caught.value), str(caught.value)


def test_aibrix_demand_must_cover_the_profiles_grid_and_paths_need_a_file(tmp_path: Path) -> None:
    (tmp_path / "a10g.json").write_text(json.dumps(A10G))
    with pytest.raises(InputError) as caught:
        load_cluster(aibrix_file(tmp_path, ["a10g.json"], shares=[[1, 0], [0, 0]]))
    assert caught.value.field == "workload_distribution" and "output ticks [64, 256]" in str(caught.value)
    with pytest.raises(InputError) as caught:
        parse_cluster({"aibrix_profiles": ["a10g.json"], "total_request_rate": 1, "workload_distribution": [[1]]})
    assert caught.value.field == "aibrix_profiles[0].path" and "inline" in str(caught.value)
