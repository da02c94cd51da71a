"""``hetsched calibrate``: fit a device's step-model constants to its stored measured profiles."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.console import Console

from hetsched.catalog import Device, host_catalog
from hetsched.cli.database import store_from_env
from hetsched.cli.output import OutputFormat, console, console_err, print_json, print_table
from hetsched.cli.specs import Output
from hetsched.engine_metrics.parse import ENGINE_SERIES_QUERY
from hetsched.errors import InputError
from hetsched.perf.calibrate import TRUSTED_MEDIAN_ERROR, Calibration, calibrate
from hetsched.profiler.calibration import profile_samples
from hetsched.profiler.profile import Profile, ProfileSource
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.store import Store
from hetsched.store.calibrations import list_calibrations, save_calibration
from hetsched.store.profiles import list_profiles, load_profile_with_id

if TYPE_CHECKING:
    from hetsched.cli.live import LiveSource
    from hetsched.perf.tail import Tail
    from hetsched.profiler.endpoint import LoadTestResult
    from hetsched.profiler.twin import TwinFit
    from hetsched.specs.model import ModelArch


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_command)
    app.command("calibrations")(calibrations_command)


def _source(profiles: list[tuple[int, Profile]], device_name: str) -> str:
    origins = {p.provenance.device.get("origin") for _, p in profiles}
    ids = ",".join(f"#{i}" for i, _ in profiles)
    if origins == {"vidur"}:
        return (f"fitted to Vidur's {device_name} operator timings (github.com/microsoft/vidur @7d47513, MIT), "
                f"profiles {ids}")
    return f"fitted to kernel profiles {ids} measured on {device_name}"


def calibrate_command(
    accelerator: Annotated[str, typer.Argument(help="catalog id of the device, e.g. a100-80gb, or cpu")],
    profiles: Annotated[list[str] | None, typer.Option("--profile", "-p", help="stored kernel profile (id or "
                                                       "digest prefix); default: every kernel profile of the device")
                        ] = None,
    save: Annotated[bool, typer.Option(help="store the calibration; a trusted one is then used by estimate, "
                                             "capacity, plan and the web planner")] = True,
    export_yaml: Annotated[Path | None, typer.Option(help="also write the constants as a perf_constants.yaml "
                                                          "'devices' entry ('-': stdout, the table then on stderr)")] = None,
    endpoint: Annotated[str | None, typer.Option(help="instead of profiles: load-test this running vLLM engine and "
                                                      "fit the twin's step time to it (needs --model)")] = None,
    model: Annotated[str | None, typer.Option(help="with --endpoint: the served model's config (bundled name or "
                                                   "config.json path)")] = None,
    served_model: Annotated[str | None, typer.Option(help="with --endpoint: model name on the server")] = None,
    rates: Annotated[str, typer.Option(help="with --endpoint: request rates to load-test (req/s); reach the "
                                            "batch sizes the twin will run")] = "1,4,8",
    requests: Annotated[int, typer.Option(min=2, help="with --endpoint: requests per round")] = 30,
    prompt_tokens: Annotated[str, typer.Option(help="with --endpoint: prompt lengths in tokens")] = "64,256",
    output_tokens: Annotated[int, typer.Option(min=2, help="with --endpoint: tokens per answer")] = 64,
    live: Annotated[bool, typer.Option("--live", help="instead: learn the step model's correction for --model on "
                                                      "ACCELERATOR from running engines' metrics (--url or "
                                                      "--prometheus)")] = False,
    url: Annotated[list[str] | None, typer.Option("--url", help="with --live: an engine's base URL (repeat for "
                                                                "each replica)")] = None,
    prometheus: Annotated[str | None, typer.Option(help="with --live: a Prometheus server whose engine series "
                                                        "to read over the past --window")] = None,
    prometheus_query: Annotated[str, typer.Option(help="with --prometheus: the series to read (narrow it to the "
                                                       "model's pods on ACCELERATOR)")] = ENGINE_SERIES_QUERY,
    pod_label: Annotated[str, typer.Option(help="with --prometheus: the label naming each engine's pod")] = "pod",
    window: Annotated[float, typer.Option(help="with --live: seconds of metrics to learn from")] = 120.0,
    interval: Annotated[float, typer.Option(help="with --live: seconds between readings")] = 10.0,
    tp: Annotated[int, typer.Option(help="with --live: the engines' tensor-parallel size")] = 1,
    engine_build: Annotated[str, typer.Option(help="with --live: the engine build, e.g. 'vllm 0.11.0' (a "
                                                   "correction is used only for the build it was learned on)")] = "",
    attention_backend: Annotated[str, typer.Option(help="with --live: the engines' attention backend, e.g. "
                                                        "FLASH_ATTN (likewise)")] = "",
    output: Output = OutputFormat.table,
) -> None:
    """Fit ACCELERATOR's step-model constants to measured operator profiles, the twin to a running engine, or
    (--live) learn a model's step-model correction on ACCELERATOR from running engines."""
    to_stdout = export_yaml is not None and str(export_yaml) == "-"
    if to_stdout and output is OutputFormat.json:
        raise InputError("'-' writes the YAML to stdout, where -o json writes too; name a file, or drop -o json",
                         field="--export-yaml")
    store = store_from_env()
    catalog = host_catalog()
    device = catalog.device(accelerator)
    if device.profile:
        raise InputError("calibrate a whole device; MIG slices and partitions scale its constants",
                         field="accelerator")
    if live:
        from hetsched.cli.live import LiveSource  # httpx and the router's step model load for --live alone

        _calibrate_live(store, device, model=model, source=LiveSource(
            urls=tuple(url or ()), prometheus=prometheus, query=prometheus_query, pod_label=pod_label),
                        window=window, interval=interval, tp=tp, engine_build=engine_build,
                        attention_backend=attention_backend, save=save, output=output,
                        conflicts={"--endpoint": endpoint, "--export-yaml": export_yaml, "--profile": profiles})
        return
    if url or prometheus:
        raise InputError("engines' metrics are read with --live", field="--url" if url else "--prometheus")
    if endpoint is not None:
        if export_yaml is not None:
            raise InputError("cannot be used with --endpoint: it exports constants fitted to profiles, and an "
                             "engine's twin is stored, not exported", field="--export-yaml")
        _calibrate_engine(store, device, endpoint, model=model, served_model=served_model, rates=rates,
                          requests=requests, prompt_tokens=prompt_tokens, output_tokens=output_tokens, save=save,
                          output=output)
        return
    refs = profiles or [str(row.id) for row in list_profiles(store, accelerator=accelerator)
                        if row.source == ProfileSource.KERNEL]
    if not refs:
        raise InputError(f"no measured kernel profiles of {accelerator} in the store; run 'hetsched profile' on it "
                         "or 'hetsched profiles import-vidur'", field="accelerator")
    loaded = [load_profile_with_id(store, ref) for ref in refs]
    wrong = [p for _, p in loaded if p.accelerator != accelerator]
    if wrong:
        raise InputError(f"profile of {wrong[0].model} was measured on {wrong[0].accelerator}, not {accelerator}",
                         field="--profile")
    base = device.accelerator.perf
    assert base is not None
    result = calibrate(profile_samples(p for _, p in loaded), device=device, base=base,
                       source=_source(loaded, device.accelerator.name))
    text = constants_yaml(result, accelerator)
    with _staged(export_yaml if export_yaml is not None and not to_stdout else None, text):
        calibration_id = (save_calibration(store, accelerator, result, profile_ids=[i for i, _ in loaded]) if save
                          else None)
    if to_stdout:
        print(text, end="")
    if output is OutputFormat.json:
        print_json({"id": calibration_id, "accelerator": accelerator, "trusted": result.trusted,
                    "constants": result.constants.to_dict(), "residuals": result.residuals,
                    "unmeasured": list(result.unmeasured)})
        return
    _show(result, accelerator, calibration_id, out=console_err if to_stdout else console)


