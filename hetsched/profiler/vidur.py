"""Vidur's profiling CSVs as Profiles: measured operator timings from GPUs that are not at hand.

Vidur (github.com/microsoft/vidur) times each operator of one transformer
layer on one tensor-parallel shard, the attention kernel, and NCCL
collectives, and publishes the results for A100 and A40 GPUs. This module
turns the text of those files (the slimmed layout that
``data/measurements/vidur/README.md`` describes) into one :class:`Profile`
per (GPU, model, TP) with the kernel profiler's conventions: the table names,
kernels and terms of :func:`hetsched.profiler.plan.model_ops`, seconds, the
median of repeated rows as the median and their maximum as the p90.

It is pure: callers read the files and pass their names and text. Any bad row
is an :class:`InputError` naming the file, the row (the header is row 1) and
the column, raised before a single Profile is returned, so a caller can store
all of them or none.

Models are matched by shape (heads, KV heads, hidden, intermediate, gated MLP)
to a bundled config; where several share it, the nearest vocabulary decides
(Llama-2-70B and Llama-3.1-70B differ only there). The vocabulary need not be
equal because Vidur pads Llama-2's 32000 tokens to 32768, and the one operator
that reads it, the embedding lookup, gathers one row per token whatever the
table's length. Meta-Llama-3-8B and -70B match the
bundled ``llama-3.1-8b`` and ``llama-3.1-70b``: Llama 3.1 only adds rope
scaling for a longer context, which no timed operator sees.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import PurePath

from hetsched.catalog import load_catalog
from hetsched.errors import InputError
from hetsched.profiler.plan import Kernel, model_ops
from hetsched.profiler.profile import Measurement, OpTable, Profile, ProfileSource, Provenance, Term, Variable
from hetsched.specs.model import LayerKind, ModelArch
from hetsched.specs.registry import bundled_model_names, load_model

VIDUR_COMMIT = "7d47513"
"""The Vidur commit whose profiler and file layout these imports follow."""

DEVICES = {"a100": "a100-80gb", "a40": "a40", "h100": "h100-sxm"}
"""Vidur's device names → catalog ids (Vidur profiles A100 80GB and H100 in DGX, i.e. SXM, nodes)."""

TOPOLOGY_PREFERENCE = ("dgx", "pairwise_nvlink")
"""Where an all-reduce table comes from when a device was measured on several: the full NVSwitch node first."""

COLLECTIVES = ("all_reduce", "send_recv")


class FileKind(StrEnum):
    """What a Vidur CSV holds: its folder in the layout ``<device>/<kind>/<file>.csv``."""

    OPS = "ops"
    ATTENTION = "attention"
    NETWORK = "network"


