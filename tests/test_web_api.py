"""The planner's REST API through FastAPI's test client: reads, solves, what-ifs, exports and every error path."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select

from hetsched.catalog import load_catalog
from hetsched.operator.resources import KINDS
from hetsched.optimizer.build import CapacityQuery
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.plan import GpuMode, Plan
from hetsched.optimizer.spec import ClusterSpec
from hetsched.settings import Settings, StoreSettings, WebSettings
from hetsched.sim.capacity import Capacity
from hetsched.store import open_store
from hetsched.store.tables import CapacityRow, ModelRow, PlanRow
from hetsched.web import create_app
from web_support import scaled_capacity

EXAMPLE = Path(__file__).parent.parent / "examples" / "chat.yaml"
BUNDLED = Path(__file__).parent.parent / "hetsched" / "specs" / "models"


def small_spec(**changes: object) -> dict:
    """Two small models on an H100 pool that may use MIG and an L40S pool; capacities come from the source."""
    spec = {
        "name": "small",
        "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "mig_allowed": True},
                  {"name": "l40s", "accelerator": "l40s", "nodes": 1}],
        "models": [
            {"name": "llama-3.1-8b", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
             "workload": {"rate_rps": 1.0, "input_tokens": 1024, "output_tokens": 256}},
            {"name": "qwen3-0.6b", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
             "workload": {"rate_rps": 2.0, "input_tokens": 512, "output_tokens": 128}},
        ],
    }
    spec.update(changes)
    return spec


def _client(database_url: str, **web: object) -> TestClient:
    settings = Settings(store=StoreSettings(database_url=database_url), web=WebSettings(**web))  # type: ignore[arg-type]
    return TestClient(create_app(settings, capacity_source=scaled_capacity))


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    with _client(database_url) as c:
        yield c


def _solve(client: TestClient, spec: dict, **headers: str) -> dict:
    response = client.post("/api/plans", json={"spec": spec}, headers=headers)
    assert response.status_code == 201, response.text
    return response.json()


def test_accelerators_carry_price_overrides_and_mig_geometry(database_url: str) -> None:
    with _client(database_url, prices={"h100-sxm": 1.25}) as client:
        accelerators = {a["id"]: a for a in client.get("/api/accelerators").json()}
    h100 = accelerators["h100-sxm"]
    assert h100["price_per_hour"] == 1.25
    assert h100["catalog_price_per_hour"] == load_catalog().get("h100-sxm").price_per_hour
    assert h100["splittable"] and h100["mig"]["memory_slices"] == 8
    assert {"3g.40gb", "1g.10gb"} <= {p["name"] for p in h100["mig"]["profiles"]}
    assert not accelerators["l40s"]["splittable"] and accelerators["l40s"]["mig"] is None


def test_solve_stores_the_plan_with_its_spec_and_matches_the_optimizer(client: TestClient) -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())
    stored = _solve(client, spec, **{})
    direct = optimize(ClusterSpec.model_validate(spec))
    assert stored["origin"] == "web" and stored["status"] == direct.status.value
    assert stored["plan"]["cost_per_hour"] == pytest.approx(direct.cost_per_hour)
    reopened = client.get(f"/api/plans/{stored['id']}").json()
    assert Plan.model_validate(reopened["plan"]) == Plan.model_validate(stored["plan"])
    assert ClusterSpec.model_validate(reopened["spec"]) == ClusterSpec.model_validate(spec)
    history = client.get("/api/plans").json()
    assert [p["id"] for p in history] == [stored["id"]]


def test_solve_computes_capacities_through_the_source_and_splits_gpus(client: TestClient) -> None:
    plan = Plan.model_validate(_solve(client, small_spec())["plan"])
    mig_gpus = [g for n in plan.nodes for g in n.gpus if g.mode is GpuMode.MIG]
    assert mig_gpus, "small demand on an H100 pool with MIG allowed should use MIG slices"
    placed = {i.model for g in mig_gpus for i in g.instances if i.model}
    assert placed <= {"llama-3.1-8b", "qwen3-0.6b"} and placed
    assert plan.cost_per_hour == pytest.approx(sum(plan.cost_by_model.values()))


def test_times_carry_their_zone_on_every_backend(client: TestClient) -> None:
    solved = _solve(client, small_spec())
    config = json.loads((BUNDLED / "qwen3-0.6b.json").read_text())
    uploaded = client.put("/api/models/timed", json=config).json()
    listed = client.get("/api/plans").json()[0]
    assert listed["created_at"] == solved["created_at"] and listed["created_at"].endswith("Z")
    assert client.get(f"/api/plans/{solved['id']}").json()["created_at"] == solved["created_at"]
    models = {m["name"]: m for m in client.get("/api/models").json()}
    assert models["timed"]["created_at"] == uploaded["created_at"] and uploaded["created_at"].endswith("Z")


def test_infeasible_spec_is_stored_and_explained(client: TestClient) -> None:
    spec = small_spec(pools=[{"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "max_gpus": 1}])
    spec["models"][0]["workload"]["rate_rps"] = 500.0
    stored = _solve(client, spec)
    assert stored["status"] == "infeasible" and stored["cost_per_hour"] is None
    assert stored["plan"]["explanation"]["infeasible"]


def test_a_body_that_is_not_json_is_a_422_naming_the_body_and_where_it_breaks(client: TestClient) -> None:
    response = client.post("/api/plans", content=b'{"spec": ', headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["field"] == "body"
    assert response.json()["detail"] == "body: the request body is not valid JSON: Expecting value at character 9"


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda s: s["models"][0]["slo"].update(ttft_ms=-1), "spec.models[0].slo.ttft_ms"),
    (lambda s: s["pools"][1].update(nodes="many"), "spec.pools[1].nodes"),
    (lambda s: s["pools"][0].update(accelerator="h999"), "spec.pools[0].accelerator"),
    (lambda s: s["models"][1].update(name="no-such-model"), "spec.models[1].name"),
    (lambda s: s.pop("pools"), "spec.pools"),
])
def test_invalid_spec_is_a_422_naming_the_field(client: TestClient, mutate, field: str) -> None:
    spec = small_spec()
    mutate(spec)
    response = client.post("/api/plans", json={"spec": spec})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["field"] == field
    assert field in body["detail"]
    assert client.get("/api/plans").json() == []


@pytest.mark.parametrize("field", ["name", "models[1].name"])
def test_names_longer_than_the_store_keeps_are_a_422_before_any_work(database_url: str, field: str) -> None:
    """Both backends alike: PostgreSQL's column holds 200 characters, and SQLite is held to the same."""
    config = json.loads((BUNDLED / "qwen3-0.6b.json").read_text())
    asked: list[CapacityQuery] = []

    def source(query: CapacityQuery) -> float:
        asked.append(query)
        return scaled_capacity(query)

    def named(length: int) -> dict:
        spec = small_spec()
        spec["models"][1]["config"] = config
        if field == "name":
            spec["name"] = "p" * length
        else:
            spec["models"][1]["name"] = "m" * length
        return spec

    settings = Settings(store=StoreSettings(database_url=database_url))
    with TestClient(create_app(settings, capacity_source=source)) as client:
        response = client.post("/api/plans", json={"spec": named(201)})
        assert response.status_code == 422, response.text
        assert response.json()["field"] == f"spec.{field}"
        assert "at most 200 characters" in response.json()["detail"]
        assert asked == [] and client.get("/api/plans").json() == []
        stored = _solve(client, named(200))["spec"]
        assert 200 in (len(stored["name"]), len(stored["models"][1]["name"]))


