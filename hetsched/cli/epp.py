"""``hetsched epp``: the router's picker as a Gateway API Inference Extension endpoint picker (gRPC ext_proc)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from hetsched.cli.output import console_err
from hetsched.cli.route import INSECURE_HELP, LOG_LEVELS, PORT, check_log_level
from hetsched.errors import InputError
from hetsched.specs.gateway import EPP_HEALTH_PORT, EPP_METRICS_PORT, EPP_PORT

EPP_LOG_LEVELS = LOG_LEVELS[:-1]
"""Python logging's levels (uvicorn's but ``trace``)."""


def register(app: typer.Typer) -> None:
    app.command("epp")(epp_command)


def epp_command(
    pool: Annotated[str | None, typer.Option(help="InferencePool whose pods to pick from")] = None,
    namespace: Annotated[str | None, typer.Option(help="the InferencePool's namespace")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help=(
        "router YAML file: its models, SLOs and policies; its endpoints too when no --pool is given"))] = None,
    model: Annotated[list[str] | None, typer.Option(help=(
        "a model the pool serves (repeat for several); the first serves pods without a hetsched.io/model label. "
        "Default: the --config file's models"))] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(**PORT, help="ext_proc gRPC port")] = EPP_PORT,
    health_port: Annotated[int, typer.Option(**PORT, help="gRPC health port (liveness, readiness)")] = EPP_HEALTH_PORT,
    metrics_port: Annotated[int, typer.Option(**PORT, help="Prometheus metrics port")] = EPP_METRICS_PORT,
    log_level: Annotated[str, typer.Option(help=f"one of {', '.join(EPP_LOG_LEVELS)}")] = "info",
    insecure: Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP)] = False,
) -> None:
    """Serve the router's picker to a Gateway API gateway as its endpoint picker (Envoy ext_proc over gRPC)."""
    import asyncio
    import gc
    import signal

    from prometheus_client import start_http_server

    from hetsched.catalog.host import read_host
    from hetsched.cli.database import store_from_env
    from hetsched.router.config import load_router_config, picker_config
    from hetsched.router.discovery import load_kubernetes_config
    from hetsched.router.epp import EppServer, PoolGauges
    from hetsched.router.h1 import H1Upstream
    from hetsched.router.picker import Picker
    from hetsched.router.pool import InferencePoolWatcher
    from hetsched.router.types import Front
    from hetsched.router.watch import EndpointWatch
    from hetsched.server.bind import bind_address, check_exposure
    from hetsched.store.calibrations import calibrated_constants

    check_log_level(log_level, EPP_LOG_LEVELS)
    if len({port, health_port, metrics_port}) < 3:
        raise InputError(f"the ext_proc, health and metrics ports must differ, got {port}, {health_port}, "
                         f"{metrics_port}", field="--health-port")
    if pool is None and config is None:
        raise InputError("give --pool NAME --namespace NS (an InferencePool) or --config FILE (a router file)",
                         field="--pool")
    if pool is not None and not namespace:
        raise InputError("the InferencePool's namespace is needed with --pool", field="--namespace")
    settings = picker_config(load_router_config(config) if config is not None else None, model or [],
                             from_pool=pool is not None)
    served = list(model or settings.models)
    if pool is not None:
        load_kubernetes_config()  # off-cluster: one clear error here, not a watcher retrying forever
    warning = check_exposure(host, has_token=False, insecure=insecure, exposes="learn every endpoint's address and "
                             "steer the picker's load accounting", token_hint="keep it on 127.0.0.1 behind a "
                             "gateway on the same host")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    picker = Picker(settings, front=Front.EPP, host=read_host(), perf=calibrated_constants(store_from_env()))
    picker.metrics.registry.register(PoolGauges(picker, pool or (config.stem if config else "hetsched")))

    def pool_watcher(watch: EndpointWatch) -> InferencePoolWatcher | None:
        if pool is None or namespace is None:
            return None
        return InferencePoolWatcher(namespace=namespace, pool_name=pool, models=served, default_model=served[0],
                                    on_change=watch.set_endpoints, on_synced=watch.set_synced)

    async def serve() -> None:
        server = EppServer(picker, upstream=H1Upstream(connect_timeout_s=settings.connect_timeout_s), host=host,
                           port=port, health_port=health_port, discovery=pool_watcher)
        await server.start()
        start_http_server(metrics_port, addr=host, registry=picker.metrics.registry)
        gc.freeze()  # the start-up's objects (catalog, protobuf descriptors) leave the collector's full passes
        source = f"InferencePool {namespace}/{pool}" if pool else f"{len(settings.static_endpoints())} endpoint(s)"
        console_err.print(f"epp: {', '.join(served)} from {source}; ext_proc on {bind_address(host, server.port)}, "
                          f"health on {server.health_port}, metrics on {metrics_port}", markup=False)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stopping.set)
        await stopping.wait()
        await server.stop()

    if warning:
        console_err.print(warning, style="bold red", markup=False)
    asyncio.run(serve())
