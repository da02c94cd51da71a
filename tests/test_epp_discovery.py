"""The endpoint picker's discovery: an InferencePool's pods → endpoints per model with their accelerators, as a
pure function and as a watcher against kmock's Kubernetes emulator."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hetsched.catalog import load_catalog
from hetsched.errors import InputError
from hetsched.router.pool import (UNKNOWN_ACCELERATOR, AppProtocol, InferencePoolWatcher, PoolEndpoints,
                                  endpoints_from_pool)
from hetsched.router.types import Endpoint
from hetsched.sim.roles import Role

kubernetes = pytest.importorskip("kubernetes")
kmock = pytest.importorskip("kmock")

NS = "serving"
MODEL = "llama-3.1-8b"
OTHER = "qwen-7b"
APP = {"app": "vllm"}
CATALOG = load_catalog()


def pool(name: str = "chat", *, selector: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,),
         **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": APP if selector is None else selector},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}}, **spec}}


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


NODES = [
    node("h100", **{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/mig.strategy": "mixed"}),
    node("a100", **{"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}),
    node("l4", **{"nvidia.com/gpu.product": "NVIDIA-L4"}),
    node("h100-single", **{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
                           "nvidia.com/mig.strategy": "single"}),
    node("mi300x", **{"amd.com/gpu.product-name": "AMD_Instinct_MI300X",
                      "amd.com/gpu.compute-memory-partition": "spx_nps1"}),
    node("mi300x-cpx", **{"beta.amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM",
                          "beta.amd.com/gpu.compute-memory-partition": "cpx_nps4"}),
    node("cpu"),
    node("b300", **{"nvidia.com/gpu.product": "NVIDIA-B300-SXM6"}),
]


def pod(name: str, node_name: str | None, ip: str | None, *, labels: dict[str, str] | None = None,
        devices: dict[str, str] | None = None, ready: bool = True, deleting: bool = False,
        namespace: str = NS) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                            "labels": {**APP, **(labels or {})}}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    spec: dict[str, Any] = {"containers": [{"name": "vllm", "image": "vllm/vllm-openai",
                                            "resources": {"limits": devices or {}}}]}
    if node_name:
        spec["nodeName"] = node_name
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def _typed(manifest: dict[str, Any], kind: str) -> Any:
    """A manifest as the ``kubernetes`` client hands it over (V1Pod, V1Node)."""
    return kubernetes.client.ApiClient().deserialize(json.dumps(manifest), kind, "application/json")


def discover(the_pool: dict[str, Any], pods: list[dict[str, Any]], *, models: tuple[str, ...] = (MODEL,),
             default_model: str | None = MODEL) -> PoolEndpoints:
    nodes = {n["metadata"]["name"]: _typed(n, "V1Node") for n in NODES}
    return endpoints_from_pool(the_pool, [_typed(p, "V1Pod") for p in pods], nodes, models=models,
                               default_model=default_model, catalog=CATALOG)


def by_url(found: PoolEndpoints, model: str = MODEL) -> dict[str, tuple[str, int]]:
    return {e.url: (e.accelerator, e.tp) for e in found.endpoints[model]}


# --- the pure function -----------------------------------------------------------------------------------------

def test_pods_on_three_gpu_types_get_their_nodes_accelerators_and_tp_from_their_requests() -> None:
    found = discover(pool(), [pod("h", "h100", "10.0.0.1", devices={"nvidia.com/gpu": "1"}),
                              pod("a", "a100", "10.0.0.2", devices={"nvidia.com/gpu": "2"}),
                              pod("l", "l4", "10.0.0.3", devices={"nvidia.com/gpu": "1"})])
    assert found.warnings == []
    assert by_url(found) == {"http://10.0.0.1:8000": ("h100-sxm", 1), "http://10.0.0.2:8000": ("a100-80gb", 2),
                             "http://10.0.0.3:8000": ("l4", 1)}
    assert [e.url for e in found.endpoints[MODEL]] == sorted(by_url(found))
    assert {e.role for e in found.endpoints[MODEL]} == {Role.UNIFIED} and found.app_protocol is AppProtocol.HTTP


def test_mig_slices_from_the_mixed_request_or_the_single_strategy_product() -> None:
    found = discover(pool(), [pod("mixed", "h100", "10.0.0.1", devices={"nvidia.com/mig-3g.40gb": "1"}),
                              pod("single", "h100-single", "10.0.0.2", devices={"nvidia.com/gpu": "1"})])
    assert found.warnings == []
    assert by_url(found) == {"http://10.0.0.1:8000": ("h100-sxm:3g.40gb", 1),
                             "http://10.0.0.2:8000": ("h100-sxm:1g.10gb", 1)}


def test_amd_gpus_and_partitions_from_the_labeller_and_the_request() -> None:
    found = discover(pool(), [pod("whole", "mi300x", "10.0.0.1", devices={"amd.com/gpu": "2"}),
                              pod("asked", "mi300x", "10.0.0.2", devices={"amd.com/cpx_nps4": "1"}),
                              pod("beta", "mi300x-cpx", "10.0.0.3", devices={"amd.com/gpu": "1"})])
    assert found.warnings == []
    assert by_url(found) == {"http://10.0.0.1:8000": ("mi300x", 2), "http://10.0.0.2:8000": ("mi300x:cpx_nps4", 1),
                             "http://10.0.0.3:8000": ("mi300x:cpx_nps4", 1)}


def test_hetsched_labels_win_over_the_node_and_name_the_model() -> None:
    labelled = {"hetsched.io/model": OTHER, "hetsched.io/accelerator": "h100-sxm_3g.40gb", "hetsched.io/tp": "2",
                "hetsched.io/role": "prefill"}
    found = discover(pool(), [pod("op", "l4", "10.0.0.1", labels=labelled, devices={"nvidia.com/gpu": "1"}),
                              pod("untp", "l4", "10.0.0.2", devices={"nvidia.com/gpu": "4"},
                                  labels={"hetsched.io/model": OTHER, "hetsched.io/accelerator": "a100-80gb"}),
                              pod("plain", "l4", "10.0.0.3"),
                              pod("elsewhere", "l4", "10.0.0.4", labels={"hetsched.io/model": "not-served"})],
                     models=(MODEL, OTHER))
    assert found.warnings == []  # the pod of a model this picker does not serve is skipped quietly
    assert found.endpoints[OTHER] == [
        Endpoint("http://10.0.0.1:8000", OTHER, "h100-sxm:3g.40gb", tp=2, role=Role.PREFILL),
        Endpoint("http://10.0.0.2:8000", OTHER, "a100-80gb", tp=4)]
    assert found.endpoints[MODEL] == [Endpoint("http://10.0.0.3:8000", MODEL, "l4")]


def test_each_target_port_of_each_pod_is_an_endpoint() -> None:
    found = discover(pool(ports=(8001, 8000)), [pod("b", "l4", "10.0.0.2"), pod("a", "l4", "10.0.0.1")])
    assert [e.url for e in found.endpoints[MODEL]] == ["http://10.0.0.1:8000", "http://10.0.0.1:8001",
                                                      "http://10.0.0.2:8000", "http://10.0.0.2:8001"]


def test_pods_that_cannot_serve_or_are_not_selected_are_skipped() -> None:
    found = discover(pool(), [pod("ok", "l4", "10.0.0.1"), pod("starting", "l4", "10.0.0.2", ready=False),
                              pod("leaving", "l4", "10.0.0.3", deleting=True), pod("no-ip", "l4", None),
                              pod("elsewhere", "l4", "10.0.0.5", namespace="other"),
                              {**pod("unselected", "l4", "10.0.0.6"), "metadata": {
                                  "name": "unselected", "namespace": NS, "labels": {"app": "other"}}}])
    assert list(by_url(found)) == ["http://10.0.0.1:8000"] and found.warnings == []


def test_a_pod_whose_accelerator_cannot_be_told_is_routed_by_load_with_a_warning_naming_it() -> None:
    found = discover(pool(), [pod("cpu-pod", "cpu", "10.0.0.1"), pod("lost", "gone", "10.0.0.2"),
                              pod("new-gpu", "b300", "10.0.0.3"), pod("bad-slice", "h100", "10.0.0.4",
                                                                      devices={"nvidia.com/mig-5g.50gb": "1"})])
    assert {e.accelerator for e in found.endpoints[MODEL]} == {UNKNOWN_ACCELERATOR} == {"unknown"}
    assert len(found.endpoints[MODEL]) == 4
    assert found.warnings[0] == (f"pod {NS}/cpu-pod: accelerator unknown (no hetsched.io/accelerator label, node cpu "
                                 "has no nvidia.com/gpu.product or AMD label); routed by load alone")
    assert f"pod {NS}/lost" in found.warnings[1] and "node gone could not be read" in found.warnings[1]
    assert "NVIDIA-B300-SXM6 names no catalog accelerator" in found.warnings[2]
    assert "h100-sxm partitioned as 5g.50gb" in found.warnings[3]


def test_a_pool_without_a_selector_selects_nothing_and_says_so() -> None:
    found = discover(pool("empty", selector={}), [pod("a", "l4", "10.0.0.1")])
    assert found.endpoints == {MODEL: []}
    assert found.warnings == [f"InferencePool {NS}/empty has no spec.selector.matchLabels: it selects no pods; set "
                              "them to the labels of its model servers' pods"]


def test_pool_fields_and_pod_labels_it_cannot_read_are_warnings() -> None:
    found = discover(pool(ports=(0,), appProtocol="grpc"), [pod("a", "l4", "10.0.0.1")])
    assert found.endpoints == {MODEL: []} and found.app_protocol is AppProtocol.HTTP
    assert any("spec.targetPorts[0].number=0 is not a port" in w for w in found.warnings)
    assert any("spec.appProtocol='grpc' is not one of http, kubernetes.io/h2c" in w for w in found.warnings)
    assert discover(pool(appProtocol="kubernetes.io/h2c"), []).app_protocol is AppProtocol.H2C

    found = discover(pool(), [pod("a", "l4", "10.0.0.1", labels={"hetsched.io/model": MODEL, "hetsched.io/tp": "two"}),
                              pod("b", "l4", "10.0.0.2")], default_model=None)
    assert found.endpoints == {MODEL: []}
    assert found.warnings == [f"pod {NS}/a: label hetsched.io/tp='two' is not a positive integer; skipped",
                              f"pod {NS}/b has no hetsched.io/model label and no default model is set; skipped"]


def test_the_watcher_refuses_a_default_model_it_does_not_serve() -> None:
    with pytest.raises(InputError, match="default_model"):
        InferencePoolWatcher(namespace=NS, pool_name="chat", models=[MODEL], default_model=OTHER,
                             on_change=lambda found: None, on_synced=lambda synced: None)


# --- the watcher against kmock ---------------------------------------------------------------------------------

RESOURCES = {"v1/nodes": {"namespaced": False, "kind": "Node"}, "v1/pods": {"namespaced": True, "kind": "Pod"},
             "inference.networking.k8s.io/v1/inferencepools": {"namespaced": True, "kind": "InferencePool"}}


@pytest.fixture()
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Point the ``kubernetes`` client's kubeconfig lookup at a file naming a server; the default config is reset
    afterwards."""
    from kubernetes.config import kube_config

    path = tmp_path / "kubeconfig"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))

    def point_at(server: str) -> None:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}]}))

    yield point_at
    kubernetes.client.Configuration.set_default(None)