def test_a_fault_inside_hetsched_is_a_json_500_that_names_no_internals(database_url: str) -> None:
    def broken(query: CapacityQuery) -> Capacity:
        raise RuntimeError("SELECT secret FROM somewhere")

    settings = Settings(store=StoreSettings(database_url=database_url))
    with TestClient(create_app(settings, capacity_source=broken), raise_server_exceptions=False) as client:
        response = client.post("/api/plans", json={"spec": small_spec()})
        assert response.status_code == 500
        assert response.json() == {"detail": "internal error (RuntimeError); the server's log has the details"}


def test_inventories_too_large_for_a_web_solve_are_refused_and_time_limits_capped(database_url: str) -> None:
    with _client(database_url, solve_timeout_s=7.0) as client:
        huge = small_spec(pools=[{"name": "h100", "accelerator": "h100-sxm", "nodes": 10**9}])
        response = client.post("/api/plans", json={"spec": huge})
        assert response.status_code == 422 and response.json()["field"] == "spec.pools[0].nodes"
        assert "hetsched plan" in response.json()["detail"]
        stored = _solve(client, small_spec(solver={"time_limit_s": 600}))
        assert stored["spec"]["solver"]["time_limit_s"] == 7.0
        grown = client.post(f"/api/plans/{stored['id']}/what-if", json={"changes": {"nodes": {"l40s": 10**6}}})
        assert grown.status_code == 422 and grown.json()["field"] == "changes.nodes.l40s"


