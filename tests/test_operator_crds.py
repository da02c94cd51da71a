"""CRDs: generated from the pydantic types, checked in, structurally valid; example CRs validate against them."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import InputError
from hetsched.operator.crdgen import crd_documents, render_crd
from hetsched.operator.resources import ACCELERATOR_POOL, KINDS, MODEL_DEPLOYMENT, AcceleratorPoolSpec, ModelDeploymentSpec

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33"


def _schema(kind: str) -> dict:
    crd = next(render_crd(k) for k in KINDS if k.kind == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _validator(kind: str) -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum).
    return jsonschema.Draft4Validator(_schema(kind))


def _examples() -> list[dict]:
    return [doc for path in sorted((ROOT / "examples" / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_checked_in_crds_are_current() -> None:
    documents = crd_documents()
    on_disk = {p.name: p.read_text() for p in (ROOT / "crds").glob("*.yaml")}
    assert on_disk == documents, "crds/ is stale: run 'hetsched crds'"


@pytest.mark.parametrize("name", sorted(crd_documents()))
def test_crd_is_a_valid_structural_definition(name: str) -> None:
    crd = yaml.safe_load(crd_documents()[name])
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}

    def walk(node: dict, path: str) -> None:
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"untyped node at {path}"
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(key, True), bool), f"{path}.{key} must be a boolean in OpenAPI v3.0"
        for child, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{child}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")


def test_kubernetes_validate_rejects_a_broken_crd() -> None:
    crd = yaml.safe_load(crd_documents()[f"{MODEL_DEPLOYMENT.crd_name}.yaml"])
    crd["spec"]["scope"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def test_model_deployment_columns_and_names() -> None:
    crd = render_crd(MODEL_DEPLOYMENT)
    columns = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:4] == ["Model", "Replicas", "Ready", "Cost/h"] and "Age" in columns
    assert crd["spec"]["names"]["shortNames"] == ["md", "mdep"]
    conditions = _schema("ModelDeployment")["properties"]["status"]["properties"]["conditions"]
    item = conditions["items"]
    assert set(item["required"]) >= {"type", "status", "reason", "lastTransitionTime"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert "observedGeneration" in item["properties"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_examples_validate_against_the_crd_schemas_and_types() -> None:
    examples = _examples()
    assert {e["kind"] for e in examples} == {k.kind for k in KINDS}
    for doc in examples:
        _validator(doc["kind"]).validate(doc)
        kind = next(k for k in KINDS if k.kind == doc["kind"])
        kind.spec.model_validate(doc["spec"])


@pytest.mark.parametrize(("path", "value", "message"), [
    (("spec", "slo", "ttft"), "half a second", "does not match"),
    (("spec", "engine", "resources", "memory"), "lots", "does not match"),
    (("spec", "engine", "resources", "cpu"), "-4", "does not match"),
    (("spec", "engine", "resources", "cpu"), "1.2.3", "does not match"),
    (("spec", "engine", "resources", "memory"), "4KK", "does not match"),
    (("spec", "disaggregation"), "split", "is not one of"),
    (("spec", "kvTransfer"), {"connector": "FooConnector"}, "is not one of"),
    (("spec", "kvTransfer"), {"port": 0}, "less than the minimum"),
    (("spec", "workload", "rateRps"), -1, "less than the minimum"),
    (("spec", "engine", "gpuMemoryUtilization"), 0, "less than or equal to the minimum"),
    (("spec", "objectives"), [{"name": "batch", "priority": 5000}], "greater than the maximum"),
    (("spec", "objectives"), [{"name": "batch", "share": 2}], "greater than the maximum"),
    (("spec", "objectives"), [{"name": "Batch jobs"}], "does not match"),
])
def test_schema_rejects_bad_model_deployments(path: tuple[str, ...], value: object, message: str) -> None:
    doc = copy.deepcopy(next(e for e in _examples() if e["kind"] == "ModelDeployment"))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError, match=message):
        _validator("ModelDeployment").validate(doc)


@pytest.mark.parametrize(("objectives", "message"), [
    ([{"name": "a"}, {"name": "a"}], "appears twice"),
    ([{"name": "default"}], "'default' is the class"),
    ([{"name": "a", "share": 0.6}, {"name": "b", "share": 0.6}], "add up to 1.2"),
])
def test_objectives_the_schema_cannot_judge_are_refused_by_the_type(objectives: list[dict], message: str) -> None:
    doc = copy.deepcopy(next(e for e in _examples() if e["kind"] == "ModelDeployment"))
    doc["spec"]["objectives"] = objectives
    with pytest.raises(ValueError, match=message):
        ModelDeploymentSpec.model_validate(doc["spec"])


def test_schema_requires_engine_image() -> None:
    doc = copy.deepcopy(next(e for e in _examples() if e["kind"] == "ModelDeployment"))
    del doc["spec"]["engine"]["image"]
    with pytest.raises(jsonschema.ValidationError, match="'image' is a required property"):
        _validator("ModelDeployment").validate(doc)
    with pytest.raises(ValueError, match="image"):
        ModelDeploymentSpec.model_validate(doc["spec"])


def test_a_pool_may_still_say_mig_and_the_api_server_adds_no_partitioning_beside_it() -> None:
    spec = _schema("AcceleratorPool")["properties"]["spec"]["properties"]
    for name in ("partitioning", "mig"):  # both listed: the API server would prune the old name otherwise
        assert spec[name]["enum"] == ["disabled", "allowed"] and "default" not in spec[name], name
    old = {"apiVersion": "hetsched.io/v1alpha1", "kind": "AcceleratorPool", "metadata": {"name": "h100"},
           "spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "mig": "allowed"}}
    _validator("AcceleratorPool").validate(old)
    assert AcceleratorPoolSpec.model_validate(old["spec"]).may_partition
    columns = {c["name"]: c["jsonPath"] for c in render_crd(ACCELERATOR_POOL)["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Partitioning"] == ".spec.partitioning"


def test_a_pool_whose_two_partitioning_names_disagree_is_refused_naming_both() -> None:
    spec = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    assert not AcceleratorPoolSpec.model_validate(spec).may_partition
    assert AcceleratorPoolSpec.model_validate({**spec, "partitioning": "allowed", "mig": "allowed"}).may_partition
    with pytest.raises(ValueError, match="partitioning is allowed but mig, its former name, is disabled"):
        AcceleratorPoolSpec.model_validate({**spec, "partitioning": "allowed", "mig": "disabled"})


def test_crds_command_writes_and_checks(tmp_path: Path) -> None:
    runner = CliRunner()
    stale = runner.invoke(app, ["crds", "--out", str(tmp_path), "--check"])
    assert isinstance(stale.exception, InputError) and "stale or missing" in str(stale.exception)
    written = runner.invoke(app, ["crds", "--out", str(tmp_path)])
    assert written.exit_code == 0, written.output
    assert {p.name for p in tmp_path.iterdir()} == set(crd_documents())
    assert runner.invoke(app, ["crds", "--out", str(tmp_path), "--check"]).exit_code == 0


def test_max_replicas_below_min_replicas_is_refused_by_the_api_server_and_the_operator() -> None:
    scaling = _schema("ModelDeployment")["properties"]["spec"]["properties"]["scaling"]
    (rule,) = scaling["x-kubernetes-validations"]
    assert rule["fieldPath"] == ".maxReplicas" and "self.minReplicas <= self.maxReplicas" in rule["rule"]
    with pytest.raises(ValueError, match="maxReplicas 2 is below minReplicas 3"):
        ModelDeploymentSpec.model_validate({"model": "qwen3-0.6b", "engine": {"image": "x"},
                                            "scaling": {"minReplicas": 3, "maxReplicas": 2}})


@pytest.mark.parametrize("value", ["500m", "0.5", "1.5Gi", "32Gi", "1e3", "4k", ".5"])
def test_kubernetes_quantities_pass_the_schema_and_the_types(value: str) -> None:
    doc = copy.deepcopy(next(e for e in _examples() if e["kind"] == "ModelDeployment"))
    doc["spec"]["engine"]["resources"] = {"cpu": value, "memory": value}
    _validator("ModelDeployment").validate(doc)
    ModelDeploymentSpec.model_validate(doc["spec"])
