"""``hetsched route`` (the router) and ``hetsched sim-worker`` (a simulated vLLM replica)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hetsched.cli.output import console_err
from hetsched.errors import InputError
from hetsched.kvcache.hashing import HashAlgorithm
from hetsched.sim.roles import Role
from hetsched.specs.engine import EngineConfig

if TYPE_CHECKING:
    from hetsched.perf.tail import Tail

PORT = {"min": 1, "max": 65535}
"""The range of a TCP port option."""

INSECURE_HELP = "listen beyond loopback without a token anyway (anyone who reaches the port may use it)"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""uvicorn's log levels, least verbose first."""
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def register(app: typer.Typer) -> None:
    app.command("route")(route_command)
    app.command("sim-worker")(sim_worker_command)
    app.command("sim-pool")(sim_pool_command)


def route_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="router YAML file (models, endpoints, policy)")],
    host: Annotated[str | None, typer.Option(help="address to listen on (default: the file's, else 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(**PORT, help="port to listen on (default: the file's, else 8000)")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    insecure: Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP)] = False,
    workers: Annotated[int, typer.Option(min=1, max=64, help="router processes sharing the port (SO_REUSEPORT), "
                                                             "one core each; they route alike from the engines' "
                                                             "metrics")] = 1,
) -> None:
    """Run the OpenAI-compatible router over the endpoints in CONFIG (or discovered in Kubernetes)."""
    import os

    check_log_level(log_level)
    import shutil
    import tempfile

    shared_metrics = None  # processes sharing the port keep their metrics there (router.metrics' MULTIPROCESS_ENV),
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # set before prometheus_client is imported
        shared_metrics = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="hetsched-router-metrics-")
    try:
        _serve_router(config, host=host, port=port, log_level=log_level, insecure=insecure, workers=workers)
    finally:
        if shared_metrics is not None:
            shutil.rmtree(shared_metrics, ignore_errors=True)


def _serve_router(config: Path, *, host: str | None, port: int | None, log_level: str, insecure: bool,
                  workers: int) -> None:
    import uvicorn

    from hetsched.cli.database import store_from_env
    from hetsched.router.app import create_router_app
    from hetsched.router.config import DiscoveryKind, load_router_config
    from hetsched.router.discovery import load_kubernetes_config
    from hetsched.server.bind import bind_address, check_exposure
    from hetsched.server.serve import serve_processes, uvicorn_options
    from hetsched.store.calibrations import calibrated_constants

    settings = load_router_config(config)
    if settings.discovery.kind is DiscoveryKind.KUBERNETES:
        load_kubernetes_config()  # off-cluster: one clear error here, not tracebacks from the server's startup
    listen_host, listen_port = host or settings.host, port if port is not None else settings.port
    warning = check_exposure(listen_host, has_token=settings.auth_token() is not None, insecure=insecure,
                             exposes="send requests to every model it routes and read its endpoints",
                             token_hint="set auth_token_env in the config and the variable it names")
    settings.api_key_holders()  # a key's variable unset: one clear error before the banner
    perf = calibrated_constants(store_from_env())
    if warning:
        console_err.print(warning, style="bold red", markup=False)
    console_err.print(f"router: {len(settings.static_endpoints())} static endpoint(s) for "
                      f"{', '.join(settings.models)}; listening on {bind_address(listen_host, listen_port)}"
                      + (f" with {workers} processes" if workers > 1 else ""), markup=False)
    # the router reads no client address, so uvicorn need not rewrite it from X-Forwarded-For on every request
    options = {"log_level": log_level, "access_log": False, "proxy_headers": False, **uvicorn_options(settings.limits())}
    if workers == 1:
        uvicorn.run(create_router_app(settings, perf=perf), host=listen_host, port=listen_port, **options)
        return
    status = serve_processes(lambda: create_router_app(settings, perf=perf), host=listen_host, port=listen_port,
                             workers=workers, options=options)
    if status:
        raise typer.Exit(status)


def sim_worker_command(
    model: Annotated[str, typer.Option(help="bundled model name or path to a config.json")],
    accelerator: Annotated[str, typer.Option(
        help="catalog device: h100-sxm, h100-sxm:3g.40gb, mi300x:cpx_nps4, cpu (this machine)")],
    port: Annotated[int, typer.Option(**PORT, help="port to listen on")] = 8000,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    tp: Annotated[int, typer.Option(min=1, help="tensor-parallel size")] = 1,
    time_scale: Annotated[float, typer.Option(help="simulated seconds per wall second (10: ten times faster)")] = 1.0,
    max_model_len: Annotated[int, typer.Option(min=1, help="longest prompt + output a request may have")] = 8192,
    served_model_name: Annotated[str | None, typer.Option(help="model name clients use (default: --model)")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="engine: most sequences per step")] = EngineConfig.max_num_seqs,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="engine: token budget per step")
                                      ] = EngineConfig.max_num_batched_tokens,
    block_size: Annotated[int, typer.Option(min=1, help="engine: KV cache block size in tokens")] = EngineConfig.block_size,
    kv_blocks: Annotated[int | None, typer.Option(min=1, help="KV cache blocks (vLLM's num_gpu_blocks); default: what "
                                                              "the memory model fits")] = None,
    request_overhead_ms: Annotated[float, typer.Option(min=0, help="front-end time per request before its first "
                                                                    "step (hetsched calibrate --endpoint fits it)")
                                   ] = 0.0,
    min_step_wall_ms: Annotated[float, typer.Option(min=0, help="decode steps shorter than this in wall time run "
                                                             "several at once, their tokens sent together (bounds "
                                                             "the events a fast --time-scale sends)")] = 2.0,
    role: Annotated[Role, typer.Option(help="prefill: answer one token and the KV's whereabouts; decode: take "
                                            "requests whose KV arrives from a prefill (after its transfer time)")
                    ] = Role.UNIFIED,
    slowdown: Annotated[float, typer.Option(help="run every step this many times as long as the step model says (a "
                                                 "device whose catalog figures are wrong)")] = 1.0,
    slowdown_prefill: Annotated[float, typer.Option(help="the same for each step's prefill share only (times "
                                                         "--slowdown)")] = 1.0,
    slowdown_decode: Annotated[float, typer.Option(help="the same for each step's decode share only (times "
                                                        "--slowdown)")] = 1.0,
    step_dispersion: Annotated[str | None, typer.Option(
        help="each step takes its modelled time × a factor of mean 1 drawn from this distribution: a lognormal's "
             "sigma (0.3) or knots probability:factor from 0 to 1 (hetsched calibrate --endpoint prints them)")
    ] = None,
    frontend_request_ms: Annotated[float, typer.Option(
        help="the API server's service time per request before the scheduler sees it, queued: one server, first "
             "come first served, shared with --frontend-token-ms")] = 0.0,
    frontend_token_ms: Annotated[float, typer.Option(help="the API server's service time per streamed token")] = 0.0,
    seed: Annotated[int, typer.Option(help="seeds the --step-dispersion draws")] = 0,
    tokenizer: Annotated[Path | None, typer.Option(
        help="the model's directory holding tokenizer.json (and tokenizer_config.json's chat template): prompts "
             "are tokenized as vLLM does; default: four bytes of text a token")] = None,
    prefix_caching: Annotated[bool, typer.Option(
        "--prefix-caching/--no-prefix-caching", help="cache prompt blocks by their hashes, as vLLM v1 does by "
                                                     "default (block hashes seeded by PYTHONHASHSEED where set)")
    ] = True,
    prefix_caching_hash_algo: Annotated[HashAlgorithm, typer.Option(
        help="how block hashes are computed, as vLLM's --prefix-caching-hash-algo")] = HashAlgorithm.SHA256,
    kv_events: Annotated[str | None, typer.Option(
        help="publish the prefix cache's KV events as vLLM does, on a ZMQ PUB socket bound here "
             "(tcp://HOST:PORT)")] = None,
    kv_events_replay: Annotated[str | None, typer.Option(
        help="answer replay requests for the last 10,000 batches on a ZMQ ROUTER socket bound here "
             "(tcp://HOST:PORT; with --kv-events)")] = None,
    kv_events_topic: Annotated[str, typer.Option(help="topic of each published KV-event batch")] = "",
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "warning",
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="VLLM_API_KEY", help="bearer token the /v1 routes require, as vLLM's --api-key")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP)] = False,
) -> None:
    """Serve the OpenAI API like one vLLM replica of MODEL on ACCELERATOR, timed by the step-latency model."""
    import uvicorn

    from hetsched.cli.specs import calibrated_catalog, check_tp
    from hetsched.server.bind import bind_address, check_exposure
    from hetsched.server.serve import uvicorn_options
    from hetsched.settings.server import ServerLimits
    from hetsched.simworker.app import WorkerSpec, create_worker_app, hash_seed_from_env
    from hetsched.specs.registry import load_model

    check_time_scale(time_scale)
    check_kv_events(kv_events, kv_events_replay)
    check_log_level(log_level)
    if not math.isfinite(min_step_wall_ms):
        raise InputError(f"expected a finite number of milliseconds, got {min_step_wall_ms}", field="--min-step-wall-ms")
    for flag, factor in (("--slowdown", slowdown), ("--slowdown-prefill", slowdown_prefill),
                         ("--slowdown-decode", slowdown_decode), ("--slowdown-prefill", slowdown * slowdown_prefill),
                         ("--slowdown-decode", slowdown * slowdown_decode)):  # the products too: 1e200 × 1e200
        check_slowdown(factor, flag)
    tail = worker_tail(step_dispersion, request_ms=frontend_request_ms, token_ms=frontend_token_ms)
    device = calibrated_catalog().device(accelerator)
    check_tp(load_model(model), device, tp)
    warning = check_exposure(host, has_token=bool(api_key), insecure=insecure, exposes="send it requests",
                             token_hint="pass --api-key (or set VLLM_API_KEY)")
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          block_size=block_size)
    spec = WorkerSpec(model=model, accelerator=accelerator, tp=tp, time_scale=time_scale,
                      max_model_len=max_model_len, served_name=served_model_name, engine=engine, kv_blocks=kv_blocks,
                      perf=device.accelerator.perf, request_overhead_ms=request_overhead_ms, role=role,
                      min_step_wall_s=min_step_wall_ms / 1e3, slowdown_prefill=slowdown * slowdown_prefill,
                      slowdown_decode=slowdown * slowdown_decode, tail=tail, seed=seed, prefix_caching=prefix_caching,
                      hash_algorithm=prefix_caching_hash_algo, hash_seed=hash_seed_from_env(),
                      tokenizer=None if tokenizer is None else str(tokenizer), kv_events=kv_events,
                      kv_events_replay=kv_events_replay, kv_events_topic=kv_events_topic)
    limits = ServerLimits()
    app = create_worker_app(spec, api_key=api_key or None, limits=limits)
    worker = app.state.worker
    if warning:
        console_err.print(warning, style="bold red", markup=False)
    console_err.print(f"sim-worker: {worker.name} ({role}) on {accelerator} TP={tp}, "
                      f"{worker.engine.scheduler.num_blocks} KV "
                      f"blocks, time ×{time_scale}{slowdown_note(spec.slowdown_prefill, spec.slowdown_decode)}"
                      f"{tail_note(tail)}{'' if prefix_caching else ', no prefix caching'}"
                      f"{f', KV events on {kv_events}' if kv_events else ''}; "
                      f"listening on {bind_address(host, port)}", markup=False)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, **uvicorn_options(limits))