@dataclass(frozen=True)
class VidurFile:
    """One CSV as the user named it (for messages and provenance) and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class VidurShape:
    """A model's shape as Vidur's ops files state it: the whole model, not one shard."""

    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    vocab: int
    gated_mlp: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class CollectiveMeasurement:
    """One row of a network file: a collective over ``workers`` GPUs of a ``size_bytes`` buffer."""

    accelerator: str
    topology: str
    collective: str
    workers: int
    size_bytes: int
    median_s: float
    file: str
    row: int


# --- reading rows -------------------------------------------------------------


def _error(file: str, row: int, column: str | None, message: str) -> InputError:
    return InputError(message, field=f"{file}, row {row}" + (f", column {column}" if column else ""))


@dataclass(frozen=True)
class _Row:
    """One data row; its accessors refuse a value with the file, row and column named."""

    file: str
    line: int
    values: dict[str, str]

    def fail(self, column: str | None, message: str) -> InputError:
        return _error(self.file, self.line, column, message)

    def text(self, column: str) -> str:
        value = self.values[column].strip()
        if not value:
            raise self.fail(column, "expected a value, got an empty field")
        return value

    def number(self, column: str) -> float:
        raw = self.text(column)
        try:
            value = float(raw)
        except ValueError:
            raise self.fail(column, f"expected a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise self.fail(column, f"expected a finite number, got {raw!r}")
        return value

    def count(self, column: str, *, minimum: int = 1) -> int:
        value = self.number(column)
        if not value.is_integer() or value < minimum:
            raise self.fail(column, f"expected a whole number ≥ {minimum}, got {self.values[column].strip()!r}")
        return int(value)

    def seconds(self, column: str) -> float:
        """A time in milliseconds, as seconds; zero or negative is a broken measurement."""
        value = self.number(column)
        if value <= 0:
            raise self.fail(column, f"expected a positive time in milliseconds, got {self.values[column].strip()!r}")
        return value / 1e3

    def flag(self, column: str) -> bool:
        raw = self.text(column).lower()
        if raw not in ("true", "false", "1", "0"):
            raise self.fail(column, f"expected True or False, got {self.values[column].strip()!r}")
        return raw in ("true", "1")

    def accelerator(self) -> str:
        device = self.text("device")
        if device.lower() not in DEVICES:
            raise self.fail("device", f"unknown GPU {device!r}; Vidur devices hetsched knows: {', '.join(DEVICES)}")
        return DEVICES[device.lower()]


_OPS_REQUIRED = ("device", "model", "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size",
                 "use_gated_mlp", "num_tokens", "num_tensor_parallel_workers")
_ATTENTION_REQUIRED = ("device", "model", "tp", "phase", "batch", "kv_tokens", "prefill_tokens", "attention_ms")
_NETWORK_REQUIRED = ("device", "topology", "collective", "num_workers", "size_bytes", "median_ms")


def _kind(file: VidurFile, header: Sequence[str]) -> FileKind:
    """The kind by the layout's folder name, else by the columns that only that kind has."""
    folder = PurePath(file.name).parent.name
    if folder in set(FileKind):
        return FileKind(folder)
    for kind, marker in ((FileKind.NETWORK, "collective"), (FileKind.ATTENTION, "phase"), (FileKind.OPS, "num_tokens")):
        if marker in header:
            return kind
    raise _error(file.name, 1, None, "not a Vidur ops, attention or network CSV: put it under <device>/ops, "
                 "<device>/attention or <device>/network, or give it the columns data/measurements/vidur/README.md "
                 "lists")


def _read(file: VidurFile) -> tuple[FileKind, list[_Row]]:
    """The file's kind and data rows, once its header has every column that kind needs."""
    reader = csv.reader(io.StringIO(file.text))
    header = [column.strip() for column in next(reader, [])]
    if not any(header):
        raise _error(file.name, 1, None, "the file is empty; expected a header row")
    kind = _kind(file, header)
    required = {FileKind.OPS: _OPS_REQUIRED + tuple(c.column for c in _OP_COLUMNS if c.required),
                FileKind.ATTENTION: _ATTENTION_REQUIRED, FileKind.NETWORK: _NETWORK_REQUIRED}[kind]
    missing = [column for column in required if column not in header]
    if missing:
        raise _error(file.name, 1, ", ".join(missing), f"missing column{'s' if len(missing) > 1 else ''} in a Vidur "
                     f"{kind} file")
    rows = []
    for fields in reader:
        if not any(f.strip() for f in fields):
            continue
        if len(fields) < len(header):
            raise _error(file.name, reader.line_num, header[len(fields)], "the row ends before this column")
        rows.append(_Row(file.name, reader.line_num, dict(zip(header, fields, strict=False))))
    if not rows:
        raise _error(file.name, 2, None, "no data rows after the header")
    return kind, rows


# --- the operators of an ops file ----------------------------------------------


@dataclass(frozen=True)
class _OpColumn:
    """One timed operator column and the kernel-profile table it becomes, with per-shard dims."""

    column: str
    op: str
    kernel: Kernel
    dims: Callable[[VidurShape, int], dict[str, int]]
    required: bool = True


