"""Helm chart checks that need no helm binary: structure, values schema, CRDs in sync, manifests validate, every
pod meets the restricted Pod Security Standard."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hetsched.cli import COMMANDS, loaded_commands
from hetsched.operator.crdgen import crd_documents
from hetsched.router.config import DiscoveryKind, parse_router_config
from hetsched.router.types import Policy
from hetsched.settings.operator import OperatorSettings
from chart_support import CHART, Chart, RenderError
from pod_security import pod_specs, restricted_violations


def _values(**changes: Any) -> dict:
    """The chart's values with top-level groups changed (a dict merges into its group)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, change in changes.items():
        values[key] = {**values[key], **change} if isinstance(change, dict) else change
    return values


def _doc(values: dict, template: str) -> dict:
    [doc] = Chart(values).documents(template)
    return doc


ROUTER_ON = {"enabled": True, "models": {"llama-3.1-8b": {"slo": {"ttft_ms": 500, "tpot_ms": 50}}},
             "tokenSecret": {"name": "router-token", "key": "token"}}
EPP_ON = {"enabled": True, "pool": "chat", "namespace": "serving"}
VARIANTS = {
    "defaults": _values(),
    "everything-on": _values(router=ROUTER_ON, rbac={"namespaces": ["serving", "batch"]}, epp=EPP_ON,
                             dcmConfigMap={"enabled": True},
                             databaseUrl={"existingSecret": "hetsched-db", "secretKey": "url", "value": ""}),
    "namespaced-router": _values(router={**ROUTER_ON, "namespace": "serving", "allowedHosts": ["llm.example"]}),
    "scaled-router": _values(router={**ROUTER_ON, "workers": 2, "autoscaling": {
        "enabled": True, "minReplicas": 3, "maxReplicas": 12, "targetCPUUtilizationPercentage": 60}}),
}


def test_chart_crds_are_identical_to_crds_folder() -> None:
    for name, text in crd_documents().items():
        assert (CHART / "crds" / name).read_text() == text, f"charts/hetsched/crds/{name} is stale: run 'hetsched crds'"


