"""``hetsched profile`` (measure or estimate a Profile) and ``hetsched profiles`` (list, show, export, import)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hetsched.backends.base import BackendKind, HostClock
from hetsched.cli.database import store_from_env
from hetsched.cli.output import OutputFormat, console, console_err, print_json, print_table
from hetsched.cli.specs import Output, parse_device
from hetsched.errors import InputError
from hetsched.perf.roofline import RooflineModel
from hetsched.profiler.compare import REFERENCE_SHAPES, extrapolation, step_table
from hetsched.profiler.exchange import export_document, parse_document
from hetsched.profiler.profile import Profile, ProfileSource
from hetsched.profiler.vidur import VidurFile, profiles_from_vidur
from hetsched.specs.engine import EngineConfig
from hetsched.specs.files import read_text
from hetsched.specs.registry import load_model
from hetsched.store import Store
from hetsched.store.profiles import list_profiles, load_profile, load_profile_with_id, save_profile, save_profiles

if TYPE_CHECKING:
    from hetsched.profiler.endpoint import LoadTestSettings

profiles_app = typer.Typer(help="Stored profiles: list, show, export, import, import-vidur.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)
    app.add_typer(profiles_app, name="profiles")


def profile_command(
    model: Annotated[str, typer.Argument(help="bundled name or path to a config.json")],
    source: Annotated[ProfileSource, typer.Option(help="kernel: time operators here; roofline: catalog estimate; "
                                                       "endpoint: load-test a live server")] = ProfileSource.KERNEL,
    backend: Annotated[BackendKind | None, typer.Option(help="kernel source: where to run (default: detect)")] = None,
    device: Annotated[int, typer.Option(help="kernel source: device index")] = 0,
    quick: Annotated[bool, typer.Option("--quick", help="coarse sweep (about a minute on a small CPU)")] = False,
    max_tokens: Annotated[int | None, typer.Option(help="token budget per step (default: engine's 8192)")] = None,
    point_timeout: Annotated[float, typer.Option(help="kernel source: seconds one point may take")] = 120.0,
    threads: Annotated[int | None, typer.Option(help="cpu backend: torch threads (default: torch's choice)")] = None,
    clock: Annotated[HostClock, typer.Option(help="cpu backend: wall time, or process CPU time (steadier with "
                                                  "--threads 1 on a busy shared host)")] = HostClock.WALL,
    accelerator: Annotated[str | None, typer.Option(help="roofline source: catalog id, e.g. h100-sxm or "
                                                         "h100-sxm:3g.40gb; endpoint source: label to store")] = None,
    tp: Annotated[int, typer.Option(help="roofline source: tensor-parallel size")] = 1,
    calibrate_from: Annotated[str | None, typer.Option(help="roofline source: stored kernel profile (id or digest) "
                                                            "of the same vendor to fit the constants to")] = None,
    url: Annotated[str | None, typer.Option(help="endpoint source: base URL of an OpenAI-compatible server")] = None,
    served_model: Annotated[str | None, typer.Option(help="endpoint source: model name on the server")] = None,
    rates: Annotated[str, typer.Option(help="endpoint source: comma-separated request rates (req/s)")] = "0.5,1,2,4",
    requests: Annotated[int, typer.Option(help="endpoint source: requests per round at each rate")] = 20,
    prompt_tokens: Annotated[str, typer.Option(help="endpoint source: comma-separated prompt lengths in the "
                                                    "server's tokens")] = "64,256,1024",
    output_tokens: Annotated[int, typer.Option(help="endpoint source: tokens each request generates")] = 64,
    max_rounds: Annotated[int, typer.Option(help="endpoint source: rounds at a rate before its medians are "
                                                 "called unstable")] = 4,
    save: Annotated[bool, typer.Option(help="store the profile in the database")] = True,
    output: Output = OutputFormat.table,
) -> None:
    """Measure (or estimate) MODEL's step latency and store it as a Profile."""
    arch = load_model(model)
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"expected a positive token budget, got {max_tokens}", field="--max-tokens")
    if threads is not None and threads < 1:
        raise InputError(f"expected a positive thread count, got {threads}", field="--threads")
    if not (math.isfinite(point_timeout) and point_timeout > 0):
        raise InputError(f"expected a positive, finite number of seconds, got {point_timeout}", field="--point-timeout")
    engine = EngineConfig(max_num_batched_tokens=max_tokens) if max_tokens is not None else EngineConfig()
    store = store_from_env() if save else None  # a store that cannot take the result fails before the sweep, not after it
    if source is ProfileSource.KERNEL:
        profile = _kernel_profile(arch, backend=backend, device=device, quick=quick, engine=engine,
                                  point_timeout=point_timeout, clock=clock, threads=threads or 0, quiet=output is OutputFormat.json)
    elif source is ProfileSource.ROOFLINE:
        profile = _roofline_profile(arch, accelerator=accelerator, tp=tp, engine=engine, calibrate_from=calibrate_from,
                                    store=store)
    else:
        settings = load_test_settings(rates=rates, requests=requests, prompt_tokens=prompt_tokens,
                                       output_tokens=output_tokens, max_rounds=max_rounds, quick=quick)
        profile = _endpoint_profile(arch.name, url=url, served_model=served_model, settings=settings,
                                    accelerator=accelerator or "endpoint", quiet=output is OutputFormat.json)
    profile_id = save_profile(store, profile) if store is not None else None
    if output is OutputFormat.json:
        print_json({"id": profile_id, **summary(profile)})
        return
    show_profile(profile, profile_id=profile_id)