def test_the_gpu_limit_counts_an_opaque_accelerators_gpus_per_node(client: TestClient) -> None:
    spec = small_spec(pools=[{"name": "x", "accelerator": "big-x", "nodes": 600}],
                      accelerators=[{"id": "big-x", "price_per_hour": 1.0, "gpus_per_node": 8}],
                      capacities=[{"model": m, "device": "big-x", "requests_per_s": 1.0}
                                  for m in ("llama-3.1-8b", "qwen3-0.6b")])
    response = client.post("/api/plans", json={"spec": spec})
    assert response.status_code == 422 and response.json()["field"] == "spec.pools[0].nodes"
    assert "4096 GPUs" in response.json()["detail"]
    assert client.get("/api/plans").json() == []


def test_uploaded_model_is_validated_listed_used_and_inlined(client: TestClient) -> None:
    config = json.loads((BUNDLED / "qwen3-0.6b.json").read_text())
    response = client.put("/api/models/my-small", json=config)
    assert response.status_code == 200, response.text
    assert response.json()["source"] == "uploaded"
    assert response.json()["total_params_b"] == pytest.approx(0.6, rel=0.1)
    listed = {m["name"]: m["source"] for m in client.get("/api/models").json()}
    assert listed["my-small"] == "uploaded" and listed["llama-3.1-8b"] == "bundled"
    spec = small_spec()
    spec["models"][1]["name"] = "my-small"
    stored = _solve(client, spec)
    assert stored["spec"]["models"][1]["config"] == config
    assert client.delete("/api/models/my-small").status_code == 204
    assert client.get(f"/api/plans/{stored['id']}").json()["spec"]["models"][1]["config"] == config


def test_an_upload_racing_another_on_a_new_name_replaces_it(client: TestClient, database_url: str) -> None:
    """Another upload of the name is inserted but not yet committed: this one waits, then replaces it."""
    small, large = (json.loads((BUNDLED / f"{m}.json").read_text()) for m in ("qwen3-0.6b", "llama-3.1-8b"))
    engine = create_engine(database_url)
    answers: list[httpx.Response] = []
    with engine.connect() as other:
        other.execute(ModelRow.__table__.insert().values(name="raced", config=small, source="upload raced",
                                                         created_at=datetime.now(timezone.utc)))
        racing = threading.Thread(target=lambda: answers.append(client.put("/api/models/raced", json=large)))
        racing.start()
        time.sleep(0.5)  # the upload has looked for the name and now waits for the other's lock
        other.commit()
        racing.join()
    engine.dispose()
    assert [a.status_code for a in answers] == [200]
    models = {m["name"]: m for m in client.get("/api/models").json()}
    assert models["raced"]["total_params_b"] == pytest.approx(8.0, rel=0.1)


