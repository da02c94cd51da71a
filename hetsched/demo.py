"""``make demo``: the most complete path hetsched has, on embedded defaults."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from pathlib import Path

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hetsched.autoscale.fleet import build_fleet
from hetsched.autoscale.policy import Reason, ReplicaCount, ScaleState, decide
from hetsched.autoscale.replan import replan
from hetsched.autoscale.window import ModelSignals, PodCounts
from hetsched.backends import BackendKind
from hetsched.catalog import Device, load_catalog
from hetsched.catalog.host import read_host
from hetsched.cli.output import console, print_table
from hetsched.cli.web import planner_url
from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.errors import BackendUnavailableError
from hetsched.operator.handlers import default_solver
from hetsched.operator.inventory import pool_inventory
from hetsched.operator.planning import bind_nodes, planning_input
from hetsched.operator.manifests import deployment_name
from hetsched.operator.objects import Observed
from hetsched.operator.reconcile import reconcile
from hetsched.operator.resources import AcceleratorPoolSpec, PartitionPolicy
from hetsched.optimizer.load import load_cluster
from hetsched.optimizer.optimize import optimize
from hetsched.optimizer.render import plan_view
from hetsched.optimizer.spec import ClusterSpec, Role
from hetsched.perf.calibrate import calibrate, errors
from hetsched.perf.memory import smallest_fit
from hetsched.perf.roofline import RooflineModel
from hetsched.profiler.compare import step_table
from hetsched.profiler.calibration import profile_samples
from hetsched.profiler.driver import profile_kernels
from hetsched.profiler.roofline_source import constants_from_profile
from hetsched.profiler.vidur import VidurFile, profiles_from_vidur
from hetsched.router.app import create_router_app
from hetsched.router.config import parse_router_config
from hetsched.router.state import RouterState
from hetsched.router.types import EngineSignals, RouteRequest
from hetsched.settings import Settings
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.sim.capacity import find_capacity
from hetsched.simworker import WorkerSpec, serve_in_thread, start_worker_thread
from hetsched.simworker.launch import free_port
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO, Workload

DEMO_MODELS = ("qwen3-0.6b", "llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b", "llama-3.1-70b", "deepseek-v3")


def show_fit_matrix(context: int = 8192) -> None:
    """Smallest TP and KV capacity of several bundled models on every catalog accelerator."""
    models = [load_model(name) for name in DEMO_MODELS]
    rows = []
    for acc in load_catalog().accelerators.values():
        row: list[object] = [acc.id]
        for model in models:
            f = smallest_fit(model, Device.whole(acc), context_len=context)
            row.append(f"TP{f.tp} {f.max_kv_tokens / 1000:,.0f}k" if f.fits else "—")
        rows.append(row)
    print_table(f"Smallest TP and KV tokens per replica ({context}-token context)",
                ["accelerator", *DEMO_MODELS], rows)


def show_capacities(model_name: str = "qwen3-0.6b", accelerators: tuple[str, ...] = ("t4", "l4", "h100-sxm")) -> None:
    """Simulated SLO capacity of one replica of a small model on a few accelerators."""
    model, catalog, slo, workload = load_model(model_name), load_catalog(), SLO(ttft_ms=500, tpot_ms=50), Workload.chat()
    rows = []
    for acc_id in accelerators:
        acc = catalog.accelerators[acc_id]
        cap = find_capacity(model, Device.whole(acc), workload=workload, slo=slo)
        rows.append([acc_id, cap.requests_per_s, str(cap.binding), round(cap.ttft_ms.p99), cap.tpot_ms.p99,
                     cap.dollars_per_million_requests(acc.price_per_hour)])
    print_table(f"Capacity of one {model_name} replica (chat workload, P99 TTFT ≤ 500 ms, TPOT ≤ 50 ms)",
                ["accelerator", "req/s", "binding", "TTFT P99 ms", "TPOT P99 ms", "$ / 1M req"], rows)


def show_plan(example: str = "mig-small-models.yaml") -> None:
    """The placement optimizer on an example cluster file: four models, MIG-capable H100/A100 pools and L4s."""
    path = Path(__file__).resolve().parent.parent / "examples" / example
    console.rule(f"[bold]placement plan for examples/{example}")
    console.print(plan_view(optimize(load_cluster(path))))
    console.print(f"  yourself: [bold].venv/bin/hetsched plan examples/{example} --partition-config-out mig/[/]")


def show_operator_objects() -> None:
    """What the Kubernetes operator would create for two ModelDeployments on two labelled H100 nodes."""
    catalog = load_catalog()
    nodes = [{"metadata": {"name": f"gpu-{i}", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
        "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed"}}} for i in (1, 2)]
    pool = pool_inventory("h100", AcceleratorPoolSpec(node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                                                      partitioning=PartitionPolicy.ALLOWED), nodes, catalog)
    models = [{"metadata": {"name": name, "namespace": "inference", "uid": name}, "spec": {
        "model": model, "engine": {"image": "vllm/vllm-openai:v0.11.0"}, "slo": {"ttft": "500ms", "tpot": "50ms"},
        "workload": {"rateRps": rate, "inputTokens": 512, "outputTokens": 128}}}
        for name, model, rate in (("chat", "llama-3.1-8b", 20.0), ("tiny", "qwen3-0.6b", 2.0))]
    planning = planning_input(models, [pool])
    assert planning.spec is not None, planning.problem
    plan = bind_nodes(default_solver(planning.spec, None), [pool])
    desired = reconcile(plan, Observed(nodes=nodes), models=planning.models, pools=[pool], catalog=catalog)
    deployments = {d["metadata"]["name"]: d for d in desired.deployments}
    rows = []
    for key, outcome in desired.models.items():
        for entry in outcome.placement:
            device = f"{entry.accelerator}:{entry.profile}" if entry.profile else entry.accelerator
            dep = deployments[deployment_name(planning.models[key].name, entry.pool, device, entry.tp, Role(entry.role))]
            pod = dep["spec"]["template"]["spec"]
            gpu = {k: v for k, v in pod["containers"][0]["resources"]["requests"].items() if "/" in k}
            hosts = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            rows.append([dep["metadata"]["name"], f"{dep['spec']['replicas']}/{entry.replicas}",
                         ", ".join(f"{k}={v}" for k, v in gpu.items()),
                         ", ".join(hosts["nodeSelectorTerms"][0]["matchExpressions"][0]["values"])])
    print_table(f"Operator: Deployments for the plan (${plan.cost_per_hour:.2f}/h)",
                ["deployment", "replicas now/planned", "requests", "nodes"], rows)
    for node, labels in sorted(desired.node_labels.items()):
        console.print(f"node {node}: set {labels}; replicas start there at nvidia.com/mig.config.state=success")


def show_measured_profile(model_name: str = "qwen3-0.6b") -> None:
    """Profile a small model's operators on this CPU (quick sweep) and set the result next to the roofline."""
    model, engine = load_model(model_name), EngineConfig(max_num_batched_tokens=2048)
    try:
        with Progress(TextColumn(f"profiling {model_name} on this CPU"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn(), console=console, transient=True) as progress:
            task = progress.add_task("sweep", total=None)
            profile = profile_kernels(model, backend=BackendKind.CPU, quick=True, engine=engine, cpu_threads=1,
                                      host_clock="process",
                                      on_plan=lambda plan: progress.update(task, total=len(plan.points)),
                                      on_result=lambda _result: progress.advance(task))
    except BackendUnavailableError as exc:
        console.print(f"[yellow]measured profile skipped:[/] {exc}")
        return
    # One thread timed in CPU time holds steady on a busy shared host; the roofline is for one core to match.
    one_core = dataclasses.replace(read_host(), cores=1)
    device = Device.whole(load_catalog().get("cpu", host=one_core))
    roofline = RooflineModel(model, device, engine=engine)
    calibrated = RooflineModel(model, device, engine=engine, constants=constants_from_profile(profile, target=device))
    rows = [[t.label, round(t.ms[0]), round(t.ms[1]), round(t.ms[2]), t.ms[0] / t.ms[2]]
            for t in step_table({"measured": profile, "shipped": roofline, "calibrated": calibrated})]
    print_table(f"{model_name} on one core of this CPU: measured profile "
                f"({profile.provenance.duration_s:.0f} s quick sweep, "
                f"{sum(len(t.points) for t in profile.tables)} points) vs the step model, shipped and calibrated to it "
                "(ratio: measured / calibrated)",
                ["step", "measured ms", "shipped", "calibrated", "ratio"], rows,
                caption="store one with: hetsched profile qwen3-0.6b --backend cpu --quick; then: hetsched calibrate cpu")


def show_step_model_accuracy(root: Path = Path("data/measurements/vidur/a100")) -> None:
    """Fit the A100's step-model constants to real timings of two models and score a third it never saw."""
    names = ("ops/Llama-2-7b-hf.csv", "ops/CodeLlama-34b-Instruct-hf.csv", "network/a100_dgx-all_reduce.csv")
    try:
        fitted_files = [VidurFile(name, (root / name).read_text()) for name in names]
        held_out = [VidurFile("ops/Meta-Llama-3-8B.csv", (root / "ops/Meta-Llama-3-8B.csv").read_text())]
    except OSError as exc:
        console.print(f"[yellow]step model accuracy skipped:[/] {exc.strerror}: {exc.filename}")
        return
    device = Device.whole(load_catalog().get("a100-80gb"))
    base = device.accelerator.perf
    assert base is not None
    fit = calibrate(profile_samples(profiles_from_vidur(fitted_files)), device=device, base=base,
                    source="demo fit on Llama-2-7B and CodeLlama-34B")
    scored = errors(profile_samples(profiles_from_vidur(held_out)), fit.constants, device)
    print_table("Step model against real A100 timings (Vidur): fitted on Llama-2-7B and CodeLlama-34B, "
                "scored on Llama-3-8B (TP 1–8, 1–32k tokens)",
                ["operator class", "points", "median |error|", "P90 |error|", "median error"],
                [[str(op), s.count, f"{s.median_abs:.1%}", f"{s.p90_abs:.1%}", f"{s.median_signed:+.1%}"]
                 for op, s in scored.items()],
                caption="all models, attention and collectives: .venv/bin/python benchmarks/model_accuracy.py")


def show_routing(model: str = "llama-3.1-8b") -> None:
    """The router's slo policy: its predictions for one request, then live traffic over simulated workers."""
    accelerators = ("h100-sxm", "a100-80gb", "l4")
    workers = [start_worker_thread(WorkerSpec(model=model, accelerator=acc)) for acc in accelerators]
    config = parse_router_config({"metrics_interval_s": 0.2, "models": {model: {
        "slo": {"ttft_ms": 1000, "tpot_ms": 100},
        "endpoints": [{"url": w.url, "accelerator": acc} for w, acc in zip(workers, accelerators, strict=True)]}}})

    state = RouterState(config)
    state.set_endpoints(model, config.static_endpoints())
    request = RouteRequest(model, prompt_tokens=1000, max_tokens=200)
    rows = []
    for busy in (0, 120, 220):
        for _ in range(busy - state.get(workers[0].url).in_flight):
            state.start(workers[0].url, request)
        state.record_signals(workers[0].url, EngineSignals(scraped_at=0.0, running=busy, waiting=0, kv_usage=0.3))
        decision = state.decide(request, now=0.0)
        for worker, acc in zip(workers, accelerators, strict=True):
            p = decision.predictions[worker.url]
            rows.append([f"{busy} on h100", acc, p.ttft_s * 1e3, p.tpot_s * 1e3, p.cost_per_token * 1e6,
                         "yes" if p.meets_slo else "no", "<-" if decision.endpoint is not None and decision.endpoint.url == worker.url else ""])
    print_table("slo policy: predictions for a 1000-token prompt, 200 out (SLO TTFT 1000 ms, TPOT 100 ms, "
                "80 % headroom)", ["load", "endpoint", "TTFT ms", "TPOT ms", "$ / 1M tokens", "meets", "chosen"],
                rows)

    router = serve_in_thread(create_router_app(config))

    ids = itertools.count()  # a prompt of its own each: the workers' prefix caches hit nothing

    async def one(client: httpx.AsyncClient) -> tuple[str, float, float]:
        started = time.monotonic()
        arrivals: list[float] = []
        body = {"model": model, "prompt": f"request {next(ids)}: " + "word " * 400, "max_tokens": 32,
                "stream": True}
        async with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic() - started)
            return (response.headers["x-hetsched-endpoint"], arrivals[0],
                    (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))

    async def traffic() -> list[tuple[str, float, float]]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = []
            for _ in range(40):
                tasks.append(asyncio.create_task(one(client)))
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(traffic())
    finally:
        router.stop()
        for worker in workers:
            worker.stop()
    rows = []
    for worker, acc in zip(workers, accelerators, strict=True):
        mine = [r for r in results if r[0] == worker.url]
        rows.append([acc, len(mine), max((r[1] * 1e3 for r in mine), default=0.0),
                     max((r[2] * 1e3 for r in mine), default=0.0)])
    print_table(f"Live: 40 streamed {model} requests at 20/s through the router to simulated workers",
                ["accelerator", "requests", "max TTFT ms", "max TPOT ms"], rows,
                caption="yourself: hetsched sim-pool --config examples/router-local.yaml & "
                        "hetsched route --config examples/router-local.yaml")