def _kernel_profile(arch: Any, *, backend: BackendKind | None, device: int, quick: bool, engine: EngineConfig,
                    point_timeout: float, clock: HostClock, threads: int, quiet: bool) -> Profile:
    from hetsched.backends import get_backend
    from hetsched.profiler.driver import profile_kernels

    kind = get_backend(backend, device=device).kind
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[point]}"))
    with Progress(*columns, console=console_err, transient=False, disable=quiet) as progress:
        task = progress.add_task(f"profiling {arch.name} on {kind}", total=None, point="starting worker")

        def on_result(result: Any) -> None:
            progress.update(task, advance=1, point=result.point.label[:60])
            if result.timing is None:
                progress.console.print(f"[yellow]skipped[/] {escape(f'{result.point.label}: {result.error}')}")

        return profile_kernels(
            arch, backend=kind, device=device, engine=engine, quick=quick, point_timeout_s=point_timeout,
            host_clock=clock.value, cpu_threads=threads,
            on_plan=lambda plan: progress.update(task, total=len(plan.points)),
            on_device=lambda info: progress.update(task, description=f"profiling {arch.name} on "
                                                                      f"{info.get('device', {}).get('name', kind)}"),
            on_result=on_result)


def _roofline_profile(arch: Any, *, accelerator: str | None, tp: int, engine: EngineConfig,
                      calibrate_from: str | None, store: Store | None) -> Profile:
    from hetsched.profiler.roofline_source import constants_from_profile, roofline_profile

    if not accelerator:
        raise InputError("the roofline source needs an accelerator, e.g. --accelerator h100-sxm", field="--accelerator")
    if tp < 1:
        raise InputError(f"expected a positive tensor-parallel size, got {tp}", field="--tp")
    target = parse_device(accelerator)
    constants = (constants_from_profile(load_profile(store or store_from_env(), calibrate_from), target=target)
                 if calibrate_from else None)
    return roofline_profile(arch, target, tp=tp, engine=engine, constants=constants,
                            calibrated_from=calibrate_from or "")


def _numbers(text: str, *, field: str, kind: type[float] | type[int]) -> tuple[Any, ...]:
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise InputError(f"expected comma-separated numbers, got {text!r}", field=field) from exc
    if not all(math.isfinite(v) for v in values):
        raise InputError(f"expected finite numbers, got {text!r}", field=field)
    return values


def load_test_settings(*, rates: str, requests: int, prompt_tokens: str, output_tokens: int, max_rounds: int,
                       quick: bool) -> LoadTestSettings:
    """A load test from the command line's comma-separated rates and prompt lengths."""
    from hetsched.profiler.endpoint import LoadTestSettings

    rate_values = _numbers(rates, field="--rates", kind=float)
    return LoadTestSettings(rates=rate_values[:2] if quick else rate_values,
                            requests_per_rate=max(1, requests // 2) if quick else requests,
                            prompt_tokens=_numbers(prompt_tokens, field="--prompt-tokens", kind=int),
                            output_tokens=output_tokens, max_rounds=2 if quick else max_rounds)


def _endpoint_profile(model: str, *, url: str | None, served_model: str | None, settings: LoadTestSettings,
                      accelerator: str, quiet: bool) -> Profile:
    from hetsched.profiler.endpoint import profile_endpoint

    if not url:
        raise InputError("the endpoint source needs the server's URL, e.g. --url http://127.0.0.1:8000", field="--url")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console_err, disable=quiet) as progress:
        task = progress.add_task(f"load-testing {url}", total=None)
        return profile_endpoint(model, url, served_model=served_model, settings=settings, accelerator=accelerator,
                                on_request=lambda _record: progress.advance(task))