@pytest.mark.parametrize(("name", "config", "status", "field"), [
    ("bad", {"model_type": "llama"}, 422, None),
    ("bad", {"model_type": "no-such-architecture", "hidden_size": 8}, 422, None),
    ("bad", {**json.loads((BUNDLED / "llama-3.1-8b.json").read_text()), "num_hidden_layers": 10**30}, 422, "num_hidden_layers"),
    ("llama-3.1-8b", {"model_type": "llama"}, 422, "name"),
    ("has space", {"model_type": "llama"}, 422, "name"),
])
def test_bad_uploads_are_refused(client: TestClient, name: str, config: dict, status: int, field: str | None) -> None:
    response = client.put(f"/api/models/{name}", json=config)
    assert response.status_code == status, response.text
    if field:
        assert response.json()["field"] == field
    assert "bad" not in {m["name"] for m in client.get("/api/models").json()}


def test_unknown_things_are_404(client: TestClient) -> None:
    assert client.get("/api/plans/999").status_code == 404
    assert client.get("/api/plans/999/resources.yaml").status_code == 404
    assert client.get("/api/plans/999/mig-parted.yaml").status_code == 404
    response = client.post("/api/plans/999/what-if", json={"changes": {"demand": {"x": 1}}})
    assert response.status_code == 404 and "unknown plan" in response.json()["detail"]
    assert client.delete("/api/models/never-uploaded").status_code == 404


def test_what_if_returns_a_diff_against_the_stored_plan(client: TestClient) -> None:
    base = _solve(client, small_spec())
    response = client.post(f"/api/plans/{base['id']}/what-if",
                           json={"changes": {"demand": {"llama-3.1-8b": 12.0}, "prices": {"l40s": 0.1}}})
    assert response.status_code == 201, response.text
    result = response.json()
    diff, after = result["diff"], result["result"]
    assert result["base_id"] == base["id"] and after["id"] != base["id"]
    assert diff["cost_before"] == pytest.approx(base["plan"]["cost_per_hour"])
    assert diff["cost_after"] == pytest.approx(after["plan"]["cost_per_hour"])
    assert diff["cost_delta"] == pytest.approx(diff["cost_after"] - diff["cost_before"])
    assert after["spec"]["models"][0]["workload"]["rate_rps"] == 12.0
    assert after["spec"]["pools"][1]["price_per_hour"] == 0.1
    before_counts = Plan.model_validate(base["plan"]).replica_counts()
    after_counts = Plan.model_validate(after["plan"]).replica_counts()
    for change in diff["replicas"]:
        key = (change["model"], change["pool"], change["device"], change["tp"], change["role"])
        assert change["before"] == before_counts.get(key, 0) and change["after"] == after_counts.get(key, 0)
    assert diff["replicas_moved"] == sum(abs(c["after"] - c["before"]) for c in diff["replicas"]) > 0
    assert "what-if of plan" in after["note"]


@pytest.mark.parametrize(("changes", "field"), [
    ({"prices": {"nope": 1.0}}, "changes.prices.nope"),
    ({"demand": {"llama-3.1-8b": -3}}, "changes.demand.llama-3.1-8b"),
    ({"nodes": {"h100": 0, "l40s": 0}}, "changes.nodes"),
    ({"partition_allowed": {"l40s": True}}, "changes.partition_allowed.l40s"),  # found by the solve, not the form
    ({}, "changes"),
])
def test_bad_what_if_is_a_422_naming_the_field(client: TestClient, changes: dict, field: str) -> None:
    base = _solve(client, small_spec())
    response = client.post(f"/api/plans/{base['id']}/what-if", json={"changes": changes})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert len(client.get("/api/plans").json()) == 1


