"""``spec.gateway.inferencePool``: the model's InferencePool (pure builder, reconcile, diff, status) and its CRD field."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from hetsched.catalog import load_catalog
from hetsched.operator.crdgen import render_crd
from hetsched.operator.diff import changes
from hetsched.operator.inventory import pool_inventory
from hetsched.operator.manifests import inference_pool, service
from hetsched.operator.objects import Action, Observed
from hetsched.operator.planning import ModelDeploymentRef, bind_nodes, parse_model_deployment
from hetsched.operator.reconcile import reconcile
from hetsched.operator.resources import (MODEL_DEPLOYMENT, AcceleratorPoolSpec, ConditionStatus, ConditionType,
                                         ModelDeploymentSpec, ModelDeploymentStatus)
from hetsched.operator.status import PlanState, model_status
from operator_fixtures import group, make_plan, model_deployment, node, pool

CATALOG = load_catalog()
GATEWAY = {"gateway": {"inferencePool": True}}
NODES = [node("n1"), node("l40s-1", product="NVIDIA-L40S")]
POOLS = [pool_inventory(p["metadata"]["name"], AcceleratorPoolSpec.model_validate(p["spec"]), NODES, CATALOG)
         for p in (pool("h100"), pool("l40s", product="NVIDIA-L40S"))]


def _model(obj: dict[str, Any]) -> ModelDeploymentRef:
    parsed = parse_model_deployment(obj)
    assert isinstance(parsed, ModelDeploymentRef), parsed
    return parsed


def _reconcile(*objs: dict[str, Any], observed: Observed | None = None, **options: Any):
    models = {m.key: m for m in map(_model, objs)}
    plan = bind_nodes(make_plan([group(key, 1) for key in sorted(models)]), POOLS)
    return reconcile(plan, observed or Observed(nodes=NODES), models=models, pools=POOLS, catalog=CATALOG, **options)


def test_the_pool_selects_the_models_engines_on_their_port_and_names_the_picker() -> None:
    model = _model(model_deployment("chat", engine={"image": "vllm/vllm-openai:v0.11.0", "port": 8080}, **GATEWAY))
    body = inference_pool(model, epp_service="chat-epp")
    the_service = service(model)
    assert (body["apiVersion"], body["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert body["metadata"] == the_service["metadata"]  # same name, namespace, labels and owner
    assert body["metadata"]["ownerReferences"][0] | {"kind": "ModelDeployment", "name": "chat", "uid": "uid-chat",
                                                     "controller": True} == body["metadata"]["ownerReferences"][0]
    assert body["spec"] == {
        "selector": {"matchLabels": {"hetsched.io/model": "chat"}},
        "targetPorts": [{"number": 8080}],
        "endpointPickerRef": {"name": "chat-epp", "kind": "Service", "port": {"number": 9002},
                              "failureMode": "FailClose"}}


def test_one_pool_holds_the_engines_of_every_accelerator_type() -> None:
    model = _model(model_deployment("chat", **GATEWAY))
    plan = bind_nodes(make_plan([group("serving/chat", 2), group("serving/chat", 1, pool="l40s", accelerator="l40s")]),
                      POOLS)
    desired = reconcile(plan, Observed(nodes=NODES), models={model.key: model}, pools=POOLS, catalog=CATALOG)
    [body] = desired.inference_pools
    selector = body["spec"]["selector"]["matchLabels"]
    accelerators = set()
    for dep in desired.deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), dep["metadata"]["name"]
        accelerators.add(labels["hetsched.io/accelerator"])
    assert accelerators == {"h100-sxm", "l40s"}


def test_only_models_that_ask_get_a_pool_and_turning_it_off_deletes_it() -> None:
    desired = _reconcile(model_deployment("chat", **GATEWAY), model_deployment("docs"))
    assert [p["metadata"]["name"] for p in desired.inference_pools] == ["chat"]
    assert desired.inference_pools[0]["spec"]["endpointPickerRef"]["name"] == "hetsched-epp"  # the chart's default
    observed = Observed(nodes=NODES)
    [create] = [c for c in changes(desired, observed) if c.kind == "InferencePool"]
    assert (create.action, create.namespace, create.name) == (Action.CREATE, "serving", "chat")

    # the API server adds its defaults around what was sent: nothing to change
    held = {**create.body, "spec": {**create.body["spec"], "endpointPickerRef": {
        **create.body["spec"]["endpointPickerRef"], "group": ""}}, "status": {"parents": []}}
    observed = Observed(nodes=NODES, inference_pools=[held])
    assert not [c for c in changes(_reconcile(model_deployment("chat", **GATEWAY), observed=observed), observed)
                if c.kind == "InferencePool"]

    moved = _reconcile(model_deployment("chat", **GATEWAY), observed=observed, epp_service="gw-epp")
    [patch] = [c for c in changes(moved, observed) if c.kind == "InferencePool"]
    assert patch.action is Action.PATCH and patch.body["spec"]["endpointPickerRef"]["name"] == "gw-epp"

    off = _reconcile(model_deployment("chat", gateway={"inferencePool": False}), observed=observed)
    assert [(c.action, c.name) for c in changes(off, observed) if c.kind == "InferencePool"] == [(Action.DELETE, "chat")]


def test_a_model_that_cannot_be_planned_keeps_its_pool() -> None:
    held = inference_pool(_model(model_deployment("chat", **GATEWAY)), epp_service="hetsched-epp")
    observed = Observed(nodes=NODES, inference_pools=[held])
    desired = reconcile(None, observed, models={}, pools=POOLS, catalog=CATALOG, untouched={("serving", "chat")})
    assert not changes(desired, observed)


def _degraded(status: ModelDeploymentStatus) -> tuple[ConditionStatus, str, str]:
    condition = next(c for c in status.conditions if c.type == ConditionType.DEGRADED)
    return condition.status, condition.reason, condition.message


def test_without_the_crds_the_model_says_how_to_install_them_and_the_engines_still_run() -> None:
    missing = Observed(nodes=NODES, inference_pools=None)
    desired = _reconcile(model_deployment("chat", **GATEWAY), model_deployment("docs"), observed=missing)
    assert desired.inference_pools == [] and len(desired.deployments) == 2 and len(desired.services) == 2
    assert all(c.kind != "InferencePool" for c in changes(desired, missing))
    plan = make_plan([group("serving/chat", 1), group("serving/docs", 1)])
    state = PlanState(proposed=plan, proposal_problem=None, awaiting_approval=False)

    def status(key: str) -> ModelDeploymentStatus:
        return model_status(key, outcome=desired.models[key], rejected=None, state=state, old=ModelDeploymentStatus(),
                            generation=1)

    flag, reason, message = _degraded(status("serving/chat"))
    assert (flag, reason) == (ConditionStatus.TRUE, "InferencePoolCRDMissing")
    assert "kubectl apply -f https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/" \
           "v1.0.0/manifests.yaml" in message and "spec.gateway.inferencePool" in message
    applied = next(c for c in status("serving/chat").conditions if c.type == ConditionType.APPLIED)
    assert applied.status is ConditionStatus.TRUE  # the engines are as planned
    assert _degraded(status("serving/docs"))[:2] == (ConditionStatus.FALSE, "AsExpected")


def test_the_gateway_field_is_optional_off_and_strict() -> None:
    spec = model_deployment("chat")["spec"]
    assert ModelDeploymentSpec.model_validate(spec).gateway.inference_pool is False
    assert ModelDeploymentSpec.model_validate({**spec, **GATEWAY}).gateway.inference_pool is True
    with pytest.raises(ValidationError, match="gateway.inferencepool"):
        ModelDeploymentSpec.model_validate({**spec, "gateway": {"inferencepool": True}})
    schema = render_crd(MODEL_DEPLOYMENT)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    gateway = schema["properties"]["spec"]["properties"]["gateway"]
    assert gateway["properties"]["inferencePool"] | {"type": "boolean", "default": False} == \
        gateway["properties"]["inferencePool"]
    jsonschema.Draft4Validator(schema).validate(model_deployment("chat", **GATEWAY))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(model_deployment("chat", gateway={"inferencePool": "yes"}))