@pytest_asyncio.fixture()
async def cluster(kubeconfig: Callable[[str], None]) -> AsyncIterator[Any]:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        for key, info in RESOURCES.items():
            emulator.resources[key] = {**info, "verbs": {"list", "watch", "get", "create", "delete"}}
        kubeconfig(str(emulator.url).rstrip("/"))
        yield emulator


def _put(emulator: Any, resource: str, obj: dict[str, Any]) -> None:
    emulator.objects[resource, obj["metadata"].get("namespace"), obj["metadata"]["name"]] = obj


async def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.timeout(20)
async def test_the_watcher_hands_on_the_pools_endpoints_and_follows_pod_events(cluster: Any) -> None:
    for n in NODES:
        _put(cluster, "v1/nodes", n)
    _put(cluster, "inference.networking.k8s.io/v1/inferencepools", pool())
    _put(cluster, "v1/pods", pod("h", "h100", "10.0.0.1", devices={"nvidia.com/gpu": "1"}))
    _put(cluster, "v1/pods", pod("a", "a100", "10.0.0.2", devices={"nvidia.com/gpu": "2"}))
    _put(cluster, "v1/pods", pod("l", "l4", "10.0.0.3", devices={"nvidia.com/gpu": "1"}))
    _put(cluster, "v1/pods", {**pod("x", "l4", "10.0.0.9"), "metadata": {"name": "x", "namespace": NS, "uid": "x"}})
    seen: list[dict[str, list[Endpoint]]] = []
    synced: list[bool] = []
    watcher = InferencePoolWatcher(namespace=NS, pool_name="chat", models=[MODEL], default_model=MODEL,
                                   on_change=seen.append, on_synced=synced.append)
    watcher.start(asyncio.get_running_loop())
    try:
        await _until(lambda: bool(seen) and synced == [True])
        assert {e.url: (e.accelerator, e.tp) for e in seen[-1][MODEL]} == {
            "http://10.0.0.1:8000": ("h100-sxm", 1), "http://10.0.0.2:8000": ("a100-80gb", 2),
            "http://10.0.0.3:8000": ("l4", 1)}

        core = kubernetes.client.CoreV1Api()
        await asyncio.to_thread(core.create_namespaced_pod, NS, pod("m", "mi300x", "10.0.0.4",
                                                                    devices={"amd.com/gpu": "1"}))
        await _until(lambda: len(seen[-1][MODEL]) == 4)
        assert seen[-1][MODEL][-1] == Endpoint("http://10.0.0.4:8000", MODEL, "mi300x")
    finally:
        watcher.stop()


@pytest.mark.asyncio
@pytest.mark.timeout(20)
async def test_the_watcher_is_not_ready_without_its_pool(cluster: Any, caplog: pytest.LogCaptureFixture) -> None:
    synced: list[bool] = []
    watcher = InferencePoolWatcher(namespace=NS, pool_name="absent", models=[MODEL], default_model=None,
                                   on_change=lambda found: None, on_synced=synced.append)
    with caplog.at_level(logging.ERROR, logger="hetsched.router.pool"):
        watcher.start(asyncio.get_running_loop())
        try:
            await _until(lambda: synced == [False])
        finally:
            watcher.stop()
    assert f"InferencePool {NS}/absent not found: is the InferencePool CRD (inference.networking.k8s.io/v1) " \
           "installed" in caplog.text