def test_what_if_can_remove_a_pool(client: TestClient) -> None:
    spec = small_spec()
    spec["models"][0]["allowed_pools"] = ["h100", "l40s"]
    base = _solve(client, spec)
    result = client.post(f"/api/plans/{base['id']}/what-if", json={"changes": {"nodes": {"l40s": 0}}}).json()
    assert [p["name"] for p in result["result"]["spec"]["pools"]] == ["h100"]
    assert result["result"]["spec"]["models"][0]["allowed_pools"] == ["h100"]
    assert all(g["pool"] == "h100" for m in result["result"]["plan"]["models"] for g in m["replicas"])


def test_export_resources_parse_as_the_operators_types(client: TestClient) -> None:
    stored = _solve(client, small_spec())
    response = client.get(f"/api/plans/{stored['id']}/resources.yaml", params={"namespace": "serving"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/yaml")
    assert "attachment" in response.headers["content-disposition"]
    documents = list(yaml.safe_load_all(response.text))
    by_kind = {kind.kind: kind for kind in KINDS}
    for document in documents:
        assert document["apiVersion"] == "hetsched.io/v1alpha1"
        by_kind[document["kind"]].spec.model_validate(document["spec"])
    kinds = [d["kind"] for d in documents]
    assert kinds.count("AcceleratorPool") == 2 and kinds.count("ModelDeployment") == 2
    assert {d["metadata"].get("namespace") for d in documents if d["kind"] == "ModelDeployment"} == {"serving"}
    placement = next(d for d in documents if d["kind"] == "PlacementPlan")
    assert Plan.model_validate(placement["spec"]["plan"]) == Plan.model_validate(stored["plan"])
    assert placement["spec"]["approval"] == "manual"
    assert client.get(f"/api/plans/{stored['id']}/resources.yaml", params={"namespace": "Bad_NS"}).status_code == 422


def test_export_mig_parted_config_matches_the_plan(client: TestClient) -> None:
    stored = _solve(client, small_spec())
    plan = Plan.model_validate(stored["plan"])
    config, labels = yaml.safe_load_all(client.get(f"/api/plans/{stored['id']}/mig-parted.yaml").text)
    assert config["version"] == "v1"
    for node in plan.nodes:
        assert labels["node-labels"][node.name]["nvidia.com/mig.config"] == node.mig_config
        groups = config["mig-configs"][node.mig_config]
        for gpu in node.gpus:
            group = next(g for g in groups if gpu.index in g["devices"])
            assert group["mig-enabled"] is (gpu.mode is GpuMode.MIG)
            if gpu.mode is GpuMode.MIG:
                counts: dict[str, int] = {}
                for instance in gpu.instances:
                    counts[instance.profile] = counts.get(instance.profile, 0) + 1
                assert group["mig-devices"] == counts


def test_export_dcm_config_holds_the_profile_of_each_partitioned_node(client: TestClient) -> None:
    spec = {"name": "amd", "pools": [{"name": "mi300x", "accelerator": "mi300x", "nodes": 1, "mig_allowed": True}],
            "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                        "workload": {"rate_rps": 6.0, "input_tokens": 512, "output_tokens": 128}}],
            "capacities": [{"model": "qwen3-0.6b", "device": "mi300x", "requests_per_s": 5.0},
                           {"model": "qwen3-0.6b", "device": "mi300x:cpx_nps1", "requests_per_s": 4.0}]}
    stored = _solve(client, spec)
    (node,) = Plan.model_validate(stored["plan"]).nodes
    response = client.get(f"/api/plans/{stored['id']}/dcm-config.json")
    assert response.status_code == 200 and "attachment" in response.headers["content-disposition"]
    assert response.headers["content-type"].startswith("application/json")
    profile = json.loads(response.text)["gpu-config-profiles"][node.partition_profile]
    assert [g["computePartition"] for g in profile["profiles"]] == ["CPX"]
    _, labels = yaml.safe_load_all(client.get(f"/api/plans/{stored['id']}/mig-parted.yaml").text)
    assert labels["node-labels"] == {node.name: {"dcm.amd.com/gpu-config-profile": node.partition_profile}}
    assert client.get("/api/plans/999999/dcm-config.json").status_code == 404


def test_operator_plans_in_the_same_store_show_up(database_url: str) -> None:
    spec = ClusterSpec.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    plan = optimize(spec)
    store = open_store(database_url)
    with store.transaction() as session:
        session.add(PlanRow(name="cluster", origin="operator", status=plan.status.value, cost_per_hour=plan.cost_per_hour,
                            spec=spec.model_dump(mode="json"), plan=plan.model_dump(mode="json"), note="applied"))
    store.engine.dispose()
    with _client(database_url) as client:
        listed = client.get("/api/plans", params={"origin": "operator"}).json()
        assert [(p["name"], p["origin"]) for p in listed] == [("cluster", "operator")]
        assert client.get("/api/plans", params={"origin": "web"}).json() == []
        assert client.get(f"/api/plans/{listed[0]['id']}").json()["plan"]["cost_per_hour"] == plan.cost_per_hour


def test_a_plan_stored_without_its_spec_opens_and_exports_but_cannot_be_re_solved(database_url: str) -> None:
    plan = optimize(ClusterSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())))
    store = open_store(database_url)
    with store.transaction() as session:
        session.add(PlanRow(name="cluster", origin="operator", status=plan.status.value, cost_per_hour=plan.cost_per_hour,
                            spec={}, plan=plan.model_dump(mode="json"), note="applied by the operator"))
    store.engine.dispose()
    with _client(database_url) as client:
        stored = client.get("/api/plans/1").json()
        assert stored["spec"] is None and Plan.model_validate(stored["plan"]) == plan
        documents = list(yaml.safe_load_all(client.get("/api/plans/1/resources.yaml").text))
        assert [d["kind"] for d in documents] == ["PlacementPlan"]
        response = client.post("/api/plans/1/what-if", json={"changes": {"demand": {"qwen3-8b": 1}}})
        assert response.status_code == 422 and response.json()["field"] == "plan_id"


