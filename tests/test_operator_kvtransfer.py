"""Disaggregated models in the operator: each role's engines carry the KV connector, and what cannot run is refused."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import kubernetes_validate
import pytest

from hetsched.catalog import load_catalog
from hetsched.catalog.types import Vendor
from hetsched.operator.inventory import pool_inventory
from hetsched.operator.planning import (
    ModelDeploymentRef,
    Rejected,
    allowed_pools,
    bind_nodes,
    parse_model_deployment,
    planning_input,
)
from hetsched.operator.kvtransfer import vendor_problem
from hetsched.operator.objects import Desired, Observed
from hetsched.operator.reconcile import reconcile
from hetsched.operator.resources import AcceleratorPoolSpec, ModelDeploymentStatus
from hetsched.operator.status import PlanState, model_status
from hetsched.optimizer.plan import ReplicaGroup
from hetsched.optimizer.spec import Role
from operator_fixtures import amd_node, group, make_plan, model_deployment, node, pool
from pod_security import restricted_violations

CATALOG = load_catalog()
AMD_POOL = {"metadata": {"name": "mi300"}, "spec": {"nodeSelector": {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}}}


def _pools(nodes: list[dict[str, Any]], *specs: dict[str, Any]):
    return [pool_inventory(s["metadata"]["name"], AcceleratorPoolSpec.model_validate(s["spec"]), nodes, CATALOG)
            for s in specs]


def _model(obj: dict[str, Any]) -> ModelDeploymentRef:
    parsed = parse_model_deployment(obj)
    assert isinstance(parsed, ModelDeploymentRef), parsed
    return parsed


def _refused(obj: dict[str, Any]) -> Rejected:
    parsed = parse_model_deployment(obj)
    assert isinstance(parsed, Rejected), parsed
    return parsed


def _disaggregated(name: str = "chat", **kv: Any) -> dict[str, Any]:
    return model_deployment(name, disaggregation="prefill_decode", **({"kvTransfer": kv} if kv else {}))


def _by_role(deployments: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The engine container of each Deployment, by role (one Deployment per role)."""
    return {d["spec"]["template"]["metadata"]["labels"]["hetsched.io/role"]: d["spec"]["template"]["spec"]
            ["containers"][0] for d in deployments}


