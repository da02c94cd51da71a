"""Plan a kernel sweep from a ModelArch: which operators, at which shapes, counted how often per step."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

from hetsched.errors import InputError
from hetsched.profiler.profile import Term, Variable
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import LayerKind, ModelArch


class Kernel(StrEnum):
    """Kernels of a profile's tables; a worker builds inputs for and times all but the collectives."""

    GEMM = "gemm"
    PREFILL_ATTENTION = "prefill_attention"
    DECODE_ATTENTION = "decode_attention"
    MLA_DECODE_ATTENTION = "mla_decode_attention"
    MOE = "moe"
    RMSNORM = "rmsnorm"
    SILU_MUL = "silu_mul"
    ROPE = "rope"
    ADD = "add"
    KV_WRITE = "kv_write"
    EMBEDDING = "embedding"
    ALL_REDUCE = "all_reduce"  # tensor-parallel collective, imported from measurements


@dataclass(frozen=True)
class SweepSettings:
    """How wide and how careful a sweep is; stored with the profile."""

    quick: bool = False
    max_tokens: int = 8192
    max_seqs: int = 256
    max_context: int = 32768
    prefill_attention_max_tokens: int = 4096
    kv_budget_gb: float = 1.0
    dtype: str = "bf16"
    warmup: int = 2
    min_repeats: int = 3
    max_repeats: int = 30
    min_total_s: float = 0.05
    point_timeout_s: float = 120.0
    host_clock: str = "wall"
    """CPU backend: ``wall`` (perf_counter_ns) or ``process`` (CPU time, for one-thread runs on a shared host)."""
    cpu_threads: int = 0
    """CPU backend: torch threads in the worker (0: torch's default)."""

    @classmethod
    def for_engine(cls, model: ModelArch, engine: EngineConfig, *, quick: bool, kv_budget_gb: float = 1.0,
                   point_timeout_s: float = 120.0, host_clock: str = "wall", cpu_threads: int = 0) -> SweepSettings:
        return cls(quick=quick, max_tokens=engine.max_num_batched_tokens, max_seqs=engine.max_num_seqs,
                   max_context=min(model.max_context, 32768),
                   prefill_attention_max_tokens=min(engine.max_num_batched_tokens, 2048 if quick else 4096),
                   kv_budget_gb=kv_budget_gb, dtype=str(model.dtype), warmup=1 if quick else 2,
                   min_repeats=3 if quick else 5, max_repeats=20 if quick else 50,
                   min_total_s=0.03 if quick else 0.1, point_timeout_s=point_timeout_s, host_clock=host_clock,
                   cpu_threads=cpu_threads)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class SweepPoint:
    """One operator at one shape: what a worker builds and times."""

    op: str
    kernel: Kernel
    params: dict[str, int]
    coords: tuple[float, ...]

    @property
    def label(self) -> str:
        return f"{self.op}(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


@dataclass(frozen=True)
class ProfiledOp:
    """An operator of the model: its kernel, fixed dimensions and the variable the sweep walks."""

    op: str
    kernel: Kernel
    variable: Variable
    dims: dict[str, int]


@dataclass(frozen=True)
class SweepPlan:
    ops: tuple[ProfiledOp, ...]
    terms: tuple[Term, ...]
    points: tuple[SweepPoint, ...]
    settings: SweepSettings
    failures: tuple[str, ...] = field(default=())


def powers(start: int, stop: int, factor: int) -> list[int]:
    """``start, start·factor, …`` up to ``stop``, always ending with ``stop``."""
    values, v = [], start
    while v < stop:
        values.append(v)
        v *= factor
    return [*values, stop] if stop >= start else values


