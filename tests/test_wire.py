"""The wire contract: a device id survives its label, and the pods the operator creates are what both of the
router's fronts read (the pod watcher and the EPP's InferencePool discovery)."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes
import pytest

from hetsched.catalog import load_catalog
from hetsched.operator.inventory import pool_inventory
from hetsched.operator.objects import Observed
from hetsched.operator.planning import ModelDeploymentRef, bind_nodes, parse_model_deployment
from hetsched.operator.reconcile import reconcile
from hetsched.operator.resources import AcceleratorPoolSpec
from hetsched.router.discovery import endpoints_from_pods, read_pod_labels
from hetsched.router.pool import endpoints_from_pool
from hetsched.specs.wire import LABEL_VALUE_MAX, Label, OptionKey, Role, device_label, device_of_label, label_value
from operator_fixtures import amd_node, group, make_plan, model_deployment, node, pool

CATALOG = load_catalog()
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
"""What the API server accepts as a label value (besides the length)."""


@pytest.mark.parametrize(("device", "value"), [
    ("h100-sxm", "h100-sxm"),
    ("h100-sxm:3g.40gb", "h100-sxm_3g.40gb"),
    ("mi300x:cpx_nps4", "mi300x_cpx_nps4"),  # the partition holds a '_' of its own
    ("cpu", "cpu"),
])
def test_a_device_id_reads_back_from_its_label(device: str, value: str) -> None:
    """The value is fixed: Deployments select their pods by it, and a selector cannot change."""
    assert device_label(device) == value
    assert device_of_label(value) == device


def test_every_catalog_device_has_a_label_that_reads_back() -> None:
    devices = ["cpu"]
    for accelerator in CATALOG.accelerators.values():
        devices.append(accelerator.id)
        if accelerator.mig is not None:
            devices += [f"{accelerator.id}:{p.name}" for p in accelerator.mig.profiles]
        if accelerator.amd_partitions is not None:
            devices += [f"{accelerator.id}:{mode}" for mode in accelerator.amd_partitions.valid_modes()]
    assert any(":" in d for d in devices) and any("_" in d for d in devices)
    for device in devices:
        value = device_label(device)
        assert LABEL_VALUE.fullmatch(value) and len(value) <= LABEL_VALUE_MAX, device
        assert device_of_label(value) == device


@pytest.mark.parametrize(("device", "message"), [
    ("a" * 56 + ":3g.40gb", "is 64 characters; a label value holds at most 63"),
    ("my_gpu:1g.10gb", "would read back as 'my:gpu_1g.10gb'"),
    ("h100-sxm:1g.10gb+me", "cannot be a label value"),
    ("h100-sxm:", "cannot be a label value"),
    ("", "cannot be a label value"),
])
def test_a_device_id_that_would_not_read_back_is_refused(device: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        device_label(device)


def test_a_device_id_of_63_characters_still_fits() -> None:
    device = "a" * 55 + ":3g.40gb"
    assert device_of_label(device_label(device)) == device


def test_a_pool_name_becomes_a_valid_label_value() -> None:
    long_name = "gpu-pool." + "x" * 300
    for name in ("h100", "team:a/h100", long_name, "-odd-"):
        value = label_value(name)
        assert LABEL_VALUE.fullmatch(value) and len(value) <= LABEL_VALUE_MAX, name
    assert label_value("team:a/h100") == "team_a_h100"


def test_an_option_key_reads_by_name_and_compares_as_its_fields() -> None:
    key = OptionKey("serving/chat", "h100", "h100-sxm:3g.40gb", 1, Role.DECODE)
    assert (key.model, key.pool, key.device, key.tp, key.role) == tuple(key)
    assert sorted([key, key._replace(tp=2), key._replace(pool="a100")]) == [
        key._replace(pool="a100"), key, key._replace(tp=2)]
    assert json.dumps(key) == '["serving/chat", "h100", "h100-sxm:3g.40gb", 1, "decode"]'


# --- what the operator writes is what the router reads ----------------------------------------------------------


def _model(obj: dict[str, Any]) -> ModelDeploymentRef:
    parsed = parse_model_deployment(obj)
    assert isinstance(parsed, ModelDeploymentRef), parsed
    return parsed


def _pods(deployments: list[dict[str, Any]]) -> list[Any]:
    """One Ready pod per Deployment, from its template, as the ``kubernetes`` client hands pods over."""
    pods = []
    for i, dep in enumerate(deployments):
        template = dep["spec"]["template"]
        manifest = {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{dep['metadata']['name']}-0", "namespace": dep["metadata"]["namespace"],
                                 "labels": template["metadata"]["labels"]},
                    "spec": template["spec"],
                    "status": {"podIP": f"10.0.0.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}}
        pods.append(kubernetes.client.ApiClient().deserialize(json.dumps(manifest), "V1Pod", "application/json"))
    return pods


def test_the_pods_the_operator_creates_are_read_back_as_planned_by_both_fronts() -> None:
    """Whole GPUs with TP, a MIG slice, and a disaggregated model on a whole AMD GPU and an AMD partition: each
    pod's device, TP and role come back from its labels, on the pod watcher's path and the EPP's."""
    nodes = [node("n1"), amd_node("a1")]
    amd_pool = {"metadata": {"name": "mi300"},
                "spec": {"nodeSelector": {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}, "mig": "allowed"}}
    pools = [pool_inventory(s["metadata"]["name"], AcceleratorPoolSpec.model_validate(s["spec"]), nodes, CATALOG)
             for s in (pool("h100", mig="allowed"), amd_pool)]
    gateway = {"gateway": {"inferencePool": True}}
    models = {m.key: m for m in map(_model, (
        model_deployment("chat", **gateway), model_deployment("big", **gateway),
        model_deployment("split", disaggregation="prefill_decode", **gateway)))}
    groups = [group("serving/chat", 1, profile="3g.40gb"), group("serving/big", 1, tp=4),
              group("serving/split", 1, pool="mi300", accelerator="mi300x", tp=2, role=Role.PREFILL),
              group("serving/split", 1, pool="mi300", accelerator="mi300x", profile="cpx_nps4", role=Role.DECODE)]
    desired = reconcile(bind_nodes(make_plan(groups), pools), Observed(nodes=nodes), models=models, pools=pools,
                        catalog=CATALOG)
    planned = {(g.model.split("/")[1], g.device, g.tp, g.role) for g in groups}
    assert {"h100-sxm_3g.40gb", "mi300x_cpx_nps4"} <= {d["spec"]["template"]["metadata"]["labels"][Label.ACCELERATOR]
                                                        for d in desired.deployments}

    told = set()
    for dep in desired.deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        read = read_pod_labels(labels)
        told.add((labels[Label.MODEL], read.accelerator, read.tp, read.role))
    assert told == planned

    pods = _pods(desired.deployments)
    names = ["chat", "big", "split"]
    watched = endpoints_from_pods(pods, models=names, default_port=8000)
    assert {(e.model, e.accelerator, e.tp, e.role) for es in watched.values() for e in es} == planned
    for inference_pool in desired.inference_pools:
        model = inference_pool["metadata"]["name"]
        found = endpoints_from_pool(inference_pool, pods, {}, models=[model], default_model=None, catalog=CATALOG)
        assert found.warnings == []
        assert found.endpoints[model] == watched[model]