def _kv_config(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    assert args.count("--kv-transfer-config") == 1
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _reconcile(md: dict[str, Any], groups: list[ReplicaGroup], *,
               deployments: Sequence[dict[str, Any]] = ()) -> tuple[Desired, ModelDeploymentRef]:
    """Reconcile ``groups`` of ``md`` on one H100 and one L40S node, which hold ``deployments``."""
    nodes = [node("gpu-1"), node("l40s-1", product="NVIDIA-L40S")]
    pools = _pools(nodes, pool("h100"), pool("l40s", product="NVIDIA-L40S"))
    model = _model(md)
    plan = bind_nodes(make_plan(groups), pools)
    return reconcile(plan, Observed(nodes=nodes, deployments=deployments), models={model.key: model}, pools=pools,
                     catalog=CATALOG), model


def _status(desired: Desired, model: ModelDeploymentRef) -> ModelDeploymentStatus:
    return model_status(model.key, outcome=desired.models[model.key], rejected=None,
                        state=PlanState(proposed=None, proposal_problem=None, awaiting_approval=False),
                        old=ModelDeploymentStatus(), generation=1)


def test_each_device_and_role_gets_a_deployment_with_nixl_by_default() -> None:
    groups = [group("serving/chat", 1, tp=2, role=Role.PREFILL),
              group("serving/chat", 1, pool="l40s", accelerator="l40s", role=Role.PREFILL),
              group("serving/chat", 1, role=Role.DECODE),
              group("serving/chat", 2, pool="l40s", accelerator="l40s", role=Role.DECODE)]
    desired, model = _reconcile(_disaggregated(), groups)
    deployments = {d["metadata"]["name"]: d for d in desired.deployments}
    assert sorted(deployments) == ["chat-h100-h100-sxm-tp1-decode", "chat-h100-h100-sxm-tp2-prefill", "chat-l40s-l40s-tp1-decode",
                                   "chat-l40s-l40s-tp1-prefill"]
    for name, dep in deployments.items():
        role = name.rsplit("-", 1)[1]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["hetsched.io/role"] == role and dep["spec"]["selector"]["matchLabels"]["hetsched.io/role"] == role
        assert labels["hetsched.io/model"] == "chat" and labels["hetsched.io/accelerator"] in ("h100-sxm", "l40s")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert _kv_config(container) == {"kv_connector": "NixlConnector",
                                         "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
        env = _env(container)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600" and env["HETSCHED_ROLE"]["value"] == role
        assert _ports(container) == {"http": 8000, "kv-transfer": 5600}
        kubernetes_validate.validate(dep, "1.33", strict=True)
        assert restricted_violations(dep["spec"]["template"]["spec"]) == [], name
    prefill = deployments["chat-h100-h100-sxm-tp2-prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert prefill["args"][prefill["args"].index("--tensor-parallel-size") + 1] == "2"
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert deployments["chat-l40s-l40s-tp1-decode"]["spec"]["replicas"] == 2

    assert [s["spec"]["selector"] for s in desired.services] == [{"hetsched.io/model": "chat"}]  # both roles' pods
    for service in desired.services:
        kubernetes_validate.validate(service, "1.33", strict=True)
    one_ready = [{**d, "status": {"readyReplicas": 1}} for d in desired.deployments]
    status = _status(*_reconcile(_disaggregated(), groups, deployments=one_ready))
    assert [(r.role, r.replicas, r.ready_replicas) for r in status.roles] == [("prefill", 2, 2), ("decode", 3, 2)]
    assert status.model_dump(by_alias=True)["roles"][0] == {"role": "prefill", "replicas": 2, "readyReplicas": 2}


def test_unified_models_are_unchanged() -> None:
    desired, model = _reconcile(model_deployment("chat"), [group("serving/chat", 2)])
    container = desired.deployments[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-transfer-config" not in container["args"] and _ports(container) == {"http": 8000}
    assert not [e for e in container["env"] if e["name"].startswith(("VLLM_", "LMCACHE_"))]
    assert _status(desired, model).roles == []


@pytest.mark.parametrize(("connector", "prefill_config", "decode_config", "prefill_env", "decode_env", "ports"), [
    ("MooncakeConnector", {}, {}, {"VLLM_MOONCAKE_BOOTSTRAP_PORT": "8998"}, {}, (8998, None)),
    ("P2pNcclConnector", {"kv_port": 14579, "kv_connector_extra_config": {"http_port": 8000}},
     {"kv_port": 14579, "kv_connector_extra_config": {"http_port": 8000}}, {}, {}, (14579, 14579)),
    ("LMCacheConnectorV1", {"kv_connector_extra_config": {"discard_partial_chunks": False}},
     {"kv_connector_extra_config": {"discard_partial_chunks": False}},
     {"LMCACHE_ENABLE_PD": "True", "LMCACHE_PD_ROLE": "sender", "LMCACHE_TRANSFER_CHANNEL": "nixl"},
     {"LMCACHE_PD_ROLE": "receiver", "LMCACHE_PD_PEER_INIT_PORT": "7300", "LMCACHE_PD_PEER_ALLOC_PORT": "7301"},
     (None, 7300)),
])
def test_each_connector_gets_its_config_variables_and_port(
        connector: str, prefill_config: dict[str, Any], decode_config: dict[str, Any], prefill_env: dict[str, str],
        decode_env: dict[str, str], ports: tuple[int | None, int | None]) -> None:
    groups = [group("serving/chat", 1, role=Role.PREFILL), group("serving/chat", 1, role=Role.DECODE)]
    desired, _ = _reconcile(_disaggregated(connector=connector), groups)
    for role, config, env, port in (("prefill", prefill_config, prefill_env, ports[0]),
                                    ("decode", decode_config, decode_env, ports[1])):
        container = _by_role(desired.deployments)[role]
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        assert _kv_config(container) == {"kv_connector": connector, "kv_role": kv_role, **config}
        have = _env(container)
        assert {name: have[name]["value"] for name in env} == env
        assert _ports(container).get("kv-transfer") == port
        assert not [n for n in have if n.startswith("VLLM_NIXL")]
    for dep in desired.deployments:
        kubernetes_validate.validate(dep, "1.33", strict=True)
    decode_env_names = _env(_by_role(desired.deployments)["decode"])
    if connector == "LMCacheConnectorV1":
        assert decode_env_names["LMCACHE_PD_PEER_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_user_settings_merge_into_the_config_and_each_role_gets_its_own_args_and_env() -> None:
    md = _disaggregated(port=5700, config={"kv_buffer_size": 8e9, "kv_load_failure_policy": "fail",
                                           "kv_connector_extra_config": {"backends": ["UCX"]}},
                        prefill={"args": ["--enforce-eager"], "env": [{"name": "UCX_TLS", "value": "rc,cuda_copy"}]},
                        decode={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]})
    groups = [group("serving/chat", 1, role=Role.PREFILL), group("serving/chat", 1, role=Role.DECODE)]
    desired, _ = _reconcile(md, groups)
    prefill, decode = _by_role(desired.deployments)["prefill"], _by_role(desired.deployments)["decode"]
    assert _kv_config(decode) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_size": 8e9,
                                  "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"backends": ["UCX"]}}
    assert prefill["args"][-1] == "--enforce-eager" and "--enforce-eager" not in decode["args"]
    assert prefill["env"][-1] == {"name": "UCX_TLS", "value": "rc,cuda_copy"} and "UCX_TLS" not in _env(decode)
    assert _env(decode)["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "t"}}
    assert _env(prefill)["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5700" and _ports(prefill)["kv-transfer"] == 5700
    for dep in desired.deployments:
        kubernetes_validate.validate(dep, "1.33", strict=True)


def test_sglang_roles_get_its_transfer_backend_and_bootstrap_port() -> None:
    md = _disaggregated(connector="MooncakeConnector")
    md["spec"]["engine"] = {"kind": "sglang", "image": "lmsysorg/sglang:v0.5", "port": 30000}
    groups = [group("serving/chat", 1, role=Role.PREFILL), group("serving/chat", 1, role=Role.DECODE)]
    desired, _ = _reconcile(md, groups)
    prefill, decode = _by_role(desired.deployments)["prefill"], _by_role(desired.deployments)["decode"]
    assert prefill["args"][-6:] == ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
                                    "--disaggregation-bootstrap-port", "8998"]
    assert decode["args"][-4:] == ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    assert _ports(prefill) == {"http": 30000, "kv-transfer": 8998} and _ports(decode) == {"http": 30000}
    assert "--kv-transfer-config" not in prefill["args"]


# --- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "field", "says"), [
    ({"disaggregation": "prefill_decode", "kvTransfer": {"connector": "FooConnector"}}, "spec.kvTransfer.connector",
     "NixlConnector"),
    ({"kvTransfer": {"connector": "NixlConnector"}}, "spec.kvTransfer", "disaggregation: prefill_decode"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"connector": "P2pNcclConnector"},
      "engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5", "port": 30000}}, "spec.kvTransfer.connector",
     "NixlConnector, MooncakeConnector"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"port": 8000}}, "spec.kvTransfer.port", "spec.engine.port"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"connector": "P2pNcclConnector", "port": 7995}},
     "spec.kvTransfer.port", "7995-8002"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"connector": "LMCacheConnectorV1", "port": 65535}},
     "spec.kvTransfer.port", "at most 65534"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"port": 70000}}, "spec.kvTransfer.port", "65535"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"config": {"kv_connector": "P2pNcclConnector"}}},
     "spec.kvTransfer.config.kv_connector", "spec.kvTransfer.connector"),
    ({"disaggregation": "prefill_decode", "kvTransfer": {"config": {"kv_buffer_size": 1e9}},
      "engine": {"kind": "sglang", "image": "lmsysorg/sglang:v0.5", "port": 30000}}, "spec.kvTransfer.config",
     "SGLang flags"),
])
def test_settings_that_cannot_run_are_refused_naming_the_field(spec: dict[str, Any], field: str, says: str) -> None:
    md = model_deployment("chat")
    md["spec"].update(spec)
    rejected = _refused(md)
    assert rejected.reason == "InvalidSpec" and rejected.message.startswith(field) and says in rejected.message