def _calibrate_engine(store: Store, device: Device, url: str, *, model: str | None, served_model: str | None,
                      rates: str, requests: int, prompt_tokens: str, output_tokens: int, save: bool,
                      output: OutputFormat) -> None:
    """Load-test the engine at ``url`` a rate at a time, reading its ``/metrics`` around each; fit the twin's step
    time to what the clients measured and its tail (step dispersion, front end) to how the engine's token gaps
    spread and how far the clients' TTFT runs past the engine's own; store the constants, print the twin's
    command."""
    import asyncio

    from hetsched.cli.profile import load_test_settings
    from hetsched.profiler.endpoint import LoadTestResult, engine_pages, observed_requests, run_load_test
    from hetsched.profiler.twin import engine_facts, fit_twin, step_samples

    if not model:
        raise InputError("name the served model's config, e.g. --model path/to/config.json", field="--model")
    arch = load_model(model)
    settings = load_test_settings(rates=rates, requests=requests, prompt_tokens=prompt_tokens,
                                  output_tokens=output_tokens, max_rounds=2, quick=False)
    metrics_text, info = asyncio.run(engine_pages(url, served_model))
    facts = engine_facts(metrics_text, max_model_len=info.max_model_len, url=url)
    rounds: list[tuple[float, str, str, LoadTestResult]] = []
    with console_err.status(f"load-testing {url} at {rates} req/s"):
        for rate in settings.rates:
            before, _ = asyncio.run(engine_pages(url, info.model))
            result = asyncio.run(run_load_test(url, served_model=info.model,
                                               settings=dataclasses.replace(settings, rates=(rate,))))
            after, _ = asyncio.run(engine_pages(url, info.model))
            rounds.append((rate, before, after, result))
    records = tuple(r for *_, result in rounds for r in result.records)
    combined = LoadTestResult(records=records, server_model=info.model, max_model_len=info.max_model_len)
    engine = EngineConfig(block_size=facts.block_size)
    fit = fit_twin(step_samples(observed_requests(combined)), model=arch, device=device, engine=engine,
                   source=f"fitted by hetsched calibrate --endpoint to {info.model} at {url}")
    with console_err.status("fitting the twin's tail"):
        tail, overhead_ms = _engine_tail(rounds, arch=arch, device=device, fit=fit, engine=engine,
                                         num_blocks=facts.kv_blocks, max_model_len=facts.max_model_len or 8192,
                                         prompt_tokens=settings.prompt_tokens, output_tokens=output_tokens)
    calibration = Calibration(constants=fit.constants, residuals=fit.residuals, unmeasured=())
    calibration_id = save_calibration(store, device.id, calibration, profile_ids=[]) if save else None
    twin = (f"hetsched sim-worker --model {model} --accelerator {device.id} --block-size {facts.block_size} "
            f"--kv-blocks {facts.kv_blocks} --request-overhead-ms {overhead_ms:g}"
            + (f" --max-model-len {facts.max_model_len}" if facts.max_model_len else "")
            + _tail_flags(tail) + " --max-num-seqs N --max-num-batched-tokens N")
    if output is OutputFormat.json:
        print_json({"id": calibration_id, "accelerator": device.id, "trusted": fit.trusted,
                    "kernel_scale": fit.kernel_scale, "step_overhead_ms": fit.step_overhead_ms,
                    "seq_overhead_us": fit.seq_overhead_us, "request_overhead_ms": overhead_ms,
                    "engine": dataclasses.asdict(facts), "residuals": fit.residuals, "tail": tail.to_json(),
                    "twin": twin})
        return
    print_table(f"Twin of {info.model} at {url}: step time fitted to what clients measured",
                ["phase", "points", "median |err|", "p90 |err|", "median err"],
                [[name, st.count, f"{st.median_abs:.1%}", f"{st.p90_abs:.1%}", f"{st.median_signed:+.1%}"]
                 for name, st in fit.residuals.items()])
    console.print(f"kernels × {fit.kernel_scale:g} of {device.id}'s constants, {fit.step_overhead_ms:g} ms per "
                  f"step + {fit.seq_overhead_us:g} µs per sequence, {overhead_ms:g} ms per request before its "
                  f"first step; engine: "
                  f"{facts.block_size}-token blocks, {facts.kv_blocks} KV blocks", markup=False)
    console.print(f"tail: {_tail_words(tail)}", markup=False)
    console.print(f"twin: {twin} (the engine's scheduler limits, which its pages do not state)", markup=False)
    stored = f"stored as calibration #{calibration_id}" if calibration_id else "not stored"
    console.print(f"{'trusted' if fit.trusted else 'not trusted'}: {stored}", markup=False)


