"""Commands over specs: models, accelerators, memory fit, roofline estimate."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, TypedDict

import typer

from hetsched.catalog import Catalog, Device, host_catalog, load_catalog
from hetsched.cli.output import OutputFormat, console, print_json, print_table
from hetsched.errors import InputError
from hetsched.partition.mig import enumerate_layouts
from hetsched.perf.memory import fit, smallest_fit, tp_degrees
from hetsched.specs.dtypes import KV_CACHE_DTYPES, parse_dtype
from hetsched.specs.model import ModelArch
from hetsched.specs.registry import bundled_model_names, load_model

if TYPE_CHECKING:  # typeshed's name for "any dataclass instance"; no module defines it at run time
    from _typeshed import DataclassInstance

    from hetsched.perf.in_force import Corrections

Output = Annotated[OutputFormat, typer.Option("--output", "-o", help="table for people, json for scripts")]

models_app = typer.Typer(help="Bundled and local model configs.", no_args_is_help=True)
accelerators_app = typer.Typer(help="The accelerator catalog.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
    app.add_typer(accelerators_app, name="accelerators")
    app.command("fit")(fit_command)
    app.command("estimate")(estimate_command)


def model_summary(m: ModelArch) -> dict[str, object]:
    """The stable JSON shape of a model (``hetsched models ... -o json``)."""
    return {
        "name": m.name, "model_type": m.model_type, "attention": str(m.attention), "layers": m.num_layers,
        "hidden_size": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings,
        "dtype": str(m.dtype), "expert_dtype": str(m.expert_dtype) if m.expert_dtype else None,
        "max_context": m.max_context, "total_params": m.total_params, "active_params": m.active_params,
        "layer_kinds": {str(k): m.count(k) for k in sorted(set(m.layer_kinds))},
        "sliding_window": m.sliding_window, "moe": _asdict(m.moe), "mla": _asdict(m.mla),
        "linear_attention": _asdict(m.linear_attention),
    }


def _asdict(value: DataclassInstance | None) -> dict[str, object] | None:
    return dataclasses.asdict(value) if value is not None else None


def _features(m: ModelArch) -> str:
    parts = [str(m.attention).upper()]
    if m.moe:
        parts.append(f"MoE {m.moe.experts_per_token}/{m.moe.num_experts}")
    if m.sliding_window:
        parts.append(f"SWA {m.sliding_window}")
    if m.linear_attention:
        parts.append("hybrid linear")
    return ", ".join(parts)


@models_app.command("list")
def models_list(output: Output = OutputFormat.table) -> None:
    """List the bundled model configs."""
    models = [load_model(name) for name in bundled_model_names()]
    if output is OutputFormat.json:
        print_json([model_summary(m) for m in models])
        return
    print_table("Bundled models", ["model", "type", "layers", "params (B)", "active (B)", "architecture", "max ctx"],
                [[m.name, m.model_type, m.num_layers, m.total_params / 1e9, m.active_params / 1e9, _features(m),
                  m.max_context] for m in models])


@models_app.command("show")
def models_show(model: Annotated[str, typer.Argument(help="bundled name or path to a config.json")],
                output: Output = OutputFormat.table) -> None:
    """Show one model's architecture and parameter counts."""
    summary = model_summary(load_model(model))
    if output is OutputFormat.json:
        print_json(summary)
        return
    print_table(f"Model {summary['name']}", ["field", "value"], [[k, v] for k, v in summary.items()])


class AcceleratorSummary(TypedDict):
    """What ``accelerators list`` and ``show`` print of a catalog entry."""

    id: str
    name: str
    vendor: str
    memory_gb: float
    memory_tbs: float
    tflops: dict[str, float]
    interconnect_gbs: float
    price_per_hour: float
    gpus_per_node: int
    products: list[str]
    resource: str
    mig_profiles: list[str]
    mig_layouts: int
    amd_partition_modes: list[str]


def accelerator_summary(acc_id: str) -> AcceleratorSummary:
    acc = host_catalog().get(acc_id)
    return {
        "id": acc.id, "name": acc.name, "vendor": str(acc.vendor), "memory_gb": acc.memory_gb,
        "memory_tbs": acc.memory_tbs, "tflops": {str(k): v for k, v in acc.tflops.items()},
        "interconnect_gbs": acc.interconnect_gbs, "price_per_hour": acc.price_per_hour,
        "gpus_per_node": acc.gpus_per_node, "products": list(acc.products), "resource": acc.resource_name,
        "mig_profiles": [p.name for p in acc.mig.profiles] if acc.mig else [],
        "mig_layouts": len(enumerate_layouts(acc.mig)) if acc.mig else 0,
        "amd_partition_modes": acc.amd_partitions.valid_modes() if acc.amd_partitions else [],
    }