def test_a_connector_that_does_not_run_on_the_pools_gpus_is_refused_or_narrows_the_pools() -> None:
    nodes = [node("gpu-1"), amd_node("mi-1")]
    pools = _pools(nodes, pool("h100"), AMD_POOL)
    mooncake_on_amd = _disaggregated("amd", connector="MooncakeConnector")
    mooncake_on_amd["spec"]["allowedPools"] = ["mi300"]
    planning = planning_input([mooncake_on_amd, _disaggregated("anywhere", connector="P2pNcclConnector"),
                               _disaggregated("nixl")], pools)
    [rejected] = planning.rejected
    assert rejected.name == "amd" and rejected.reason == "ConnectorUnsupported"
    assert rejected.message.startswith("spec.kvTransfer.connector: MooncakeConnector moves KV caches between NVIDIA")
    assert "mi300 (amd)" in rejected.message and "choose NixlConnector" in rejected.message
    assert planning.spec is not None
    allowed = {m.name: m.allowed_pools for m in planning.spec.models}
    assert allowed == {"serving/anywhere": ["h100"], "serving/nixl": None}  # NIXL runs on both vendors

    nixl = _model(_disaggregated())
    assert allowed_pools(nixl, {"h100": Vendor.NVIDIA, "mi300": Vendor.AMD}) is None
    assert allowed_pools(nixl, {"cpu": Vendor.CPU}) == []
    unified = _model(model_deployment("chat"))
    assert allowed_pools(unified, {"cpu": Vendor.CPU}) is None


def test_nixl_on_cpus_is_refused_naming_the_connector() -> None:
    message = vendor_problem(_model(_disaggregated()).spec, {"cpu": Vendor.CPU})
    assert message.startswith("spec.kvTransfer.connector: NixlConnector (the default) moves KV caches between AMD and "
                              "NVIDIA GPUs only")
    assert "cpu (cpu)" in message and "serve it unified (spec.disaggregation)" in message
