"""Vidur's profiling CSVs as Profiles: measured operator timings from GPUs that are not at hand.

Vidur (github.com/microsoft/vidur) times each operator of one transformer
layer on one tensor-parallel shard, the attention kernel, and NCCL
collectives, and publishes the results for A100, A40 and H100 GPUs. This
module reads two layouts of those files and turns both into one
:class:`Profile` per (GPU, model, TP) with the kernel profiler's conventions:
the table names, kernels and terms of :func:`hetsched.profiler.plan.model_ops`,
seconds, the median of repeated rows as the median and the largest of their
maxima as the p90.

- The slimmed layout (``data/measurements/vidur/README.md``): one median per
  row, the GPU and model in columns.
- The original layout, as Vidur's profiler writes it and Vidur's repository
  keeps it: ``compute/<device>/<org>/<model>/mlp.csv`` and ``attention.csv``,
  ``network/<device>_<topology>/all_reduce.csv`` and ``send_recv.csv``, each
  timing as ``time_stats.<op>.{min,max,mean,median,std}`` in milliseconds.
  The GPU and model are not in these files: they come from the path, or the
  GPU from the caller (``--device``) where the path does not say.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
    """What a Vidur CSV holds: its folder in the slimmed layout ``<device>/<kind>/<file>.csv``."""

    OPS = "ops"
    ATTENTION = "attention"
    NETWORK = "network"


class Layout(StrEnum):
    """Which of Vidur's two layouts a file follows; both give the same Profiles."""

    SLIMMED = "slimmed"
    ORIGINAL = "original"


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
    """One row of a network file: a collective over ``workers`` GPUs of a ``size_bytes`` buffer.

    ``one_node`` says whether all ranks sat on one node; None where the file does not say (the slimmed layout).
    """

    accelerator: str
    topology: str
    collective: str
    workers: int
    size_bytes: int
    median_s: float
    p90_s: float
    one_node: bool | None
    file: str
    row: int


# --- reading rows -------------------------------------------------------------


def _error(file: str, row: int | None, column: str | None, message: str) -> InputError:
    where = file + (f", row {row}" if row is not None else "") + (f", column {column}" if column else "")
    return InputError(message, field=where)


@dataclass(frozen=True)
class _Row:
    """One data row; its accessors refuse a value with the file, row and column named."""

    file: str
    line: int
    values: dict[str, str]

    def fail(self, column: str | None, message: str) -> InputError:
        return _error(self.file, self.line, column, message)

    def text(self, column: str) -> str:
        if column not in self.values:
            raise self.fail(column, "missing column, which this row needs")
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

    def timing(self, median: str, maximum: str | None) -> tuple[float, float]:
        """(median, p90) in seconds: the maximum of the repeats where the file keeps it, else the median."""
        middle = self.seconds(median)
        if maximum is None or maximum not in self.values:
            return middle, middle
        top = self.seconds(maximum)
        if top < middle:
            raise self.fail(maximum, f"the maximum is below the median ({self.values[median].strip()} ms)")
        return middle, top

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


_SHAPE_COLUMNS = {"heads": "n_head", "kv_heads": "n_kv_head", "hidden": "n_embd", "intermediate": "n_expanded_embd",
                  "vocab": "vocab_size", "gated_mlp": "use_gated_mlp"}
_OPS_COUNTS = ("num_tokens", "num_tensor_parallel_workers")
_REQUIRED = {
    (Layout.SLIMMED, FileKind.OPS): ("device", "model", *_SHAPE_COLUMNS.values(), *_OPS_COUNTS),
    (Layout.SLIMMED, FileKind.ATTENTION): ("device", "model", "tp", "phase", "batch", "kv_tokens", "prefill_tokens",
                                           "attention_ms"),
    (Layout.SLIMMED, FileKind.NETWORK): ("device", "topology", "collective", "num_workers", "size_bytes",
                                         "median_ms"),
    (Layout.ORIGINAL, FileKind.OPS): (*_SHAPE_COLUMNS.values(), *_OPS_COUNTS),
    # The phase's time column is required by the rows of that phase: a decode-only sweep has no prefill columns.
    (Layout.ORIGINAL, FileKind.ATTENTION): ("n_q_head", "n_kv_head", "n_embd", "num_tensor_parallel_workers",
                                            "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill"),
    (Layout.ORIGINAL, FileKind.NETWORK): ("num_workers", "size", "collective"),
}
"""The columns each file needs in its header (ops files also need their operators' time columns)."""