def _engine_tail(rounds: list[tuple[float, str, str, LoadTestResult]], *, arch: ModelArch, device: Device,
                 fit: TwinFit, engine: EngineConfig, num_blocks: int, max_model_len: int,
                 prompt_tokens: tuple[int, ...], output_tokens: int) -> tuple[Tail, float]:
    """The twin's tail fitted to the load test's rounds (:func:`~hetsched.sim.tail_fit.fit_tail`), and its
    request overhead (ms): the one fitted to the clients' TTFT less what the front end adds at the lowest rate."""
    from hetsched.engine_metrics.parse import parse_metrics_text
    from hetsched.perf.roofline import RooflineModel
    from hetsched.perf.tail import FrontEnd, GapHistogram, Tail
    from hetsched.sim.step_cache import MemoizedStepModel
    from hetsched.sim.tail_fit import TailWindow, fit_tail
    from hetsched.specs.workload import LengthDistribution, LengthKind, Workload

    prompt = LengthDistribution(kind=LengthKind.EMPIRICAL, values=tuple(prompt_tokens))  # drawn as the test drew
    workload = Workload(input_len=prompt, output_len=LengthDistribution.fixed(output_tokens))
    windows = []
    for rate, before_text, after_text, result in rounds:
        before, after = parse_metrics_text(before_text), parse_metrics_text(after_text)
        ttfts = [r.ttft_s for r in result.records if r.error is None and r.ttft_s is not None]
        engine_ttft = after.ttft_s.minus(before.ttft_s) if after.ttft_s and before.ttft_s else None
        itl = after.itl_s.minus(before.itl_s) if after.itl_s and before.itl_s else None
        windows.append(TailWindow(
            rate, workload, GapHistogram(itl.le, itl.counts, itl.total) if itl is not None else None,
            sum(ttfts) / len(ttfts) if ttfts else None,
            engine_ttft.total / engine_ttft.count if engine_ttft is not None and engine_ttft.count else None))
    step_model = MemoizedStepModel(RooflineModel(arch, device, engine=engine, constants=fit.constants))
    tail = fit_tail(step_model, windows, engine=engine, num_blocks=num_blocks, max_model_len=max_model_len).tail
    front = tail.front_end
    if front is None or front.identity:
        return Tail(dispersion=tail.dispersion), fit.request_overhead_ms
    lowest = min(windows, key=lambda w: w.rate)
    in_front_ms = front.mean_gap(lowest.rate, output_tokens=output_tokens) * 1e3
    overhead_ms = round(max(fit.request_overhead_ms - in_front_ms, 0.0), 4)
    return Tail(tail.dispersion, FrontEnd(front.request_s, front.token_s, latency_s=overhead_ms / 1e3)), overhead_ms