def test_values_match_their_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(_values())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate({**_values(), "approval": "sometimes"})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_templates_validate(variant: str) -> None:
    chart = Chart(VARIANTS[variant])
    for template in sorted(p.name for p in (CHART / "templates").glob("*.yaml")):
        text = chart.text(template)
        assert "{{" not in text, template
        for doc in yaml.safe_load_all(text):
            if not doc or doc["apiVersion"].startswith("kopf.dev"):
                continue  # a custom resource: its CRD is in crds/
            kubernetes_validate.validate(doc, "1.33", strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_pod_meets_the_restricted_pod_security_standard(variant: str) -> None:
    pods = list(pod_specs(Chart(VARIANTS[variant]).all_documents()))
    assert len(pods) == {"defaults": 1, "everything-on": 3}.get(variant, 2)
    for name, pod in pods:
        assert restricted_violations(pod) == [], name
        for container in pod["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) & set(resources["limits"]), name
            assert container["readinessProbe"] and container["livenessProbe"], name
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/tmp" in mounts and {"name": "HOME", "value": "/tmp"} in container["env"], name


def test_the_database_url_comes_from_a_secret_when_one_is_named() -> None:
    def url_env(values: dict) -> list[dict]:
        pods = dict(pod_specs(Chart(values).all_documents()))
        return [e for pod in pods.values() for e in pod["containers"][0]["env"] if e["name"] == "HETSCHED_DATABASE_URL"]

    assert url_env(_values()) == [{"name": "HETSCHED_DATABASE_URL", "value": ""}]
    from_secret = url_env(VARIANTS["everything-on"])
    assert len(from_secret) == 3 and all(e == {"name": "HETSCHED_DATABASE_URL", "valueFrom": {
        "secretKeyRef": {"name": "hetsched-db", "key": "url"}}} for e in from_secret)
    plain = url_env(_values(databaseUrl={"value": "postgresql+psycopg://planner@db/hetsched"}))
    assert plain == [{"name": "HETSCHED_DATABASE_URL", "value": "postgresql+psycopg://planner@db/hetsched"}]


def _options(command: str) -> set[str]:
    found = loaded_commands(COMMANDS[command][0])[command]  # the root group lists commands without loading them
    return {name for param in found.params for name in param.opts}


def test_operator_runs_two_replicas_with_peering_and_the_flags_exist() -> None:
    deployment = _doc(VARIANTS["everything-on"], "deployment.yaml")
    assert deployment["spec"]["replicas"] == 2
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=hetsched" in args
    for arg in args:
        assert arg.split("=")[0] in _options("operator")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "--autoscale-interval=5" in args and env["HETSCHED_AUTOSCALE"] == "true"
    off = _doc(_values(autoscale={"enabled": False}), "deployment.yaml")
    assert {e["name"]: e.get("value") for e in off["spec"]["template"]["spec"]["containers"][0]["env"]}[
        "HETSCHED_AUTOSCALE"] == "false"


def test_rbac_grants_only_what_the_operator_uses() -> None:
    docs = Chart(_values()).documents("rbac.yaml")
    rules = docs[0]["rules"]
    granted = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert all("*" not in verbs for verbs in granted.values())
    assert not any(r == "*" for _, r in granted)
    assert granted[("", "nodes")] == {"get", "list", "watch", "patch"}
    assert "delete" not in granted[("hetsched.io", "modeldeployments")]
    # the engines' owner references block their ModelDeployment's deletion, which needs update on its finalizers
    assert granted.pop(("hetsched.io", "modeldeployments/finalizers")) == {"update"}
    assert "update" not in set().union(*granted.values())
    assert ("", "configmaps") not in granted  # only in the MIG manager's namespace, below
    (role,) = [d for d in docs if d["kind"] == "Role"]  # AMD partitions are off by default
    assert role["metadata"]["namespace"] == "gpu-operator"
    assert {"resources": ["configmaps"], "resourceNames": ["hetsched-mig-parted-config"], "verbs": ["get", "patch"],
            "apiGroups": [""]} in role["rules"]


def test_mig_switches_off_with_its_configmap_flag_and_role() -> None:
    off = _values(migConfigMap={"enabled": False})
    deployment = _doc(off, "deployment.yaml")
    assert "--mig-configmap=" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]  # empty: MIG off
    assert not [d for d in Chart(off).documents("rbac.yaml") if d["kind"] in ("Role", "RoleBinding")]


def test_amd_partitions_switch_on_with_their_configmap_flag_and_role() -> None:
    values = _values()
    on = _values(dcmConfigMap={"enabled": True})

    def args(values: dict) -> list[str]:
        return _doc(values, "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not [a for a in args(values) if a.startswith("--dcm-configmap")]
    assert "--dcm-configmap=kube-amd-gpu/hetsched-dcm-config" in args(on)
    docs = Chart(on).documents("rbac.yaml")
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    assert {"resources": ["configmaps"], "resourceNames": ["hetsched-dcm-config"], "verbs": ["get", "patch"],
            "apiGroups": [""]} in roles["kube-amd-gpu"]["rules"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_namespaced_rbac_writes_only_in_the_listed_namespaces() -> None:
    values = _values(rbac={"namespaces": ["serving", "batch"]})
    docs = Chart(values).documents("rbac.yaml")
    [cluster_role] = [d for d in docs if d["kind"] == "ClusterRole"]
    granted = {(g, r): set(rule["verbs"]) for rule in cluster_role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"]}
    for namespaced in (("", "services"), ("apps", "deployments"), ("policy", "poddisruptionbudgets"), ("", "events"),
                       ("inference.networking.k8s.io", "inferencepools")):
        assert not granted.get(namespaced, set()) & {"create", "patch", "delete"}, namespaced
    assert granted[("inference.networking.k8s.io", "inferencepools")] == {"list"}
    assert ("hetsched.io", "modeldeployments/finalizers") not in granted
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
    for namespace in ("serving", "batch"):
        rules = {(g, r): set(rule["verbs"]) for rule in roles[(namespace, "hetsched-operator")]["rules"]
                 for g in rule["apiGroups"] for r in rule["resources"]}
        assert rules[("apps", "deployments")] == rules[("", "services")] == {"create", "patch", "delete"}
        assert rules[("inference.networking.k8s.io", "inferencepools")] == {"get", "create", "patch", "delete"}
        assert rules[("hetsched.io", "modeldeployments/finalizers")] == {"update"}
        [binding] = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == namespace
                     and d["roleRef"]["name"] == "hetsched-operator"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hetsched-operator", "namespace": "hetsched"}]
    assert ("hetsched", "hetsched-operator-events") in roles
    args = _doc(values, "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--serve-namespace")] == ["--serve-namespace=serving",
                                                                       "--serve-namespace=batch"]
    cluster_wide = {(g, r): set(rule["verbs"]) for rule in Chart(_values()).documents("rbac.yaml")[0]["rules"]
                    for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "delete"} <= cluster_wide[("apps", "deployments")]
    assert cluster_wide[("inference.networking.k8s.io", "inferencepools")] == {"get", "list", "create", "patch", "delete"}


def test_the_router_is_off_by_default_and_a_whole_component_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Chart(_values()).documents("router.yaml") == []
    docs = {d["kind"]: d for d in Chart(VARIANTS["everything-on"]).documents("router.yaml")}
    assert set(docs) == {"ServiceAccount", "ConfigMap", "Deployment", "Service", "ClusterRole", "ClusterRoleBinding"}
    monkeypatch.setenv("HETSCHED_ROUTER_TOKEN", "s3cret")
    config = parse_router_config(yaml.safe_load(docs["ConfigMap"]["data"]["router.yaml"]))
    assert config.discovery.kind is DiscoveryKind.KUBERNETES and config.discovery.namespace is None
    assert config.auth_token() == "s3cret" and list(config.models) == ["llama-3.1-8b"]
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["hetsched", "route"]
    for arg in container["args"]:
        assert arg.split("=")[0] in _options("route")
    assert {"name": "HETSCHED_ROUTER_TOKEN", "valueFrom": {"secretKeyRef": {"name": "router-token", "key": "token"}}} \
        in container["env"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    rules = {(g, r): set(rule["verbs"]) for rule in docs["ClusterRole"]["rules"] for g in rule["apiGroups"]
             for r in rule["resources"]}
    assert rules == {("", "pods"): {"list", "watch"}, ("hetsched.io", "modeldeployments"): {"list"}}
    assert docs["ClusterRoleBinding"]["subjects"][0]["name"] == docs["Deployment"]["spec"]["template"]["spec"][
        "serviceAccountName"]
    scoped = {d["kind"]: d for d in Chart(VARIANTS["namespaced-router"]).documents("router.yaml")}
    assert scoped["Role"]["metadata"]["namespace"] == scoped["RoleBinding"]["metadata"]["namespace"] == "serving"
    scoped_config = parse_router_config(yaml.safe_load(scoped["ConfigMap"]["data"]["router.yaml"]))
    assert scoped_config.discovery.namespace == "serving" and scoped_config.allowed_hosts == ["llm.example"]
    insecure = Chart(_values(router={**ROUTER_ON, "tokenSecret": {"name": "", "key": "token"}, "insecure": True}))
    [deployment] = [d for d in insecure.documents("router.yaml") if d["kind"] == "Deployment"]
    assert "--insecure" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_router_scales_on_its_own_cpu_when_autoscaling_is_on() -> None:
    fixed = {d["kind"]: d for d in Chart(VARIANTS["everything-on"]).documents("router.yaml")}
    assert "HorizontalPodAutoscaler" not in fixed and fixed["Deployment"]["spec"]["replicas"] == 2
    assert "--workers=1" in fixed["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    docs = {d["kind"]: d for d in Chart(VARIANTS["scaled-router"]).documents("router.yaml")}
    deployment, hpa = docs["Deployment"], docs["HorizontalPodAutoscaler"]
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it; a fixed count would fight it on upgrade
    assert "--workers=2" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"]  # utilization is a share of the request


def test_values_schema_refuses_a_router_without_models_or_token() -> None:
    validator = jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))
    for variant in VARIANTS.values():
        validator.validate(variant)
    for router in ({"enabled": True, "models": {}, "tokenSecret": {"name": "t", "key": "token"}},
                   {**ROUTER_ON, "tokenSecret": {"name": "", "key": "token"}}, {**ROUTER_ON, "policy": "fastest"},
                   {**ROUTER_ON, "workers": 0}):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(_values(router=router))
    policies = validator.schema["properties"]["router"]["properties"]["policy"]["enum"]
    assert policies == [p.value for p in Policy]


def test_the_image_runs_the_operator_and_holds_the_router() -> None:
    dockerfile = (CHART.parents[1] / "operator" / "Dockerfile").read_text()
    # the router's extra for `hetsched route`, the PostgreSQL driver for the chart's database URL
    assert 'ENTRYPOINT ["hetsched", "operator"]' in dockerfile and "'.[operator,serve,postgres]'" in dockerfile


def test_the_epp_is_off_by_default_and_picks_for_one_pool_in_its_namespace_when_on() -> None:
    assert Chart(_values()).documents("epp.yaml") == []
    docs = {d["kind"]: d for d in Chart(VARIANTS["everything-on"]).documents("epp.yaml")}
    assert set(docs) == {"ServiceAccount", "Deployment", "Service", "Role", "RoleBinding", "ClusterRole",
                         "ClusterRoleBinding"}
    for kind in ("ServiceAccount", "Deployment", "Service", "Role", "RoleBinding"):
        assert docs[kind]["metadata"]["namespace"] == "serving", kind  # the pool names its Service in its namespace
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["hetsched", "epp"]
    for arg in container["args"]:
        assert arg.split("=")[0] in _options("epp")
    assert {"--pool=chat", "--namespace=serving", "--model=chat", "--host=0.0.0.0", "--port=9002", "--health-port=9003",
            "--metrics-port=9090"} <= set(container["args"])
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    ports = {p["name"]: p for p in docs["Service"]["spec"]["ports"]}
    assert ports["grpc-ext-proc"] | {"port": 9002, "appProtocol": "http2"} == ports["grpc-ext-proc"]
    assert ports["metrics"]["port"] == 9090
    assert {p["name"] for p in container["ports"]} >= {p["targetPort"] for p in ports.values()}
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["template"]["metadata"]["labels"]

    def granted(role: dict) -> dict[tuple[str, str], set[str]]:
        return {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    read = {"get", "list", "watch"}
    assert granted(docs["Role"]) == {("", "pods"): read, ("inference.networking.k8s.io", "inferencepools"): read}
    assert granted(docs["ClusterRole"]) == {("", "nodes"): read}
    for binding in (docs["RoleBinding"], docs["ClusterRoleBinding"]):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                        "namespace": "serving"}]
    default_namespace = Chart(_values(epp={"enabled": True, "pool": "chat"})).documents("epp.yaml")
    assert {d["metadata"].get("namespace", "hetsched") for d in default_namespace} == {"hetsched"}


def test_the_epp_needs_its_pool_named() -> None:
    with pytest.raises(RenderError, match=r"^epp\.pool: name the InferencePool"):
        Chart(_values(epp={"enabled": True})).documents("epp.yaml")


def test_the_operators_pools_name_the_charts_epp_service() -> None:
    def service_of(values: dict) -> str:
        [service] = [d for d in Chart(values).documents("epp.yaml") if d["kind"] == "Service"]
        return service["metadata"]["name"]

    def operator_flag(values: dict) -> str:
        args = _doc(values, "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]["args"]
        [flag] = [a for a in args if a.startswith("--epp-service=")]
        return flag.removeprefix("--epp-service=")

    assert service_of(VARIANTS["everything-on"]) == operator_flag(_values()) == OperatorSettings().epp_service
    renamed = _values(epp={**EPP_ON, "serviceName": "chat-picker"})
    assert service_of(renamed) == operator_flag(renamed) == "chat-picker"
    validator = jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))
    for epp in ({**EPP_ON, "serviceName": "Chat_Picker"}, {**EPP_ON, "pool": "Chat"}, {**EPP_ON, "replicas": 0}):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(_values(epp=epp))