def test_the_token_guards_every_api_route_but_info(database_url: str) -> None:
    with _client(database_url, token="s3cret") as client:
        assert client.get("/api/info").json()["auth_required"] is True
        for public in ("/", "/static/app.js", "/openapi.json"):
            assert client.get(public).status_code == 200, public
        app = client.app
        assert isinstance(app, FastAPI)
        for route in app.routes:
            if not isinstance(route, APIRoute) or not route.path.startswith("/api/") or route.path == "/api/info":
                continue
            path = route.path.replace("{plan_id}", "1").replace("{name}", "x")
            for method in route.methods:
                response = client.request(method, path, json={})
                assert response.status_code == 401, (method, path)
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json()["field"] == "authorization"
        wrong = client.post("/api/plans", json={"spec": small_spec()}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        stored = _solve(client, small_spec(), Authorization="BEARER s3cret")
        for path in (f"/api/plans/{stored['id']}", f"/api/plans/{stored['id']}/resources.yaml", "/api/plans"):
            assert client.get(path, headers={"Authorization": "bearer  s3cret"}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_json_endpoints_refuse_other_content_types(client: TestClient, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"spec": small_spec()}).encode()
    for method, path in (("POST", "/api/plans"), ("POST", "/api/specs/parse"), ("PUT", "/api/models/x")):
        response = client.request(method, path, content=body, headers=headers)
        assert response.status_code == 415, (method, path)
        assert response.json()["field"] == "content-type" and "application/json" in response.json()["detail"]
    assert client.get("/api/plans").json() == []
    assert client.post("/api/plans", content=body,
                       headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 201


def test_large_bodies_are_refused_with_413(database_url: str) -> None:
    with _client(database_url, max_body_bytes=2_000) as client:
        big = small_spec(name="x" * 3_000)
        response = client.post("/api/plans", json={"spec": big})
        assert response.status_code == 413 and "2000 bytes" in response.json()["detail"]
        chunks = iter([b'{"spec": {"name": "', b"y" * 1_500, b"y" * 1_500, b'"}}'])
        streamed = client.post("/api/plans", content=chunks, headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413 and streamed.headers["connection"] == "close"
        claimed = client.post("/api/plans", content=b"{}", headers={"Content-Type": "application/json",
                                                                   "Content-Length": "999999999999"})
        assert claimed.status_code == 413 and claimed.json()["field"] == "content-length"
        assert client.post("/api/plans", json={"spec": small_spec()}).status_code == 201


def test_a_body_that_arrives_too_slowly_gets_408(database_url: str) -> None:
    settings = Settings(store=StoreSettings(database_url=database_url), web=WebSettings(body_timeout_s=0.2))
    app = create_app(settings, capacity_source=scaled_capacity)

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"spec": '
        await asyncio.sleep(0.5)
        yield b"{}}"

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
            return await client.post("/api/plans", content=trickle(), headers={"Content-Type": "application/json"})

    started = time.monotonic()
    response = asyncio.run(post())
    assert response.status_code == 408 and "0.2 s" in response.json()["detail"]
    assert time.monotonic() - started < 0.45


def test_host_names_are_checked_against_dns_rebinding(database_url: str) -> None:
    settings = Settings(store=StoreSettings(database_url=database_url))
    with TestClient(create_app(settings, capacity_source=scaled_capacity), base_url="http://127.0.0.1:8080") as local:
        assert local.get("/api/plans").status_code == 200
        assert local.get("/api/plans", headers={"Host": "localhost:8080"}).status_code == 200
        rebound = local.get("/api/plans", headers={"Host": "attacker.example:8080"})
        assert rebound.status_code == 400 and rebound.json()["field"] == "host"
    listed = Settings(store=StoreSettings(database_url=database_url),
                      web=WebSettings(allowed_hosts=("planner.example", "*.corp.example")))
    with TestClient(create_app(listed, capacity_source=scaled_capacity), base_url="http://10.0.0.5") as remote:
        for host, status in (("planner.example", 200), ("a.corp.example", 200), ("10.0.0.5", 400),
                             ("attacker.example", 400)):
            assert remote.get("/api/plans", headers={"Host": host}).status_code == status, host


def test_a_solve_past_its_deadline_stops_and_frees_its_thread(database_url: str) -> None:
    """Two heavy solves time out; a trivial one queued behind them gets a thread in time and succeeds."""
    calls: list[str] = []

    def slow_for_heavy(query: CapacityQuery) -> float:
        calls.append(query.spec.name)
        if query.spec.name.startswith("heavy"):
            time.sleep(0.2)
        return scaled_capacity(query)

    heavy = small_spec(name="heavy", models=[
        {"name": f"heavy-{i}", "model": "qwen3-0.6b", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
         "workload": {"rate_rps": 1.0, "input_tokens": 512, "output_tokens": 128}} for i in range(8)])
    settings = Settings(store=StoreSettings(database_url=database_url), web=WebSettings(solve_timeout_s=1.0))
    app = create_app(settings, capacity_source=slow_for_heavy)

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                                     timeout=30) as client:
            heavies = [asyncio.create_task(client.post("/api/plans", json={"spec": heavy})) for _ in range(2)]
            await asyncio.sleep(0.1)
            trivial = await client.post("/api/plans", json={"spec": small_spec()})
            return [*await asyncio.gather(*heavies), trivial]

    first, second, trivial = asyncio.run(scenario())
    assert first.status_code == second.status_code == 504
    assert "1 s" in first.json()["detail"] and "no plan was stored" in first.json()["detail"]
    assert trivial.status_code == 201, trivial.text
    heavy_calls = sum(name.startswith("heavy") for name in calls)
    time.sleep(0.3)
    assert sum(name.startswith("heavy") for name in calls) == heavy_calls  # stopped, not running on unseen
    assert heavy_calls < 2 * 8 * 3
    with TestClient(app) as client:
        assert [p["name"] for p in client.get("/api/plans").json()] == ["small"]


def test_capacities_cached_before_a_deadline_are_whole_rows(database_url: str) -> None:
    spec = {"name": "sim", "pools": [{"name": p, "accelerator": p, "nodes": 1} for p in ("l40s", "l4", "a10g")],
            "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 2000, "tpot_ms": 200}, "max_tp": 1,
                        "workload": {"rate_rps": 5, "input_tokens": 256, "output_tokens": 64}}]}
    short = Settings(store=StoreSettings(database_url=database_url), web=WebSettings(solve_timeout_s=0.05))
    with TestClient(create_app(short)) as client:
        assert client.post("/api/plans", json={"spec": spec}).status_code == 504
        cached = client.get("/api/capacities").json()
        assert client.get("/api/plans").json() == []
    with open_store(database_url).transaction() as session:
        rows = session.scalars(select(CapacityRow)).all()
        assert len(rows) == len(cached) < 3
        assert all(Capacity.from_json(r.result).requests_per_s == r.requests_per_s for r in rows)
    with TestClient(create_app(Settings(store=StoreSettings(database_url=database_url)))) as client:
        assert _solve(client, spec)["status"] == "optimal"
        assert len(client.get("/api/capacities").json()) == 3