PICKS_PER_S = 100.0
"""The endpoint picker step's pace: about what the demo's three workers prefill of its 1000-token prompts."""


def show_endpoint_picker(model: str = "llama-3.1-8b") -> None:
    """``hetsched epp``: the same picker behind a Gateway API gateway, asked over Envoy's ext_proc stream."""
    import grpc
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

    from hetsched.router.epp import DESTINATION_HEADER, EppServer
    from hetsched.router.h1 import H1Upstream
    from hetsched.router.picker import Picker
    from hetsched.router.types import Front

    accelerators = ("h100-sxm", "a100-80gb", "l4")
    workers = [start_worker_thread(WorkerSpec(model=model, accelerator=acc)) for acc in accelerators]
    by_address = {w.url.removeprefix("http://"): acc for w, acc in zip(workers, accelerators, strict=True)}
    config = parse_router_config({"models": {model: {"slo": {"ttft_ms": 1000, "tpot_ms": 100}, "endpoints": [
        {"url": w.url, "accelerator": acc} for w, acc in zip(workers, accelerators, strict=True)]}}})
    head = pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in (
        (":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))]))
    body = f'{{"model": "{model}", "prompt": "{"word " * 1000}", "max_tokens": 200}}'.encode()

    async def ask() -> list[list[object]]:
        """Requests whose answers have not begun: each holds its place, so the picks spread as load grows. They are
        sent :data:`PICKS_PER_S` a second: as fast as the picker answers, their prompts would come faster than any
        endpoint prefills them, and every prediction would miss the SLO."""
        server = EppServer(Picker(config, front=Front.EPP, host=read_host()), upstream=H1Upstream(connect_timeout_s=2.0),
                           host="127.0.0.1", port=0, health_port=0)
        await server.start()
        rows: list[list[object]] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub, streams = ExternalProcessorStub(channel), []
                begun = time.perf_counter()
                for n in range(1, 301):
                    await asyncio.sleep(max(begun + n / PICKS_PER_S - time.perf_counter(), 0.0))
                    stream = stub.Process()
                    await stream.write(pb.ProcessingRequest(request_headers=head))
                    started = time.perf_counter()
                    await stream.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
                    answer = await stream.read()
                    took = time.perf_counter() - started
                    streams.append(stream)
                    picked = next(h.header.raw_value.decode() for h in
                                  answer.request_headers.response.header_mutation.set_headers
                                  if h.header.key == DESTINATION_HEADER).split(",")
                    if n in (1, 100, 200, 230, 260, 300):
                        rows.append([n, " → ".join(by_address[p] for p in picked), took * 1e3])
                for stream in streams:
                    stream.cancel()
        finally:
            await server.stop(0)
        return rows

    try:
        rows = asyncio.run(ask())
    finally:
        for worker in workers:
            worker.stop()
    print_table(f"Endpoint picker: the nth {model} request in flight (1000 prompt tokens, 200 out, "
                f"{PICKS_PER_S:g} a second) and its pick with fallbacks",
                ["in flight", "x-gateway-destination-endpoint", "pick ms"], rows,
                caption="yourself: hetsched epp --config examples/router-local.yaml (docs/epp.md)")


def show_autoscaling() -> None:
    """The autoscaler's decisions on a 3x burst and the quiet after it, then a re-solve (replicas Ready at once)."""
    model = "llama-3.1-8b"
    spec = ClusterSpec.model_validate({
        "pools": [{"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "max_gpus": 1},
                  {"name": "l40s", "accelerator": "l40s", "nodes": 1, "max_gpus": 4},
                  {"name": "a10g", "accelerator": "a10g", "nodes": 1, "max_gpus": 4}],
        "models": [{"name": model, "slo": {"ttft_ms": 1000, "tpot_ms": 60}, "min_replicas": 1,
                    "workload": {"rate_rps": 8, "input_tokens": 512, "output_tokens": 256}}],
        "capacities": [{"model": model, "device": "h100-sxm", "requests_per_s": 33},
                       {"model": model, "device": "l40s", "requests_per_s": 8},
                       {"model": model, "device": "a10g", "requests_per_s": 1}]})
    fleet = build_fleet(spec, load_catalog())
    settings, state = AutoscaleSettings(), ScaleState()
    placement: dict[OptionKey, ReplicaCount] = {}
    rows = []
    for now in range(0, 1500, 5):
        rate = 36.0 if 120 <= now < 300 else 12.0 if now < 300 else 4.0
        stable = rate if now >= 360 or now < 120 else 12.0 + (rate - 12.0) * min(1.0, (now - 120) / 60)
        signals = {model: ModelSignals(model, stable, rate, stable * 60, 512, 256, None, None, 0, 0, None, None, None,
                                       PodCounts(fresh=sum(c.desired for c in placement.values()),
                                                 fresh_by_key={k: c.desired for k, c in placement.items()}))}
        decision, state = decide(signals, placement, fleet=fleet, settings=settings, now=float(now), state=state)
        if decision.replan_due and (target := replan(fleet, decision, placement, settings=settings)) is not None:
            state = state.following(target, now=float(now))
        placement = {k: ReplicaCount(n, n) for k, n in decision.desired.items()}
        verdict = decision.model(model)
        if verdict.reason is not Reason.STEADY:
            rows.append([f"{now} s", f"{rate:.0f}", verdict.reason.value,
                         ", ".join(f"{n}x {k.device}" for k, n in sorted(decision.desired.items()) if n),
                         f"{verdict.unmet_rps:.1f}"])
    print_table("autoscaler: 12 req/s, a 3x burst at 2 min, quiet from 5 min",
                ["time", "req/s", "reason", "replicas", "unmet req/s"], rows)
    console.print("  live: [bold].venv/bin/hetsched autoscale --config examples/autoscale-local.yaml[/]")


def show_web_planner() -> None:
    """Where to go next: the planner page, on the same embedded store."""
    settings = Settings.from_env()
    console.rule("[bold]web placement planner")
    console.print("Plan interactively: choose models, load and SLOs, set the inventory, press Solve, try what-ifs.")
    console.print(f"  start it:  [bold].venv/bin/hetsched web --port {settings.web.port}[/]")
    console.print(f"  then open: [bold]{planner_url(settings.web.host, settings.web.port)}[/]"
                  f"  (store: {settings.store.resolved_url()})")


def show_flow_control(model: str = "llama-3.1-8b") -> None:
    """Flow control: while a model is saturated, its requests wait and leave by class priority, then tenant by
    tenant in fair shares of tokens, whatever order they came in."""
    from hetsched.router.openai import ApiKind
    from hetsched.router.picker import FAIRNESS_HEADER, OBJECTIVE_HEADER, Picker
    from hetsched.router.types import Front

    config = parse_router_config({"models": {model: {
        "slo": {"ttft_ms": 60_000, "tpot_ms": 1000}, "policy": "least-request",
        "objectives": [{"name": "interactive", "priority": 10, "slo": {"ttft_ms": 60_000, "tpot_ms": 1000}},
                       {"name": "batch", "sheddable": True, "slo": {"ttft_ms": 60_000, "tpot_ms": 1000}}],
        "endpoints": [{"url": "http://10.0.0.1:8000", "accelerator": "h100-sxm", "max_concurrency": 1}]}}})
    body = f'{{"model": "{model}", "prompt": "{"word " * 200}", "max_tokens": 64}}'.encode()
    arrivals = [("batch", "flood")] * 6 + [("batch", "team-a"), ("batch", "team-b"), ("interactive", "team-a"),
                                          ("batch", "team-a"), ("interactive", "team-b")]

    async def run() -> list[list[object]]:
        picker = Picker(config, front=Front.HTTP, host=read_host())
        held = picker.route_request(body, ApiKind.COMPLETIONS, {})
        decision = await picker.admit(held)
        assert decision.endpoint is not None
        ticket, endpoint = picker.start(decision.endpoint, held), decision.endpoint
        order: list[list[object]] = []

        async def wait(n: int, objective: str, tenant: str) -> None:
            route = picker.route_request(body, ApiKind.COMPLETIONS, {OBJECTIVE_HEADER: objective,
                                                                     FAIRNESS_HEADER: tenant})
            await picker.admit(route)
            order.append([len(order) + 1, n, objective, tenant])
            nonlocal ticket
            ticket = picker.start(endpoint, route)

        tasks = []
        for n, (objective, tenant) in enumerate(arrivals, 1):
            tasks.append(asyncio.create_task(wait(n, objective, tenant)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        while len(order) < len(arrivals):  # the endpoint finishes one request at a time
            picker.finish(ticket, endpoint)
            count = len(order)
            while len(order) == count:
                await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        return order

    print_table(f"Flow control: {model} saturated (one slot), {len(arrivals)} requests waiting; the order they leave in",
                ["left", "arrived", "class", "tenant"], asyncio.run(run()),
                caption="interactive (priority 10) first; batch by tenant in fair shares, so the flood's six "
                        "alternate with the others (docs/router.md, Flow control)")


def show_closed_loop(model: str = "llama-3.1-8b") -> None:
    """Predictions that correct themselves: one worker runs 1.4x slower than its catalog says; the router learns it
    from the requests it serves and predicts with the correction once it trusts it."""
    import random

    fleet = (("h100-sxm", 1.0), ("a100-80gb", 1.4))
    scale = 4.0
    workers = [start_worker_thread(WorkerSpec(model=model, accelerator=acc, time_scale=scale, slowdown_prefill=slow,
                                              slowdown_decode=slow)) for acc, slow in fleet]
    config = parse_router_config({"policy": "least-request", "time_scale": scale, "metrics_interval_s": 0.2,
                                  "models": {model: {"slo": {"ttft_ms": 2000, "tpot_ms": 200}, "endpoints": [
                                      {"url": w.url, "accelerator": acc} for w, (acc, _) in zip(workers, fleet)]}}})
    router = serve_in_thread(create_router_app(config))
    rng = random.Random(3)

    async def traffic() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one() -> None:
                body = {"model": model, "prompt": f"{rng.random()} " + "word " * rng.randint(50, 1500),  # its own prefix
                        "max_tokens": rng.randint(16, 96), "stream": True}
                async with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass
            tasks = []
            for _ in range(500):
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(rng.expovariate(40.0))
            await asyncio.gather(*tasks)

    try:
        asyncio.run(traffic())
        endpoints = httpx.get(f"{router.url}/router/endpoints", timeout=10).json()["endpoints"]
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    finally:
        router.stop()
        for worker in workers:
            worker.stop()
    ratios = {(line.split('accelerator="')[1].split('"')[0], line.split('metric="')[1].split('"')[0]):
              float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("hetsched_router_prediction_error_ratio{")}
    rows = []
    for (acc, slow), entry in zip(fleet, sorted(endpoints, key=lambda e: [a for a, _ in fleet].index(e["accelerator"]))):
        c = entry["step_correction"]
        rows.append([acc, f"x{slow:g}", f"x{c['prefill_scale']:.2f}", f"x{c['decode_scale']:.2f}",
                     f"{ratios.get((acc, 'ttft'), float('nan')):.2f}", f"{ratios.get((acc, 'tpot'), float('nan')):.2f}"])
    print_table(f"Closed loop: 500 {model} requests through the router; what it learned of each worker's step model",
                ["accelerator", "true speed", "prefill correction", "decode correction", "predicted/observed TTFT",
                 "TPOT"], rows,
                caption="the a100 worker runs 1.4x slower than the catalog (sim-worker --slowdown 1.4); a correction "
                        "is in force once trusted (docs/perf.md, Online recalibration)")


def _engine_prefix_counts(url: str) -> tuple[float, float]:
    """An engine's ``vllm:prefix_cache_queries`` and ``_hits`` (tokens) from its ``/metrics``."""
    found = parse_metrics_text(httpx.get(f"{url}/metrics", timeout=10).text)
    return found.prefix_cache_queries or 0.0, found.prefix_cache_hits or 0.0


def show_kv_routing(model: str = "llama-3.1-8b") -> None:
    """Exact prefix routing: two workers publish their prefix caches' KV events, the router follows them and sends
    each turn of a conversation where its history is cached; round-robin on fresh workers for comparison."""
    conversations, turns = 16, 4
    system = "You are a careful assistant for a logistics company; answer from the manual. " * 4

    def prompt(conversation: int, turn: int) -> str:
        """The conversation's history and its next question: each turn's prompt extends the one before."""
        asked = [f"User: question {k} of conversation {conversation}, about shipment {conversation * 7 + k}."
                 f"\nAssistant:" for k in range(turn + 1)]
        return system + "".join(f"{q} {'an answer in several words ' * 20}\n" for q in asked[:-1]) + asked[-1]

    def run(policy: str) -> list[object]:
        ports = [free_port() for _ in range(2)]
        workers = [start_worker_thread(WorkerSpec(model=model, accelerator="a100-80gb", time_scale=4.0, kv_blocks=1200,
                                                  kv_events=f"tcp://127.0.0.1:{port}")) for port in ports]
        config = parse_router_config({"policy": policy, "time_scale": 4.0, "metrics_interval_s": 0.2, "models": {
            model: {"kv_cache": {"block_size": 16, "resync_s": 0}, "endpoints": [
                {"url": w.url, "accelerator": "a100-80gb", "kv_events": f"tcp://127.0.0.1:{port}"}
                for w, port in zip(workers, ports, strict=True)]}}})
        router = serve_in_thread(create_router_app(config))

        async def conversation(client: httpx.AsyncClient, c: int) -> None:
            for turn in range(turns):
                body = {"model": model, "prompt": prompt(c, turn), "max_tokens": 8}
                (await client.post(f"{router.url}/v1/completions", json=body)).raise_for_status()

        async def traffic() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                await asyncio.gather(*(conversation(client, c) for c in range(conversations)))

        try:
            asyncio.run(traffic())
            sources = {e["prefix_cache"]["source"] for e in
                       httpx.get(f"{router.url}/router/endpoints", timeout=10).json()["endpoints"]}
            counts = [_engine_prefix_counts(w.url) for w in workers]
        finally:
            router.stop()
            for worker in workers:
                worker.stop()
        queries, hits = sum(q for q, _ in counts), sum(h for _, h in counts)
        return [policy, ", ".join(sorted(sources)) if policy == "kv-aware" else "-", f"{queries:,.0f}", f"{hits:,.0f}", f"{hits / queries:.0%}"]

    rows = [run("kv-aware"), run("round-robin")]
    print_table(f"Prefix routing from KV events: {conversations} conversations x {turns} turns over two "
                f"{model} workers (1,200 KV blocks each)",
                ["policy", "prefix source", "prompt tokens", "cached tokens (engines' own count)", "hit rate"], rows,
                caption="hetsched sim-worker --kv-events tcp://HOST:PORT publishes vLLM's events; the router file's "
                        "endpoint kv_events names it (docs/router.md, Exact prefix caches from KV events)")


def main() -> None:
    console.rule("[bold]hetsched demo")
    show_fit_matrix()
    show_capacities()
    show_measured_profile()
    show_step_model_accuracy()
    show_plan()
    show_operator_objects()
    show_routing()
    show_endpoint_picker()
    show_flow_control()
    show_kv_routing()
    show_closed_loop()
    show_autoscaling()
    show_web_planner()


if __name__ == "__main__":
    main()