def summary(profile: Profile) -> dict[str, Any]:
    """The stable JSON shape of a profile's headline facts."""
    return {"model": profile.model, "accelerator": profile.accelerator, "source": str(profile.source),
            "backend": profile.backend, "tp": profile.tp, "digest": profile.digest,
            "created_at": profile.provenance.created_at, "duration_s": profile.provenance.duration_s,
            "device": profile.provenance.device.get("name") or profile.provenance.device.get("url", ""),
            "points": sum(len(t.points) for t in profile.tables), "failed_points": len(profile.failures),
            "ops": [t.op for t in profile.tables], "warnings": list(profile.sweep.get("warnings", ())),
            "extrapolated": {label: why for label, shape in REFERENCE_SHAPES
                             if (why := extrapolation(profile, shape)) is not None}}


def roofline_for(profile: Profile) -> RooflineModel | None:
    """The catalog roofline of the profile's model and device, when both are known."""
    from hetsched.profiler.roofline_source import measured_device

    try:
        return RooflineModel(load_model(profile.model), measured_device(profile), tp=profile.tp)
    except InputError:
        return None


def show_profile(profile: Profile, *, profile_id: int | None = None) -> None:
    head = summary(profile)
    title = f"Profile {profile_id or ''} {profile.model} on {profile.accelerator} ({profile.source}, {profile.backend})"
    failed = (f"{head['failed_points']} of {profile.sweep['requests']} requests failed" if "requests" in profile.sweep
              else f"{head['failed_points']} failed")
    console.print(f"[bold]{escape(title.replace('  ', ' '))}[/]  digest {head['digest'][:12]}  "
                  f"{head['points']} points, {failed}, {head['duration_s']:.1f} s")
    if profile.provenance.device.get("name"):
        console.print(f"device: {profile.provenance.device.get('name')}  versions: "
                      + ", ".join(f"{k} {v}" for k, v in profile.provenance.versions.items()), markup=False)
    models: dict[str, Any] = {"profile ms": profile}
    roofline = roofline_for(profile)
    if roofline is not None and profile.source is not ProfileSource.ROOFLINE:
        models["roofline ms"] = roofline
    ratio = len(models) == 2
    rows = [[f"{t.label} (extrapolated)" if t.label in head["extrapolated"] else t.label, t.tokens, *t.ms,
             *([t.ms[0] / t.ms[1]] if ratio else [])] for t in step_table(models)]
    print_table("Step time at reference shapes", ["step", "tokens", *models, *(["profile/roofline"] if len(models) == 2
                                                                             else [])], rows)
    for label, why in head["extrapolated"].items():
        console.print(f"[yellow]extrapolated[/] {escape(f'{label}: {why}')}")
    for warning in head["warnings"]:
        console.print(f"[yellow]warning[/] {escape(warning)}")
    for failure in profile.failures[:10]:
        console.print(f"[yellow]failed point[/] {escape(f'{failure.op} {failure.params}: {failure.reason}')}")


@profiles_app.command("list")
def profiles_list(model: Annotated[str | None, typer.Option(help="only this model")] = None,
                  accelerator: Annotated[str | None, typer.Option(help="only this accelerator id")] = None,
                  output: Output = OutputFormat.table) -> None:
    """Stored profiles, newest first."""
    rows = list_profiles(store_from_env(), model=model, accelerator=accelerator)
    if output is OutputFormat.json:
        print_json([{**dataclasses.asdict(r), "created_at": r.created_at.isoformat()} for r in rows])
        return
    print_table("Profiles", ["id", "model", "accelerator", "source", "backend", "tp", "points", "digest", "created"],
                [[r.id, r.model, r.accelerator, r.source, r.backend, r.tp, r.points, r.digest[:12],
                  r.created_at.strftime("%Y-%m-%d %H:%M")] for r in rows])


