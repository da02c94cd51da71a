"""Pure operator functions: inventory, planning input, reconcile, MIG flow, make-before-break, statuses."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hetsched.catalog import load_catalog
from hetsched.operator.diff import changes
from hetsched.operator.inventory import pool_condition, pool_inventory
from hetsched.operator.manifests import deployment_name
from hetsched.operator.objects import Observed, ScalingDecision
from hetsched.operator.planning import ModelDeploymentRef, Rejected, bind_nodes, parse_model_deployment, planning_input
from hetsched.operator.reconcile import reconcile
from hetsched.operator.resources import AcceleratorPoolSpec, Approval, ModelDeploymentStatus, PlacementPlanSpec
from hetsched.operator.status import PlanState, model_status
from hetsched.optimizer.spec import Role
from hetsched.partition.phases import PartitionPhase
from hetsched.partition.render import mig_parted_yaml
from operator_fixtures import amd_node, group, make_plan, mig_plan, model_deployment, node, pool
from pod_security import pod_specs, restricted_violations

CATALOG = load_catalog()


def _pools(nodes: list[dict[str, Any]], *specs: dict[str, Any]):
    return [pool_inventory(s["metadata"]["name"], AcceleratorPoolSpec.model_validate(s["spec"]), nodes, CATALOG)
            for s in specs]


def _models(*objs: dict[str, Any]) -> dict[str, ModelDeploymentRef]:
    parsed = [parse_model_deployment(o) for o in objs]
    return {m.key: m for m in parsed if isinstance(m, ModelDeploymentRef)}


def _apply(observed: Observed, desired_changes) -> Observed:
    """What the API server would hold after the changes (merge patch on top)."""
    stores = {"Deployment": list(observed.deployments), "Service": list(observed.services),
              "PodDisruptionBudget": list(observed.disruption_budgets), "Node": list(observed.nodes)}
    configmap = observed.mig_configmap
    for c in desired_changes:
        if c.kind == "ConfigMap":
            configmap = c.body if c.action == "create" else {**(configmap or {}), **c.body}
            continue
        items = stores[c.kind]
        index = next((i for i, o in enumerate(items) if o["metadata"]["name"] == c.name
                      and o["metadata"].get("namespace") == c.namespace), None)
        if c.action == "create":
            items.append(copy.deepcopy(c.body))
        elif c.action == "delete":
            items.pop(index)
        else:
            items[index] = _merge(items[index], c.body)
    return Observed(nodes=stores["Node"], deployments=stores["Deployment"], services=stores["Service"],
                    disruption_budgets=stores["PodDisruptionBudget"], pods=observed.pods, mig_configmap=configmap)


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in patch.items()}}
    return copy.deepcopy(patch)


def _ready(observed: Observed, names: set[str] | None = None) -> Observed:
    deps = [_merge(d, {"status": {"readyReplicas": d["spec"]["replicas"]}})
            if names is None or d["metadata"]["name"] in names else d for d in observed.deployments]
    return Observed(nodes=observed.nodes, deployments=deps, services=observed.services,
                    disruption_budgets=observed.disruption_budgets, pods=observed.pods,
                    mig_configmap=observed.mig_configmap)


# --- inventory ---------------------------------------------------------------------------------------------------


def test_inventory_from_gpu_feature_discovery_and_amd_labels() -> None:
    nodes = [node("n1"), node("n2", mig_config="all-disabled"), node("x1", product="NVIDIA-Mystery-9000"),
             amd_node("a1")]
    nodes[1]["metadata"]["labels"]["nvidia.com/mig.config"] = "all-disabled"
    h100 = pool_inventory("h100", AcceleratorPoolSpec(node_selector={"nvidia.com/mig.capable": "true"}), nodes, CATALOG)
    assert h100.status.unknown_products == ["NVIDIA-Mystery-9000"]
    assert h100.status.accelerator == "h100-sxm" and h100.status.nodes == 2 and h100.status.gpus == 16
    assert h100.status.memory_gb == 79.6 and h100.status.mig_capable
    assert [n.mig_config for n in h100.status.inventory if n.name == "n2"] == ["all-disabled"]
    amd = pool_inventory("mi300", AcceleratorPoolSpec(node_selector={"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}),
                         nodes, CATALOG)
    assert amd.status.accelerator == "mi300x" and amd.status.gpus == 8 and amd.status.memory_gb == 192.0
    assert amd.status.inventory[0].partition == "spx_nps1"
    assert amd.status.mig_capable  # the catalog knows MI300X partitions, and no label says otherwise
    unsupported = amd_node("a2")
    unsupported["metadata"]["labels"]["amd.com/compute-partitioning-supported"] = "false"
    vetoed = pool_inventory("mi300", AcceleratorPoolSpec(node_selector={"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}),
                            [unsupported], CATALOG)
    assert not vetoed.status.mig_capable



@pytest.mark.parametrize(("capacity", "partition", "gpus"), [
    ({"amd.com/gpu": "8"}, "spx_nps1", 8),
    ({"amd.com/gpu": "64"}, "cpx_nps1", 8),  # strategy single: partitions show as GPUs
    ({"amd.com/spx_nps1": "7", "amd.com/cpx_nps1": "8"}, None, 8),  # strategy mixed, one GPU split
    ({"amd.com/spx_nps1": "6", "amd.com/qpx_nps1": "8"}, None, 8),
    ({"amd.com/gpu": "8", "amd.com/spx_nps1": "8"}, None, 8),  # a stale count from before a switch to mixed
])
def test_amd_gpus_are_counted_whole_however_the_device_plugin_shows_partitions(
        capacity: dict[str, str], partition: str | None, gpus: int) -> None:
    amd = amd_node("a1")
    amd["status"]["capacity"] = capacity
    if partition is None:
        del amd["metadata"]["labels"]["amd.com/gpu.compute-memory-partition"]
    else:
        amd["metadata"]["labels"]["amd.com/gpu.compute-memory-partition"] = partition
    inv = pool_inventory("mi300", AcceleratorPoolSpec(node_selector={"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}),
                         [amd], CATALOG)
    assert inv.status.gpus == gpus


def test_mig_needs_the_mixed_strategy_and_the_pool_says_why_not() -> None:
    nodes = [node("n1"), node("n2", **{"nvidia.com/mig.strategy": "single"})]
    h100 = pool_inventory("h100", AcceleratorPoolSpec(node_selector={"nvidia.com/mig.capable": "true"}, partitioning="allowed"),
                          nodes, CATALOG)
    assert not h100.status.mig_capable
    status, reason, message = pool_condition(h100)
    assert status == "True" and "MIG stays off: nvidia.com/mig.strategy on n2 is not mixed" in message
    planning = planning_input([model_deployment("chat")], [h100])
    assert planning.spec is not None and not planning.spec.pools[0].partition_allowed
    mixed = pool_inventory("h100", AcceleratorPoolSpec(node_selector={"nvidia.com/mig.capable": "true"}, partitioning="allowed"),
                           nodes[:1], CATALOG)
    assert mixed.status.mig_capable and "MIG" not in pool_condition(mixed)[2]


def test_a_pool_under_the_former_name_mig_is_partitioned_and_asked_to_rename_it() -> None:
    selector = {"nvidia.com/mig.capable": "true"}
    old = pool_inventory("h100", AcceleratorPoolSpec.model_validate({"nodeSelector": selector, "mig": "allowed"}),
                         [node("n1")], CATALOG)
    status, _, message = pool_condition(old)
    assert status == "True" and message.endswith(
        "; spec.mig is deprecated and read until the next release: rename it spec.partitioning")
    planning = planning_input([model_deployment("chat")], [old])
    assert planning.spec is not None and planning.spec.pools[0].partition_allowed
    renamed = pool_inventory("h100", AcceleratorPoolSpec(node_selector=selector, partitioning="allowed"), [node("n1")],
                             CATALOG)
    assert "deprecated" not in pool_condition(renamed)[2]
    missing = pool_inventory("h100", AcceleratorPoolSpec.model_validate({"nodeSelector": selector, "mig": "allowed"}),
                             [], CATALOG)
    status, _, message = pool_condition(missing)
    assert status == "False" and "rename it spec.partitioning" in message  # said also while the pool is not ready


@pytest.mark.parametrize("partitioning", ["disabled", "allowed"])
def test_nodes_whose_mig_single_strategy_shows_slices_as_gpus_are_left_out_and_named(partitioning: str) -> None:
    sliced = node("n2", product="NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", **{"nvidia.com/mig.strategy": "single",
                                                                        "nvidia.com/gpu.memory": "9856"})
    sliced["status"]["capacity"]["nvidia.com/gpu"] = "56"
    selector = {"nvidia.com/mig.capable": "true"}
    h100 = pool_inventory("h100", AcceleratorPoolSpec(node_selector=selector, partitioning=partitioning), [node("n1"), sliced], CATALOG)
    assert h100.status.nodes == 1 and h100.status.gpus == 8 and h100.status.memory_gb == 79.6
    status, _, message = pool_condition(h100)
    assert status == "True"
    assert "left out n2: MIG runs there with the single strategy" in message and "migStrategy: mixed" in message
    planning = planning_input([model_deployment("chat")], [h100])
    assert planning.spec is not None and planning.spec.pools[0].nodes == 1
    only = pool_inventory("h100", AcceleratorPoolSpec(node_selector=selector, partitioning=partitioning), [sliced], CATALOG)
    status, reason, message = pool_condition(only)
    assert (status, reason) == ("False", "NoNodes") and "left out n2" in message and "disable MIG" in message
    assert planning_input([model_deployment("chat")], [only]).spec is None


def test_gpus_stay_whole_without_a_configmap_for_their_partitioning_manager() -> None:
    from hetsched.catalog.types import Vendor

    selector = {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}
    amd = pool_inventory("mi300", AcceleratorPoolSpec(node_selector=selector, partitioning="allowed"), [amd_node("a1")], CATALOG,
                         splitting={Vendor.NVIDIA})
    assert not amd.status.mig_capable
    assert "partitions stay off: the operator runs without --dcm-configmap" in pool_condition(amd)[2]
    planning = planning_input([model_deployment("chat")], [amd])
    assert planning.spec is not None and not planning.spec.pools[0].partition_allowed
    h100 = pool_inventory("h100", AcceleratorPoolSpec(node_selector={"nvidia.com/mig.capable": "true"}, partitioning="allowed"),
                          [node("n1")], CATALOG, splitting={Vendor.NVIDIA})
    assert h100.status.mig_capable and h100.split_off is None
    whole = pool_inventory("mi300", AcceleratorPoolSpec(node_selector=selector), [amd_node("a1")], CATALOG,
                           splitting={Vendor.NVIDIA})
    assert whole.split_off is None  # the spec never asked for partitions: nothing to explain


def test_unknown_products_are_reported_not_guessed() -> None:
    nodes = [node("x1", product="NVIDIA-Mystery-9000")]
    inv = pool_inventory("p", AcceleratorPoolSpec(node_selector={"nvidia.com/gpu.product": "NVIDIA-Mystery-9000"}),
                         nodes, CATALOG)
    assert inv.status.accelerator is None and inv.usable_nodes == []
    assert "not in the catalog" in (inv.problem or "")


# --- planning input ----------------------------------------------------------------------------------------------


def test_bad_model_deployments_are_rejected_with_the_field_and_do_not_block_others() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    good = model_deployment("good")
    no_image = model_deployment("no-image")
    del no_image["spec"]["engine"]["image"]
    unknown = model_deployment("unknown", model="acme/not-a-model")
    bad_pool = model_deployment("bad-pool", allowedPools=["tpu"])
    inverted = model_deployment("inverted", scaling={"minReplicas": 3, "maxReplicas": 2})
    dotted, digit, long = model_deployment("llama-3.1-8b"), model_deployment("8b-chat"), model_deployment("a" * 64)
    result = planning_input([good, no_image, unknown, bad_pool, inverted, dotted, digit, long], pools)
    assert list(result.models) == ["serving/good"]
    assert [m.name for m in result.spec.models] == ["serving/good"]
    reasons = {r.name: (r.reason, r.message) for r in result.rejected}
    assert reasons["no-image"][0] == "InvalidSpec" and "spec.engine.image" in reasons["no-image"][1]
    assert reasons["unknown"][0] == "UnknownModel" and "spec.model" in reasons["unknown"][1]
    assert reasons["bad-pool"][0] == "NoAllowedPool" and "tpu" in reasons["bad-pool"][1]
    assert reasons["inverted"] == ("InvalidSpec", "spec.scaling: Value error, maxReplicas 2 is below minReplicas 3")
    assert reasons["llama-3.1-8b"][0] == "InvalidName" and "metadata.name" in reasons["llama-3.1-8b"][1]
    assert "'llama-3-1-8b'" in reasons["llama-3.1-8b"][1] and "'m-8b-chat'" in reasons["8b-chat"][1]
    assert reasons["a" * 64][0] == "InvalidName"
    spec = result.spec.models[0]
    assert spec.slo.ttft_ms == 500.0 and spec.workload.rate_rps == 10.0 and spec.model == "llama-3.1-8b"
    assert result.spec.pools[0].accelerator == "h100-sxm" and result.spec.pools[0].gpus_per_node == 8


def test_bind_nodes_maps_plan_nodes_to_real_ones() -> None:
    nodes = [node("gpu-b"), node("gpu-a")]
    plan = bind_nodes(make_plan([group("serving/m", 9)]), _pools(nodes, pool("h100")))
    assert [n.name for n in plan.nodes] == ["gpu-a", "gpu-b"]


# --- reconcile ---------------------------------------------------------------------------------------------------


def test_deployments_carry_selectors_resources_args_labels_and_owner() -> None:
    nodes = [node("n1"), node("n2")]
    pools = _pools(nodes, pool("h100", tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm",
                                                     "effect": "NoSchedule"}]))
    models = _models(model_deployment("chat"))
    plan = bind_nodes(make_plan([group("serving/chat", 3, tp=2)]), pools)
    desired = reconcile(plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG)
    [dep] = desired.deployments
    assert dep["metadata"]["name"] == deployment_name("chat", "h100", "h100-sxm", 2, Role.UNIFIED) == "chat-h100-h100-sxm-tp2-unified"
    assert dep["metadata"]["namespace"] == "serving" and dep["spec"]["replicas"] == 3
    assert dep["metadata"]["ownerReferences"][0] | {"uid": "uid-chat", "kind": "ModelDeployment", "controller": True} \
        == dep["metadata"]["ownerReferences"][0]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["hetsched.io/model"] == "chat" and labels["hetsched.io/accelerator"] == "h100-sxm"
    assert labels["hetsched.io/role"] == "unified"
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    hosts = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert hosts[0]["matchExpressions"][0]["values"] == ["n1"]
    assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    container = pod["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--max-num-seqs") + 1] == "128"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"
    assert desired.services[0]["spec"]["selector"] == {"hetsched.io/model": "chat"}
    assert desired.disruption_budgets[0]["spec"]["maxUnavailable"] == 1
    for obj in [*desired.deployments, *desired.services, *desired.disruption_budgets]:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_engine_pods_meet_the_restricted_pod_security_standard_with_probes_and_limits() -> None:
    nodes = [node("n1"), amd_node("a1")]
    amd_pool = {"metadata": {"name": "mi300"}, "spec": {"nodeSelector": {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}}}
    pools = _pools(nodes, pool("h100"), amd_pool)
    md = model_deployment("chat", engine={"image": "vllm/vllm-openai:v0.11.0", "startupTimeout": "1h",
                                          "security": {"runAsUser": 2000, "supplementalGroups": [44, 110]}})
    plan = bind_nodes(make_plan([group("serving/chat", 2, tp=2),
                                 group("serving/chat", 1, pool="mi300", accelerator="mi300x", tp=1)]), pools)
    desired = reconcile(plan, Observed(nodes=nodes), models=_models(md), pools=pools, catalog=CATALOG)
    assert len(desired.deployments) == 2
    for name, pod in pod_specs(desired.deployments):
        assert restricted_violations(pod) == [], name
        assert pod["securityContext"]["runAsUser"] == 2000 and pod["securityContext"]["supplementalGroups"] == [44, 110]
        [container] = pod["containers"]
        assert {"cpu", "memory"} <= set(container["resources"]["limits"]) & set(container["resources"]["requests"])
        assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] == 3600
        assert container["livenessProbe"]["httpGet"]["path"] == container["readinessProbe"]["httpGet"]["path"] == "/health"
        env = {e["name"]: e["value"] for e in container["env"]}
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert env["HOME"] in mounts and "/tmp" in mounts
    writable = _models(model_deployment("chat", engine={"image": "x", "security": {"readOnlyRootFilesystem": False}}))
    [dep, _] = reconcile(plan, Observed(nodes=nodes), models=writable, pools=pools, catalog=CATALOG).deployments
    pod = dep["spec"]["template"]["spec"]
    assert restricted_violations(pod, read_only_root=False) == [] and restricted_violations(pod) != []


def test_a_namespaced_operator_leaves_out_model_deployments_elsewhere() -> None:
    pools = _pools([node("n1")], pool("h100"))
    deployments = [model_deployment("a"), model_deployment("b", namespace="other")]
    planning = planning_input(deployments, pools, namespaces=("serving",))
    assert list(planning.models) == ["serving/a"] and [m.name for m in planning.spec.models] == ["serving/a"]
    [rejected] = planning.rejected
    assert (rejected.namespace, rejected.reason) == ("other", "NamespaceNotServed") and "serving" in rejected.message
    assert sorted(planning_input(deployments, pools).models) == ["other/b", "serving/a"]


def test_engine_env_takes_secrets_through_value_from_and_env_from() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    md = model_deployment("chat", engine={
        "image": "vllm/vllm-openai:v0.11.0",
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "engine", "key": "mode", "optional": True}}}],
        "envFrom": [{"secretRef": {"name": "engine-secrets"}}, {"configMapRef": {"name": "engine"}, "prefix": "CFG_"}]})
    plan = bind_nodes(make_plan([group("serving/chat", 1)]), pools)
    [dep] = reconcile(plan, Observed(nodes=nodes), models=_models(md), pools=pools, catalog=CATALOG).deployments
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["VLLM_LOGGING_LEVEL"] == {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}
    assert env["MODE"]["valueFrom"] == {"configMapKeyRef": {"name": "engine", "key": "mode", "optional": True}}
    assert container["envFrom"] == [{"secretRef": {"name": "engine-secrets"}},
                                    {"prefix": "CFG_", "configMapRef": {"name": "engine"}}]
    kubernetes_validate.validate(dep, "1.33", strict=True)
    for engine, problem in (({"image": "x", "env": [{"name": "A", "value": "1", "valueFrom": {
                                 "secretKeyRef": {"name": "s", "key": "k"}}}]}, "not both"),
                            ({"image": "x", "env": [{"name": "A", "valueFrom": {}}]}, "exactly one"),
                            ({"image": "x", "envFrom": [{"prefix": "P_"}]}, "exactly one")):
        rejected = parse_model_deployment(model_deployment("bad", engine=engine))
        assert isinstance(rejected, Rejected) and rejected.reason == "InvalidSpec" and problem in rejected.message
        assert "spec.engine" in rejected.message


def test_sglang_mig_and_amd_resources() -> None:
    nodes = [node("n1"), amd_node("a1")]
    amd_pool = {"metadata": {"name": "mi300"}, "spec": {"nodeSelector": {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}}}
    pools = _pools(nodes, pool("h100"), amd_pool)
    md = model_deployment("chat", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5", "port": 30000},
                          disaggregation="prefill_decode")
    plan = bind_nodes(make_plan([group("serving/chat", 1, pool="mi300", accelerator="mi300x", tp=4, role=Role.PREFILL),
                                 group("serving/chat", 2, pool="mi300", accelerator="mi300x", profile="cpx_nps4",
                                       role=Role.DECODE)]), pools)
    desired = reconcile(plan, Observed(nodes=nodes), models=_models(md), pools=pools, catalog=CATALOG)
    by_role = {d["spec"]["template"]["metadata"]["labels"]["hetsched.io/role"]: d for d in desired.deployments}
    prefill = by_role["prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert prefill["resources"]["requests"]["amd.com/gpu"] == "4"
    assert prefill["args"][prefill["args"].index("--tp-size") + 1] == "4"
    assert prefill["args"][prefill["args"].index("--disaggregation-mode") + 1] == "prefill"
    decode = by_role["decode"]["spec"]["template"]["spec"]["containers"][0]
    assert decode["resources"]["requests"]["amd.com/gpu"] == "1"  # the device plugin's single naming
    assert not [k for k in decode["resources"]["requests"] if k.startswith("amd.com/") and k != "amd.com/gpu"]
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        by_role["decode"]["spec"]["template"]["spec"]["tolerations"]

    per_mode = amd_node("a1")  # the device plugin's mixed naming: every GPU under its partition mode
    per_mode["status"]["capacity"] = {"amd.com/spx_nps1": "6", "amd.com/cpx_nps4": "16"}
    pools = _pools([per_mode], amd_pool)
    assert pools[0].status.inventory[0].mig_strategy == "mixed" and pools[0].status.gpus == 8
    desired = reconcile(bind_nodes(plan, pools), Observed(nodes=[per_mode]), models=_models(md), pools=pools,
                        catalog=CATALOG)
    requests = {d["spec"]["template"]["metadata"]["labels"]["hetsched.io/role"]:
                d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] for d in desired.deployments}
    assert requests["prefill"]["amd.com/spx_nps1"] == "4" and requests["decode"]["amd.com/cpx_nps4"] == "1"
    assert not any("amd.com/gpu" in r for r in requests.values())


def test_reconcile_twice_changes_nothing() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    models = _models(model_deployment("a"), model_deployment("b", namespace="other"))
    plan = bind_nodes(make_plan([group("serving/a", 2), group("other/b", 1, tp=4)]), pools)
    observed = Observed(nodes=nodes)
    first = changes(reconcile(plan, observed, models=models, pools=pools, catalog=CATALOG), observed)
    assert {(c.action, c.kind) for c in first} == {("create", "Deployment"), ("create", "Service"),
                                                   ("create", "PodDisruptionBudget")}
    observed = _ready(_apply(observed, first))
    assert changes(reconcile(plan, observed, models=models, pools=pools, catalog=CATALOG), observed) == []


def test_quantities_the_api_server_rewrites_canonically_are_not_patched_again() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    engine = {"image": "vllm/vllm-openai:v0.11.0", "resources": {"cpu": "0.5", "memory": "1.5Gi"}}
    plan = bind_nodes(make_plan([group("serving/chat", 1)]), pools)
    models = _models(model_deployment("chat", engine=engine))
    observed = _ready(_apply(Observed(nodes=nodes), changes(
        reconcile(plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG), Observed(nodes=nodes))))
    stored = json.loads(json.dumps(observed.deployments).replace('"0.5"', '"500m"').replace('"1.5Gi"', '"1536Mi"'))
    observed = Observed(nodes=nodes, deployments=stored, services=observed.services,
                        disruption_budgets=observed.disruption_budgets)
    assert changes(reconcile(plan, observed, models=models, pools=pools, catalog=CATALOG), observed) == []

    more = _models(model_deployment("chat", engine={**engine, "resources": {"cpu": "0.6", "memory": "1.5Gi"}}))
    step = changes(reconcile(plan, observed, models=more, pools=pools, catalog=CATALOG), observed)
    assert [(c.action, c.kind) for c in step] == [("patch", "Deployment")]


def test_make_before_break_keeps_old_replicas_until_new_ones_are_ready() -> None:
    nodes = [node("n1"), node("n2", product="NVIDIA-L40S")]
    pools = _pools(nodes, pool("h100"), pool("l40s", product="NVIDIA-L40S"))
    models = _models(model_deployment("chat"))
    old_plan = bind_nodes(make_plan([group("serving/chat", 2)]), pools)
    observed = _ready(_apply(Observed(nodes=nodes), changes(
        reconcile(old_plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG), Observed(nodes=nodes))))
    new_plan = bind_nodes(make_plan([group("serving/chat", 3, pool="l40s", accelerator="l40s")]), pools)

    step = changes(reconcile(new_plan, observed, models=models, pools=pools, catalog=CATALOG), observed)
    assert [(c.action, c.name) for c in step if c.kind == "Deployment"] == [("create", "chat-l40s-l40s-tp1-unified")]
    observed = _apply(observed, step)
    desired = reconcile(new_plan, observed, models=models, pools=pools, catalog=CATALOG)
    assert desired.models["serving/chat"].retiring == ["chat-h100-h100-sxm-tp1-unified"]
    assert changes(desired, observed) == []  # old still serving while new are not Ready

    observed = _ready(observed)
    step = changes(reconcile(new_plan, observed, models=models, pools=pools, catalog=CATALOG), observed)
    assert [(c.action, c.name) for c in step] == [("delete", "chat-h100-h100-sxm-tp1-unified")]


def test_scale_down_waits_for_readiness_and_adjuster_changes_replicas() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    models = _models(model_deployment("chat"))
    observed = _ready(_apply(Observed(nodes=nodes), changes(reconcile(
        bind_nodes(make_plan([group("serving/chat", 4)]), pools), Observed(nodes=nodes), models=models, pools=pools,
        catalog=CATALOG), Observed(nodes=nodes))))
    smaller = bind_nodes(make_plan([group("serving/chat", 2)]), pools)
    [patch] = [c for c in changes(reconcile(smaller, observed, models=models, pools=pools, catalog=CATALOG), observed)
               if c.kind == "Deployment"]
    assert patch.body["spec"]["replicas"] == 2  # the 2 planned are among the 4 Ready ones

    def burst(model, targets):
        return ScalingDecision(replicas={t.deployment: t.planned + 3 for t in targets}, reasons=("queue above target",),
                               observed_rps=41.23456, slo_attainment=0.98765)

    desired = reconcile(smaller, observed, models=models, pools=pools, catalog=CATALOG, adjust=burst)
    assert desired.deployments[0]["spec"]["replicas"] == 5
    outcome = desired.models["serving/chat"]
    assert outcome.scaling_reasons == ["queue above target"] and outcome.planned_replicas == 5
    status = model_status("serving/chat", outcome=outcome, rejected=None, state=PlanState(smaller, None, False),
                          old=ModelDeploymentStatus(), generation=1)
    assert status.scaling_reasons == ["queue above target"]
    assert (status.observed_rps, status.slo_attainment) == (41.235, 0.9877)


def test_replicas_beyond_the_plan_may_go_on_any_pool_node_the_plans_preferred() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    pools = _pools(nodes, pool("h100"))
    models = _models(model_deployment("a"), model_deployment("b"))
    plan = bind_nodes(make_plan([group("serving/a", 2), group("serving/b", 6)]), pools)
    assert {n.name for n in plan.nodes} == {"n1"}

    def hosts(desired, model: str) -> tuple[list[str], list[str]]:
        [dep] = [d for d in desired.deployments if d["metadata"]["name"].startswith(f"{model}-")]
        affinity = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        preferred = affinity.get("preferredDuringSchedulingIgnoredDuringExecution", [])
        return (required[0]["matchExpressions"][0]["values"],
                [v for p in preferred for e in p["preference"]["matchExpressions"] for v in e["values"]])

    planned = reconcile(plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG)
    assert hosts(planned, "a") == (["n1"], [])  # the plan's count stays where the plan packed it

    def burst(model, targets):
        return ScalingDecision(replicas={t.deployment: t.planned + 2 for t in targets if model.name == "a"},
                               reasons=("queue above target",))

    scaled = reconcile(plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG, adjust=burst)
    assert hosts(scaled, "a") == (["n1", "n2", "n3"], ["n1"])
    assert hosts(scaled, "b") == (["n1"], [])
    for dep in scaled.deployments:
        kubernetes_validate.validate(dep, "1.33", strict=True)


def test_mig_flow_drains_labels_waits_for_success_and_reports_failure() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100", partitioning="allowed"))
    models = _models(model_deployment("small"))
    plan = mig_plan("serving/small", node_name="n1")
    pod = {"metadata": {"name": "old-pod", "namespace": "serving", "labels": {"hetsched.io/model": "other"}},
           "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}

    tenant = [{"metadata": {"name": f"b-h100-h100-sxm-tp1-unified-7d9f-{i}", "namespace": "serving",
                            "labels": {"hetsched.io/model": "b", "pod-template-hash": "7d9f"},
                            "ownerReferences": [{"kind": "ReplicaSet", "name": "b-h100-h100-sxm-tp1-unified-7d9f"}]},
               "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}} for i in range(2)]
    draining = reconcile(plan, Observed(nodes=nodes, pods=[pod, *tenant]), models=models, pools=pools, catalog=CATALOG)
    assert draining.partition_nodes[0].phase is PartitionPhase.DRAINING and draining.node_labels == {}
    assert draining.deployments[0]["spec"]["replicas"] == 0
    still = "still there: pod serving/old-pod, serving/b-h100-h100-sxm-tp1-unified (2 pods)"
    assert still in draining.partition_nodes[0].message
    waiting = model_status("serving/small", outcome=draining.models["serving/small"], rejected=None,
                           state=PlanState(plan, None, False), old=ModelDeploymentStatus(), generation=1)
    applied = next(c for c in waiting.conditions if c.type == "Applied")
    assert applied.reason == "WaitingForMig" and applied.message.startswith("re-partitioning n1: draining")
    assert still in applied.message

    nodes[0]["metadata"]["labels"]["nvidia.com/mig.config.state"] = "success"  # of the config before
    observed = Observed(nodes=nodes)
    desired = reconcile(plan, observed, models=models, pools=pools, catalog=CATALOG, now=1_000_000.0)
    assert desired.node_labels == {"n1": {"nvidia.com/mig.config": "hetsched-2x3g", "nvidia.com/mig.config.state": None,
                                          "hetsched.io/partitioning-since": "1000000"}}
    step = changes(desired, observed, mig_configmap=("gpu-operator", "mig-parted"))
    assert [c.kind for c in step][-1] == "Node"  # the label comes after the ConfigMap it names
    configmap = next(c for c in step if c.kind == "ConfigMap").body
    kubernetes_validate.validate(configmap, "1.33", strict=True)
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["mig-configs"]["hetsched-2x3g"][0] == {"devices": [0], "mig-enabled": True,
                                                         "mig-devices": {"3g.40gb": 2}}
    assert "all-disabled" in config["mig-configs"]
    assert configmap["data"]["config.yaml"] == mig_parted_yaml(plan.mig_configs)  # the file the CLI and web render
    dep = next(c for c in step if c.kind == "Deployment").body
    assert dep["spec"]["replicas"] == 0  # nothing scheduled before the MIG manager reports success

    for state, phase, replicas in (("pending", PartitionPhase.CONFIGURING, 0), ("success", PartitionPhase.READY, 2),
                                   ("failed", PartitionPhase.FAILED, 0)):
        labelled = [node("n1", **{"nvidia.com/mig.config": "hetsched-2x3g", "nvidia.com/mig.config.state": state})]
        desired = reconcile(plan, Observed(nodes=labelled), models=models, pools=pools, catalog=CATALOG)
        assert desired.partition_nodes[0].phase is phase
        dep = desired.deployments[0]
        assert dep["spec"]["replicas"] == replicas
        pod_spec = dep["spec"]["template"]["spec"]
        assert pod_spec["nodeSelector"]["nvidia.com/mig.config.state"] == "success"
        assert pod_spec["containers"][0]["resources"]["requests"]["nvidia.com/mig-3g.40gb"] == "1"
    outcome = desired.models["serving/small"]
    assert outcome.failed_partition == ["n1"]
    status = model_status("serving/small", outcome=outcome, rejected=None, state=PlanState(plan, None, False),
                          old=ModelDeploymentStatus(), generation=1)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.status == "True" and degraded.reason == "MigConfigFailed"

    # no answer: the state label the switch removed never comes back (no MIG manager reads this ConfigMap)
    asked = [node("n1", **{"nvidia.com/mig.config": "hetsched-2x3g", "hetsched.io/partitioning-since": "1000000"})]
    for seconds, phase in ((19 * 60, PartitionPhase.CONFIGURING), (21 * 60, PartitionPhase.FAILED)):
        desired = reconcile(plan, Observed(nodes=asked), models=models, pools=pools, catalog=CATALOG,
                            now=1_000_000.0 + seconds)
        assert desired.partition_nodes[0].phase is phase
    assert "no answer from the MIG manager" in desired.partition_nodes[0].message


def test_failed_mig_keeps_the_old_placement_serving() -> None:
    nodes = [node("n1", **{"nvidia.com/mig.config": "hetsched-2x3g", "nvidia.com/mig.config.state": "failed"}),
             node("n2")]
    pools = _pools(nodes, pool("h100", partitioning="allowed"))
    models = _models(model_deployment("small"))
    old = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "small-h100-sxm-tp1-unified", "namespace": "serving",
                        "labels": {"hetsched.io/model": "small", "app.kubernetes.io/managed-by": "hetsched"}},
           "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}
    observed = Observed(nodes=nodes, deployments=[old])
    desired = reconcile(mig_plan("serving/small", node_name="n1"), observed, models=models, pools=pools, catalog=CATALOG)
    step = changes(desired, observed)
    assert not [c for c in step if c.action == "delete"]
    assert desired.models["serving/small"].retiring == ["small-h100-sxm-tp1-unified"]


def test_a_model_planned_on_a_deleted_pool_keeps_serving_and_says_why() -> None:
    nodes = [node("n1"), node("n2", product="NVIDIA-L40S")]
    both = _pools(nodes, pool("h100"), pool("l40s", product="NVIDIA-L40S"))
    models = _models(model_deployment("chat"))
    applied = bind_nodes(make_plan([group("serving/chat", 3, pool="l40s", accelerator="l40s")]), both)
    observed = _ready(_apply(Observed(nodes=nodes), changes(
        reconcile(applied, Observed(nodes=nodes), models=models, pools=both, catalog=CATALOG), Observed(nodes=nodes))))
    only_h100 = [p for p in both if p.name == "h100"]

    desired = reconcile(applied, observed, models=models, pools=only_h100, catalog=CATALOG)
    assert changes(desired, observed) == []  # the 3 replicas on l40s keep serving
    assert desired.models["serving/chat"].missing_pools == ["l40s"]
    status = model_status("serving/chat", outcome=desired.models["serving/chat"], rejected=None,
                          state=PlanState(None, None, True), old=ModelDeploymentStatus(), generation=1)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.status == "True" and degraded.reason == "PoolGone" and "AcceleratorPool l40s" in degraded.message
    assert status.ready_replicas == 3

    moved = bind_nodes(make_plan([group("serving/chat", 2)]), only_h100)
    step = changes(reconcile(moved, observed, models=models, pools=only_h100, catalog=CATALOG), observed)
    assert [c.action for c in step if c.kind == "Deployment"] == ["create"]  # make-before-break as for any move
    observed = _ready(_apply(observed, step))
    step = changes(reconcile(moved, observed, models=models, pools=only_h100, catalog=CATALOG), observed)
    assert [c.action for c in step] == ["delete"]


def test_rejected_model_keeps_what_serves_it_and_deleted_models_are_collected() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    models = _models(model_deployment("a"), model_deployment("b"))
    plan = bind_nodes(make_plan([group("serving/a", 1), group("serving/b", 1)]), pools)
    observed = _ready(_apply(Observed(nodes=nodes), changes(
        reconcile(plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG), Observed(nodes=nodes))))
    only_a = {k: v for k, v in models.items() if k == "serving/a"}
    kept = reconcile(plan, observed, models=only_a, pools=pools, catalog=CATALOG, untouched={("serving", "b")})
    assert changes(kept, observed) == []
    gone = changes(reconcile(plan, observed, models=only_a, pools=pools, catalog=CATALOG), observed)
    assert sorted((c.action, c.kind, c.name) for c in gone) == [
        ("delete", "Deployment", "b-h100-h100-sxm-tp1-unified"), ("delete", "PodDisruptionBudget", "b"),
        ("delete", "Service", "b")]


def test_status_conditions_follow_the_kubernetes_convention() -> None:
    rejected = parse_model_deployment({"metadata": {"name": "x", "namespace": "n"}, "spec": {"model": "llama-3.1-8b"}})
    assert isinstance(rejected, Rejected)
    status = model_status("n/x", outcome=None, rejected=rejected, state=PlanState(None, "no pools", False),
                          old=ModelDeploymentStatus(), generation=3)
    planned = next(c for c in status.conditions if c.type == "Planned")
    assert planned.status == "False" and planned.reason == "InvalidSpec" and "spec.engine" in planned.message
    assert planned.observed_generation == 3 and planned.last_transition_time is not None
    again = model_status("n/x", outcome=None, rejected=rejected, state=PlanState(None, "no pools", False),
                         old=status, generation=3)
    assert again == status


@pytest.mark.parametrize("name", ["a" * 80, "Chat.Model", "llama-3.1-8b"])
def test_deployment_names_are_dns_labels(name: str) -> None:
    result = deployment_name(name, "h100.spot", "h100-sxm:3g.40gb", 1, Role.DECODE)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", result)
    assert result == deployment_name(name, "h100.spot", "h100-sxm:3g.40gb", 1, Role.DECODE)
    assert result != deployment_name(name, "h100-spot", "h100-sxm:3g.40gb", 1, Role.DECODE)


def test_two_pools_of_one_accelerator_run_one_deployment_each_and_old_names_retire_after_the_new_are_ready() -> None:
    nodes = [node("od-1", pool="ondemand"), node("spot-1", pool="spot")]
    specs = [pool(name, nodeSelector={"pool": sel}) for name, sel in (("h100-ondemand", "ondemand"), ("h100-spot", "spot"))]
    pools = _pools(nodes, *specs)
    models = _models(model_deployment("chat"))
    plan = bind_nodes(make_plan([group("serving/chat", 2, pool="h100-ondemand"), group("serving/chat", 3, pool="h100-spot")]),
                      pools)
    legacy = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "chat-h100-sxm-tp1-unified", "namespace": "serving",
                           "labels": {"hetsched.io/model": "chat", "app.kubernetes.io/managed-by": "hetsched"}},
              "spec": {"replicas": 5}, "status": {"readyReplicas": 5}}
    observed = Observed(nodes=nodes, deployments=[legacy])
    step = changes(reconcile(plan, observed, models=models, pools=pools, catalog=CATALOG), observed)
    created = {c.name: c.body for c in step if c.kind == "Deployment" and c.action == "create"}
    assert {n: (b["spec"]["replicas"], b["spec"]["selector"]["matchLabels"]["hetsched.io/pool"])
            for n, b in created.items()} == {"chat-h100-ondemand-h100-sxm-tp1-unified": (2, "h100-ondemand"),
                                             "chat-h100-spot-h100-sxm-tp1-unified": (3, "h100-spot")}
    assert not [c for c in step if c.action == "delete"]  # the old name serves until the new ones are Ready
    observed = _ready(_apply(observed, step))
    step = changes(reconcile(plan, observed, models=models, pools=pools, catalog=CATALOG), observed)
    assert [(c.action, c.name) for c in step] == [("delete", "chat-h100-sxm-tp1-unified")]


def test_the_real_optimizer_plan_reconciles_into_valid_mig_deployments() -> None:
    from hetsched.operator.handlers import default_solver
    from hetsched.optimizer.spec import CapacityEntry

    nodes = [node("gpu-a"), node("gpu-b")]
    pools = _pools(nodes, pool("h100", partitioning="allowed"))
    planning = planning_input([model_deployment("tiny", rate=6, model="qwen3-0.6b")], pools)
    capacities = [CapacityEntry(model="serving/tiny", device="h100-sxm:1g.10gb", requests_per_s=4.0),
                  CapacityEntry(model="serving/tiny", device="h100-sxm", requests_per_s=5.0)]
    plan = bind_nodes(default_solver(planning.spec.model_copy(update={"capacities": capacities}), None), pools)
    assert [(g.device, g.replicas) for g in plan.models[0].replicas] == [("h100-sxm:1g.10gb", 2)]
    [planned_node] = [n for n in plan.nodes if n.mig_config]
    assert planned_node.name in ("gpu-a", "gpu-b")

    observed = Observed(nodes=nodes)
    desired = reconcile(plan, observed, models=planning.models, pools=pools, catalog=CATALOG)
    assert desired.node_labels[planned_node.name]["nvidia.com/mig.config"] == planned_node.mig_config
    [dep] = desired.deployments
    assert dep["spec"]["replicas"] == 0
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "cpu": "4", "memory": "32Gi", "nvidia.com/mig-1g.10gb": "1"}
    config = yaml.safe_load(desired.mig_configmap["config.yaml"])
    assert any(g.get("mig-devices", {}).get("1g.10gb") for g in config["mig-configs"][planned_node.mig_config])

    labelled = [n if n["metadata"]["name"] != planned_node.name else
                node(planned_node.name, **{"nvidia.com/mig.config": planned_node.mig_config,
                                           "nvidia.com/mig.config.state": "success"}) for n in nodes]
    ready = reconcile(plan, Observed(nodes=labelled), models=planning.models, pools=pools, catalog=CATALOG)
    assert ready.deployments[0]["spec"]["replicas"] == 2
    kubernetes_validate.validate(ready.deployments[0], "1.33", strict=True)


def test_manual_approval_holds_for_the_approved_plan_only() -> None:
    assert PlacementPlanSpec(approval=Approval.AUTO).approves("abc")
    assert not PlacementPlanSpec(approval=Approval.MANUAL, plan_hash="abc").approves("abc")
    approved = PlacementPlanSpec(approval=Approval.MANUAL, approved=True, plan_hash="abc")
    assert approved.approves("abc") and not approved.approves("def")


def test_router_discovery_reads_the_routing_policy_of_a_model_deployment() -> None:
    """A ModelDeployment the operator accepts names its model as its pods are labelled, and its routing
    policy is one the router applies; the CRD offers exactly the router's policies."""
    from pathlib import Path

    import yaml

    from hetsched.router.discovery import policies_from_deployments
    from hetsched.router.types import Policy

    chat = model_deployment("chat", routing={"policy": "least-kv"})
    assert set(_models(chat, model_deployment("big"))) == {"serving/chat", "serving/big"}
    found = policies_from_deployments([chat, model_deployment("big")], models=["chat", "big"])
    assert found == {"chat": Policy.LEAST_KV}
    crd = yaml.safe_load((Path(__file__).parent.parent / "crds" / "modeldeployments.hetsched.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert set(spec["routing"]["properties"]["policy"]["enum"]) == {p.value for p in Policy}


def test_router_discovery_reads_the_pods_the_operator_creates() -> None:
    """The operator's pod labels and served name are the router's contract: device, TP and model survive."""
    from types import SimpleNamespace

    from hetsched.router.discovery import endpoints_from_pods

    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100", partitioning="allowed"))
    models = _models(model_deployment("chat", routing={"kvEvents": True}), model_deployment("big"))
    plan = bind_nodes(make_plan([group("serving/chat", 1, profile="3g.40gb"), group("serving/big", 1, tp=4)]), pools)
    desired = reconcile(plan, Observed(nodes=nodes), models=models, pools=pools, catalog=CATALOG)
    pods = []
    for i, dep in enumerate(desired.deployments):
        template = dep["spec"]["template"]
        container = template["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--served-model-name") + 1] == template["metadata"]["labels"]["hetsched.io/model"]
        ports = [SimpleNamespace(name=p["name"], container_port=p["containerPort"]) for p in container["ports"]]
        pods.append(SimpleNamespace(
            metadata=SimpleNamespace(name=f"pod-{i}", labels=template["metadata"]["labels"], deletion_timestamp=None),
            spec=SimpleNamespace(containers=[SimpleNamespace(ports=ports)]),
            status=SimpleNamespace(pod_ip=f"10.0.0.{i + 1}", conditions=[SimpleNamespace(type="Ready", status="True")]),
        ))
    found = endpoints_from_pods(pods, models=["chat", "big"], default_port=8000)
    [chat], [big] = found["chat"], found["big"]
    assert (chat.accelerator, chat.tp) == ("h100-sxm:3g.40gb", 1)
    assert (big.accelerator, big.tp) == ("h100-sxm", 4)
    # routing.kvEvents: vLLM publishes where the router subscribes; the other model publishes nothing
    assert (chat.kv_events, big.kv_events) == (f"tcp://{chat.url[7:].split(':')[0]}:5557", "")
    assert chat.kv_events_replay.endswith(":5558")
    [chat_dep] = [d for d in desired.deployments if d["spec"]["template"]["metadata"]["labels"]["hetsched.io/model"]
                  == "chat"]
    args = chat_dep["spec"]["template"]["spec"]["containers"][0]["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}


def test_kv_events_are_refused_for_an_engine_that_does_not_publish_them() -> None:
    rejected = parse_model_deployment(model_deployment("s", engine={"image": "lmsysorg/sglang:v0.5", "kind": "sglang"},
                                                       routing={"kvEvents": True}))
    assert isinstance(rejected, Rejected) and "routing.kvEvents" in rejected.message


def test_amd_partition_flow_taints_labels_waits_for_the_device_config_manager_and_untaints() -> None:
    from hetsched.operator.handlers import default_solver
    from hetsched.optimizer.spec import CapacityEntry

    user_taint = {"key": "team", "value": "ml", "effect": "NoSchedule"}
    stale = {"dcm.amd.com/gpu-config-profile-state": "success"}  # left from an earlier profile
    nodes = [amd_node("mi-a")]
    nodes[0]["metadata"]["labels"].update(stale)
    nodes[0]["spec"] = {"taints": [user_taint]}
    nodes[0]["status"]["capacity"] = {"amd.com/spx_nps1": "8"}  # the device plugin's mixed naming
    amd_pool = pool("mi300", "AMD_Instinct_MI300X", partitioning="allowed")
    amd_pool["spec"]["nodeSelector"] = {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}
    pools = _pools(nodes, amd_pool)
    planning = planning_input([model_deployment("tiny", rate=6, model="qwen3-0.6b")], pools)
    capacities = [CapacityEntry(model="serving/tiny", device="mi300x:cpx_nps1", requests_per_s=4.0),
                  CapacityEntry(model="serving/tiny", device="mi300x", requests_per_s=5.0)]
    plan = bind_nodes(default_solver(planning.spec.model_copy(update={"capacities": capacities}), None), pools)
    [planned] = plan.nodes
    profile = planned.partition_profile
    assert profile is not None and planned.mig_config is None
    where = ("kube-amd-gpu", "dcm")

    def step(observed: Observed, now: float = 1_000_000.0) -> tuple[Any, list[Any], Observed]:
        desired = reconcile(plan, observed, models=planning.models, pools=pools, catalog=CATALOG, now=now)
        todo = changes(desired, observed, dcm_configmap=where)
        return desired, todo, _apply(observed, todo)

    # 1. taint first: the manager can only re-partition GPUs its own daemons have let go of
    desired, todo, observed = step(Observed(nodes=nodes))
    assert desired.partition_nodes[0].phase is PartitionPhase.CONFIGURING and desired.node_labels == {}
    assert observed.nodes[0]["spec"]["taints"] == [user_taint, {"key": "amd-dcm", "value": "up", "effect": "NoExecute"}]
    configmap = next(c for c in todo if c.kind == "ConfigMap").body
    kubernetes_validate.validate(configmap, "1.33", strict=True)
    assert (configmap["metadata"]["namespace"], configmap["metadata"]["name"]) == where
    groups = json.loads(configmap["data"]["config.json"])["gpu-config-profiles"][profile]["profiles"]
    assert groups == [{"computePartition": "CPX", "memoryPartition": "NPS1", "numGPUsAssigned": 8}]
    assert desired.deployments[0]["spec"]["replicas"] == 0

    # 2. a pass later, the profile label, with the stale state removed so it cannot pass for this profile's
    desired, todo, observed = step(observed)
    assert desired.node_labels == {"mi-a": {"dcm.amd.com/gpu-config-profile": profile,
                                            "dcm.amd.com/gpu-config-profile-state": None,
                                            "hetsched.io/partitioning-since": "1000000"}}
    assert [c.kind for c in todo][-1] == "Node"
    labels = observed.nodes[0]["metadata"]["labels"]
    labels.pop("dcm.amd.com/gpu-config-profile-state")  # a merge patch with null removes the label
    desired, todo, observed = step(observed)
    assert desired.partition_nodes[0].phase is PartitionPhase.CONFIGURING and [c for c in todo if c.kind == "Node"] == []
    assert desired.deployments[0]["spec"]["replicas"] == 0

    # 3. the manager reports: success schedules the replicas and lifts the taint; failure lifts it too
    for state, phase, replicas in (("success", PartitionPhase.READY, 2), ("failure", PartitionPhase.FAILED, 0)):
        done = copy.deepcopy(observed.nodes[0])
        done["metadata"]["labels"]["dcm.amd.com/gpu-config-profile-state"] = state
        desired, todo, after = step(Observed(nodes=[done]))
        assert desired.partition_nodes[0].phase is phase
        assert after.nodes[0]["spec"]["taints"] == [user_taint]
        dep = desired.deployments[0]
        assert dep["spec"]["replicas"] == replicas
        pod_spec = dep["spec"]["template"]["spec"]
        assert pod_spec["nodeSelector"]["dcm.amd.com/gpu-config-profile-state"] == "success"
        assert pod_spec["containers"][0]["resources"]["requests"]["amd.com/cpx_nps1"] == "1"
    assert desired.models["serving/tiny"].failed_partition == ["mi-a"]

    # 4. no answer at all (no manager deployed, or it reads another ConfigMap): the node must not stay tainted
    desired, todo, after = step(observed, now=1_000_000.0 + 19 * 60)
    assert desired.partition_nodes[0].phase is PartitionPhase.CONFIGURING
    desired, todo, after = step(observed, now=1_000_000.0 + 21 * 60)
    assert desired.partition_nodes[0].phase is PartitionPhase.FAILED and "no answer" in desired.partition_nodes[0].message
    assert after.nodes[0]["spec"]["taints"] == [user_taint]


def test_amd_nodes_of_whole_gpus_need_no_partition_profile_applied() -> None:
    from hetsched.operator.handlers import default_solver
    from hetsched.optimizer.spec import CapacityEntry

    nodes = [amd_node("mi-a")]
    amd_pool = {"metadata": {"name": "mi300"}, "spec": {"nodeSelector": {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"},
                                                         "partitioning": "allowed"}}
    pools = _pools(nodes, amd_pool)
    planning = planning_input([model_deployment("chat", rate=15)], pools)
    capacities = [CapacityEntry(model="serving/chat", device="mi300x", requests_per_s=10.0)]
    plan = bind_nodes(default_solver(planning.spec.model_copy(update={"capacities": capacities}), None), pools)
    [planned] = plan.nodes
    assert [(g.compute, g.gpus) for g in plan.partition_profiles[planned.partition_profile]] == [("SPX", 8)]
    desired = reconcile(plan, Observed(nodes=nodes), models=planning.models, pools=pools, catalog=CATALOG)
    assert desired.partition_nodes[0].phase is PartitionPhase.READY
    assert desired.node_labels == {} and desired.node_taints == {}
    assert desired.deployments[0]["spec"]["replicas"] == 2

    split = amd_node("mi-a")  # partitioned by hand: the plan's whole GPUs need SPX applied first
    split["metadata"]["labels"]["amd.com/gpu.compute-memory-partition"] = "cpx_nps1"
    desired = reconcile(plan, Observed(nodes=[split]), models=planning.models, pools=pools, catalog=CATALOG)
    assert desired.partition_nodes[0].phase is PartitionPhase.CONFIGURING and "mi-a" in desired.node_taints


def test_an_auto_model_planned_disaggregated_runs_as_role_deployments() -> None:
    from hetsched.operator.handlers import default_solver
    from hetsched.operator.planning import as_planned
    from hetsched.optimizer.spec import CapacityEntry, Disaggregation

    nodes = [node("gpu-a")]
    pools = _pools(nodes, pool("h100"))
    planning = planning_input([model_deployment("chat", rate=4, model="qwen3-0.6b", disaggregation="auto")], pools)
    assert planning.spec is not None and planning.spec.models[0].disaggregation is Disaggregation.AUTO
    capacities = [CapacityEntry(model="serving/chat", device="h100-sxm", role=role, requests_per_s=rate)
                  for role, rate in ((Role.UNIFIED, 1.0), (Role.PREFILL, 10.0), (Role.DECODE, 10.0))]
    plan = bind_nodes(default_solver(planning.spec.model_copy(update={"capacities": capacities}), None), pools)
    assert {g.role for g in plan.models[0].replicas} == {Role.PREFILL, Role.DECODE}
    assert as_planned(planning.spec, plan).models[0].disaggregation is Disaggregation.PREFILL_DECODE
    assert as_planned(planning.spec, None).models[0].disaggregation is Disaggregation.PREFILL_DECODE

    desired = reconcile(plan, Observed(nodes=nodes), models=planning.models, pools=pools, catalog=CATALOG)
    by_role = {d["spec"]["template"]["metadata"]["labels"]["hetsched.io/role"]: d for d in desired.deployments}
    assert set(by_role) == {"prefill", "decode"}
    for role, producer in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        args = by_role[role]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_role"] == producer


def test_an_auto_model_is_planned_unified_where_its_connector_misses_a_pool() -> None:
    from hetsched.operator.planning import as_planned
    from hetsched.optimizer.plan import PlanStatus
    from hetsched.optimizer.spec import Disaggregation

    nodes = [node("n1"), amd_node("a1")]
    amd_pool = {"metadata": {"name": "mi300"}, "spec": {"nodeSelector": {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}}}
    pools = _pools(nodes, pool("h100"), amd_pool)
    mooncake = model_deployment("chat", disaggregation="auto", kvTransfer={"connector": "MooncakeConnector"})
    nixl = model_deployment("docs", disaggregation="auto")
    planning = planning_input([mooncake, nixl], pools)
    assert planning.spec is not None
    assert {m.name: m.disaggregation for m in planning.spec.models} == {
        "serving/chat": Disaggregation.UNIFIED, "serving/docs": Disaggregation.AUTO}
    unified = make_plan([group("serving/docs", 1)])
    assert unified.status is not PlanStatus.INFEASIBLE
    assert as_planned(planning.spec, unified).model("serving/docs").disaggregation is Disaggregation.UNIFIED


def test_an_attention_backend_reaches_the_engine_and_the_pods_labels_and_a_wrong_one_is_refused() -> None:
    nodes = [node("n1")]
    pools = _pools(nodes, pool("h100"))
    plan = bind_nodes(make_plan([group("serving/chat", 1)]), pools)
    md = model_deployment("chat", engine={"image": "vllm/vllm-openai:v0.11.0", "attentionBackend": "FLASHINFER"})
    [dep] = reconcile(plan, Observed(nodes=nodes), models=_models(md), pools=pools, catalog=CATALOG).deployments
    template = dep["spec"]["template"]
    env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
    assert env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"
    assert template["metadata"]["labels"]["hetsched.io/attention-backend"] == "FLASHINFER"
    assert "hetsched.io/attention-backend" not in dep["spec"]["selector"]["matchLabels"]
    kubernetes_validate.validate(dep, "1.33", strict=True)
    sglang = model_deployment("chat", engine={"kind": "sglang", "image": "lmsysorg/sglang:v0.5",
                                              "attentionBackend": "FLASHINFER"})
    [dep] = reconcile(plan, Observed(nodes=nodes), models=_models(sglang), pools=pools, catalog=CATALOG).deployments
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--attention-backend") + 1] == "flashinfer"
    rejected = parse_model_deployment(model_deployment("bad", engine={"image": "x", "attentionBackend": "flash attn"}))
    assert isinstance(rejected, Rejected) and "spec.engine.attentionBackend" in rejected.message
    planning = planning_input([md], pools)  # planned under the corrections learned for that backend
    assert planning.spec is not None and planning.spec.models[0].attention_backend == "FLASHINFER"


def _classed(**objectives: dict[str, Any]) -> dict[str, Any]:
    return model_deployment("chat", rate=40, model="qwen3-0.6b", objectives=[
        {"name": name, **fields} for name, fields in objectives.items()])


def test_a_model_with_class_demand_is_planned_per_class_and_deployed_as_one() -> None:
    from hetsched.operator.handlers import default_solver
    from hetsched.optimizer.objectives import join_objectives, objective_models

    nodes = [node("h-a", gpus=2), node("l-a", product="NVIDIA-L4", gpus=8)]
    pools = _pools(nodes, pool("h100"), pool("l4", product="NVIDIA-L4"))
    planning = planning_input([_classed(
        interactive={"priority": 10, "demandShare": 0.3, "slo": {"ttft": "300ms", "tpot": "30ms"}},
        batch={"demandShare": 0.6, "slo": {"ttft": "20s", "tpot": "200ms"}, "sheddable": True},
        audit={"bestEffort": True, "demandShare": 0.1})], pools)
    assert planning.spec is not None
    [model] = planning.spec.models
    assert [(o.name, o.demand_share, o.slo.ttft_ms, o.best_effort) for o in model.objectives] == [
        ("interactive", 0.3, 300, False), ("batch", 0.6, 20_000, False), ("audit", 0.1, 500, True)]

    split = default_solver(planning.spec, None)
    assert {m.name for m in split.models} == {"serving/chat/interactive", "serving/chat/batch"}  # audit: spare
    plan = join_objectives(split, objective_models(planning.spec))
    [joined] = plan.models
    by_group = {(g.device, g.role): g.replicas for g in joined.replicas}
    assert joined.name == "serving/chat" and sum(by_group.values()) == sum(
        g.replicas for m in split.models for g in m.replicas)
    assert abs(joined.demand_rps - 0.9 * 40) < 1e-6 and joined.cost_per_hour == pytest.approx(split.cost_per_hour)
    assert {r.model for n in plan.nodes for r in n.replicas} == {"serving/chat"}
    desired = reconcile(bind_nodes(plan, pools), Observed(nodes=nodes), models=planning.models, pools=pools,
                        catalog=CATALOG)
    assert sum(d["spec"]["replicas"] for d in desired.deployments) == sum(by_group.values())


def test_the_default_class_carries_the_demand_no_objective_claims_and_over_one_is_refused() -> None:
    pools = _pools([node("h-a")], pool("h100"))
    planning = planning_input([_classed(batch={"demandShare": 0.75, "slo": {"ttft": "20s", "tpot": "200ms"}},
                                        interactive={"priority": 10})], pools)
    assert planning.spec is not None
    assert [(o.name, o.demand_share, o.slo.ttft_ms) for o in planning.spec.models[0].objectives] == [
        ("batch", 0.75, 20_000), ("default", 0.25, 500)]
    unsplit = planning_input([_classed(interactive={"priority": 10})], pools)
    assert unsplit.spec is not None and unsplit.spec.models[0].objectives == []  # no demand said: one SLO
    over = planning_input([_classed(a={"demandShare": 0.7}, b={"demandShare": 0.6})], pools)
    [rejected] = over.rejected
    assert rejected.reason == "InvalidSpec" and "demand shares add up to 1.3" in rejected.message