def sim_pool_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="router YAML file whose endpoints to simulate")],
    time_scale: Annotated[float, typer.Option(help="simulated seconds per wall second")] = 1.0,
) -> None:
    """Start one simulated worker per loopback endpoint of a router CONFIG; Ctrl-C stops them all."""
    import signal
    from urllib.parse import urlsplit

    from hetsched.router.config import load_router_config
    from hetsched.simworker.app import WorkerSpec
    from hetsched.simworker.launch import WorkerProcess, spawn_worker

    check_time_scale(time_scale)
    settings = load_router_config(config)
    workers: list[WorkerProcess] = []
    try:
        for name, model in settings.models.items():
            for index, endpoint in enumerate(model.endpoints):
                url = urlsplit(endpoint.url)
                if url.hostname not in ("127.0.0.1", "localhost") or url.port is None:
                    raise InputError(f"expected a loopback URL with a port, got {endpoint.url!r}",
                                     field=f"models.{name}.endpoints.{index}.url")
                spec = WorkerSpec(model=model.arch or name, accelerator=endpoint.accelerator, tp=endpoint.tp,
                                  time_scale=time_scale, max_model_len=model.max_model_len, served_name=name,
                                  role=endpoint.role)
                workers.append(spawn_worker(spec, port=url.port, host=url.hostname, timeout=120))
                console_err.print(f"sim-worker {name} ({endpoint.role}) on {endpoint.accelerator} at {endpoint.url}",
                                  markup=False)
        console_err.print(f"{len(workers)} simulated worker(s) up; Ctrl-C stops them")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # after spawning: children keep theirs
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for worker in workers:  # signal all first so they shut down together
            worker.process.terminate()
        for worker in workers:
            worker.stop()