@profiles_app.command("show")
def profiles_show(profile: Annotated[str, typer.Argument(help="id or digest prefix")],
                  output: Output = OutputFormat.table) -> None:
    """One profile: provenance, step time at reference shapes (next to the roofline)."""
    profile_id, loaded = load_profile_with_id(store_from_env(), profile)
    if output is OutputFormat.json:
        print_json(loaded.to_dict())
        return
    show_profile(loaded, profile_id=profile_id)


@profiles_app.command("export")
def profiles_export(profiles: Annotated[list[str] | None, typer.Argument(help="ids or digest prefixes")] = None,
                    all_profiles: Annotated[bool, typer.Option("--all", help="every stored profile")] = False,
                    file: Annotated[Path | None, typer.Option("--file", "-f",
                                                              help="write here (default stdout)")] = None,
                    ) -> None:
    """Write profiles as a versioned JSON document."""
    store = store_from_env()
    refs = [str(r.id) for r in list_profiles(store)] if all_profiles else (profiles or [])
    if not refs:
        raise InputError("name profiles to export, or pass --all", field="profiles")
    text = json.dumps(export_document([load_profile(store, ref) for ref in refs]), indent=1)
    if file is None:
        print(text)
        return
    try:
        file.write_text(text + "\n")
    except OSError as exc:
        raise InputError(f"cannot write {file}: {exc.strerror}", field="--file") from exc
    console_err.print(f"wrote {len(refs)} profile(s) to {file}", markup=False)


@profiles_app.command("import")
def profiles_import(file: Annotated[Path, typer.Argument(help="a file written by 'hetsched profiles export'")],
                    output: Output = OutputFormat.table) -> None:
    """Read profiles from a JSON document; all or nothing."""
    profiles = parse_document(read_text(file, field="file"), source=file.name)
    ids = save_profiles(store_from_env(), profiles)
    if output is OutputFormat.json:
        print_json([{"id": i, **summary(p)} for i, p in zip(ids, profiles, strict=True)])
        return
    print_table(f"Imported from {file.name}", ["id", "model", "accelerator", "source", "digest"],
                [[i, p.model, p.accelerator, str(p.source), p.digest[:12]] for i, p in zip(ids, profiles, strict=True)])



def _vidur_files(paths: list[Path]) -> list[VidurFile]:
    """The CSVs named, or found under the folders named, as text through the file boundary (size, UTF-8)."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            csvs = sorted(p for p in path.rglob("*.csv") if p.is_file())
            if not csvs:
                raise InputError(f"no .csv files under {path}", field="paths")
            found.extend(csvs)
        elif path.is_file():
            found.append(path)
        else:
            raise InputError(f"no such file or folder: {path}", field="paths")
    return [VidurFile(str(path), read_text(path, field=str(path))) for path in found]


@profiles_app.command("import-vidur")
def profiles_import_vidur(
    paths: Annotated[list[Path], typer.Argument(help="Vidur CSVs, or folders of them searched recursively: "
                                                     "Vidur's data/profiling or a slimmed <device>/{ops,attention,"
                                                     "network}/*.csv")],
    model: Annotated[str | None, typer.Option(help="hetsched model (bundled name or config.json) of a single-model "
                                                   "import; default: the bundled model of the measured shape")] = None,
    device: Annotated[str | None, typer.Option(help="catalog id of the GPU that Vidur's profiler output was measured "
                                                    "on, where its path (compute/<device>/…, "
                                                    "network/<device>_<topology>/…) does not say")] = None,
    output: Output = OutputFormat.table,
) -> None:
    """Store Vidur's measured GPU timings as Profiles, one per GPU, model and TP; all or nothing.

    Reads the profiler's own files (mlp.csv, attention.csv, all_reduce.csv, send_recv.csv) and the slimmed layout.
    """
    profiles = profiles_from_vidur(_vidur_files(paths), model=load_model(model) if model else None, device=device)
    ids = save_profiles(store_from_env(), profiles)
    if output is OutputFormat.json:
        print_json([{"id": i, **summary(p), "missing_ops": p.sweep["missing_ops"]}
                    for i, p in zip(ids, profiles, strict=True)])
        return
    print_table("Imported from Vidur", ["id", "model", "accelerator", "tp", "ops", "points", "missing ops"],
                [[i, p.model, p.accelerator, p.tp, len(p.tables), sum(len(t.points) for t in p.tables),
                  ", ".join(p.sweep["missing_ops"])] for i, p in zip(ids, profiles, strict=True)])
