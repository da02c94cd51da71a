"""The real kopf operator against kmock's Kubernetes emulator over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import attrs
import httpx
import kmock
import pytest
import pytest_asyncio
from sqlalchemy import select

from hetsched.operator.handlers import default_solver, operate
from hetsched.operator.kube import Connection
from hetsched.operator.manifests import deployment_name
from hetsched.operator.planning import Solver
from hetsched.optimizer.build import CapacityQuery, CapacitySource
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import CapacityEntry, ClusterSpec, Disaggregation, Role
from hetsched.settings import AutoscaleSettings, OperatorSettings
from hetsched.settings.operator import Approval, RetryPolicy
from hetsched.store import Store, open_store
from hetsched.store.tables import PlanRow
from operator_fixtures import amd_node, group, make_plan, mig_plan, model_deployment, node, pool, proportional_solver

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

GROUP = "hetsched.io/v1alpha1"


@dataclass
class Failure:
    """Answer ``remaining`` requests of ``method`` whose path contains ``path`` with ``status``."""

    method: str
    path: str
    status: int
    remaining: int


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what the operator relies on: uid/resourceVersion/generation stamps, injected failures."""

    failures: list[Failure] = attrs.field(factory=list)
    served_failures: list[str] = attrs.field(factory=list)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1))

    async def _handle(self, request: Any) -> Any:
        for failure in self.failures:
            if failure.remaining and request.method.value.upper() == failure.method and failure.path in str(request.url):
                failure.remaining -= 1
                self.served_failures.append(f"{failure.method} {request.url.path} → {failure.status}")
                raise kmock.KubernetesError(status=failure.status, reason="Injected", message="injected failure")
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {}) if request.action in (kmock.action.CREATE, kmock.action.UPDATE) else None
            if meta is not None:
                meta["resourceVersion"] = str(next(self._versions))
            if request.action == kmock.action.CREATE and meta is not None:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return await super()._handle(request)


RESOURCES = {
    "v1/namespaces": {"namespaced": False, "kind": "Namespace"},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"namespaced": False, "kind": "CustomResourceDefinition"},
    "v1/nodes": {"namespaced": False, "kind": "Node"},
    "v1/pods": {"namespaced": True, "kind": "Pod"},
    "v1/services": {"namespaced": True, "kind": "Service"},
    "v1/configmaps": {"namespaced": True, "kind": "ConfigMap"},
    "v1/events": {"namespaced": True, "kind": "Event"},
    "apps/v1/deployments": {"namespaced": True, "kind": "Deployment"},
    "policy/v1/poddisruptionbudgets": {"namespaced": True, "kind": "PodDisruptionBudget"},
    f"{GROUP}/acceleratorpools": {"namespaced": False, "kind": "AcceleratorPool", "subresources": {"status"}},
    f"{GROUP}/modeldeployments": {"namespaced": True, "kind": "ModelDeployment", "subresources": {"status"}},
    f"{GROUP}/placementplans": {"namespaced": False, "kind": "PlacementPlan", "subresources": {"status"}},
}
VERBS = {"list", "watch", "get", "create", "patch", "delete"}


@pytest_asyncio.fixture()
async def cluster() -> AsyncIterator[Emulator]:
    async with Emulator() as emulator, kmock.Server(emulator):
        for key, info in RESOURCES.items():
            emulator.resources[key] = {**info, "verbs": VERBS}
        yield emulator


def _objects(emulator: Emulator, resource: str) -> list[dict[str, Any]]:
    return [obj.raw for (res, _, _), obj in list(emulator.objects.items())
            if str(res.plural) == resource.rsplit("/", 1)[-1] and not obj.deleted]


