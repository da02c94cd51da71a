"""``hetsched autoscale``: the autoscaling loop over simulated workers (or a fixed set of endpoints)."""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from hetsched.cli.output import OutputFormat, console, console_err, to_jsonable
from hetsched.errors import InputError

if TYPE_CHECKING:
    from hetsched.autoscale.policy import ModelDecision, ReplicaCount
    from hetsched.specs.wire import OptionKey


def register(app: typer.Typer) -> None:
    app.command("autoscale")(autoscale_command)


def autoscale_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="autoscale YAML file: cluster, bounds, settings, workers")],
    duration: Annotated[float | None, typer.Option(help="stop after this many wall seconds (default: run until Ctrl-C)")] = None,
    output: Annotated[OutputFormat, typer.Option("--output", "-o", help="table: a line per change; json: one object per round and model")] = OutputFormat.table,
) -> None:
    """Scale each model's replicas to live demand on the cheapest accelerators, without flapping."""
    from hetsched.autoscale.config import ApplierKind, load_autoscale_file, worker_options
    from hetsched.autoscale.fleet import build_fleet
    from hetsched.autoscale.loop import Applier, Autoscaler, StaticApplier
    from hetsched.autoscale.policy import Reason
    from hetsched.autoscale.scrape import EngineScraper, PrometheusSource, RouterScraper
    from hetsched.autoscale.signals import MetricsSource, Replica
    from hetsched.autoscale.step import placement_of
    from hetsched.catalog import host_catalog
    from hetsched.cli.database import store_from_env
    from hetsched.optimizer.build import computed_models
    from hetsched.settings.autoscale import AutoscaleSettings
    from hetsched.store.cache import cached_capacity_source

    if duration is not None and not (math.isfinite(duration) and duration >= 0):
        raise InputError(f"expected a finite number of seconds, 0 or more, got {duration}", field="--duration")
    file, spec = load_autoscale_file(config)
    settings = AutoscaleSettings.from_mapping(file.autoscale)
    source = None
    if computed_models(spec):
        source = cached_capacity_source(store_from_env())
    fleet = build_fleet(spec, host_catalog(), max_replicas=file.max_replicas, capacity_source=source)
    keys = worker_options(file, fleet)

    time_scale = file.applier.time_scale if file.applier.kind is ApplierKind.LOCAL else 1.0
    router = None
    local_applier = None
    if file.applier.kind is ApplierKind.LOCAL:
        from hetsched.autoscale.local import LocalApplier, LocalRouter, wall_clock
        from hetsched.router.config import RouterConfig, parse_router_config

        clock = wall_clock(time_scale)
        archs = file.applier.simulated_models(spec)
        slos = {bounds.name: bounds.slo for bounds in fleet.models}
        defaults = RouterConfig.model_fields
        router = LocalRouter(parse_router_config({
            "host": file.router.host, "port": file.router.port,
            **({"policy": file.router.policy} if file.router.policy else {}),
            # engine signals as fresh in simulated time as on real hardware
            "metrics_interval_s": defaults["metrics_interval_s"].default / time_scale,
            "metrics_stale_after_s": defaults["metrics_stale_after_s"].default / time_scale,
            "models": {m.name: {"slo": slos[m.name].model_dump(), "arch": archs[m.name],
                                "max_model_len": file.applier.max_model_len} for m in spec.models}}))
        local_applier = LocalApplier(router, archs=archs, time_scale=time_scale, startup_s=file.applier.startup_s,
                                     drain_s=file.applier.drain_s, max_model_len=file.applier.max_model_len,
                                     min_step_wall_s=file.applier.min_step_wall_s, clock=clock)
        for worker, key in zip(file.workers, keys):
            local_applier.start(key, worker.replicas)
        applier: Applier = local_applier
        console_err.print(f"router on {router.url}; {sum(w.replicas for w in file.workers)} worker(s) starting, "
                          f"time ×{time_scale}")
    else:
        clock = time.monotonic
        applier = StaticApplier([Replica(f"{w.model}-{i}", key, w.url or "", True)
                                 for i, (w, key) in enumerate(zip(file.workers, keys))])
    metrics: MetricsSource = (PrometheusSource(file.prometheus.url, query=file.prometheus.query,
                                               pod_label=file.prometheus.pod_label)
                              if file.prometheus else EngineScraper(clock))
    scaler = Autoscaler(fleet, settings, applier, metrics, clock=clock,
                        router=RouterScraper(router.url, clock) if router is not None else None)
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: workers and router shut down cleanly
    try:
        while duration is None or time.monotonic() - started < duration:
            tick = time.monotonic()
            decision = scaler.step()
            placement = placement_of(applier.replicas()) if output is OutputFormat.json else {}
            for model in decision.models:
                if output is OutputFormat.json:
                    print(json.dumps(round_json(model, placement, time_s=clock())), flush=True)
                elif model.reason is not Reason.STEADY:
                    console.print(f"[dim]{clock():8.1f}s[/] [bold]{escape(model.model)}[/] {escape(model.message)}")
            time.sleep(max(0.0, settings.interval_s / time_scale - (time.monotonic() - tick)))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if local_applier is not None:
            local_applier.close()
        if router is not None:
            router.stop()


def round_json(model: ModelDecision, placement: Mapping[OptionKey, ReplicaCount], *,
               time_s: float) -> dict[str, Any]:
    """One ``-o json`` line: the model's decision, its options as named fields, and the replicas applied."""
    def option(key: OptionKey) -> dict[str, Any]:
        return {"pool": key.pool, "device": key.device, "tp": key.tp, "role": str(key.role)}

    return {"time_s": round(time_s, 1), **to_jsonable(model),
            "desired": [{**option(key), "replicas": count} for key, count in sorted(model.desired.items())],
            "correction": [{**option(key), "factor": to_jsonable(factor)}
                           for key, factor in sorted(model.correction.items())],
            "replicas": [{"pool": key.pool, "device": key.device, "tp": key.tp, "replicas": count.desired,
                          "ready": count.ready}
                         for key, count in sorted(placement.items()) if key.model == model.model]}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