def model_ops(model: ModelArch) -> tuple[list[ProfiledOp], list[Term]]:
    """The operators of one engine step of ``model`` and how many times each runs per step."""
    if model.count(LayerKind.LINEAR):
        raise InputError(f"{model.name} has linear-attention layers, which the kernel profiler does not time yet; "
                         "use --source roofline or --source endpoint", field="model")
    h, layers = model.hidden_size, model.num_layers
    dense_layers = layers - model.num_moe_layers
    ops: list[ProfiledOp] = []
    terms: list[Term] = []

    def add(op: str, kernel: Kernel, variable: Variable, multiplier: float, term: str, **dims: int) -> None:
        if multiplier <= 0:
            return
        ops.append(ProfiledOp(op, kernel, variable, dims))
        terms.append(Term(name=term, table=op, multiplier=multiplier))

    if model.mla is not None:
        mla = model.mla
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            add("q_a_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections", k=h, n=mla.q_lora_rank)
            add("q_b_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
                k=mla.q_lora_rank, n=model.num_heads * qk_dim)
        else:
            add("q_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
                k=h, n=model.num_heads * qk_dim)
        add("kv_a_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
            k=h, n=mla.kv_lora_rank + mla.qk_rope_head_dim)
        add("kv_b_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
            k=mla.kv_lora_rank, n=model.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        add("o_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
            k=model.num_heads * mla.v_head_dim, n=h)
        add("rope", Kernel.ROPE, Variable.TOKENS, layers, "elementwise",
            heads=model.num_heads, kv_heads=1, head_dim=mla.qk_rope_head_dim)
        add("kv_write", Kernel.KV_WRITE, Variable.TOKENS, layers, "kv cache write",
            kv_heads=1, head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim)
        add("prefill_attention", Kernel.PREFILL_ATTENTION, Variable.PREFILL_PAIRS, layers, "attention prefill",
            heads=model.num_heads, kv_heads=model.num_heads, head_dim=qk_dim)
        add("decode_attention", Kernel.MLA_DECODE_ATTENTION, Variable.DECODE, layers, "attention decode",
            heads=model.num_heads, kv_lora_rank=mla.kv_lora_rank, rope_dim=mla.qk_rope_head_dim)
    else:
        q_out = model.num_heads * model.head_dim * (2 if model.attention_output_gate else 1)
        add("qkv_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
            k=h, n=q_out + 2 * model.num_kv_heads * model.head_dim)
        add("o_proj", Kernel.GEMM, Variable.TOKENS, layers, "attention projections",
            k=model.num_heads * model.head_dim, n=h)
        add("rope", Kernel.ROPE, Variable.TOKENS, layers, "elementwise",
            heads=model.num_heads, kv_heads=model.num_kv_heads, head_dim=model.head_dim)
        add("kv_write", Kernel.KV_WRITE, Variable.TOKENS, layers, "kv cache write",
            kv_heads=model.num_kv_heads, head_dim=model.head_dim)
        attn = {"heads": model.num_heads, "kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
        full, sliding = model.count(LayerKind.FULL), model.count(LayerKind.SLIDING)
        ops.append(ProfiledOp("prefill_attention", Kernel.PREFILL_ATTENTION, Variable.PREFILL_PAIRS, attn))
        ops.append(ProfiledOp("decode_attention", Kernel.DECODE_ATTENTION, Variable.DECODE, attn))
        for count, window in ((full, None), (sliding, model.sliding_window)):
            if count:
                terms.append(Term("attention prefill", "prefill_attention", count, window))
                terms.append(Term("attention decode", "decode_attention", count, window))

    add("gate_up_proj", Kernel.GEMM, Variable.TOKENS, dense_layers, "mlp", k=h,
        n=(2 if model.gated_mlp else 1) * model.intermediate_size)
    add("silu_mul", Kernel.SILU_MUL, Variable.TOKENS, dense_layers, "elementwise", inter=model.intermediate_size)
    add("down_proj", Kernel.GEMM, Variable.TOKENS, dense_layers, "mlp", k=model.intermediate_size, n=h)
    if model.moe is not None and model.num_moe_layers:
        moe = model.moe
        add("moe", Kernel.MOE, Variable.TOKENS, model.num_moe_layers, "moe", hidden=h,
            inter=moe.expert_intermediate_size, experts=moe.num_experts, top_k=moe.experts_per_token)
        if moe.shared_intermediate_size:
            add("shared_gate_up_proj", Kernel.GEMM, Variable.TOKENS, model.num_moe_layers, "moe",
                k=h, n=2 * moe.shared_intermediate_size)
            add("shared_down_proj", Kernel.GEMM, Variable.TOKENS, model.num_moe_layers, "moe",
                k=moe.shared_intermediate_size, n=h)
    add("rmsnorm", Kernel.RMSNORM, Variable.TOKENS, 2 * layers + 1, "elementwise", hidden=h)
    add("residual_add", Kernel.ADD, Variable.TOKENS, 2 * layers, "elementwise", hidden=h)
    add("embedding", Kernel.EMBEDDING, Variable.TOKENS, 1, "embedding", vocab=model.vocab_size, hidden=h)
    add("lm_head", Kernel.GEMM, Variable.SAMPLED, 1, "lm head", k=h, n=model.vocab_size)
    return ops, terms


def kv_bytes_per_token(op: ProfiledOp, dtype_bytes: float = 2.0) -> float:
    """KV cache bytes per context token of one layer for an attention operator."""
    if op.kernel is Kernel.MLA_DECODE_ATTENTION:
        return (op.dims["kv_lora_rank"] + op.dims["rope_dim"]) * dtype_bytes
    return 2 * op.dims["kv_heads"] * op.dims["head_dim"] * dtype_bytes


def _points(op: ProfiledOp, s: SweepSettings) -> list[SweepPoint]:
    step = 8 if s.quick else 2
    if op.variable is Variable.TOKENS:
        return [SweepPoint(op.op, op.kernel, {**op.dims, "m": m}, (m,)) for m in powers(1, s.max_tokens, step)]
    if op.variable is Variable.SAMPLED:
        return [SweepPoint(op.op, op.kernel, {**op.dims, "m": m}, (m,))
                for m in powers(1, s.max_seqs, 8 if s.quick else 2)]
    if op.variable is Variable.PREFILL_PAIRS:
        points = []
        for new in powers(16, s.prefill_attention_max_tokens, 8 if s.quick else 2):
            for cached in ((0,) if s.quick else (0, new)):
                if new + cached <= s.max_context:
                    pairs = new * cached + new * (new + 1) / 2
                    points.append(SweepPoint(op.op, op.kernel, {**op.dims, "new": new, "cached": cached}, (pairs,)))
        return points
    if op.variable is Variable.DECODE:
        budget = s.kv_budget_gb * 1e9 / kv_bytes_per_token(op)
        points = []
        for batch in powers(1, s.max_seqs, 8 if s.quick else 4):
            contexts = powers(64, s.max_context, 8 if s.quick else 4)
            fitting = [c for c in contexts if batch * c <= budget] or [max(1, int(budget // batch))]
            points.extend(SweepPoint(op.op, op.kernel, {**op.dims, "batch": batch, "context": c}, (batch, c))
                          for c in fitting)
        return points
    raise ValueError(f"no sweep for variable {op.variable}")


def plan_sweep(model: ModelArch, settings: SweepSettings) -> SweepPlan:
    """Every point to time for ``model``, cheapest operators first within each op."""
    ops, terms = model_ops(model)
    points = [p for op in ops for p in _points(op, settings)]
    return SweepPlan(ops=tuple(ops), terms=tuple(terms), points=tuple(points), settings=settings)