@accelerators_app.command("list")
def accelerators_list(output: Output = OutputFormat.table) -> None:
    """List the catalog (the CPU entry describes this host)."""
    ids = [*load_catalog().accelerators, "cpu"]
    rows = [accelerator_summary(i) for i in ids]
    if output is OutputFormat.json:
        print_json(rows)
        return
    print_table("Accelerator catalog", ["id", "name", "bf16 TFLOP/s", "HBM GB", "TB/s", "$/h", "partitions"],
                [[r["id"], r["name"], r["tflops"].get("bf16", r["tflops"].get("fp16")), r["memory_gb"],
                  r["memory_tbs"], r["price_per_hour"],
                  ", ".join(r["mig_profiles"] or r["amd_partition_modes"]) or None] for r in rows])


@accelerators_app.command("show")
def accelerators_show(accelerator: str, output: Output = OutputFormat.table) -> None:
    """Show one accelerator, with its MIG profiles or AMD partition modes."""
    summary = accelerator_summary(accelerator)
    if output is OutputFormat.json:
        print_json(summary)
        return
    print_table(f"Accelerator {accelerator}", ["field", "value"], [[k, v] for k, v in summary.items()])


def parse_device(spec: str) -> Device:
    """A device named on the command line; ``cpu`` describes this host."""
    return calibrated_catalog().device(spec)


def calibrated_catalog() -> Catalog:
    """The catalog on this host, each device with its newest trusted stored calibration over the shipped constants."""
    from hetsched.cli.database import store_on_demand  # the settings and the store load only for commands that time steps
    from hetsched.store.calibrations import calibrated_constants

    return host_catalog().with_perf(calibrated_constants(store_on_demand()))


def corrections_in_use() -> Corrections:
    """The newest trusted step-model correction per key in the store, read from its file as the calibrations are;
    each applies to exactly its model, device and TP (:mod:`hetsched.perf.in_force`)."""
    from hetsched.cli.database import store_on_demand
    from hetsched.store.corrections import corrections_in_force

    return corrections_in_force(store_on_demand())


def check_tp(arch: ModelArch, device: Device, tp: int, *, field: str = "--tp") -> None:
    """A tensor-parallel size is at least 1 and splits the attention heads evenly (as ``fit`` requires)."""
    if tp < 1:
        raise InputError(f"expected a tensor-parallel size of at least 1, got {tp}", field=field)
    if arch.num_heads % tp:
        raise InputError(f"{arch.num_heads} attention heads of {arch.name} do not split evenly over TP={tp}; try "
                         f"{', '.join(map(str, tp_degrees(arch, device)))}", field=field)


def fit_command(
    model: Annotated[str, typer.Argument(help="bundled name or path to a config.json")],
    accelerators: Annotated[list[str] | None, typer.Argument(
        help="accelerator ids, MIG slices (h100-sxm:1g.10gb) or AMD partitions; default: the whole catalog")] = None,
    tp: Annotated[int | None, typer.Option(help="tensor-parallel size; default: the smallest that fits")] = None,
    dtype: Annotated[str | None, typer.Option(help="weight dtype: bf16, fp8, int8, int4, mxfp4, nvfp4")] = None,
    kv_dtype: Annotated[str | None, typer.Option(help="KV cache dtype: bf16, fp16 or fp8")] = None,
    context: Annotated[int, typer.Option(help="context length one sequence must hold")] = 8192,
    output: Output = OutputFormat.table,
) -> None:
    """Memory breakdown of MODEL on each accelerator: weights, KV capacity, smallest TP.

    Memory does not depend on step-model constants, so the devices come from the shipped catalog, not the store."""
    arch = load_model(model)
    weight_dt = parse_dtype(dtype, field="--dtype") if dtype else None
    kv_dt = parse_dtype(kv_dtype, field="--kv-dtype", allowed=KV_CACHE_DTYPES) if kv_dtype else None
    if context < 1:
        raise InputError(f"expected a positive token count, got {context}", field="--context")
    check_context(arch, context)
    if tp is not None and tp < 1:
        raise InputError(f"expected a tensor-parallel size of at least 1, got {tp}", field="--tp")
    if accelerators:
        catalog = host_catalog()
        devices = [catalog.device(a) for a in accelerators]
    else:
        devices = [Device.whole(a) for a in load_catalog().accelerators.values()]
    fits = [fit(arch, d, tp=tp, weight_dtype=weight_dt, kv_dtype=kv_dt, context_len=context) if tp
            else smallest_fit(arch, d, weight_dtype=weight_dt, kv_dtype=kv_dt, context_len=context) for d in devices]
    if output is OutputFormat.json:
        print_json(fits)
        return
    print_table(f"Memory fit of {arch.name} ({fits[0].weight_dtype} weights, {fits[0].kv_dtype} KV, {context}-token context)",
                ["device", "TP", "fits", "weights GB/dev", "KV GB/dev", "KV tokens", "seqs @ctx", "why not"],
                [[f.device, f.tp, f.fits, f.weights_gb, f.kv_cache_gb, f.max_kv_tokens, f.max_sequences_at_context,
                  f.reason] for f in fits])