_ORIGINAL_FILES = {FileKind.OPS: "mlp.csv", FileKind.ATTENTION: "attention.csv",
                   FileKind.NETWORK: "all_reduce.csv or send_recv.csv"}
"""How Vidur's profiler names the file of each kind."""


def _recognise(file: VidurFile, header: Sequence[str]) -> tuple[Layout, FileKind]:
    """The layout by its ``time_stats.<op>.<stat>`` columns and the kind by the ops they time; in the slimmed
    layout, the kind by the folder name or else the columns only that kind has."""
    timed = {column.split(".")[1] for column in header if column.startswith("time_stats.") and column.count(".") == 2}
    if timed:
        for kind, ops in ((FileKind.NETWORK, set(COLLECTIVES)), (FileKind.ATTENTION, {"attn_prefill", "attn_decode"}),
                          (FileKind.OPS, {c.stat for c in _OP_COLUMNS})):
            if timed & ops:
                return Layout.ORIGINAL, kind
        raise _error(file.name, 1, None, f"Vidur time_stats columns of {', '.join(sorted(timed))}, none of which "
                     "mlp.csv, attention.csv, all_reduce.csv or send_recv.csv time")
    folder = PurePath(file.name).parent.name
    if folder in set(FileKind):
        return Layout.SLIMMED, FileKind(folder)
    for kind, marker in ((FileKind.NETWORK, "collective"), (FileKind.ATTENTION, "phase"), (FileKind.OPS, "num_tokens")):
        if marker in header:
            return Layout.SLIMMED, kind
    raise _error(file.name, 1, None, "not a Vidur CSV: expected the profiler's mlp.csv, attention.csv, all_reduce.csv "
                 "or send_recv.csv, or a slimmed file under <device>/ops, <device>/attention or <device>/network "
                 "with the columns data/measurements/vidur/README.md lists")


def _path_accelerator(path: PurePath, kind: FileKind) -> str | None:
    """The GPU an original file's path names: ``compute/<device>/…`` or ``network/<device>_<topology>/…``."""
    if kind is FileKind.NETWORK:
        return DEVICES.get(path.parent.name.split("_", 1)[0].lower())
    folders = [part.lower() for part in path.parts[:-1]]
    after = [folders[i + 1] for i, part in enumerate(folders[:-1]) if part == "compute"]
    return DEVICES.get(after[-1]) if after else None


def _stat_columns(layout: Layout, stat: str, slimmed: str) -> tuple[str, str | None]:
    """The median and maximum columns of a timing: ``time_stats.<stat>.*``, or the slimmed median alone."""
    if layout is Layout.ORIGINAL:
        return f"time_stats.{stat}.median", f"time_stats.{stat}.max"
    return slimmed, None


@dataclass(frozen=True)
class _Origin:
    """What an original file's path (or ``--device``) says and its rows do not: the GPU, and in its folder's
    name the model (compute files) or the node's topology (network files)."""

    accelerator: str
    folder: str


@dataclass(frozen=True)
class _File:
    """One file read: its layout, kind and data rows, and for the original layout what its path says."""

    name: str
    layout: Layout
    kind: FileKind
    rows: list[_Row]
    device: str | None
    """The catalog id the caller named (``--device``): the GPU of files that do not name theirs."""
    origin: _Origin | None

    def accelerator_of(self, row: _Row) -> str:
        if self.origin is not None:
            return self.origin.accelerator
        named = row.accelerator()
        if self.device is not None and named != self.device:
            raise row.fail("device", f"the row says {named}, --device says {self.device}")
        return named

    def model_of(self, row: _Row) -> str:
        return self.origin.folder if self.origin is not None else row.text("model")