def _tail_flags(tail: Tail) -> str:
    """The sim-worker flags that run ``tail``."""
    flags = f" --step-dispersion {tail.dispersion.spec}" if tail.dispersion is not None else ""
    if tail.front_end is not None and (tail.front_end.request_s or tail.front_end.token_s):
        flags += (f" --frontend-request-ms {tail.front_end.request_s * 1e3:.4g} --frontend-token-ms "
                  f"{tail.front_end.token_s * 1e3:.4g}")
    return flags


def _tail_words(tail: Tail) -> str:
    steps = (f"steps × ({tail.dispersion.describe()}) of their mean" if tail.dispersion is not None else
             "no step dispersion (the engine's token-gap buckets are too coarse, or too few gaps: start vLLM with "
             "--custom-histogram-buckets for a finer one)")
    front = tail.front_end
    if front is None or not (front.request_s or front.token_s):
        return f"{steps}; no front end measured (the engine reported no TTFT)"
    return (f"{steps}; front end {front.request_s * 1e3:.3g} ms a request + {front.token_s * 1e3:.3g} ms a "
            "token, one server (from the clients' TTFT less the engine's own)")


def _calibrate_live(store: Store, device: Device, *, model: str | None, source: LiveSource, window: float,
                    interval: float, tp: int, engine_build: str, attention_backend: str, save: bool,
                    output: OutputFormat, conflicts: dict[str, object]) -> None:
    """Check ``--live``'s options, then learn (see :mod:`hetsched.cli.live`)."""
    from hetsched.catalog.host import read_host
    from hetsched.cli.live import calibrate_live
    from hetsched.cli.specs import check_tp
    from hetsched.perf.online import CorrectionKey
    from hetsched.router.profiles import roofline_profile
    from hetsched.store.calibrations import calibrated_constants

    for flag, value in conflicts.items():
        if value:
            raise InputError("cannot be used with --live, which reads running engines' metrics", field=flag)
    if not model:
        raise InputError("name the served model, e.g. --model llama-3.1-8b (a bundled name or a config.json)",
                         field="--model")
    for flag, value in (("--window", window), ("--interval", interval)):
        if not math.isfinite(value) or value <= 0:
            raise InputError(f"expected a positive number of seconds, got {value}", field=flag)
    if interval > window:
        raise InputError(f"is longer than --window ({window:g} s): no window would fit", field="--interval")
    source.check()
    arch = load_model(model)
    check_tp(arch, device, tp)
    constants = calibrated_constants(store)
    profile = roofline_profile(model, device.id, tp, host=read_host(), perf=tuple(sorted(constants.items())))
    key = CorrectionKey(arch.name, device.id, tp, engine_build, attention_backend)
    base = constants[device.id].source if device.id in constants else f"{device.id}'s catalog constants"
    where = ", ".join(source.urls) if source.prometheus is None else f"{source.prometheus} ({source.query})"
    calibrate_live(store, device, profile, key, source, window_s=window, interval_s=interval, save=save,
                   output=output, origin=f"hetsched calibrate --live from {where}, over {base}")


