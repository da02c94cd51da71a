"""Analytic step latency: each kernel of a layer from its shape, the device's peaks and calibrated constants.

A step runs, per layer, the attention projections and MLP GEMMs, two norms, rope, the
activation, two residual adds and attention, then the final norm and the LM head; with
tensor parallelism two ring all-reduces per layer. Every launch pays its floor, GEMMs
follow the compute/memory ridge, memory-bound kernels their own bandwidth share,
attention its own curves, collectives NCCL's ring model over the one-way link (see
:mod:`hetsched.perf.costs`). The constants come from the device's catalog entry
(calibrated where measured, a generation default otherwise) or from the caller. The engine's
host-side overhead is added once per step, with a share per sequence in it. Measured profiles answer the same
:class:`StepLatencyModel` interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hetsched.catalog.perf import PerfConstants
from hetsched.catalog.types import Device
from hetsched.errors import InputError
from hetsched.perf.costs import (ACTIVATION_BYTES, all_reduce_seconds, decode_attention_seconds, gemm_seconds,
                                 memory_kernel_seconds, prefill_attention_seconds, ridge_seconds)
from hetsched.perf.memory import default_kv_dtype
from hetsched.perf.step import OpTime, StepShape
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import LayerKind, ModelArch


@dataclass(frozen=True)
class _Gemm:
    """One weight GEMM of a layer, per TP shard, run ``count`` times per step."""

    k: float
    n: float
    count: int


@dataclass(frozen=True)
class _Shapes:
    """Per-shard shapes every step reuses; the simulator asks for millions of steps."""

    projections: tuple[_Gemm, ...]
    mlp: tuple[_Gemm, ...]
    attention_layers: int
    full_layers: int
    sliding_layers: int
    linear_layers: int
    moe_layers: int
    kv_bytes_per_token: float
    """One layer's KV bytes per context token on one shard."""
    state_bytes_per_seq: float
    """Linear-attention state read per sequence per layer on one shard."""
    rope_width: float
    """(query + key heads) × rotary dims per token on one shard."""