def check_kv_events(endpoint: str | None, replay: str | None) -> None:
    """ZMQ addresses the sockets can bind (``tcp://HOST:PORT``, ``ipc://PATH``); a replay needs a publisher."""
    for flag, value in (("--kv-events", endpoint), ("--kv-events-replay", replay)):
        if value is not None and not value.startswith(ZMQ_SCHEMES):
            raise InputError(f"expected a ZMQ address such as tcp://127.0.0.1:5557, got {value!r}", field=flag)
    if replay is not None and endpoint is None:
        raise InputError("a replay socket serves the published batches: pass --kv-events too",
                         field="--kv-events-replay")


def check_log_level(value: str, levels: tuple[str, ...] = LOG_LEVELS) -> None:
    if value.lower() not in levels:
        raise InputError(f"expected one of {', '.join(levels)}, got {value!r}", field="--log-level")


def check_slowdown(value: float, flag: str) -> None:
    """A factor on step times: a finite number above zero (0 would make steps free, NaN would stop the clock)."""
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"expected a finite factor above 0 (2: steps twice as long), got {value}", field=flag)


def slowdown_note(prefill: float, decode: float) -> str:
    """The banner's words for a worker's slowdown factors; nothing when its steps take what the model says."""
    if prefill == decode:
        return "" if prefill == 1 else f", slowdown ×{prefill:g}"
    return f", slowdown prefill ×{prefill:g} decode ×{decode:g}"