def _original_origin(name: str, kind: FileKind, device: str | None) -> _Origin:
    """An original file's GPU (from its path or ``device``), and its model or topology from its folders."""
    path = PurePath(name)
    named = _path_accelerator(path, kind)
    if named is not None and device is not None and named != device:
        raise _error(name, None, None, f"the path says the GPU is {named}, --device says {device}")
    accelerator = named or device
    if accelerator is None:
        raise _error(name, None, None, "Vidur's profiler output does not name its GPU: keep its path as "
                     "compute/<device>/<org>/<model>/ or network/<device>_<topology>/, device one of "
                     f"{', '.join(DEVICES)}, or pass --device with a catalog id")
    folder = path.parent.name
    if not folder:
        where = "network/<device>_<topology>/" if kind is FileKind.NETWORK else "<org>/<model>/"
        raise _error(name, None, None, f"the folder names the {'topology' if kind is FileKind.NETWORK else 'model'}: "
                     f"keep the file under {where}")
    if kind is FileKind.NETWORK:
        prefix = next((f"{vidur}_" for vidur, ours in DEVICES.items() if ours == accelerator
                       and folder.lower().startswith(f"{vidur}_")), "")
        return _Origin(accelerator, folder[len(prefix):])
    return _Origin(accelerator, folder)


def _read(file: VidurFile, *, device: str | None) -> _File:
    """The file's layout, kind and data rows, once its header has every column that kind needs."""
    reader = csv.reader(io.StringIO(file.text))
    header = [column.strip() for column in next(reader, [])]
    if not any(header):
        raise _error(file.name, 1, None, "the file is empty; expected a header row")
    layout, kind = _recognise(file, header)
    required = _REQUIRED[layout, kind]
    if kind is FileKind.OPS:
        required += tuple(_stat_columns(layout, c.stat, f"{c.stat}_ms")[0] for c in _OP_COLUMNS if c.required)
    missing = [column for column in required if column not in header]
    if missing:
        what = _ORIGINAL_FILES[kind] if layout is Layout.ORIGINAL else f"slimmed {kind} file"
        raise _error(file.name, 1, ", ".join(missing), f"missing column{'s' if len(missing) > 1 else ''} in Vidur's "
                     f"{what}")
    rows = []
    for fields in reader:
        if not any(f.strip() for f in fields):
            continue
        if len(fields) < len(header):
            raise _error(file.name, reader.line_num, header[len(fields)], "the row ends before this column")
        rows.append(_Row(file.name, reader.line_num, dict(zip(header, fields, strict=False))))
    if not rows:
        raise _error(file.name, 2, None, "no data rows after the header")
    origin = _original_origin(file.name, kind, device) if layout is Layout.ORIGINAL else None
    return _File(file.name, layout, kind, rows, device, origin)


# --- the operators of an ops file ----------------------------------------------


@dataclass(frozen=True)
class _OpColumn:
    """One timed operator (Vidur's name; ``<stat>_ms`` slimmed, ``time_stats.<stat>.*`` original) and the
    kernel-profile table it becomes, with per-shard dims."""

    stat: str
    op: str
    kernel: Kernel
    dims: Callable[[VidurShape, int], dict[str, int]]
    required: bool = True


