"""Roofline step latency: per-operator FLOPs and bytes against catalog peaks.

For each operator, ``time = max(flops / (peak · e_c), bytes / (bandwidth · e_m))``.
Tensor parallelism divides both by ``tp`` and adds two ring all-reduces of the
step's activations per layer. A fixed per-step overhead covers scheduling,
sampling and launches. This is the fall-back for hardware not yet profiled;
measured profiles answer the same :class:`StepLatencyModel` interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hetsched.catalog.types import Device
from hetsched.perf.memory import KVLayout, default_kv_dtype, kv_layout
from hetsched.perf.step import OpTime, StepShape
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import LayerKind, ModelArch


@dataclass(frozen=True)
class Efficiency:
    """Achieved share of catalog peaks; calibrated from measured profiles where available."""

    gemm: float = 0.70
    attention: float = 0.50
    memory: float = 0.80
    network: float = 0.70
    allreduce_latency_us: float = 8.0


@dataclass(frozen=True)
class _ModelTotals:
    """Per-model sums every step reuses; the simulator asks for millions of steps."""

    projection_params: int
    layers: int
    dense_layers: int
    moe_layers: int
    full_layers: int
    sliding_layers: int
    linear_layers: int
    kv: KVLayout


@dataclass(frozen=True)
class RooflineModel:
    """Step latency of ``model`` on ``tp`` × ``device`` from first principles."""

    model: ModelArch
    device: Device
    tp: int = 1
    weight_dtype: DType | None = None
    kv_dtype: DType | None = None
    engine: EngineConfig = EngineConfig()
    efficiency: Efficiency = Efficiency()

    @cached_property
    def _totals(self) -> _ModelTotals:
        m = self.model
        return _ModelTotals(
            projection_params=sum(m.attention_params(kind) for kind in m.layer_kinds),
            layers=m.num_layers,
            dense_layers=m.num_layers - m.num_moe_layers,
            moe_layers=m.num_moe_layers,
            full_layers=m.count(LayerKind.FULL),
            sliding_layers=m.count(LayerKind.SLIDING),
            linear_layers=m.count(LayerKind.LINEAR),
            kv=kv_layout(m, tp=self.tp, kv_dtype=self.kv_dtype or default_kv_dtype(m, self.weight_dtype)),
        )

    def step_time(self, shape: StepShape) -> float:
        return sum(op.seconds for op in self.breakdown(shape))

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        m, tp, totals = self.model, self.tp, self._totals
        tokens = shape.tokens
        if tokens == 0:
            return []
        wdt = self.weight_dtype or m.dtype
        act = 2.0  # bf16 activations
        h = m.hidden_size
        ops: list[OpTime] = []

        # 1. Attention projections (QKV + O) per layer kind.
        ops.append(self._gemm("attention projections", tokens, totals.projection_params, wdt,
                              act * tokens * h * 4 * totals.layers))

        # 2. Dense MLPs.
        dense_layers = totals.dense_layers
        if dense_layers:
            ops.append(self._gemm("mlp", tokens, dense_layers * m.dense_mlp_params, wdt,
                                  act * tokens * (2 * h + 3 * m.intermediate_size) * dense_layers))

        # 3. MoE: every token runs k experts; weights of each expert any token chose are read once.
        if m.moe is not None and totals.moe_layers:
            e, k = m.moe.num_experts, m.moe.experts_per_token
            touched = e * (1.0 - (1.0 - k / e) ** tokens)
            edt = self.weight_dtype or m.expert_dtype or wdt
            flops = 2.0 * tokens * (k * m.expert_params + 3 * h * m.moe.shared_intermediate_size + h * e)
            weights = (touched * m.expert_params * edt.bytes_per_element
                       + (3 * h * m.moe.shared_intermediate_size + h * e) * wdt.bytes_per_element)
            moved = act * tokens * (2 * h + 3 * m.moe.expert_intermediate_size * k)
            ops.append(self._op("moe", totals.moe_layers * flops / tp, totals.moe_layers * (weights / tp + moved),
                                self.device.peak_tflops(edt) * 1e12, self.efficiency.gemm))

        # 4. Attention itself: prefill (compute-bound) and decode (reads the KV cache).
        ops.extend(self._attention(shape))

        # 5. Norms, residuals, activations: a few elementwise passes over the hidden state.
        ops.append(self._op("elementwise", 10.0 * tokens * h * totals.layers / tp,
                            8.0 * act * tokens * h * totals.layers, self.device.peak_tflops(DType.BF16) * 1e12,
                            self.efficiency.gemm))

        # 6. LM head for the sequences that sample this step.
        sampled = shape.decode_seqs + shape.prefill_seqs
        ops.append(self._gemm("lm head", sampled, m.vocab_size * h, wdt, 4.0 * sampled * m.vocab_size))

        # 7. Tensor-parallel all-reduces: two per layer over the step's activations.
        if tp > 1:
            payload = tokens * h * act
            link = self.device.accelerator.interconnect_gbs * 1e9 * self.efficiency.network
            per = 2 * (tp - 1) / tp * payload / link + self.efficiency.allreduce_latency_us * 1e-6
            ops.append(OpTime("all-reduce", 2 * totals.layers * per, 0.0, 2 * totals.layers * payload, "network"))

        ops.append(OpTime("step overhead", self.engine.step_overhead_ms / 1e3, 0.0, 0.0, "fixed"))
        return ops

    # --- helpers ------------------------------------------------------------
    def _gemm(self, name: str, tokens: int, params: float, dtype: DType, moved: float) -> OpTime:
        return self._op(name, 2.0 * tokens * params / self.tp, (params * dtype.bytes_per_element + moved) / self.tp,
                        self.device.peak_tflops(dtype) * 1e12, self.efficiency.gemm)

    def _op(self, name: str, flops: float, nbytes: float, peak: float, efficiency: float) -> OpTime:
        compute = flops / (peak * efficiency)
        memory = nbytes / (self.device.memory_tbs * 1e12 * self.efficiency.memory)
        return OpTime(name, max(compute, memory), flops, nbytes, "compute" if compute >= memory else "memory")

    def _attention(self, shape: StepShape) -> list[OpTime]:
        m, tp, totals = self.model, self.tp, self._totals
        layout = totals.kv
        heads = m.num_heads / tp
        if m.mla is not None:  # absorbed MLA: scores and values over the latent
            qk_dim, v_dim = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim, m.mla.kv_lora_rank
        else:
            qk_dim, v_dim = m.head_dim, m.head_dim
        flops_per_pair = 2.0 * heads * (qk_dim + v_dim)
        full, sliding = totals.full_layers, totals.sliding_layers
        window = m.sliding_window or 0
        peak = self.device.peak_tflops(DType.BF16) * 1e12
        ops: list[OpTime] = []
        if shape.prefill_tokens:
            pairs = shape.prefill_attention_pairs
            sliding_pairs = min(pairs, shape.prefill_tokens * window) if window else pairs
            flops = flops_per_pair * (full * pairs + sliding * sliding_pairs)
            kv_bytes = layout.bytes_for(max(shape.prefill_kv_tokens // max(shape.prefill_seqs, 1), 1)) * shape.prefill_seqs
            ops.append(self._op("attention prefill", flops, kv_bytes, peak, self.efficiency.attention))
        if shape.decode_seqs:
            avg_context = shape.decode_kv_tokens / shape.decode_seqs
            sliding_ctx = min(avg_context, window) if window else avg_context
            flops = flops_per_pair * shape.decode_seqs * (full * avg_context + sliding * sliding_ctx)
            kv_bytes = shape.decode_seqs * (layout.full_bytes_per_token * avg_context
                                            + layout.sliding_bytes_per_token * sliding_ctx
                                            + 2 * layout.state_bytes_per_seq)
            ops.append(self._op("attention decode", flops, kv_bytes, peak, self.efficiency.attention))
        linear = totals.linear_layers
        if linear and m.linear_attention is not None:
            la = m.linear_attention
            flops = 6.0 * shape.tokens * la.num_value_heads * la.key_head_dim * la.value_head_dim * linear / tp
            ops.append(self._op("linear attention", flops, 0.0, peak, self.efficiency.attention))
        return ops