def _put(emulator: Emulator, resource: str, obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("resourceVersion", "1")
    meta.setdefault("generation", 1)
    emulator.objects[resource, meta.get("namespace"), meta["name"]] = obj


async def _eventually(check: Callable[[], Any], *, timeout: float = 15.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = check()
        except (AssertionError, KeyError, StopIteration, IndexError):
            result = None
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            return check()
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def running_operator(emulator: Emulator, *, solver: Solver = proportional_solver, peering: str | None = None,
                           capacity_source: CapacitySource | None = None, store: Store | None = None,
                           autoscale: AutoscaleSettings | None = None, **config: Any) -> AsyncIterator[None]:
    stop, ready = asyncio.Event(), asyncio.Event()
    settings = OperatorSettings(debounce_s=0.1, requeue_s=0.3, mig_configmap=("gpu-operator", "mig-parted"),
                                retry=RetryPolicy(attempts=4, initial_delay_s=0.02, timeout_s=2.0), **config)
    connection = Connection(server=str(emulator.url).rstrip("/"))
    task = asyncio.create_task(operate(connection, settings, solver=solver, peering=peering,
                                       capacity_source=capacity_source, store=store, autoscale=autoscale,
                                       stop_flag=stop, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _deployments(emulator: Emulator) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _objects(emulator, "apps/v1/deployments")}


def _set_ready(emulator: Emulator) -> None:
    """Play the Deployment controller: every replica becomes Ready."""
    for d in _objects(emulator, "apps/v1/deployments"):
        if (d.get("status") or {}).get("readyReplicas") != d["spec"]["replicas"]:
            emulator.objects["apps/v1/deployments", d["metadata"]["namespace"], d["metadata"]["name"]] = \
                {**d, "status": {"readyReplicas": d["spec"]["replicas"]}}


async def test_plans_applies_scales_and_collects(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, "v1/nodes", node("gpu-2"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=25))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("broken", model="acme/unknown"))
    async with running_operator(cluster):
        deps = await _eventually(lambda: _deployments(cluster))
        dep = deps["chat-h100-h100-sxm-tp1-unified"]
        assert dep["spec"]["replicas"] == 3
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        container = pod["containers"][0]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert "--tensor-parallel-size" in container["args"]
        assert dep["metadata"]["ownerReferences"][0]["name"] == "chat"
        assert await _eventually(lambda: [s for s in _objects(cluster, "v1/services") if s["metadata"]["name"] == "chat"])

        def broken_condition() -> dict[str, Any]:
            md = next(m for m in _objects(cluster, f"{GROUP}/modeldeployments") if m["metadata"]["name"] == "broken")
            return next(c for c in md["status"]["conditions"] if c["type"] == "Planned")
        planned = await _eventually(broken_condition)
        assert planned["status"] == "False" and planned["reason"] == "UnknownModel" and "spec.model" in planned["message"]
        pool_status = await _eventually(lambda: _objects(cluster, f"{GROUP}/acceleratorpools")[0].get("status"))
        assert pool_status["gpus"] == 16 and pool_status["accelerator"] == "h100-sxm"

        _set_ready(cluster)
        md = next(m for m in _objects(cluster, f"{GROUP}/modeldeployments") if m["metadata"]["name"] == "chat")
        cluster.objects[f"{GROUP}/modeldeployments", "serving", "chat"] = \
            {**md, "spec": {**md["spec"], "workload": {**md["spec"]["workload"], "rateRps": 55}}}
        scaled = await _eventually(lambda: _deployments(cluster)["chat-h100-h100-sxm-tp1-unified"]["spec"]["replicas"] == 6)
        assert scaled

        del cluster.objects[f"{GROUP}/modeldeployments", "serving", "chat"]
        assert await _eventually(lambda: not _deployments(cluster))
        assert await _eventually(lambda: not [s for s in _objects(cluster, "v1/services")])


def _mig_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
    return mig_plan(spec.models[0].name)


async def test_mig_flow_waits_for_the_state_label(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100", partitioning="allowed"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("small", rate=5))
    async with running_operator(cluster, solver=_mig_solver):
        def labelled() -> bool:
            return _objects(cluster, "v1/nodes")[0]["metadata"]["labels"].get("nvidia.com/mig.config") == "hetsched-2x3g"
        assert await _eventually(labelled)
        configmap = await _eventually(lambda: _objects(cluster, "v1/configmaps")[0])
        assert "hetsched-2x3g" in configmap["data"]["config.yaml"]
        dep = await _eventually(lambda: _deployments(cluster)[deployment_name("small", "h100", "h100-sxm:3g.40gb", 1, Role.UNIFIED)])
        assert dep["spec"]["replicas"] == 0
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/mig-3g.40gb"] == "1"

        gpu = _objects(cluster, "v1/nodes")[0]
        gpu["metadata"]["labels"]["nvidia.com/mig.config.state"] = "success"
        cluster.objects["v1/nodes", None, "gpu-1"] = gpu
        assert await _eventually(
            lambda: _deployments(cluster)[deployment_name("small", "h100", "h100-sxm:3g.40gb", 1, Role.UNIFIED)]["spec"]["replicas"] == 2)

        gpu["metadata"]["labels"]["nvidia.com/mig.config.state"] = "failed"
        cluster.objects["v1/nodes", None, "gpu-1"] = gpu

        def phase() -> str:
            return _objects(cluster, f"{GROUP}/placementplans")[0]["status"]["phase"]
        assert await _eventually(lambda: phase() == "Failed")


def _amd_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
    """The real optimizer, with a table where one CPX partition of an MI300X beats a whole one."""
    name = spec.models[0].name
    capacities = [CapacityEntry(model=name, device="mi300x:cpx_nps1", requests_per_s=4.0),
                  CapacityEntry(model=name, device="mi300x", requests_per_s=5.0)]
    return default_solver(spec.model_copy(update={"capacities": capacities}), current)


async def test_amd_partitions_go_through_the_device_config_manager(cluster: Emulator) -> None:
    user_taint = {"key": "team", "value": "ml", "effect": "NoSchedule"}
    mi = amd_node("mi-1")
    mi["spec"] = {"taints": [user_taint]}
    mi["status"]["capacity"] = {"amd.com/spx_nps1": "8"}  # the device plugin's mixed naming
    _put(cluster, "v1/nodes", mi)
    amd_pool = pool("mi300", partitioning="allowed")
    amd_pool["spec"]["nodeSelector"] = {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}
    _put(cluster, f"{GROUP}/acceleratorpools", amd_pool)
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("small", rate=6, model="qwen3-0.6b"))
    dcm_taint = {"key": "amd-dcm", "value": "up", "effect": "NoExecute"}

    def the_node() -> dict[str, Any]:
        return _objects(cluster, "v1/nodes")[0]

    async with running_operator(cluster, solver=_amd_solver, dcm_configmap=("kube-amd-gpu", "dcm")):
        assert await _eventually(lambda: dcm_taint in the_node()["spec"]["taints"])
        profile = await _eventually(lambda: the_node()["metadata"]["labels"]["dcm.amd.com/gpu-config-profile"])
        configmap = await _eventually(lambda: next(c for c in _objects(cluster, "v1/configmaps")
                                                   if c["metadata"]["namespace"] == "kube-amd-gpu"))
        assert configmap["metadata"]["name"] == "dcm" and f'"{profile}"' in configmap["data"]["config.json"]
        name = deployment_name("small", "mi300", "mi300x:cpx_nps1", 1, Role.UNIFIED)
        dep = await _eventually(lambda: _deployments(cluster)[name])
        assert dep["spec"]["replicas"] == 0
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["amd.com/cpx_nps1"] == "1"

        done = the_node()
        done["metadata"]["labels"]["dcm.amd.com/gpu-config-profile-state"] = "success"
        cluster.objects["v1/nodes", None, "mi-1"] = done
        assert await _eventually(lambda: _deployments(cluster)[name]["spec"]["replicas"] == 2)
        assert await _eventually(lambda: the_node()["spec"]["taints"] == [user_taint])


async def test_restart_mid_apply_converges_and_errors_are_retried(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    for name in ("a", "b", "c"):
        _put(cluster, f"{GROUP}/modeldeployments", model_deployment(name, rate=5))
    cluster.failures += [Failure("POST", "/deployments", 500, 2), Failure("PATCH", "/status", 409, 1)]
    async with running_operator(cluster):
        await _eventually(lambda: len(_deployments(cluster)) >= 1, timeout=10)
    # stopped mid-apply (one Deployment lost, too): a new operator converges without duplicates
    with contextlib.suppress(KeyError):
        del cluster.objects["apps/v1/deployments", "serving", "b-h100-h100-sxm-tp1-unified"]
    cluster.failures.append(Failure("GET", "/placementplans/cluster", 503, 1))
    async with running_operator(cluster):
        deps = await _eventually(lambda: len(_deployments(cluster)) == 3 and _deployments(cluster))
        assert sorted(deps) == ["a-h100-h100-sxm-tp1-unified", "b-h100-h100-sxm-tp1-unified", "c-h100-h100-sxm-tp1-unified"]
        assert await _eventually(lambda: len(_objects(cluster, "v1/services")) == 3)
    assert len(cluster.served_failures) == 4, cluster.served_failures


def _doubling_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
    plan = proportional_solver(spec, current)
    groups = [g.model_copy(update={"replicas": g.replicas * 2}) for m in plan.models for g in m.replicas]
    return make_plan(groups)


async def test_two_replicas_elect_one_leader_through_peering(cluster: Emulator) -> None:
    cluster.resources["kopf.dev/v1/clusterkopfpeerings"] = {"namespaced": False, "kind": "ClusterKopfPeering",
                                                            "verbs": VERBS}
    _put(cluster, "kopf.dev/v1/clusterkopfpeerings", {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                                      "metadata": {"name": "hetsched"}})
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=15))
    name = "chat-h100-h100-sxm-tp1-unified"
    async with running_operator(cluster, peering="hetsched", priority=10):
        assert await _eventually(lambda: _deployments(cluster)[name]["spec"]["replicas"] == 2)
        async with running_operator(cluster, solver=_doubling_solver, peering="hetsched", priority=20):
            assert await _eventually(lambda: _deployments(cluster)[name]["spec"]["replicas"] == 4)
            await asyncio.sleep(1.0)  # the paused replica does not fight back
            assert _deployments(cluster)[name]["spec"]["replicas"] == 4


def _writes(emulator: Emulator) -> int:
    return sum(1 for r in emulator if r.method.value.upper() in ("POST", "PATCH", "PUT", "DELETE"))


async def test_manual_approval_and_no_writes_once_converged(cluster: Emulator, tmp_path: Path) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=15))
    database_url = f"sqlite:///{tmp_path / 'plans.db'}"
    async with running_operator(cluster, default_approval=Approval.MANUAL, store=open_store(database_url)):
        plan = await _eventually(lambda: _objects(cluster, f"{GROUP}/placementplans")[0]["status"]["phase"] == "Proposed"
                                 and _objects(cluster, f"{GROUP}/placementplans")[0])
        assert plan["spec"]["approval"] == "manual" and plan["spec"]["planHash"] and not _deployments(cluster)

        def applied_condition() -> dict[str, Any]:
            md = _objects(cluster, f"{GROUP}/modeldeployments")[0]
            return next(c for c in md["status"]["conditions"] if c["type"] == "Applied")
        assert (await _eventually(lambda: applied_condition()["reason"] == "AwaitingApproval"))

        # approve the plan as it is now: kopf may have written it (its finalizer) since it was first Proposed
        current = _objects(cluster, f"{GROUP}/placementplans")[0]
        cluster.objects[f"{GROUP}/placementplans", None, "cluster"] = \
            {**current, "spec": {**current["spec"], "approved": True}}
        assert await _eventually(lambda: _deployments(cluster)["chat-h100-h100-sxm-tp1-unified"]["spec"]["replicas"] == 2)
        _set_ready(cluster)
        assert await _eventually(lambda: _objects(cluster, f"{GROUP}/placementplans")[0]["status"]["phase"] == "Applied")
        await asyncio.sleep(1.0)  # the last passes end: nothing pokes the loop but the CRD

        await asyncio.sleep(0.5)  # the last pass finishes its events
        settled = _writes(cluster)
        await asyncio.sleep(1.0)  # several requeue intervals: reconcile keeps finding nothing to change
        assert _writes(cluster) == settled, "\n".join(str((r.method, r.url.path, r.data)) for r in cluster
                                             if r.method.value.upper() != "GET")
    with open_store(database_url).transaction() as session:
        rows = session.scalars(select(PlanRow)).all()
        assert [(r.origin, r.name, r.cost_per_hour) for r in rows] == [("operator", "cluster", 4.0)]
        assert rows[0].plan["models"][0]["name"] == "serving/chat"