_OP_COLUMNS = (
    _OpColumn("attn_pre_proj", "qkv_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.hidden, "n": (s.heads + 2 * s.kv_heads) * s.head_dim // tp}),
    _OpColumn("attn_post_proj", "o_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.heads * s.head_dim // tp, "n": s.hidden}),
    _OpColumn("attn_rope", "rope", Kernel.ROPE,
              lambda s, tp: {"heads": s.heads // tp, "kv_heads": s.kv_heads // tp, "head_dim": s.head_dim}),
    _OpColumn("mlp_up_proj", "gate_up_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.hidden, "n": (2 if s.gated_mlp else 1) * s.intermediate // tp}),
    _OpColumn("mlp_act", "silu_mul", Kernel.SILU_MUL,
              lambda s, tp: {"inter": s.intermediate // tp, "gated": int(s.gated_mlp)}),
    _OpColumn("mlp_down_proj", "down_proj", Kernel.GEMM,
              lambda s, tp: {"k": s.intermediate // tp, "n": s.hidden}),
    _OpColumn("input_layernorm", "input_layernorm", Kernel.RMSNORM, lambda s, tp: {"hidden": s.hidden}),
    # Parallel-block models (phi-2) have one norm per layer, and their files no such column.
    _OpColumn("post_attention_layernorm", "post_attention_layernorm", Kernel.RMSNORM,
              lambda s, tp: {"hidden": s.hidden}, required=False),
    _OpColumn("add", "residual_add", Kernel.ADD, lambda s, tp: {"hidden": s.hidden}),
    _OpColumn("emb", "embedding", Kernel.EMBEDDING, lambda s, tp: {"vocab": s.vocab, "hidden": s.hidden}),
)

_NORMS = ("input_layernorm", "post_attention_layernorm")
"""The per-layer norms Vidur times apart; model_ops counts them (and the final norm) as one ``rmsnorm``."""
PARALLEL_BLOCK_ADDS = 2
"""Launches under the add timer of a parallel block: ``attn + mlp + residual`` runs as two adds."""


def _shape(row: _Row) -> VidurShape:
    return VidurShape(heads=row.count("n_head"), kv_heads=row.count("n_kv_head"), hidden=row.count("n_embd"),
                      intermediate=row.count("n_expanded_embd"), vocab=row.count("vocab_size"),
                      gated_mlp=row.flag("use_gated_mlp"))


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

_Timing = tuple[float, float]
"""(median, p90) of one measurement, seconds."""


@dataclass(frozen=True)
class _Seen:
    """A model's shape where an ops file first states it, and the column that names the model (None: the path)."""

    shape: VidurShape
    row: _Row
    vidur_model: str
    model_column: str | None

    def fail(self, message: str) -> InputError:
        column = self.model_column or ", ".join(_SHAPE_COLUMNS.values())
        return self.row.fail(column, f"{self.vidur_model}: {message}")


@dataclass
class _Group:
    """Everything measured for one (GPU, Vidur model, TP): the seed of one Profile."""

    accelerator: str
    vidur_model: str
    shape: VidurShape
    tp: int
    first: _Row
    times: dict[str, dict[int, list[_Timing]]] = field(default_factory=dict)
    decode: dict[tuple[int, int], list[_Timing]] = field(default_factory=dict)
    prefill: dict[tuple[int, int], list[_Timing]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    attention_backend: tuple[str, _Row] | None = None

    def note(self, file: _File) -> None:
        if file.name not in self.files:
            self.files.append(file.name)


def _parse_ops(file: _File, groups: dict[tuple[str, str, int], _Group], shapes: dict[str, _Seen]) -> None:
    for row in file.rows:
        accelerator, vidur_model, shape = file.accelerator_of(row), file.model_of(row), _shape(row)
        seen = shapes.setdefault(normalized_name(vidur_model), _Seen(shape, row, vidur_model,
                                                                     "model" if file.origin is None else None))
        if shape != seen.shape:
            attr, column = next((a, c) for a, c in _SHAPE_COLUMNS.items()
                                if getattr(shape, a) != getattr(seen.shape, a))
            raise row.fail(column, f"{vidur_model} has {column} {getattr(seen.shape, attr)} at {seen.row.file} row "
                                   f"{seen.row.line}; one model has one shape")
        tp = _tp(row, "num_tensor_parallel_workers", shape)
        tokens = row.count("num_tokens")
        group = groups.setdefault((accelerator, normalized_name(vidur_model), tp),
                                  _Group(accelerator, vidur_model, shape, tp, row))
        group.note(file)
        for spec in _OP_COLUMNS:
            median, maximum = _stat_columns(file.layout, spec.stat, f"{spec.stat}_ms")
            if median in row.values:
                group.times.setdefault(spec.op, {}).setdefault(tokens, []).append(row.timing(median, maximum))


@dataclass(frozen=True)
class _AttentionColumns:
    """Where each layout keeps an attention row's TP size and shape: decode (batch, context), prefill (new, cached)."""

    tp: str
    batch: str
    cached: str
    new: str


_ATTENTION_COLUMNS = {
    Layout.SLIMMED: _AttentionColumns(tp="tp", batch="batch", cached="kv_tokens", new="prefill_tokens"),
    Layout.ORIGINAL: _AttentionColumns(tp="num_tensor_parallel_workers", batch="batch_size", cached="kv_cache_size",
                                       new="prefill_chunk_size"),
}

_ATTENTION_SHAPE = {"n_q_head": "heads", "n_kv_head": "kv_heads", "n_embd": "hidden"}
"""The shape an original attention file repeats on every row, checked against its model's mlp.csv."""


def _is_prefill(file: _File, row: _Row) -> bool:
    if file.layout is Layout.ORIGINAL:
        return row.flag("is_prefill")
    phase = row.text("phase").lower()
    if phase not in ("decode", "prefill"):
        raise row.fail("phase", f"expected decode or prefill, got {row.values['phase'].strip()!r}")
    return phase == "prefill"


def _attention_group(file: _File, row: _Row, groups: dict[tuple[str, str, int], _Group]) -> _Group:
    """The ops group an attention row adds to, refused with the TP or model named when the import lacks it."""
    accelerator, vidur_model = file.accelerator_of(row), file.model_of(row)
    column = _ATTENTION_COLUMNS[file.layout].tp
    tp = row.count(column)
    group = groups.get((accelerator, normalized_name(vidur_model), tp))
    if group is not None:
        return group
    measured = sorted(t for a, n, t in groups if (a, n) == (accelerator, normalized_name(vidur_model)))
    if measured:
        raise row.fail(column, f"unknown tensor-parallel size {tp}: the ops files measure {vidur_model} on "
                               f"{accelerator} at TP {', '.join(map(str, measured))}")
    raise row.fail("model" if file.origin is None else None,
                   f"no ops file in this import measures {vidur_model} on {accelerator}; import its "
                   + ("<device>/ops/<model>.csv" if file.layout is Layout.SLIMMED else "mlp.csv") + " with it")


def _check_original_attention(row: _Row, group: _Group) -> None:
    """The row's shape is its model's, and one profile times one attention kernel."""
    for column, attr in _ATTENTION_SHAPE.items():
        if row.count(column) != getattr(group.shape, attr):
            raise row.fail(column, f"{group.vidur_model}'s ops file ({group.first.file}) has "
                                   f"{getattr(group.shape, attr)}")
    if "attention_backend" not in row.values:
        return
    backend = row.text("attention_backend").rsplit(".", 1)[-1].lower()
    if group.attention_backend is None:
        group.attention_backend = (backend, row)
    elif group.attention_backend[0] != backend:
        first = group.attention_backend[1]
        raise row.fail("attention_backend", f"{backend}, where {first.file} row {first.line} has "
                                            f"{group.attention_backend[0]}; one profile times one attention kernel")


def _parse_attention(file: _File, groups: dict[tuple[str, str, int], _Group]) -> None:
    columns = _ATTENTION_COLUMNS[file.layout]
    for row in file.rows:
        group = _attention_group(file, row, groups)
        if file.layout is Layout.ORIGINAL:
            _check_original_attention(row, group)
        group.note(file)
        prefill = _is_prefill(file, row)
        timing = row.timing(*_stat_columns(file.layout, "attn_prefill" if prefill else "attn_decode", "attention_ms"))
        if prefill:
            if row.count(columns.batch) != 1:
                raise row.fail(columns.batch, "a prefill row times one sequence; expected 1")
            group.prefill.setdefault((row.count(columns.new), row.count(columns.cached, minimum=0)),
                                     []).append(timing)
        else:
            if row.count(columns.new, minimum=0):
                raise row.fail(columns.new, "a decode row adds one token per sequence and no prefill; expected 0")
            group.decode.setdefault((row.count(columns.batch), row.count(columns.cached)), []).append(timing)


def _parse_network(file: _File) -> list[CollectiveMeasurement]:
    measurements = []
    for row in file.rows:
        collective = row.text("collective")
        if collective not in COLLECTIVES:
            raise row.fail("collective", f"expected one of {', '.join(COLLECTIVES)}, got {collective!r}")
        workers = row.count("num_workers", minimum=2)
        if file.origin is not None:
            topology, size = file.origin.folder, row.count("size")
            # devices_per_node: how many of the ranks share a node; all of them is the placement TP runs on.
            one_node = row.count("devices_per_node") >= workers if "devices_per_node" in row.values else None
        else:
            topology = row.text("topology").removeprefix(f"{row.text('device').lower()}_")
            size, one_node = row.count("size_bytes"), None
        median_s, p90_s = row.timing(*_stat_columns(file.layout, collective, "median_ms"))
        measurements.append(CollectiveMeasurement(
            accelerator=file.accelerator_of(row), topology=topology, collective=collective, workers=workers,
            size_bytes=size, median_s=median_s, p90_s=p90_s, one_node=one_node, file=row.file, row=row.line))
    return measurements


def _read_all(files: Sequence[VidurFile], device: str | None) -> list[_File]:
    if device is not None:
        load_catalog().get(device)
    return [_read(file, device=device) for file in files]


def collective_measurements(files: Sequence[VidurFile], *, device: str | None = None) -> list[CollectiveMeasurement]:
    """Every row of the network files among ``files`` (others are skipped), in file order, seconds.

    The raw rows, repeats and every node placement included (``one_node`` tells them apart where the file
    does), so a calibrator can fit collective models (all-reduce and send/recv) to them directly.
    """
    return [m for file in _read_all(files, device) if file.kind is FileKind.NETWORK for m in _parse_network(file)]


# --- building profiles ----------------------------------------------------------------


def _point(timings: list[_Timing]) -> _Timing:
    """Repeated rows as one point: the median of their medians, the largest of their p90s."""
    return statistics.median(median for median, _ in timings), max(p90 for _, p90 in timings)


def _all_reduce(group: _Group, collectives: Sequence[CollectiveMeasurement]) -> tuple[OpTable, str] | None:
    """The all-reduce table of a TP > 1 group from one topology (the preferred, else the first by name)."""
    rows = [m for m in collectives if m.accelerator == group.accelerator and m.collective == "all_reduce"
            and m.workers == group.tp and m.one_node is not False]
    measured = {m.topology for m in rows}
    topology = next((t for t in TOPOLOGY_PREFERENCE if t in measured), min(measured, default=None))
    if topology is None:
        return None
    bytes_per_token = group.shape.hidden * 2  # fp16 activations
    by_size: dict[int, list[CollectiveMeasurement]] = {}
    for m in rows:
        if m.topology == topology:
            by_size.setdefault(m.size_bytes, []).append(m)
    points = []
    for size, ms in sorted(by_size.items()):
        placed = [(m.median_s, m.p90_s) for m in ms if m.one_node]
        # Vidur's sweep repeats a worker count with the ranks on one node and spread over nodes; the slimmed
        # files drop which, and there the fastest row of a size is the one-node placement TP runs on.
        fastest = min(m.median_s for m in ms)
        points.append(Measurement((size / bytes_per_token,), *(_point(placed) if placed else (fastest, fastest))))
    table = OpTable("all_reduce", str(Kernel.ALL_REDUCE), Variable.TOKENS,
                    {"workers": group.tp, "hidden": group.shape.hidden, "bytes_per_token": bytes_per_token,
                     "tp": group.tp}, tuple(points))
    return table, topology


def _tables(group: _Group, collectives: Sequence[CollectiveMeasurement]) -> tuple[list[OpTable], str | None]:
    """The profile's tables in model_ops' order, and the topology its all-reduce table came from."""
    shape, tp = group.shape, group.tp
    tables = []
    for spec in _OP_COLUMNS:
        by_tokens = group.times.get(spec.op)
        if by_tokens:
            points = tuple(Measurement((float(tokens),), *_point(times)) for tokens, times in sorted(by_tokens.items()))
            tables.append(OpTable(spec.op, str(spec.kernel), Variable.TOKENS, {**spec.dims(shape, tp), "tp": tp},
                                  points))
    if not group.times.get("post_attention_layernorm"):
        # A parallel block (phi-2) sums attention, MLP and residual under Vidur's one add timer: two launches.
        tables = [replace(t, dims={**t.dims, "launches": PARALLEL_BLOCK_ADDS}) if t.op == "residual_add" else t
                  for t in tables]
    attention = {"heads": shape.heads // tp, "kv_heads": shape.kv_heads // tp, "head_dim": shape.head_dim, "tp": tp}
    if group.prefill:
        points = tuple(Measurement((new * cached + new * (new + 1) / 2,), *_point(times))
                       for (new, cached), times in _prefill_order(group.prefill))
        tables.append(OpTable("prefill_attention", str(Kernel.PREFILL_ATTENTION), Variable.PREFILL_PAIRS,
                              dict(attention), points))
    if group.decode:
        points = tuple(Measurement((float(batch), float(context)), *_point(times))
                       for (batch, context), times in sorted(group.decode.items()))
        tables.append(OpTable("decode_attention", str(Kernel.DECODE_ATTENTION), Variable.DECODE, dict(attention),
                              points))
    reduce = _all_reduce(group, collectives) if tp > 1 else None
    if reduce is None:
        return tables, None
    tables.append(reduce[0])
    return tables, reduce[1]


def _prefill_order(prefill: dict[tuple[int, int], list[_Timing]]) -> list[tuple[tuple[int, int], list[_Timing]]]:
    """Prefill points by attention pairs (the table's coordinate), then new tokens."""
    return sorted(prefill.items(), key=lambda item: (item[0][0] * item[0][1] + item[0][0] * (item[0][0] + 1) / 2,
                                                     item[0]))


def _terms(arch: ModelArch, tables: Sequence[OpTable]) -> list[Term]:
    """model_ops' terms for the tables present, the per-layer norms, and two all-reduces per layer.

    A table whose points time several launches at once (``launches`` in its dims) counts that many fewer times.
    """
    _, terms = model_ops(arch)
    names = {table.op: table for table in tables}
    kept = [replace(term, multiplier=term.multiplier / names[term.table].dims.get("launches", 1))
            for term in terms if term.table in names]
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
             layouts: dict[str, Layout], catalog_names: dict[str, str], created_at: str) -> Profile:
    tables, topology = _tables(group, collectives)
    names = {table.op for table in tables}
    sweep: dict[str, object] = {"origin": "vidur", "vidur_model": group.vidur_model,
                                "missing_ops": _missing(arch, names, group.tp)}
    if group.prefill:
        sweep["prefill_points"] = [[new, cached] for (new, cached), _ in _prefill_order(group.prefill)]
    if group.attention_backend is not None:
        sweep["attention_backend"] = group.attention_backend[0]
    files = list(group.files)
    if topology is not None:
        sweep["all_reduce_topology"] = topology
        files += sorted({m.file for m in collectives if m.accelerator == group.accelerator
                         and m.collective == "all_reduce" and m.topology == topology} - set(files))
    sweep["files"] = files
    sweep["vidur_layouts"] = sorted({str(layouts[name]) for name in files})
    device = {"catalog": group.accelerator, "name": catalog_names[group.accelerator], "origin": "vidur",
              "file": group.first.file}
    provenance = Provenance(host="", device=device, driver="vidur profiler (PyTorch/cuBLAS fp16, CUDA events)",
                            versions={"vidur": VIDUR_COMMIT}, created_at=created_at)
    return Profile(model=arch.name, accelerator=group.accelerator, source=ProfileSource.KERNEL, backend="cuda",
                   tables=tuple(tables), terms=tuple(_terms(arch, tables)), provenance=provenance, sweep=sweep,
                   tp=group.tp, dtype="fp16")


def profiles_from_vidur(files: Sequence[VidurFile], *, model: ModelArch | None = None,
                        device: str | None = None) -> list[Profile]:
    """One Profile per (GPU, model, TP) that the ops files among ``files`` measure, with the attention and
    all-reduce tables of the other files added; ``model`` forces the hetsched model of a single-model import,
    ``device`` (a catalog id) names the GPU of profiler output whose path does not.

    Every file is read and every model matched before anything is returned: one bad row refuses the lot.
    """
    groups: dict[tuple[str, str, int], _Group] = {}
    shapes: dict[str, _Seen] = {}
    parsed = _read_all(files, device)
    for file in parsed:
        if file.kind is FileKind.OPS:
            _parse_ops(file, groups, shapes)
    if model is not None and len(shapes) > 1:
        raise InputError(f"a forced model names one model; these files measure {len(shapes)}: "
                         + ", ".join(sorted(shapes)), field="model")
    archs = {}
    for name, seen in shapes.items():
        try:
            archs[name] = match_model(seen.shape, model=model)
        except InputError as exc:
            raise seen.fail(str(exc)) from exc
    for file in parsed:
        if file.kind is FileKind.ATTENTION:
            _parse_attention(file, groups)
    collectives = [m for file in parsed if file.kind is FileKind.NETWORK for m in _parse_network(file)]
    if not groups:
        raise InputError("no Vidur ops file among the inputs; the profiles are built from the profiler's mlp.csv "
                         "or a slimmed <device>/ops/<model>.csv", field="files")
    catalog = load_catalog()
    catalog_names = {acc: catalog.get(acc).name for acc in {group.accelerator for group in groups.values()}}
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ordered = sorted(groups.values(), key=lambda g: (g.first.file, g.tp))
    layouts = {file.name: file.layout for file in parsed}
    return [_profile(group, archs[normalized_name(group.vidur_model)], collectives, layouts=layouts,
                     catalog_names=catalog_names, created_at=created_at) for group in ordered]
