"""Helm chart checks that need no helm binary: structure, values schema, CRDs in sync, manifests validate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from hetsched.cli import app
from hetsched.operator.crdgen import crd_documents

CHART = Path(__file__).resolve().parents[1] / "charts" / "hetsched"


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _render(text: str, values: dict) -> str:
    """The few template expressions the chart uses, filled in the way helm would."""
    def lookup(path: str) -> object:
        node: object = {"Values": values, "Release": {"Namespace": "hetsched"}}
        for part in path.strip(".").split("."):
            node = node[part]  # type: ignore[index]
        return node

    text = re.sub(r"\n[ \t]*\{\{- if (\S+) \}\}(.*?)(?:\n[ \t]*\{\{- else \}\}(.*?))?\n[ \t]*\{\{- end \}\}",
                  lambda m: m.group(2) if lookup(m.group(1)) else m.group(3) or "", text, flags=re.S)
    text = re.sub(r"\{\{-? toYaml (\S+) \| nindent (\d+) \}\}",
                  lambda m: "\n" + "\n".join(" " * int(m.group(2)) + line
                                             for line in yaml.safe_dump(lookup(m.group(1))).splitlines()), text)
    text = re.sub(r"\{\{ (\S+) \| quote \}\}", lambda m: json.dumps(str(lookup(m.group(1)))), text)
    return re.sub(r"\{\{ (\S+) \}\}", lambda m: str(lookup(m.group(1))), text)


def test_chart_crds_are_identical_to_crds_folder() -> None:
    for name, text in crd_documents().items():
        assert (CHART / "crds" / name).read_text() == text, f"charts/hetsched/crds/{name} is stale: run 'hetsched crds'"


def test_values_match_their_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(_values())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate({**_values(), "approval": "sometimes"})


@pytest.mark.parametrize("template", sorted(p.name for p in (CHART / "templates").glob("*.yaml")))
def test_rendered_templates_validate(template: str) -> None:
    text = _render((CHART / "templates" / template).read_text(), _values())
    assert "{{" not in text
    for doc in yaml.safe_load_all(text):
        if doc["apiVersion"].startswith("kopf.dev"):
            continue  # a custom resource: its CRD is in crds/
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_operator_runs_two_replicas_with_peering_and_the_flags_exist() -> None:
    deployment = yaml.safe_load(_render((CHART / "templates" / "deployment.yaml").read_text(), _values()))
    assert deployment["spec"]["replicas"] == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=hetsched" in args
    command = typer.main.get_command(app).commands["operator"]  # type: ignore[attr-defined]
    options = {name for param in command.params for name in param.opts}
    for arg in args:
        assert arg.split("=")[0] in options
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "--autoscale-interval=5" in args and env["HETSCHED_AUTOSCALE"].lower() == "true"
    off = yaml.safe_load(_render((CHART / "templates" / "deployment.yaml").read_text(),
                                 {**_values(), "autoscale": {"enabled": False, "intervalSeconds": 5}}))
    assert {e["name"]: e["value"] for e in off["spec"]["template"]["spec"]["containers"][0]["env"]}[
        "HETSCHED_AUTOSCALE"].lower() == "false"


def test_rbac_grants_only_what_the_operator_uses() -> None:
    docs = list(yaml.safe_load_all(_render((CHART / "templates" / "rbac.yaml").read_text(), _values())))
    rules = docs[0]["rules"]
    granted = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert all("*" not in verbs for verbs in granted.values())
    assert not any(r == "*" for _, r in granted)
    assert granted[("", "nodes")] == {"get", "list", "watch", "patch"}
    assert "delete" not in granted[("hetsched.io", "modeldeployments")]
    assert "update" not in set().union(*granted.values())
    assert ("", "configmaps") not in granted  # only in the MIG manager's namespace, below
    (role,) = [d for d in docs if d["kind"] == "Role"]  # AMD partitions are off by default
    assert role["metadata"]["namespace"] == "gpu-operator"
    assert {"resources": ["configmaps"], "resourceNames": ["hetsched-mig-parted-config"], "verbs": ["get", "patch"],
            "apiGroups": [""]} in role["rules"]


def test_mig_switches_off_with_its_configmap_flag_and_role() -> None:
    values = _values()
    off = {**values, "migConfigMap": {**values["migConfigMap"], "enabled": False}}
    deployment = yaml.safe_load(_render((CHART / "templates" / "deployment.yaml").read_text(), off))
    assert "--mig-configmap=" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]  # empty: MIG off
    docs = list(yaml.safe_load_all(_render((CHART / "templates" / "rbac.yaml").read_text(), off)))
    assert not [d for d in docs if d and d["kind"] in ("Role", "RoleBinding")]


def test_amd_partitions_switch_on_with_their_configmap_flag_and_role() -> None:
    values = _values()
    on = {**values, "dcmConfigMap": {**values["dcmConfigMap"], "enabled": True}}

    def args(values: dict) -> list[str]:
        deployment = yaml.safe_load(_render((CHART / "templates" / "deployment.yaml").read_text(), values))
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not [a for a in args(values) if a.startswith("--dcm-configmap")]
    assert "--dcm-configmap=kube-amd-gpu/hetsched-dcm-config" in args(on)
    docs = list(yaml.safe_load_all(_render((CHART / "templates" / "rbac.yaml").read_text(), on)))
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    assert {"resources": ["configmaps"], "resourceNames": ["hetsched-dcm-config"], "verbs": ["get", "patch"],
            "apiGroups": [""]} in roles["kube-amd-gpu"]["rules"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_operator_image_runs_the_operator() -> None:
    dockerfile = (CHART.parents[1] / "operator" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["hetsched", "operator"]' in dockerfile and "'.[operator]'" in dockerfile