def constants_yaml(result: Calibration, accelerator: str) -> str:
    """The fitted constants as a perf_constants.yaml ``devices`` entry."""
    return yaml.safe_dump({"devices": {accelerator: result.constants.to_dict()}}, sort_keys=False,
                          default_flow_style=None, width=120)


@contextmanager
def _staged(path: Path | None, text: str) -> Iterator[None]:
    """Write ``text`` beside ``path`` first and put it in place only when the block succeeds.

    A path that cannot be written fails before anything is stored, and a failure in the block leaves no file."""
    if path is None:
        yield
        return
    if path.is_dir():
        raise InputError(f"{path} is a folder; name the file to write, e.g. {path / 'perf_constants.yaml'}",
                         field="--export-yaml")
    staged = path.with_name(f".{path.name}.tmp")
    try:
        staged.write_text(text)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}", field="--export-yaml") from exc
    try:
        yield
        try:
            staged.replace(path)
        except OSError as exc:
            raise InputError(f"cannot write {path}: {exc.strerror}", field="--export-yaml") from exc
    finally:
        staged.unlink(missing_ok=True)


def verdict(result: Calibration, accelerator: str, calibration_id: int | None) -> str:
    """One line on whether the fit is trusted, whether it was stored, and so whether commands now use it."""
    if result.trusted:
        if calibration_id is None:
            return (f"[green]trusted[/]: not stored (--no-save); estimate, capacity, plan and the web planner keep "
                    f"the step model they had for {accelerator}")
        return (f"[green]trusted[/]: stored as calibration #{calibration_id}; estimate, capacity, plan and the web "
                f"planner use it for {accelerator}")
    why = (f"[yellow]not trusted[/]: median error above {TRUSTED_MEDIAN_ERROR:.0%} in "
           f"{', '.join(result.untrusted_classes)}")
    return f"{why}; not stored" if calibration_id is None else f"{why}; stored as calibration #{calibration_id}, not used"


def _show(result: Calibration, accelerator: str, calibration_id: int | None, *, out: Console) -> None:
    print_table(f"Calibration of {accelerator}: error of the fitted model on the measurements",
                ["operator class", "points", "median |err|", "p90 |err|", "median err"],
                [[name, s.count, f"{s.median_abs:.1%}", f"{s.p90_abs:.1%}", f"{s.median_signed:+.1%}"]
                 for name, s in result.residuals.items()], out=out)
    if result.unmeasured:
        out.print(f"not measured, kept from {accelerator}'s catalog set: {', '.join(result.unmeasured)}", markup=False)
    (out if result.trusted else console_err).print(verdict(result, accelerator, calibration_id))


def calibrations_command(
    accelerator: Annotated[str | None, typer.Option(help="only this device")] = None,
    output: Output = OutputFormat.table,
) -> None:
    """Stored calibrations, newest first; the newest trusted one per device is in use."""
    if accelerator is not None:
        host_catalog().device(accelerator)  # an unknown device is named, not an empty table
    rows = list_calibrations(store_from_env(), accelerator=accelerator)
    if output is OutputFormat.json:
        print_json([{**dataclasses.asdict(r), "created_at": r.created_at.isoformat()} for r in rows])
        return
    in_use: set[str] = set()
    table = []
    for r in rows:
        used = r.trusted and r.accelerator not in in_use
        if used:
            in_use.add(r.accelerator)
        worst = max((s["median_abs"] for s in r.residuals.values()), default=0.0)
        table.append([r.id, r.accelerator, r.trusted, used, f"{worst:.1%}", ",".join(map(str, r.profile_ids)),
                      r.created_at.strftime("%Y-%m-%d %H:%M")])
    print_table("Calibrations", ["id", "accelerator", "trusted", "in use", "worst median |err|", "profiles",
                                 "created"], table)