MAX_STEP_SEQUENCES = 1 << 16
"""More sequences than any engine batches in one step (vLLM's max_num_seqs is 256 to 1,024)."""


def check_context(arch: ModelArch, tokens: int, *, field: str = "--context") -> None:
    """A sequence no longer than the model's context window: past it the figures would be for a model that
    does not exist."""
    if tokens > arch.max_context:
        raise InputError(f"expected at most {arch.name}'s context window of {arch.max_context} tokens, got {tokens}",
                         field=field)


def estimate_command(
    model: Annotated[str, typer.Argument(help="bundled name or path to a config.json")],
    accelerator: Annotated[str, typer.Argument(help="accelerator id or MIG slice / AMD partition")],
    batch: Annotated[int, typer.Option(help="decoding sequences in the step")] = 1,
    context: Annotated[int, typer.Option(help="context length of each decoding sequence")] = 1024,
    prefill: Annotated[int, typer.Option(help="prefill tokens in the step (one new request)")] = 0,
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    dtype: Annotated[str | None, typer.Option(help="weight dtype")] = None,
    output: Output = OutputFormat.table,
) -> None:
    """Roofline step latency of one engine step, with a per-operator breakdown.

    The step model is corrected by the step-model correction in force for the model, accelerator and TP, if any."""
    # the step model loads only for the commands that time steps
    from hetsched.perf.in_force import correction_for, correction_json, correction_line, replica_step_model
    from hetsched.perf.roofline import RooflineModel
    from hetsched.perf.step import StepShape

    arch = load_model(model)
    if batch < 0 or prefill < 0 or context < 1 or batch + prefill == 0:
        raise InputError("expected --batch ≥ 0 and --prefill ≥ 0 with at least one token, and --context ≥ 1",
                         field="--batch/--prefill/--context")
    if batch > MAX_STEP_SEQUENCES:
        raise InputError(f"expected at most {MAX_STEP_SEQUENCES} decoding sequences in one step, got {batch}",
                         field="--batch")
    check_context(arch, context)
    check_context(arch, prefill, field="--prefill")
    device = parse_device(accelerator)
    check_tp(arch, device, tp)
    roofline = RooflineModel(arch, device, tp=tp, weight_dtype=parse_dtype(dtype, field="--dtype") if dtype else None)
    correction = correction_for(corrections_in_use(), arch, device, tp)
    step_model = replica_step_model(arch, device, tp=tp, step_model=roofline, correction=correction)
    shape = StepShape.build(prefill=[(prefill, 0)] if prefill else [], decode_contexts=[context] * batch)
    ops = step_model.breakdown(shape)
    total = sum(op.seconds for op in ops)
    if output is OutputFormat.json:
        print_json({"step_ms": total * 1e3, "tokens": shape.tokens, "tokens_per_s": shape.tokens / total,
                    "step_model": roofline.source, "correction": correction_json(correction),
                    "tpot_ms": total * 1e3 if batch else None, "ops": ops})
        return
    print_table(f"Roofline step of {arch.name} on {accelerator} (TP={tp}): {prefill} prefill + {batch} decode @ {context}",
                ["operator", "ms", "share", "bound", "GFLOP", "GB moved"],
                [[op.op, op.seconds * 1e3, f"{op.seconds / total:.0%}", op.bound, op.flops / 1e9, op.bytes / 1e9]
                 for op in ops])
    console.print(f"step [bold]{total * 1e3:.2f} ms[/], {shape.tokens / total:,.0f} tokens/s")
    console.print(f"step model: {roofline.source}", markup=False)
    if correction is not None:
        console.print(correction_line(correction), markup=False)