async def test_moving_a_model_keeps_the_old_replicas_until_the_new_are_ready(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, "v1/nodes", node("l40s-1", product="NVIDIA-L40S"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("l40s", product="NVIDIA-L40S"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=15, allowedPools=["h100"]))
    old, new = "chat-h100-h100-sxm-tp1-unified", "chat-l40s-l40s-tp1-unified"
    async with running_operator(cluster):
        await _eventually(lambda: old in _deployments(cluster))
        _set_ready(cluster)
        md = _objects(cluster, f"{GROUP}/modeldeployments")[0]
        cluster.objects[f"{GROUP}/modeldeployments", "serving", "chat"] = \
            {**md, "spec": {**md["spec"], "allowedPools": ["l40s"]}}
        assert await _eventually(lambda: new in _deployments(cluster))
        await asyncio.sleep(0.5)  # the new replicas are not Ready: the old ones keep serving
        assert _deployments(cluster)[old]["spec"]["replicas"] == 2
        _set_ready(cluster)
        assert await _eventually(lambda: old not in _deployments(cluster))
        assert _deployments(cluster)[new]["spec"]["replicas"] == 2


@contextlib.contextmanager
def engine_metrics(text: str | Callable[[], str]) -> Iterator[int]:
    """A loopback engine whose ``/metrics`` answers ``text`` (or what it returns, read anew each time); yields its
    port."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            page = text() if callable(text) else text
            body = page.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _running_pod(deployment: dict[str, Any], *, port: int) -> dict[str, Any]:
    """Play the kubelet: one Ready pod of ``deployment``, its engine listening on loopback ``port``."""
    template = deployment["spec"]["template"]
    container = {**template["spec"]["containers"][0], "ports": [{"name": "http", "containerPort": port}]}
    meta = deployment["metadata"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{meta['name']}-0", "namespace": meta["namespace"],
                         "labels": template["metadata"]["labels"]},
            "spec": {**template["spec"], "containers": [container]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _two_rps(query: CapacityQuery) -> float:
    """Every config holds 2 req/s at the SLO."""
    return 2.0


async def test_the_autoscaler_scales_up_when_the_engines_queue_more_than_the_plan_holds(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=5))
    name = "chat-h100-h100-sxm-tp1-unified"
    # 40 queued requests drain in 10 s: 4 req/s more than the planned replica holds, 3 replicas of 2 req/s
    queued = "vllm:num_requests_running 8\nvllm:num_requests_waiting 40\nvllm:request_success_total 100\n"
    scaling = AutoscaleSettings(interval_s=0.2, queue_drain_s=10.0, headroom=0.1)
    with engine_metrics(queued) as port:
        async with running_operator(cluster, autoscale=scaling, capacity_source=_two_rps):
            deployment = await _eventually(lambda: _deployments(cluster)[name])
            assert deployment["spec"]["replicas"] == 1
            await asyncio.sleep(0.5)  # autoscaling rounds without any pod: the plan stands
            assert _deployments(cluster)[name]["spec"]["replicas"] == 1
            _put(cluster, "v1/pods", _running_pod(deployment, port=port))
            assert await _eventually(lambda: _deployments(cluster)[name]["spec"]["replicas"] == 3)

            def scaled_up() -> dict[str, Any]:
                status = _objects(cluster, f"{GROUP}/modeldeployments")[0]["status"]
                assert status["scalingReasons"][0].startswith("scale-up")
                return status
            status = await _eventually(scaled_up)
            assert status["observedRps"] == pytest.approx(4.0)  # the queue to drain, as the autoscaler saw it
            assert "sloAttainment" not in status  # no latency histogram yet: unknown, not 100 %
            events = await _eventually(lambda: [e for e in _objects(cluster, "v1/events") if e["reason"] == "Autoscaled"])
            assert events[0]["involvedObject"]["name"] == "chat" and "scale-up" in events[0]["message"]

            def reads(path: str) -> int:
                return sum(1 for r in cluster if r.method.value.upper() == "GET" and r.url.path.endswith(path))
            passes, pod_lists = reads("/placementplans/cluster"), reads("/v1/pods")
            assert passes - 1 <= pod_lists <= passes  # each round reads the pods its pass listed, none of its own


def _slow_engine(slowdown: float, *, prompt: int = 512, output: int = 128, running: int = 8) -> Callable[[], str]:
    """An engine's /metrics page whose counters grow by 20 requests a reading, each timed as llama-3.1-8b on an
    h100-sxm ``slowdown`` times slower than the catalog says (at ``running`` sequences)."""
    from hetsched.router.predict import predict
    from hetsched.router.profiles import roofline_profile
    from hetsched.router.types import Endpoint, EndpointView, RouteRequest

    others = running - 1
    view = EndpointView(Endpoint("x", "", ""), in_flight=others, in_flight_prompt_tokens=others * prompt,
                        in_flight_max_tokens=others * output, running=others, waiting=0)
    p = predict(roofline_profile("llama-3.1-8b", "h100-sxm", 1), view,
                RouteRequest(model="", prompt_tokens=prompt, max_tokens=output), slo=None)
    readings = itertools.count(1)

    def page() -> str:
        n = 20 * next(readings)
        lines = [f"vllm:num_requests_running {running}", "vllm:num_requests_waiting 0", f"vllm:request_success_total {n}"]
        for name, mean in (("time_to_first_token_seconds", p.ttft_s * slowdown),
                           ("request_time_per_output_token_seconds", p.tpot_s * slowdown),
                           ("request_queue_time_seconds", 0.0), ("request_prompt_tokens", prompt),
                           ("request_generation_tokens", output)):
            lines += [f'vllm:{name}_bucket{{le="+Inf"}} {n}', f"vllm:{name}_sum {n * mean}", f"vllm:{name}_count {n}"]
        return "\n".join(lines) + "\n"
    return page


async def test_a_type_slower_than_its_catalog_is_learned_stored_reported_and_re_planned(
        cluster: Emulator, tmp_path: Path) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=1))
    store = open_store(f"sqlite:///{tmp_path / 'store.sqlite'}")
    solved: list[ClusterSpec] = []

    def counting_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
        solved.append(spec)
        return proportional_solver(spec, current)

    scaling = AutoscaleSettings(interval_s=0.1, correction_threshold=0.1)
    with engine_metrics(_slow_engine(1.5)) as port:
        async with running_operator(cluster, solver=counting_solver, autoscale=scaling, capacity_source=_two_rps,
                                    store=store):
            name = "chat-h100-h100-sxm-tp1-unified"
            deployment = await _eventually(lambda: _deployments(cluster)[name])
            solves_before = len(solved)
            _put(cluster, "v1/pods", _running_pod(deployment, port=port))
            events = await _eventually(
                lambda: [e for e in _objects(cluster, "v1/events") if e["reason"] == "StepModelCorrected"], timeout=20)
            assert events[0]["involvedObject"]["name"] == "chat"
            assert "llama-3.1-8b on h100-sxm" in events[0]["message"]

            def calibrated() -> dict[str, Any]:
                status = _objects(cluster, f"{GROUP}/modeldeployments")[0]["status"]
                return next(c for c in status["conditions"] if c["type"] == "Calibrated")
            condition = await _eventually(calibrated)
            assert condition["status"] == "True" and condition["reason"] == "StepModelCorrected"
            assert await _eventually(lambda: len(solved) > solves_before)  # the new step model is a new input
    from hetsched.store.corrections import corrections_in_force

    [stored] = corrections_in_force(store).values()
    assert stored.key.model == "llama-3.1-8b" and stored.key.accelerator == "h100-sxm"
    assert stored.correction.decode_scale > 1.3 and "operator" in stored.origin
    store.engine.dispose()


def _pd_solver(spec: ClusterSpec, current: Plan | None) -> Plan:
    """Unified models as ``proportional_solver`` places them; a disaggregated one: prefill on H100, decode on L40S."""
    unified = [m for m in spec.models if m.disaggregation is Disaggregation.UNIFIED]
    groups = [g for m in proportional_solver(spec.model_copy(update={"models": unified}), current).models
              for g in m.replicas]
    for m in spec.models:
        if m not in unified:
            groups += [group(m.name, 1, role=Role.PREFILL),
                       group(m.name, 2, pool="l40s", accelerator="l40s", role=Role.DECODE)]
    return make_plan(groups)


async def test_a_disaggregated_model_runs_both_roles_and_the_autoscaler_keeps_them(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, "v1/nodes", node("l40s-1", product="NVIDIA-L40S"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("l40s", product="NVIDIA-L40S"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=5, allowedPools=["h100"]))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment(
        "docs", rate=5, disaggregation="prefill_decode", kvTransfer={"connector": "NixlConnector", "port": 5700}))
    prefill, decode, chat = "docs-h100-h100-sxm-tp1-prefill", "docs-l40s-l40s-tp1-decode", "chat-h100-h100-sxm-tp1-unified"
    queued = "vllm:num_requests_running 8\nvllm:num_requests_waiting 40\nvllm:request_success_total 100\n"
    scaling = AutoscaleSettings(interval_s=0.2, queue_drain_s=10.0, headroom=0.1)
    with engine_metrics(queued) as port:
        async with running_operator(cluster, solver=_pd_solver, autoscale=scaling, capacity_source=_two_rps):
            deps = await _eventually(lambda: {prefill, decode, chat} <= set(_deployments(cluster)) and _deployments(cluster))
            for name, role, kv_role in ((prefill, "prefill", "kv_producer"), (decode, "decode", "kv_consumer")):
                template = deps[name]["spec"]["template"]
                assert template["metadata"]["labels"]["hetsched.io/role"] == role
                container = template["spec"]["containers"][0]
                config = json.loads(container["args"][container["args"].index("--kv-transfer-config") + 1])
                assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role}
                assert {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "5700"} in container["env"]
                assert {"name": "kv-transfer", "containerPort": 5700, "protocol": "TCP"} in container["ports"]
            assert deps[prefill]["spec"]["replicas"] == 1 and deps[decode]["spec"]["replicas"] == 2

            for name in (prefill, decode, chat):  # every engine reports a long queue
                _put(cluster, "v1/pods", _running_pod(_deployments(cluster)[name], port=port))
            assert await _eventually(lambda: _deployments(cluster)[chat]["spec"]["replicas"] == 3)
            await asyncio.sleep(0.5)
            assert _deployments(cluster)[prefill]["spec"]["replicas"] == 1
            assert _deployments(cluster)[decode]["spec"]["replicas"] == 2

            def roles() -> list[dict[str, Any]]:
                md = next(m for m in _objects(cluster, f"{GROUP}/modeldeployments") if m["metadata"]["name"] == "docs")
                return md["status"]["roles"]
            assert await _eventually(lambda: [(r["role"], r["replicas"]) for r in roles()]
                                     == [("prefill", 1), ("decode", 2)])


async def test_a_write_the_api_server_refuses_shows_on_the_model_as_degraded_until_it_succeeds(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=5))
    refused = Failure("POST", "/services", 422, 10_000)
    cluster.failures.append(refused)

    def condition(kind: str) -> dict[str, Any]:
        md = next(m for m in _objects(cluster, f"{GROUP}/modeldeployments") if m["metadata"]["name"] == "chat")
        return next(c for c in md["status"]["conditions"] if c["type"] == kind)

    async with running_operator(cluster):
        degraded = await _eventually(lambda: condition("Degraded")["status"] == "True" and condition("Degraded"))
        assert degraded["reason"] == "WriteFailed"
        assert "Service chat" in degraded["message"] and "injected failure" in degraded["message"]
        assert condition("Applied")["status"] == "False" and condition("Applied")["reason"] == "WriteFailed"
        refused.remaining = 0
        assert await _eventually(lambda: condition("Degraded")["status"] == "False")
        assert _objects(cluster, "v1/services")


INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"


async def test_an_inference_pool_waits_for_its_crds_then_follows_the_model(cluster: Emulator) -> None:
    _put(cluster, "v1/nodes", node("gpu-1"))
    _put(cluster, f"{GROUP}/acceleratorpools", pool("h100"))
    _put(cluster, f"{GROUP}/modeldeployments", model_deployment("chat", rate=5, gateway={"inferencePool": True}))

    def condition(kind: str) -> dict[str, Any]:
        md = _objects(cluster, f"{GROUP}/modeldeployments")[0]
        return next(c for c in md["status"]["conditions"] if c["type"] == kind)

    async with running_operator(cluster, epp_service="gw-epp"):
        missing = await _eventually(lambda: condition("Degraded")["reason"] == "InferencePoolCRDMissing"
                                    and condition("Degraded"))
        assert missing["status"] == "True" and "releases/download/v1.0.0/manifests.yaml" in missing["message"]
        assert await _eventually(lambda: _deployments(cluster))  # the engines run without the gateway's pool
        _set_ready(cluster)
        assert await _eventually(lambda: _objects(cluster, f"{GROUP}/placementplans")[0]["status"]["phase"] == "Applied")
        await asyncio.sleep(1.0)  # the last passes end: nothing pokes the loop but the CRD
        warning = await _eventually(lambda: [e for e in _objects(cluster, "v1/events")
                                             if e["reason"] == "InferencePoolCRDMissing"])
        assert warning[0]["type"] == "Warning" and warning[0]["involvedObject"]["name"] == "chat"

        # the CRDs are installed: with nothing else in flight, the CRD's event pokes the loop; the pool appears
        cluster.resources[INFERENCE_POOLS] = {"namespaced": True, "kind": "InferencePool", "verbs": VERBS}
        async with httpx.AsyncClient(base_url=str(cluster.url)) as api:  # through the API: watchers see it
            installed = await api.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json={
                "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": "inferencepools.inference.networking.k8s.io"},
                "spec": {"group": "inference.networking.k8s.io", "scope": "Namespaced",
                         "names": {"kind": "InferencePool", "plural": "inferencepools", "singular": "inferencepool"},
                         "versions": [{"name": "v1", "served": True, "storage": True}]}})
            assert installed.is_success, installed.text
        created = await _eventually(lambda: _objects(cluster, INFERENCE_POOLS)[0])
        assert created["metadata"]["namespace"] == "serving" and created["metadata"]["name"] == "chat"
        assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
        assert created["spec"]["selector"] == {"matchLabels": {"hetsched.io/model": "chat"}}
        assert created["spec"]["endpointPickerRef"]["name"] == "gw-epp"
        assert await _eventually(lambda: condition("Degraded")["status"] == "False")

        md = _objects(cluster, f"{GROUP}/modeldeployments")[0]
        cluster.objects[f"{GROUP}/modeldeployments", "serving", "chat"] = \
            {**md, "spec": {**md["spec"], "gateway": {"inferencePool": False}}}
        assert await _eventually(lambda: not _objects(cluster, INFERENCE_POOLS))
        assert _deployments(cluster)
