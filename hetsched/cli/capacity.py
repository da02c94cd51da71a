"""``hetsched capacity``: the largest request rate one replica serves within an SLO."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hetsched.catalog import Device
from hetsched.cli.database import store_on_demand
from hetsched.cli.output import OutputFormat, console, console_err, print_json, print_table
from hetsched.cli.specs import Output, calibrated_catalog, corrections_in_use, parse_device
from hetsched.errors import InfeasibleError, InputError
from hetsched.perf.in_force import correction_json, correction_line
from hetsched.sim.capacity import CapacityFinder, DeviceCapacity, device_capacity, find_capacity
from hetsched.sim.roles import Role
from hetsched.specs.dtypes import KV_CACHE_DTYPES, parse_dtype
from hetsched.specs.durations import parse_duration_ms
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, Workload, load_workload
from hetsched.store.cache import cached_capacity

if TYPE_CHECKING:
    from hetsched.profiler.profile import Profile
    from hetsched.store import Store


def register(app: typer.Typer) -> None:
    app.command("capacity")(capacity_command)


def parse_edges(text: str | None, *, field: str) -> list[int]:
    """``512,2048`` → [512, 2048]: bucket edges, checked here so that an error names the flag they came from."""
    if not text:
        return []
    try:
        edges = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InputError(f"expected comma-separated token counts such as 512,2048, got {text!r}", field=field) from exc
    if any(e < 1 for e in edges) or edges != sorted(set(edges)):
        raise InputError(f"expected increasing positive token counts such as 512,2048, got {text!r}", field=field)
    return edges


def capacity_command(
    model: Annotated[str, typer.Argument(help="bundled name or path to a config.json")],
    accelerator: Annotated[str | None, typer.Argument(
        help="accelerator id, MIG slice (h100-sxm:3g.40gb) or AMD partition; omit for a table over the catalog")] = None,
    slo_ttft: Annotated[str, typer.Option("--slo-ttft", help="time-to-first-token target, e.g. 500ms or 1s")] = "500ms",
    slo_tpot: Annotated[str, typer.Option("--slo-tpot", help="time-per-output-token target, e.g. 50ms")] = "50ms",
    percentile: Annotated[float, typer.Option(help="the SLO percentile of TTFT and TPOT")] = 99.0,
    max_failure_rate: Annotated[float, typer.Option(help="share of requests that may be rejected")] = 0.01,
    workload: Annotated[Path | None, typer.Option(
        help="workload YAML/JSON, or a JSONL/CSV trace; default: chat (prompts ~512, answers ~128 tokens)")] = None,
    tp: Annotated[int | None, typer.Option(help="tensor-parallel size; default: the smallest that meets the SLO")] = None,
    all_devices: Annotated[bool, typer.Option("--all", help="a table over every catalog accelerator")] = False,
    input_buckets: Annotated[str | None, typer.Option(help="input-length bucket edges, e.g. 512,2048")] = None,
    output_buckets: Annotated[str | None, typer.Option(help="output-length bucket edges, e.g. 256")] = None,
    dtype: Annotated[str | None, typer.Option(help="weight dtype: bf16, fp8, int8, int4, mxfp4, nvfp4")] = None,
    kv_dtype: Annotated[str | None, typer.Option(help="KV cache dtype: bf16, fp16 or fp8")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="engine: most sequences per step")
                            ] = EngineConfig.max_num_seqs,
    max_num_batched_tokens: Annotated[int, typer.Option(
        min=1, help="engine: token budget per step")] = EngineConfig.max_num_batched_tokens,
    cache: Annotated[bool, typer.Option(help="answer from and save to the store (HETSCHED_DATABASE_URL)")] = True,
    profile: Annotated[str | None, typer.Option(
        help="stored profile id or digest prefix to take step times from instead of the roofline")] = None,
    role: Annotated[Role, typer.Option(help="unified, or one phase of disaggregated serving: prefill (TTFT, the KV "
                                             "transfer included) or decode (TPOT, the prompt's KV arriving)")
                    ] = Role.UNIFIED,
    output: Output = OutputFormat.table,
) -> None:
    """Per-replica SLO capacity of MODEL on ACCELERATOR (simulated continuous batching), or over the catalog.

    Steps take the catalog's time under the step-model correction in force for the model, device and TP (a
    measured --profile is used as measured)."""
    arch = load_model(model)
    slo = _slo(slo_ttft, slo_tpot, percentile, max_failure_rate)
    shape = load_workload(workload) if workload else Workload.chat()
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    if tp is not None and tp < 1:
        raise InputError(f"expected a positive TP size, got {tp}", field="--tp")
    if accelerator and all_devices:
        raise InputError("give an ACCELERATOR or --all, not both", field="--all")
    weight_dt = parse_dtype(dtype, field="--dtype") if dtype else None
    kv_dt = parse_dtype(kv_dtype, field="--kv-dtype", allowed=KV_CACHE_DTYPES) if kv_dtype else None
    input_edges = parse_edges(input_buckets, field="--input-buckets")
    output_edges = parse_edges(output_buckets, field="--output-buckets")
    store = store_on_demand() if cache or profile else None
    measured: Profile | None = None
    profile_id: int | None = None
    if profile:
        if not accelerator:
            raise InputError("a profile belongs to one accelerator; give ACCELERATOR too", field="--profile")
        assert store is not None, "opened above for a profile"
        measured, profile_id = _stored_profile(store.opened(), profile, model=arch.name,
                                               device=parse_device(accelerator).id)
        if tp is not None and tp != measured.tp:
            raise InputError(f"profile {profile} was measured at TP={measured.tp}, not {tp}", field="--tp")
        tp = measured.tp
    find: CapacityFinder
    if store is not None and cache:
        find = functools.partial(cached_capacity, store, weight_dtype=weight_dt, kv_dtype=kv_dt,
                                 input_edges=input_edges, output_edges=output_edges, step_model=measured,
                                 profile_id=profile_id)
    else:
        find = functools.partial(find_capacity, weight_dtype=weight_dt, kv_dtype=kv_dt, input_edges=input_edges,
                                 output_edges=output_edges, step_model=measured)
    corrections = corrections_in_use() if measured is None else None

    if accelerator:
        device = parse_device(accelerator)
        row = device_capacity(arch, device, workload=shape, slo=slo, engine=engine, tp=tp, find=find, role=role,
                              corrections=corrections)
        if row.capacity is None:
            raise InfeasibleError(row.reason or f"no capacity for {arch.name} on {accelerator}")
        _print_one(row, slo, shape, output)
        if output is OutputFormat.table:
            if role is not Role.UNIFIED:
                console.print(f"{role} replica: {_role_text(role)}", markup=False)
            source = f"profile {profile}" if profile else (device.accelerator.perf.source
                                                          if device.accelerator.perf else "catalog")
            console.print(f"step model: {source}", markup=False)
            if row.correction is not None:
                console.print(correction_line(row.correction), markup=False)
        return
    devices = [Device.whole(a) for a in calibrated_catalog().accelerators.values()]
    rows = []
    with console_err.status(f"simulating {arch.name} on {len(devices)} accelerators") as status:
        for device in devices:
            status.update(f"simulating {arch.name} on {device.id}")
            rows.append(device_capacity(arch, device, workload=shape, slo=slo, engine=engine, tp=tp, find=find,
                                        role=role, corrections=corrections))
    _print_table(arch.name, rows, devices, slo, shape, output)


def _stored_profile(store: Store, ref: str, *, model: str, device: str) -> tuple[Profile, int]:
    """The profile named by ``ref``, checked to be of this model and accelerator, and its row id."""
    from hetsched.store.profiles import load_profile_with_id

    profile_id, measured = load_profile_with_id(store, ref)
    if measured.model != model or measured.accelerator != device:
        raise InputError(f"profile {ref} is of {measured.model} on {measured.accelerator}, not {model} on {device}",
                         field="--profile")
    return measured, profile_id


def _slo(ttft: str, tpot: str, percentile: float, max_failure_rate: float) -> SLO:
    if not 0 < percentile < 100:
        raise InputError(f"expected a percentile between 0 and 100, got {percentile}", field="--percentile")
    if not 0 <= max_failure_rate < 1:
        raise InputError(f"expected a share in [0, 1), got {max_failure_rate}", field="--max-failure-rate")
    return SLO(ttft_ms=parse_duration_ms(ttft, field="--slo-ttft", positive=True),
               tpot_ms=parse_duration_ms(tpot, field="--slo-tpot", positive=True),
               percentile=percentile, max_failure_rate=max_failure_rate)


def _role_text(role: Role) -> str:
    if role is Role.PREFILL:
        return "one-token answers under the TTFT target less the KV cache's transfer off the node"
    return "the prompt's KV cache arrives with each request; TPOT target, the TTFT target bounds the wait to start"


def _slo_text(slo: SLO) -> str:
    return f"P{slo.percentile:g} TTFT ≤ {slo.ttft_ms:g} ms, TPOT ≤ {slo.tpot_ms:g} ms, failures ≤ {slo.max_failure_rate:.1%}"


def _print_one(row: DeviceCapacity, slo: SLO, workload: Workload, output: OutputFormat) -> None:
    cap = row.capacity
    assert cap is not None, "an infeasible row is an error before it is printed"
    if output is OutputFormat.json:
        print_json({**cap.to_json(), "correction": correction_json(row.correction)})
        return
    p = f"P{slo.percentile:g}"
    print_table(f"Capacity of {cap.model} on {cap.device} (TP={cap.tp}), workload {workload.name}, {_slo_text(slo)}",
                ["", "value"], [
                    ["requests/s per replica", cap.requests_per_s],
                    ["binding threshold", str(cap.binding)],
                    [f"TTFT P50 / P90 / {p} ms", f"{cap.ttft_ms.p50:.0f} / {cap.ttft_ms.p90:.0f} / "
                                                 f"{cap.ttft_ms.at_slo_percentile:.0f}"],
                    [f"TPOT P50 / P90 / {p} ms", f"{cap.tpot_ms.p50:.1f} / {cap.tpot_ms.p90:.1f} / "
                                                 f"{cap.tpot_ms.at_slo_percentile:.1f}"],
                    [f"queue {p} ms", cap.queue_ms.at_slo_percentile],
                    ["running requests (mean / peak)", f"{cap.mean_concurrency:.0f} / {cap.max_concurrency}"],
                    ["output tokens/s", cap.output_tokens_per_s],
                    ["KV cache tokens", cap.kv_tokens],
                    ["failure rate", f"{cap.failure_rate:.2%}"],
                    ["requests simulated", cap.requests_simulated],
                ])
    if cap.buckets:
        print_table("Per request-size bucket", ["bucket", "share", "requests/s", "binding", f"TTFT {p} ms",
                                                f"TPOT {p} ms"],
                    [[b.label, f"{b.share:.1%}", b.capacity.requests_per_s, str(b.capacity.binding),
                      b.capacity.ttft_ms.at_slo_percentile, b.capacity.tpot_ms.at_slo_percentile]
                     if b.capacity else [b.label, f"{b.share:.1%}", None, b.reason, None, None] for b in cap.buckets])


def _print_table(model: str, rows: list[DeviceCapacity], devices: list[Device], slo: SLO, workload: Workload,
                 output: OutputFormat) -> None:
    if output is OutputFormat.json:
        print_json([{"device": r.device, "tp": r.tp, "capacity": r.capacity.to_json() if r.capacity else None,
                     "reason": r.reason, "correction": correction_json(r.correction)} for r in rows])
        return
    price = {d.id: d.accelerator.price_per_hour for d in devices}
    p = f"P{slo.percentile:g}"
    table_rows: list[list[object]] = []
    for r in rows:
        c = r.capacity
        if c is None:
            table_rows.append([r.device, None, None, None, None, None, None, None, r.reason])
            continue
        table_rows.append([r.device, c.tp, c.requests_per_s, str(c.binding), round(c.ttft_ms.at_slo_percentile),
                           c.tpot_ms.at_slo_percentile, c.max_concurrency,
                           c.dollars_per_million_requests(price[r.device]) if price[r.device] else None, None])
    columns = ["device", "TP", "req/s", "binding", f"TTFT {p} ms", f"TPOT {p} ms", "peak running", "$ / 1M req",
               "why not"]
    if all(r.capacity for r in rows):
        columns, table_rows = columns[:-1], [row[:-1] for row in table_rows]
    print_table(f"Capacity of {model} per replica, workload {workload.name}, {_slo_text(slo)}", columns, table_rows)
    for r in rows:
        if r.correction is not None and r.capacity is not None:
            console.print(f"{r.device} TP={r.tp}: {correction_line(r.correction)}", markup=False)
    console.print("[dim]$ / 1M req at catalog list prices; override prices in the cluster spec.[/]")