_OP_COLUMNS = (
    _OpColumn("attn_pre_proj_ms", "qkv_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.hidden, "n": (s.heads + 2 * s.kv_heads) * s.head_dim // tp}),
    _OpColumn("attn_post_proj_ms", "o_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.heads * s.head_dim // tp, "n": s.hidden}),
    _OpColumn("attn_rope_ms", "rope", Kernel.ROPE,
              lambda s, tp: {"heads": s.heads // tp, "kv_heads": s.kv_heads // tp, "head_dim": s.head_dim}),
    _OpColumn("mlp_up_proj_ms", "gate_up_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.hidden, "n": (2 if s.gated_mlp else 1) * s.intermediate // tp}),
    _OpColumn("mlp_act_ms", "silu_mul", Kernel.SILU_MUL,
              lambda s, tp: {"inter": s.intermediate // tp, "gated": int(s.gated_mlp)}),
    _OpColumn("mlp_down_proj_ms", "down_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.intermediate // tp, "n": s.hidden}),
    _OpColumn("input_layernorm_ms", "input_layernorm", Kernel.RMSNORM, lambda s, tp: {"hidden": s.hidden}),
    # Parallel-block models (phi-2) have one norm per layer, and their files no such column.
    _OpColumn("post_attention_layernorm_ms", "post_attention_layernorm", Kernel.RMSNORM,
              lambda s, tp: {"hidden": s.hidden}, required=False),
    _OpColumn("add_ms", "residual_add", Kernel.ADD, lambda s, tp: {"hidden": s.hidden}),
    _OpColumn("emb_ms", "embedding", Kernel.EMBEDDING, lambda s, tp: {"vocab": s.vocab, "hidden": s.hidden}),
)

_NORMS = ("input_layernorm", "post_attention_layernorm")
"""The per-layer norms Vidur times apart; model_ops counts them (and the final norm) as one ``rmsnorm``."""


def _shape(row: _Row) -> VidurShape:
    return VidurShape(heads=row.count("n_head"), kv_heads=row.count("n_kv_head"), hidden=row.count("n_embd"),
                      intermediate=row.count("n_expanded_embd"), vocab=row.count("vocab_size"),
                      gated_mlp=row.flag("use_gated_mlp"))


_SHAPE_COLUMNS = {"heads": "n_head", "kv_heads": "n_kv_head", "hidden": "n_embd", "intermediate": "n_expanded_embd",
                  "vocab": "vocab_size", "gated_mlp": "use_gated_mlp"}


def _tp(row: _Row, column: str, shape: VidurShape) -> int:
    """The tensor-parallel size, refused unless it splits the heads and the MLP width evenly."""
    tp = row.count(column)
    if shape.heads % tp or shape.kv_heads % tp or shape.intermediate % tp:
        raise row.fail(column, f"unknown tensor-parallel size {tp}: it must divide the heads ({shape.heads}), KV "
                               f"heads ({shape.kv_heads}) and n_expanded_embd ({shape.intermediate})")
    return tp


# --- model matching ---------------------------------------------------------------


def normalized_name(vidur_model: str) -> str:
    """How ops and attention files name the same model: ``Llama-2-7b-hf`` and ``llama-2-7b`` agree."""
    return vidur_model.strip().lower().removesuffix("-hf")


def _disagreement(arch: ModelArch, shape: VidurShape) -> str | None:
    """What in ``arch`` differs from the measured shape (the vocabulary aside), or None."""
    if arch.mla is not None or arch.moe is not None or arch.count(LayerKind.LINEAR):
        return "its layers are not the dense attention and MLP blocks Vidur times"
    pairs = (("attention heads", arch.num_heads, shape.heads), ("KV heads", arch.num_kv_heads, shape.kv_heads),
             ("hidden size", arch.hidden_size, shape.hidden), ("head size", arch.head_dim, shape.head_dim),
             ("intermediate size", arch.intermediate_size, shape.intermediate),
             ("gated MLP", arch.gated_mlp, shape.gated_mlp))
    for what, ours, theirs in pairs:
        if ours != theirs:
            return f"its {what} is {ours}, the file's {theirs}"
    return None


def match_model(shape: VidurShape, *, model: ModelArch | None = None) -> ModelArch:
    """The hetsched model whose operators the file timed: ``model`` if given (it must agree), else the
    bundled config of that shape with the nearest vocabulary (padding moves it a little, a new tokenizer a lot)."""
    if model is not None:
        problem = _disagreement(model, shape)
        if problem:
            raise InputError(f"model {model.name} does not match the measured shape: {problem}")
        return model
    candidates = [arch for arch in (load_model(name) for name in bundled_model_names())
                  if _disagreement(arch, shape) is None]
    nearest = min((abs(arch.vocab_size - shape.vocab) for arch in candidates), default=0)
    chosen = [arch for arch in candidates if abs(arch.vocab_size - shape.vocab) == nearest]
    if len(chosen) == 1:
        return chosen[0]
    described = (f"{shape.heads} heads, {shape.kv_heads} KV heads, hidden {shape.hidden}, intermediate "
                 f"{shape.intermediate}, {'gated' if shape.gated_mlp else 'ungated'} MLP, vocabulary {shape.vocab}")
    if not chosen:
        raise InputError(f"no bundled model has this shape ({described}); pass --model with the path to its "
                         "config.json")
    raise InputError(f"several bundled models have this shape ({', '.join(a.name for a in chosen)}); pass --model "
                     "to choose")


# --- parsing each kind ------------------------------------------------------------


@dataclass
class _Group:
    """Everything measured for one (GPU, Vidur model, TP): the seed of one Profile."""

    accelerator: str
    vidur_model: str
    shape: VidurShape
    tp: int
    first: _Row
    times: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    decode: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    prefill: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def _note_file(group: _Group, name: str) -> None:
    if name not in group.files:
        group.files.append(name)


def _parse_ops(rows: Iterable[_Row], groups: dict[tuple[str, str, int], _Group],
               shapes: dict[str, tuple[VidurShape, _Row]]) -> None:
    for row in rows:
        accelerator, vidur_model, shape = row.accelerator(), row.text("model"), _shape(row)
        known, first = shapes.setdefault(normalized_name(vidur_model), (shape, row))
        if shape != known:
            attr, column = next((a, c) for a, c in _SHAPE_COLUMNS.items() if getattr(shape, a) != getattr(known, a))
            raise row.fail(column, f"{vidur_model} has {column} {getattr(known, attr)} at {first.file} row "
                                   f"{first.line}; one model has one shape")
        tp = _tp(row, "num_tensor_parallel_workers", shape)
        tokens = row.count("num_tokens")
        group = groups.setdefault((accelerator, normalized_name(vidur_model), tp),
                                  _Group(accelerator, vidur_model, shape, tp, row))
        _note_file(group, row.file)
        for spec in _OP_COLUMNS:
            if spec.column in row.values:
                group.times.setdefault(spec.op, {}).setdefault(tokens, []).append(row.seconds(spec.column))


def _parse_attention(rows: Iterable[_Row], groups: dict[tuple[str, str, int], _Group]) -> None:
    for row in rows:
        accelerator, name, tp = row.accelerator(), normalized_name(row.text("model")), row.count("tp")
        group = groups.get((accelerator, name, tp))
        if group is None:
            measured = sorted(t for a, n, t in groups if (a, n) == (accelerator, name))
            if measured:
                raise row.fail("tp", f"unknown tensor-parallel size {tp}: the ops files measure {row.text('model')} "
                                     f"on {accelerator} at TP {', '.join(map(str, measured))}")
            raise row.fail("model", f"no ops file in this import measures {row.text('model')} on {accelerator}; "
                                    "import its <device>/ops/<model>.csv with it")
        _note_file(group, row.file)
        phase, seconds = row.text("phase").lower(), row.seconds("attention_ms")
        if phase == "decode":
            group.decode.setdefault((row.count("batch"), row.count("kv_tokens")), []).append(seconds)
        elif phase == "prefill":
            if row.count("batch") != 1:
                raise row.fail("batch", "a prefill row times one sequence; expected 1")
            group.prefill.setdefault((row.count("prefill_tokens"), row.count("kv_tokens", minimum=0)),
                                     []).append(seconds)
        else:
            raise row.fail("phase", f"expected decode or prefill, got {row.values['phase'].strip()!r}")


def _parse_network(rows: Iterable[_Row]) -> list[CollectiveMeasurement]:
    measurements = []
    for row in rows:
        collective = row.text("collective")
        if collective not in COLLECTIVES:
            raise row.fail("collective", f"expected one of {', '.join(COLLECTIVES)}, got {collective!r}")
        topology = row.text("topology").removeprefix(f"{row.text('device').lower()}_")
        measurements.append(CollectiveMeasurement(
            accelerator=row.accelerator(), topology=topology, collective=collective,
            workers=row.count("num_workers", minimum=2), size_bytes=row.count("size_bytes"),
            median_s=row.seconds("median_ms"), file=row.file, row=row.line))
    return measurements


def collective_measurements(files: Sequence[VidurFile]) -> list[CollectiveMeasurement]:
    """Every row of the network files among ``files`` (others are skipped), in file order, seconds.

    The raw rows, repeats included, so a calibrator can fit collective models (all-reduce and
    send/recv) to them directly.
    """
    measurements = []
    for file in files:
        kind, rows = _read(file)
        if kind is FileKind.NETWORK:
            measurements.extend(_parse_network(rows))
    return measurements


# --- building profiles ----------------------------------------------------------------


def _median_and_max(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values)


def _tables(group: _Group, collectives: Sequence[CollectiveMeasurement]) -> tuple[list[OpTable], str | None]:
    """The profile's tables in model_ops' order, and the topology its all-reduce table came from."""
    shape, tp = group.shape, group.tp
    tables = []
    for spec in _OP_COLUMNS:
        by_tokens = group.times.get(spec.op)
        if by_tokens:
            points = tuple(Measurement((float(tokens),), *_median_and_max(times))
                           for tokens, times in sorted(by_tokens.items()))
            tables.append(OpTable(spec.op, str(spec.kernel), Variable.TOKENS, {**spec.dims(shape, tp), "tp": tp},
                                  points))
    attention = {"heads": shape.heads // tp, "kv_heads": shape.kv_heads // tp, "head_dim": shape.head_dim, "tp": tp}
    if group.prefill:
        points = tuple(Measurement((new * cached + new * (new + 1) / 2,), *_median_and_max(times))
                       for (new, cached), times in _prefill_order(group.prefill))
        tables.append(OpTable("prefill_attention", str(Kernel.PREFILL_ATTENTION), Variable.PREFILL_PAIRS,
                              dict(attention), points))
    if group.decode:
        points = tuple(Measurement((float(batch), float(context)), *_median_and_max(times))
                       for (batch, context), times in sorted(group.decode.items()))
        tables.append(OpTable("decode_attention", str(Kernel.DECODE_ATTENTION), Variable.DECODE, dict(attention),
                              points))
    topology = None
    if tp > 1:
        rows = [m for m in collectives if m.accelerator == group.accelerator and m.collective == "all_reduce"
                and m.workers == tp]
        topology = next((t for t in TOPOLOGY_PREFERENCE if any(m.topology == t for m in rows)), None)
        if topology is not None:
            bytes_per_token = shape.hidden * 2  # fp16 activations
            by_size: dict[int, list[float]] = {}
            for m in rows:
                if m.topology == topology:
                    by_size.setdefault(m.size_bytes, []).append(m.median_s)
            # Vidur's sweep repeats a worker count with the ranks on one node and spread over nodes (the
            # slimmed files drop which): the fastest row of a size is the one-node placement TP runs on.
            points = tuple(Measurement((size / bytes_per_token,), min(times), min(times))
                           for size, times in sorted(by_size.items()))
            tables.append(OpTable("all_reduce", str(Kernel.ALL_REDUCE), Variable.TOKENS,
                                  {"workers": tp, "hidden": shape.hidden, "bytes_per_token": bytes_per_token,
                                   "tp": tp}, points))
    return tables, topology


def _prefill_order(prefill: dict[tuple[int, int], list[float]]) -> list[tuple[tuple[int, int], list[float]]]:
    """Prefill points by attention pairs (the table's coordinate), then new tokens."""
    return sorted(prefill.items(), key=lambda item: (item[0][0] * item[0][1] + item[0][0] * (item[0][0] + 1) / 2,
                                                     item[0]))


def _terms(arch: ModelArch, names: set[str]) -> list[Term]:
    """model_ops' terms for the tables present, the per-layer norms, and two all-reduces per layer."""
    _, terms = model_ops(arch)
    kept = [term for term in terms if term.table in names]
    layers = arch.num_layers
    kept += [Term("elementwise", norm, layers) for norm in _NORMS if norm in names]
    if "all_reduce" in names:
        kept.append(Term("all-reduce", "all_reduce", 2 * layers))
    return kept


def _missing(arch: ModelArch, names: set[str], tp: int) -> list[str]:
    """The step's operators these files do not time, as breakdown names, so nobody takes the profile as whole."""
    _, terms = model_ops(arch)
    missing = [term.name for term in terms if term.table not in names and term.table != "rmsnorm"]
    missing.append("final norm")
    if tp > 1 and "all_reduce" not in names:
        missing.append("all-reduce")
    return list(dict.fromkeys(missing))


def _profile(group: _Group, arch: ModelArch, collectives: Sequence[CollectiveMeasurement], *,
             catalog_names: dict[str, str], created_at: str) -> Profile:
    tables, topology = _tables(group, collectives)
    names = {table.op for table in tables}
    sweep: dict[str, object] = {"origin": "vidur", "vidur_model": group.vidur_model,
                                "missing_ops": _missing(arch, names, group.tp)}
    if group.prefill:
        sweep["prefill_points"] = [[new, cached] for (new, cached), _ in _prefill_order(group.prefill)]
    files = list(group.files)
    if topology is not None:
        sweep["all_reduce_topology"] = topology
        files += sorted({m.file for m in collectives if m.accelerator == group.accelerator
                         and m.collective == "all_reduce" and m.topology == topology} - set(files))
    sweep["files"] = files
    device = {"catalog": group.accelerator, "name": catalog_names[group.accelerator], "origin": "vidur",
              "file": group.first.file}
    provenance = Provenance(host="", device=device, driver="vidur profiler (PyTorch/cuBLAS fp16, CUDA events)",
                            versions={"vidur": VIDUR_COMMIT}, created_at=created_at)
    return Profile(model=arch.name, accelerator=group.accelerator, source=ProfileSource.KERNEL, backend="cuda",
                   tables=tuple(tables), terms=tuple(_terms(arch, names)), provenance=provenance, sweep=sweep,
                   tp=group.tp, dtype="fp16")


def profiles_from_vidur(files: Sequence[VidurFile], *, model: ModelArch | None = None) -> list[Profile]:
    """One Profile per (GPU, model, TP) that the ops files among ``files`` measure, with the attention and
    all-reduce tables of the other files added; ``model`` forces the hetsched model of a single-model import.

    Every file is read and every model matched before anything is returned: one bad row refuses the lot.
    """
    groups: dict[tuple[str, str, int], _Group] = {}
    shapes: dict[str, tuple[VidurShape, _Row]] = {}
    parsed = [_read(file) for file in files]
    for kind, rows in parsed:
        if kind is FileKind.OPS:
            _parse_ops(rows, groups, shapes)
    for kind, rows in parsed:
        if kind is FileKind.ATTENTION:
            _parse_attention(rows, groups)
    collectives = [m for kind, rows in parsed if kind is FileKind.NETWORK for m in _parse_network(rows)]
    if not groups:
        raise InputError("no Vidur ops file among the inputs; the profiles are built from <device>/ops/<model>.csv",
                         field="files")
    if model is not None and len(shapes) > 1:
        raise InputError(f"a forced model names one model; these files measure {len(shapes)}: "
                         + ", ".join(sorted(shapes)), field="model")
    archs = {}
    for name, (shape, first) in shapes.items():
        try:
            archs[name] = match_model(shape, model=model)
        except InputError as exc:
            raise first.fail("model", f"{first.text('model')}: {exc}") from exc
    catalog = load_catalog()
    catalog_names = {acc: catalog.get(acc).name for acc in {group.accelerator for group in groups.values()}}
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ordered = sorted(groups.values(), key=lambda g: (g.first.file, g.tp))
    return [_profile(group, archs[normalized_name(group.vidur_model)], collectives, catalog_names=catalog_names,
                     created_at=created_at) for group in ordered]