@dataclass(frozen=True)
class RooflineModel:
    """Step latency of ``model`` on ``tp`` × ``device`` from its shapes and the device's constants."""

    model: ModelArch
    device: Device
    tp: int = 1
    weight_dtype: DType | None = None
    kv_dtype: DType | None = None
    engine: EngineConfig = EngineConfig()
    constants: PerfConstants | None = None

    @cached_property
    def perf(self) -> PerfConstants:
        """The constants in use: the caller's, else the catalog's for this device."""
        constants = self.constants or self.device.accelerator.perf
        if constants is None:
            raise InputError(f"no step-model constants for {self.device.id}; the catalog lists none",
                             field="accelerator")
        return constants

    @property
    def source(self) -> str:
        """Which constants this model uses, for users to read."""
        return self.perf.source

    @property
    def step_overhead_s(self) -> float:
        """The engine's stated overhead, else the device's."""
        overhead = self.engine.step_overhead_ms
        return (self.perf.step_overhead_ms if overhead is None else overhead) / 1e3

    @cached_property
    def _shapes(self) -> _Shapes:
        m, tp = self.model, self.tp
        h = m.hidden_size
        kv_dtype = self.kv_dtype or default_kv_dtype(m, self.weight_dtype)
        kv_heads = -(-m.num_kv_heads // tp)
        projections: list[_Gemm] = []
        layers = {kind: m.count(kind) for kind in LayerKind}
        softmax_layers = layers[LayerKind.FULL] + layers[LayerKind.SLIDING]
        if m.mla is not None:
            a = m.mla
            qk_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
            if a.q_lora_rank:
                projections += [_Gemm(h, a.q_lora_rank, softmax_layers),
                                _Gemm(a.q_lora_rank, m.num_heads * qk_dim / tp, softmax_layers)]
            else:
                projections.append(_Gemm(h, m.num_heads * qk_dim / tp, softmax_layers))
            projections += [_Gemm(h, a.kv_lora_rank + a.qk_rope_head_dim, softmax_layers),
                            _Gemm(a.kv_lora_rank, m.num_heads * (a.qk_nope_head_dim + a.v_head_dim) / tp,
                                  softmax_layers),
                            _Gemm(m.num_heads * a.v_head_dim / tp, h, softmax_layers)]
            kv_bytes = (a.kv_lora_rank + a.qk_rope_head_dim) * kv_dtype.bytes_per_element
            rope_width = (m.num_heads / tp + 1) * a.qk_rope_head_dim
        else:
            q_out = m.num_heads * m.head_dim * (2 if m.attention_output_gate else 1)
            projections += [_Gemm(h, q_out / tp + 2 * kv_heads * m.head_dim, softmax_layers),
                            _Gemm(m.num_heads * m.head_dim / tp, h, softmax_layers)]
            kv_bytes = 2 * kv_heads * m.head_dim * kv_dtype.bytes_per_element
            rope_width = (m.num_heads / tp + kv_heads) * m.head_dim
        state = 0.0
        if layers[LayerKind.LINEAR] and m.linear_attention is not None:
            params = m.attention_params(LayerKind.LINEAR)
            projections.append(_Gemm(h, params / h / tp, layers[LayerKind.LINEAR]))
            la = m.linear_attention
            state = la.recurrent_state_elements * DType.FP32.bytes_per_element / tp
        dense = m.num_layers - m.num_moe_layers
        mlp = (_Gemm(h, (2 if m.gated_mlp else 1) * m.intermediate_size / tp, dense), _Gemm(m.intermediate_size / tp, h, dense)) if dense else ()
        return _Shapes(projections=tuple(projections), mlp=mlp, attention_layers=softmax_layers,
                       full_layers=layers[LayerKind.FULL], sliding_layers=layers[LayerKind.SLIDING],
                       linear_layers=layers[LayerKind.LINEAR], moe_layers=m.num_moe_layers,
                       kv_bytes_per_token=kv_bytes, state_bytes_per_seq=state, rope_width=rope_width)

    def step_time(self, shape: StepShape) -> float:
        return sum(op.seconds for op in self.breakdown(shape))

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        tokens = shape.tokens
        if tokens == 0:
            return []
        before, elementwise, collectives = self._token_ops(tokens)
        ops = [*before, *self._attention(shape), elementwise]
        seqs = shape.decode_seqs + shape.prefill_seqs
        if seqs:
            ops.append(self._lm_head(seqs))
        ops.extend(collectives)
        ops.append(OpTime("step overhead", self.step_overhead_s + seqs * self.perf.seq_overhead_us * 1e-6, 0.0, 0.0,
                          "fixed"))
        return ops

    # --- helpers ------------------------------------------------------------
    @cached_property
    def _by_tokens(self) -> dict[int, tuple[tuple[OpTime, ...], OpTime, tuple[OpTime, ...]]]:
        """:meth:`_token_ops` by token count: a simulation repeats the same few counts."""
        return {}

    @cached_property
    def _by_sampled(self) -> dict[int, OpTime]:
        """:meth:`_lm_head` by sequence count."""
        return {}

    def _token_ops(self, tokens: int) -> tuple[tuple[OpTime, ...], OpTime, tuple[OpTime, ...]]:
        """What a step of ``tokens`` runs whatever its sequences: the GEMMs before attention, the elementwise
        launches, and the all-reduces."""
        known = self._by_tokens.get(tokens)
        if known is not None:
            return known
        m, s, c = self.model, self._shapes, self.perf
        wdt = self.weight_dtype or m.dtype
        before = [self._gemms("attention projections", tokens, s.projections, wdt)]
        if s.mlp:
            before.append(self._gemms("mlp", tokens, s.mlp, wdt))
        if m.moe is not None and s.moe_layers:
            before.append(self._moe(tokens, wdt))
        collectives = []
        if self.tp > 1:
            payload = tokens * m.hidden_size * ACTIVATION_BYTES
            link = self.device.accelerator.one_way_link_gbs * 1e9
            if link <= 0:
                raise InputError(f"{self.device.id} has no GPU-to-GPU link in the catalog; use tp 1",
                                 field="tp")
            per = all_reduce_seconds(payload, self.tp, link_bytes_per_s=link, c=c.collective)
            collectives.append(OpTime("all-reduce", 2 * m.num_layers * per, 0.0, 2 * m.num_layers * payload,
                                      "network"))
        ops = (tuple(before), self._elementwise(tokens), tuple(collectives))
        self._by_tokens[tokens] = ops
        return ops

    def _lm_head(self, sampled: int) -> OpTime:
        head = self._by_sampled.get(sampled)
        if head is None:
            m = self.model
            head = self._gemms("lm head", sampled, (_Gemm(m.hidden_size, m.vocab_size / self.tp, 1),),
                               self.weight_dtype or m.dtype)
            self._by_sampled[sampled] = head
        return head

    @cached_property
    def _bandwidth(self) -> float:
        return self.device.memory_tbs * 1e12

    @cached_property
    def _peaks(self) -> dict[DType, float]:
        return {dtype: self.device.peak_tflops(dtype) * 1e12 for dtype in DType}

    def _peak(self, dtype: DType) -> float:
        return self._peaks[dtype]

    def _gemms(self, name: str, tokens: int, gemms: tuple[_Gemm, ...], dtype: DType) -> OpTime:
        seconds = flops = nbytes = 0.0
        peak, bandwidth, c, weight_bytes = self._peaks[dtype], self._bandwidth, self.perf.gemm, dtype.bytes_per_element
        for g in gemms:
            seconds += g.count * gemm_seconds(float(tokens), g.k, g.n, peak_flops=peak, bandwidth=bandwidth, c=c,
                                              compute_units=self.device.compute_units,
                                              weight_bytes=weight_bytes)
            flops += g.count * 2.0 * tokens * g.k * g.n
            nbytes += g.count * (g.k * g.n * weight_bytes + ACTIVATION_BYTES * tokens * (g.k + g.n))
        return OpTime(name, seconds, flops, nbytes, self._bound(flops, nbytes, dtype))

    def _bound(self, flops: float, nbytes: float, dtype: DType) -> str:
        return "compute" if flops / self._peak(dtype) >= nbytes / self._bandwidth else "memory"

    def _moe(self, tokens: int, wdt: DType) -> OpTime:
        """Every token runs k experts; the weights of each expert any token chose are read once."""
        m, tp = self.model, self.tp
        assert m.moe is not None
        h, e, k = m.hidden_size, m.moe.num_experts, m.moe.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** tokens)
        edt = self.weight_dtype or m.expert_dtype or wdt
        shared = 3 * h * m.moe.shared_intermediate_size + h * e
        flops = 2.0 * tokens * (k * m.expert_params + shared) / tp
        nbytes = (touched * m.expert_params * edt.bytes_per_element + shared * wdt.bytes_per_element) / tp
        nbytes += ACTIVATION_BYTES * tokens * (2 * h + 3 * m.moe.expert_intermediate_size * k / tp)
        layers = self._shapes.moe_layers
        launches = 3.0 if m.moe.shared_intermediate_size else 2.0  # router + grouped GEMMs (+ shared expert)
        seconds = layers * ridge_seconds(flops, nbytes, peak_flops=self._peak(edt), bandwidth=self._bandwidth,
                                         c=self.perf.gemm, launches=launches)
        return OpTime("moe", seconds, layers * flops, layers * nbytes, self._bound(flops, nbytes, edt))

    def _elementwise(self, tokens: int) -> OpTime:
        """Two norms, rope, the activation and two residual adds per layer; final norm and embedding once."""
        m, s, c, bw = self.model, self._shapes, self.perf, self._bandwidth
        cycles = self.device.compute_unit_cycles_per_s
        h, a = m.hidden_size, ACTIVATION_BYTES
        width = m.moe.expert_intermediate_size * m.moe.experts_per_token if m.moe else m.intermediate_size
        norm = memory_kernel_seconds(2 * a * tokens * h + a * h, bandwidth=bw, c=c.norm, width=h, cycles_per_s=cycles)
        rope = memory_kernel_seconds(2 * a * tokens * s.rope_width, bandwidth=bw, c=c.rope, cycles_per_s=cycles)
        act = memory_kernel_seconds((3 if m.gated_mlp else 2) * a * tokens * width / self.tp, bandwidth=bw,
                                    c=c.activation, cycles_per_s=cycles)
        add = memory_kernel_seconds(3 * a * tokens * h, bandwidth=bw, c=c.residual_add, cycles_per_s=cycles)
        embedding = memory_kernel_seconds(2 * a * tokens * h, bandwidth=bw, c=c.embedding, cycles_per_s=cycles)
        per_layer = 2 * norm + act + 2 * add
        seconds = m.num_layers * per_layer + s.attention_layers * rope + norm + embedding
        nbytes = a * tokens * h * (m.num_layers * 10 + 4)
        return OpTime("elementwise", seconds, 0.0, nbytes, "memory")

    def _attention(self, shape: StepShape) -> list[OpTime]:
        m, s, c, tp = self.model, self._shapes, self.perf, self.tp
        heads = m.num_heads / tp
        if m.mla is not None:  # absorbed MLA: scores and values over the latent
            qk_dim, v_dim = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim, m.mla.kv_lora_rank
        else:
            qk_dim, v_dim = m.head_dim, m.head_dim
        flops_per_pair = 2.0 * heads * (qk_dim + v_dim)
        window = m.sliding_window or 0
        peak, bw = self._peak(DType.BF16), self._bandwidth
        units = self.device.compute_units
        ops: list[OpTime] = []
        if shape.prefill_tokens:
            pairs = shape.prefill_attention_pairs
            causal_share = shape.prefill_causal_pairs / pairs if pairs else 1.0
            cached = max(shape.prefill_kv_tokens - shape.prefill_tokens, 0)
            seconds = flops = 0.0
            for layers, layer_pairs in ((s.full_layers, pairs),
                                        (s.sliding_layers, min(pairs, shape.prefill_tokens * window) if window
                                         else pairs)):
                if layers:
                    layer_flops = flops_per_pair * layer_pairs
                    seconds += layers * prefill_attention_seconds(
                        shape.prefill_tokens, causal_share * layer_flops, (1.0 - causal_share) * layer_flops,
                        cached * s.kv_bytes_per_token, peak_flops=peak, bandwidth=bw, c=c.prefill_attention)
                    flops += layers * layer_flops
            ops.append(OpTime("attention prefill", seconds, flops, s.attention_layers * cached * s.kv_bytes_per_token,
                              "compute"))
        if shape.decode_seqs:
            seqs = shape.decode_seqs
            avg_context = shape.decode_kv_tokens / seqs
            sliding_ctx = min(avg_context, window) if window else avg_context
            seconds = nbytes = 0.0
            for layers, context in ((s.full_layers, avg_context), (s.sliding_layers, sliding_ctx)):
                if layers:
                    kv = seqs * context * s.kv_bytes_per_token
                    seconds += layers * decode_attention_seconds(seqs, kv, bandwidth=bw, c=c.decode_attention,
                                                                 heads=heads, context=context, compute_units=units)
                    nbytes += layers * kv
            flops = flops_per_pair * shape.decode_kv_tokens * s.attention_layers
            ops.append(OpTime("attention decode", seconds, flops, nbytes, "memory"))
        if s.linear_layers and m.linear_attention is not None:
            la = m.linear_attention
            flops = 6.0 * shape.tokens * la.recurrent_state_elements / tp
            per_layer = prefill_attention_seconds(shape.tokens, flops, 0.0, 2 * (shape.prefill_seqs + shape.decode_seqs)
                                                  * s.state_bytes_per_seq, peak_flops=peak, bandwidth=bw,
                                                  c=c.prefill_attention)
            ops.append(OpTime("linear attention", s.linear_layers * per_layer, s.linear_layers * flops, 0.0,
                              "compute"))
        return ops
