"""The planner page end to end in headless Chromium (Debian's, never a downloaded one) driven by Playwright.

The app is served by uvicorn on an ephemeral port with a deterministic
capacity source; the test sets a scenario through the form, solves, and
checks the table, the cost charts and the MIG drawing against the stored plan.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml

from hetsched.optimizer.plan import GpuMode, Plan
from hetsched.optimizer.spec import ClusterSpec
from hetsched.settings import Settings, StoreSettings
from hetsched.store import open_store
from hetsched.store.tables import CapacityRow
from hetsched.web import create_app
from web_support import scaled_capacity

CHROMIUM = Path(os.environ.get("HETSCHED_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install -e '.[dev]')")
pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM}: install Debian's "
                                "'chromium' package (.ci/run does) or set HETSCHED_TEST_CHROMIUM")


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'web.sqlite'}"


@pytest.fixture
def server(database_url: str) -> Iterator[str]:
    """The planner on 127.0.0.1 at an ephemeral port, on a fresh SQLite store."""
    app = create_app(Settings(store=StoreSettings(database_url=database_url)), capacity_source=scaled_capacity)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(5)
        sock.close()


@pytest.fixture
def page(tmp_path: Path) -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True,
            accept_downloads=True, viewport={"width": 1280, "height": 900})
        context.set_default_timeout(15_000)
        try:
            yield context.new_page()
        finally:
            context.close()


def _fill_model(row, *, name: str, rate: float, prompt: int, output: int, ttft: float, tpot: float) -> None:
    row.locator("select[name=model]").select_option(name)
    for field, value in (("rate", rate), ("input", prompt), ("output", output), ("ttft", ttft), ("tpot", tpot)):
        row.locator(f"input[name={field}]").fill(str(value))


def test_plan_a_scenario_in_the_browser(server: str, page) -> None:
    page.goto(server)
    page.wait_for_selector("body[data-ready=true]")

    # every control of the scenario form has an accessible name
    unnamed = page.evaluate("""() => Array.from(document.querySelectorAll('#scenario input, #scenario select'))
        .filter(e => !e.getAttribute('aria-label') && !(e.id && document.querySelector(`label[for="${e.id}"]`)))
        .map(e => e.outerHTML)""")
    assert unnamed == []

    # scenario: two models, an H100 node that may be split with MIG, an L40S node
    models = page.locator("#models tbody tr")
    _fill_model(models.nth(0), name="llama-3.1-8b", rate=1, prompt=1024, output=256, ttft=1000, tpot=100)
    page.get_by_role("button", name="Add a model").click()
    _fill_model(models.nth(1), name="qwen3-0.6b", rate=2, prompt=512, output=128, ttft=1000, tpot=100)
    pools = page.locator("#pools tbody tr")
    assert pools.count() == 2
    pools.nth(0).locator("select[name=accelerator]").select_option("h100-sxm")
    pools.nth(0).locator("input[name=nodes]").fill("1")
    pools.nth(0).locator("input[name=mig]").check()
    pools.nth(1).locator("select[name=accelerator]").select_option("l40s")
    pools.nth(1).locator("input[name=nodes]").fill("1")
    page.locator("#plan-name").fill("browser")

    # solve from the keyboard: Enter in a field submits the form
    models.nth(1).locator("input[name=tpot]").press("Enter")
    page.wait_for_selector("#solve-status.ok")
    assert "plan #1" in page.locator("#solve-status").inner_text()
    stored = httpx.get(f"{server}/api/plans/1").json()
    plan = Plan.model_validate(stored["plan"])
    assert stored["spec"]["models"][1]["workload"]["rate_rps"] == 2
    assert [p["partition_allowed"] for p in stored["spec"]["pools"]] == [True, False]

    # the table: one row per replica group of the stored plan
    rows = page.locator("#plan-table tbody tr")
    shown = {tuple(rows.nth(i).locator("th, td").all_inner_texts()[:6]) for i in range(rows.count())}
    expected = {(g.model, g.role.value, g.pool, g.device, str(g.tp), str(g.replicas))
                for m in plan.models for g in m.replicas}
    assert shown == expected and expected

    # the charts: one bar per pool and per model, with the plan's costs
    def bars(chart: str) -> dict[str, float]:
        groups = page.locator(f"{chart} g.bar")
        return {groups.nth(i).get_attribute("data-label"): float(groups.nth(i).get_attribute("data-value"))
                for i in range(groups.count())}

    assert bars("#chart-models") == pytest.approx(plan.cost_by_model, abs=1e-3)
    assert bars("#chart-pools") == pytest.approx({f"{p.pool} ({p.accelerator})": p.cost_per_hour for p in plan.pools},
                                                 abs=1e-3)

    # the MIG drawing: one bar per split GPU, one box per instance at its start slice
    mig_gpus = [(n, g) for n in plan.nodes for g in n.gpus if g.mode is GpuMode.MIG]
    assert mig_gpus, "this scenario is cheapest with MIG slices"
    drawings = page.locator("#mig svg.gpu")
    assert drawings.count() == len(mig_gpus)
    for node, gpu in mig_gpus:
        drawing = page.locator(f'#mig svg.gpu[data-node="{node.name}"][data-gpu="{gpu.index}"]')
        boxes = drawing.locator("g.instance")
        drawn = {(boxes.nth(i).get_attribute("data-profile"), int(boxes.nth(i).get_attribute("data-start")),
                  boxes.nth(i).get_attribute("data-model")) for i in range(boxes.count())}
        assert drawn == {(i.profile, i.start, i.model or "") for i in gpu.instances}
        slots = drawing.locator("rect.slots")
        slot_w = float(slots.get_attribute("width")) / 8  # an H100 has 8 memory slices
        left = float(slots.get_attribute("x"))
        for i in range(boxes.count()):
            start = int(boxes.nth(i).get_attribute("data-start"))
            assert float(boxes.nth(i).locator("rect").get_attribute("x")) == pytest.approx(left + start * slot_w + 1)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-planner.png"), full_page=True)

    # what-if: more demand for one model, compared against plan 1
    page.get_by_label("llama-3.1-8b: requests/s").fill("12")
    page.get_by_label("h100: MIG allowed").uncheck()
    page.get_by_role("button", name="Compare").click()
    page.wait_for_selector("#diff-headline")
    what_if = httpx.get(f"{server}/api/plans/2").json()
    assert what_if["note"] == "what-if of plan 1: demand llama-3.1-8b=12; mig h100=off"
    headline = page.locator("#diff-headline").inner_text()
    assert f"${plan.cost_per_hour:,.2f} → ${what_if['plan']['cost_per_hour']:,.2f}" in headline
    assert page.locator("#diff-replicas tbody tr").count() >= 1
    page.screenshot(path=str(ARTIFACTS / "web-planner-what-if.png"), full_page=True)

    # download the custom resources of plan 1
    with page.expect_download() as download:
        page.get_by_role("link", name="Download custom resources (YAML)").click()
    documents = list(yaml.safe_load_all(Path(download.value.path()).read_text()))
    assert [d["kind"] for d in documents].count("ModelDeployment") == 2
    assert Plan.model_validate(documents[-1]["spec"]["plan"]) == plan

    # history lists both plans; a 422 points at the field
    assert page.locator("#history tbody tr").count() == 2
    models.nth(0).locator("input[name=ttft]").fill("-5")
    page.get_by_role("button", name="Solve").click()
    page.wait_for_selector("#solve-status.error")
    assert "spec.models[0].slo.ttft_ms" in page.locator("#solve-status").inner_text()
    assert page.locator("#models tbody tr").nth(0).locator("input[name=ttft]").get_attribute("aria-invalid") == "true"


def test_a_cluster_file_loads_into_the_form_and_solves_unchanged(server: str, database_url: str, page) -> None:
    store = open_store(database_url)
    with store.transaction() as session:
        session.add(CapacityRow(key="k" * 64, model="qwen3-8b", device="l4", tp=1, requests_per_s=3.25,
                                inputs={}, result={}))
    store.engine.dispose()
    example = Path(__file__).parent.parent / "examples" / "chat.yaml"
    page.goto(server)
    page.wait_for_selector("body[data-ready=true]")
    page.get_by_text("Profiles and cached capacities").click()
    page.wait_for_selector("#capacity-cache tbody tr >> text=qwen3-8b")
    assert page.locator("#capacity-cache tbody tr").first.locator("td").all_inner_texts()[:4] == ["qwen3-8b", "l4", "1", "3.25"]
    assert page.locator("#profiles tbody").inner_text() == "None yet."
    page.locator("#load-file").set_input_files(str(example))
    page.wait_for_selector("#solve-status.ok")
    assert page.locator("#models tbody tr").count() == 2 and page.locator("#pools tbody tr").count() == 3
    assert page.locator("#capacities-box").get_attribute("open") is not None
    assert page.locator("#models tbody tr").nth(0).locator("input[name=input]").is_disabled()
    page.get_by_role("button", name="Solve").click()
    page.wait_for_selector("#solve-status.ok >> text=plan #1")
    stored = httpx.get(f"{server}/api/plans/1").json()
    assert ClusterSpec.model_validate(stored["spec"]) == ClusterSpec.model_validate(yaml.safe_load(example.read_text()))

    # upload a config.json; every model picker offers it at once
    page.get_by_text("Upload a model config").click()
    page.get_by_label("Name", exact=True).fill("my-small")
    page.get_by_label("config.json").set_input_files(
        str(Path(__file__).parent.parent / "hetsched" / "specs" / "models" / "qwen3-0.6b.json"))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_selector("#upload-status.ok")
    assert "my-small" in page.locator("#upload-status").inner_text()
    uploaded = page.locator('#models tbody tr select[name=model] optgroup[label="Uploaded"] option')
    assert uploaded.count() == 2 and uploaded.first.get_attribute("value") == "my-small"


def test_a_melange_file_with_a_gpu_the_catalog_lacks_and_no_slo_solves_unchanged(server: str, page,
                                                                                  tmp_path: Path) -> None:
    melange = json.loads((Path(__file__).parent.parent / "examples" / "melange-profile.json").read_text())
    melange["gpu_info"]["RTX-PRO-6000"] = {"cost": 1.5, "tputs": [[9.0, 4.0, 1.5], [4.0, 2.0, 1.0], [1.0, 0.6, 0.3]]}
    melange.pop("slo", None)
    file = tmp_path / "melange-rtx.json"
    file.write_text(json.dumps(melange))
    parsed = httpx.post(f"{server}/api/specs/parse", json={"text": file.read_text(), "filename": file.name}).json()
    assert parsed["accelerators"] and all(m.get("slo") is None for m in parsed["models"])
    page.goto(server)
    page.wait_for_selector("body[data-ready=true]")
    page.locator("#load-file").set_input_files(str(file))
    page.wait_for_selector("#solve-status.ok")
    page.get_by_role("button", name="Solve").click()
    page.wait_for_selector("#solve-status.ok >> text=plan #1")
    stored = httpx.get(f"{server}/api/plans/1").json()
    assert ClusterSpec.model_validate(stored["spec"]) == ClusterSpec.model_validate(parsed)


def test_amd_partitions_are_drawn_and_their_profiles_downloaded(server: str, page) -> None:
    slo = {"ttft_ms": 1000, "tpot_ms": 100}
    spec = {"name": "amd", "pools": [{"name": "mi300x", "accelerator": "mi300x", "nodes": 1, "mig_allowed": True}],
            "models": [{"name": "qwen3-0.6b", "slo": slo,
                        "workload": {"rate_rps": 6.0, "input_tokens": 512, "output_tokens": 128}}],
            "capacities": [{"model": "qwen3-0.6b", "device": "mi300x", "requests_per_s": 5.0},
                           {"model": "qwen3-0.6b", "device": "mi300x:cpx_nps1", "requests_per_s": 4.0}]}
    stored = httpx.post(f"{server}/api/plans", json={"spec": spec}).json()
    plan = Plan.model_validate(stored["plan"])
    [(node, gpu)] = [(n, g) for n in plan.nodes for g in n.gpus if g.mode is GpuMode.PARTITIONED]

    page.goto(server)
    page.wait_for_selector("body[data-ready=true]")
    assert not page.get_by_role("link", name="Download AMD partition profiles (JSON)").is_visible()
    page.get_by_role("button", name=f"Open plan {stored['id']}").click()
    drawing = page.locator(f'#mig svg.gpu[data-node="{node.name}"][data-gpu="{gpu.index}"]')
    drawing.wait_for()
    boxes = drawing.locator("g.instance")
    drawn = {(boxes.nth(i).get_attribute("data-profile"), int(boxes.nth(i).get_attribute("data-start")),
              boxes.nth(i).get_attribute("data-model")) for i in range(boxes.count())}
    assert drawn == {(i.profile, i.start, i.model or "") for i in gpu.instances} and len(drawn) == 8
    assert node.partition_profile in page.locator("#mig figcaption").inner_text()

    with page.expect_download() as download:
        page.get_by_role("link", name="Download AMD partition profiles (JSON)").click()
    profiles = json.loads(Path(download.value.path()).read_text())["gpu-config-profiles"]
    assert profiles[node.partition_profile]["profiles"] == [
        {"computePartition": "CPX", "memoryPartition": "NPS1", "numGPUsAssigned": 8}]
