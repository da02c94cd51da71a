"""The planner's pure logic: what-if changes, plan diffs and the export to custom resources."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hetsched.catalog import load_catalog
from hetsched.errors import InputError
from hetsched.operator.resources import KINDS
from hetsched.optimizer.load import parse_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.spec import ClusterSpec
from hetsched.specs.wire import Label
from hetsched.web.export import mig_parted_and_node_labels_yaml, plan_resources, resource_name
from hetsched.web.whatif import WhatIfChanges, apply_changes, plan_diff

EXAMPLE = ClusterSpec.model_validate(yaml.safe_load((Path(__file__).parent.parent / "examples" / "chat.yaml").read_text()))


def test_changes_apply_to_named_pools_and_models_only() -> None:
    changed = apply_changes(EXAMPLE, WhatIfChanges(prices={"l40s": 0.5}, demand={"qwen3-8b": 30},
                                                   nodes={"a10g": 1}, mig_allowed={"h100": False}))
    pools = {p.name: p for p in changed.pools}
    assert pools["l40s"].price_per_hour == 0.5 and pools["h100"].price_per_hour is None
    assert pools["a10g"].nodes == 1 and pools["h100"].partition_allowed is False
    assert changed.model("qwen3-8b").workload.rate_rps == 30
    assert changed.model("llama-3.1-8b") == EXAMPLE.model("llama-3.1-8b")
    assert EXAMPLE.model("qwen3-8b").workload.rate_rps == 12, "the input spec is left alone"


def test_removing_a_pool_drops_it_from_allowed_pools() -> None:
    spec = EXAMPLE.model_copy(update={"models": [EXAMPLE.models[0].model_copy(update={"allowed_pools": ["h100", "a10g"]}),
                                                 EXAMPLE.models[1]]})
    changed = apply_changes(spec, WhatIfChanges(nodes={"a10g": 0}))
    assert [p.name for p in changed.pools] == ["h100", "l40s"]
    assert changed.models[0].allowed_pools == ["h100"]


@pytest.mark.parametrize(("changes", "field"), [
    (WhatIfChanges(prices={"tpu": 1.0}), "prices.tpu"),
    (WhatIfChanges(demand={"h100": 1.0}), "demand.h100"),
    (WhatIfChanges(mig_allowed={"nope": True}), "partition_allowed.nope"),
    (WhatIfChanges(nodes={"l40s": -1}), "nodes.l40s"),
    (WhatIfChanges(nodes={"h100": 0, "l40s": 0, "a10g": 0}), "nodes"),
])
def test_bad_changes_name_their_field(changes: WhatIfChanges, field: str) -> None:
    with pytest.raises(InputError) as caught:
        apply_changes(EXAMPLE, changes)
    assert caught.value.field == field


def test_diff_lines_up_replica_groups_and_costs() -> None:
    before = optimize(EXAMPLE)
    after = optimize(apply_changes(EXAMPLE, WhatIfChanges(demand={"qwen3-8b": 40})))
    same = plan_diff(before, before)
    assert same.replicas == [] and same.cost_delta == 0 and same.replicas_moved == 0
    diff = plan_diff(before, after)
    assert diff.cost_delta == pytest.approx(after.cost_per_hour - before.cost_per_hour) and diff.cost_delta > 0
    old, new = before.replica_counts(), after.replica_counts()
    assert {(c.model, c.pool, c.device, c.tp, c.role): (c.before, c.after) for c in diff.replicas} == {
        k: (old.get(k, 0), new.get(k, 0)) for k in set(old) | set(new) if old.get(k, 0) != new.get(k, 0)}
    by_model = {c.name: c for c in diff.models}
    assert by_model["qwen3-8b"].delta == pytest.approx(after.cost_by_model["qwen3-8b"] - before.cost_by_model["qwen3-8b"])
    assert {c.name for c in diff.pools} == {p.name for p in EXAMPLE.pools}
    assert diff.model_dump()["models"][0]["delta"] == by_model[diff.models[0].name].delta


def test_resources_validate_against_the_operators_types() -> None:
    plan = optimize(EXAMPLE)
    documents = plan_resources(EXAMPLE, plan, catalog=load_catalog(), namespace="llm", engine_image="vllm/vllm-openai:v1")
    kinds = {k.kind: k for k in KINDS}
    for document in documents:
        kinds[document["kind"]].spec.model_validate(document["spec"])
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ModelDeployment"}
    llama = deployments["llama-3-1-8b"]["spec"]
    assert llama["model"] == "llama-3.1-8b" and llama["slo"] == {"ttft": "500ms", "tpot": "60ms", "percentile": 99.0,
                                                                   "maxFailureRate": 0.01}
    assert llama["scaling"] == {"minReplicas": 2, "spreadAcrossNodes": True}
    assert [b["name"] for b in llama["workload"]["buckets"]] == ["short", "medium"]
    assert llama["engine"]["image"] == "vllm/vllm-openai:v1"
    pools = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "AcceleratorPool"}
    assert pools["h100"]["partitioning"] == "allowed" and pools["l40s"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L40S"}


def test_pools_of_one_accelerator_are_told_apart_by_a_label() -> None:
    spec = EXAMPLE.model_copy(update={"pools": [*EXAMPLE.pools, EXAMPLE.pools[1].model_copy(update={"name": "L40S spot"})]})
    documents = plan_resources(spec, optimize(spec), catalog=load_catalog(), namespace="default", engine_image="x")
    selectors = {d["metadata"]["name"]: d["spec"]["nodeSelector"] for d in documents if d["kind"] == "AcceleratorPool"}
    assert selectors["l40s"][Label.POOL] == "l40s" and selectors["l40s-spot"][Label.POOL] == "l40s-spot"
    assert Label.POOL not in selectors["h100"]


def test_fractional_slo_and_distributions() -> None:
    model = EXAMPLE.models[1].model_copy(update={"slo": EXAMPLE.models[1].slo.model_copy(update={"ttft_ms": 12.5})})
    spec = EXAMPLE.model_copy(update={"models": [EXAMPLE.models[0], model]})
    documents = plan_resources(spec, optimize(spec), catalog=load_catalog(), namespace="default", engine_image="x")
    assert next(d for d in documents if d["metadata"]["name"] == "qwen3-8b")["spec"]["slo"]["ttft"] == "12.5ms"
    shaped = spec.model_validate({**spec.model_dump(mode="json"), "models": [
        spec.models[0].model_dump(mode="json"),
        {**model.model_dump(mode="json"), "workload": {"rate_rps": 5, "distribution": {
            "input_len": {"kind": "fixed", "value": 100}, "output_len": {"kind": "fixed", "value": 10}}}}]})
    with pytest.raises(InputError) as caught:
        plan_resources(shaped, optimize(spec), catalog=load_catalog(), namespace="default", engine_image="x")
    assert caught.value.field == "models[1].workload.distribution"


def test_quantization_takes_the_optimizers_aliases_and_refuses_what_a_deployment_cannot_serve() -> None:
    def with_quantization(value: str) -> ClusterSpec:
        return EXAMPLE.model_copy(update={"models": [EXAMPLE.models[0].model_copy(update={"quantization": value}),
                                                     *EXAMPLE.models[1:]]})

    plan = optimize(EXAMPLE)
    documents = plan_resources(with_quantization("bfloat16"), plan, catalog=load_catalog(), namespace="default",
                               engine_image="x")
    first = next(d for d in documents if d["kind"] == "ModelDeployment" and d["spec"]["model"] == EXAMPLE.models[0].source)
    assert first["spec"]["quantization"] == "bf16"
    with pytest.raises(InputError) as caught:
        plan_resources(with_quantization("fp32"), plan, catalog=load_catalog(), namespace="default", engine_image="x")
    assert caught.value.field == "models[0].quantization"


def test_a_model_without_an_slo_cannot_become_a_deployment() -> None:
    plan = optimize(EXAMPLE)
    without = EXAMPLE.model_copy(update={"models": [EXAMPLE.models[0].model_copy(update={"slo": None}),
                                                    *EXAMPLE.models[1:]]})
    with pytest.raises(InputError) as caught:
        plan_resources(without, plan, catalog=load_catalog(), namespace="default", engine_image="x")
    assert caught.value.field == "models[0].slo"


def test_a_pool_of_an_opaque_accelerator_cannot_become_an_accelerator_pool() -> None:
    spec = parse_cluster({"gpu_info": {"Gaudi2": {"cost": 2.0, "tputs": [[10.0]]}}, "workload_distribution": [[1.0]],
                          "total_request_rate": 5, "slo": {"ttft_ms": 500, "tpot_ms": 50}})
    with pytest.raises(InputError) as caught:
        plan_resources(spec, optimize(spec), catalog=load_catalog(), namespace="default", engine_image="x")
    assert caught.value.field == "pools[0].accelerator" and "'gaudi2' is no catalog accelerator" in str(caught.value)


def test_names_become_dns_labels_and_mig_config_has_labels() -> None:
    assert resource_name("Llama 3.1 / 70B!") == "llama-3-1-70b"
    assert resource_name("___") == "unnamed"
    assert len(resource_name("x" * 100)) == 63
    config, labels = yaml.safe_load_all(mig_parted_and_node_labels_yaml(optimize(EXAMPLE)))
    assert config["version"] == "v1" and set(labels["node-labels"]) == {n.name for n in optimize(EXAMPLE).nodes}