def worker_tail(dispersion: str | None, *, request_ms: float, token_ms: float) -> Tail | None:
    """The tail the sim-worker flags ask for (None: none), each bad value refused by its flag."""
    from hetsched.perf.tail import Dispersion, FrontEnd, Tail

    for flag, value in (("--frontend-request-ms", request_ms), ("--frontend-token-ms", token_ms)):
        if not math.isfinite(value) or value < 0:
            raise InputError(f"expected a finite number of milliseconds, 0 or more, got {value}", field=flag)
    parsed = None
    if dispersion is not None:
        try:
            parsed = Dispersion.parse(dispersion)
        except InputError as exc:
            raise InputError(str(exc), field="--step-dispersion") from exc
    front = FrontEnd(request_s=request_ms / 1e3, token_s=token_ms / 1e3) if request_ms or token_ms else None
    if parsed is None and front is None:
        return None
    return Tail(dispersion=parsed, front_end=front)


def tail_note(tail: Tail | None) -> str:
    """The banner's words for a worker's tail; nothing without one."""
    if tail is None:
        return ""
    parts = []
    if tail.dispersion is not None:
        parts.append(f"steps × ({tail.dispersion.describe()})")
    if tail.front_end is not None:
        front = tail.front_end
        parts.append(f"front end {front.request_s * 1e3:g} ms a request, {front.token_s * 1e3:g} ms a token")
    return ", " + ", ".join(parts)


def check_time_scale(value: float) -> None:
    """Simulated seconds per wall second: a finite number above zero (NaN would never advance the clock)."""
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"expected a finite number above 0, got {value}", field="--time-scale")