def test_by_default_capacities_come_from_the_simulator_and_are_cached_in_the_store(database_url: str) -> None:
    spec = {"name": "sim", "pools": [{"name": "l40s", "accelerator": "l40s", "nodes": 1}],
            "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 2000, "tpot_ms": 200}, "max_tp": 1,
                        "workload": {"rate_rps": 5, "input_tokens": 256, "output_tokens": 64}}]}
    with TestClient(create_app(Settings(store=StoreSettings(database_url=database_url)))) as client:
        stored = _solve(client, spec)
        assert stored["status"] == "optimal"
        cached = client.get("/api/capacities", params={"model": "qwen3-0.6b"}).json()
        assert cached and {c["device"] for c in cached} == {"l40s"}
        group = stored["plan"]["models"][0]["replicas"][0]
        assert group["capacity_rps"] >= 5 and group["replicas"] >= 1


def test_a_store_that_cannot_be_used_answers_a_json_503_without_sql(tmp_path: Path) -> None:
    path = tmp_path / "locked.sqlite"
    with _client(f"sqlite:///{path}?timeout=0.1") as client:
        assert client.get("/api/plans").status_code == 200
        lock = sqlite3.connect(path, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # another writer holds the file
        try:
            for response in (client.get("/api/plans"), client.post("/api/plans", json={"spec": small_spec()})):
                assert response.status_code == 503, response.text
                detail = response.json()["detail"]
                assert "is unavailable (database is locked)" in detail and "try again" in detail
                assert "SELECT" not in detail and "INSERT" not in detail
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert client.get("/api/plans").json() == []


def test_cluster_files_parse_into_specs(client: TestClient) -> None:
    response = client.post("/api/specs/parse", json={"text": EXAMPLE.read_text(), "filename": "chat.yaml"})
    assert response.status_code == 200
    assert ClusterSpec.model_validate(response.json()) == ClusterSpec.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    broken = client.post("/api/specs/parse", json={"text": "pools: [", "filename": "x.yaml"})
    assert broken.status_code == 422 and broken.json()["field"] == "text"
    wrong = client.post("/api/specs/parse", json={"text": "name: x\npools: []\nmodels: []\n"})
    assert wrong.status_code == 422 and wrong.json()["field"] == "pools"


def test_page_and_openapi_are_served(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "<h1>hetsched placement planner</h1>" in page.text
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/style.css").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/api/plans", "/api/plans/{plan_id}/what-if", "/api/plans/{plan_id}/resources.yaml",
            "/api/models/{name}", "/api/accelerators", "/api/capacities", "/api/profiles"} <= set(paths)
