"""Memory model: does a model fit a device at a TP degree, and how much KV is left.

Per device, with tensor parallelism ``tp``::

    budget  = memory × gpu_memory_utilization − runtime reserve
    weights = Σ params × bytes(dtype) / tp          (experts may use their own dtype)
    act     = max_num_batched_tokens × (4·h + 2·I/tp) × 2 B + max_num_seqs × V/tp × 4 B
    kv      = budget − weights − act                 (what the KV cache may use)

KV per sequence of context L (whole model, per device)::

    full/MLA layers:     L × bytes_per_token
    sliding layers:      min(L, window) × bytes_per_token
    linear-attn layers:  a fixed recurrent state
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetsched.catalog.types import Device, Vendor
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import LayerKind, ModelArch

GB = 1e9


@dataclass(frozen=True)
class KVLayout:
    """KV bytes one device keeps per sequence, as a function of context length."""

    full_bytes_per_token: float     # all full-attention (or MLA) layers together
    sliding_bytes_per_token: float  # all sliding-window layers together
    window: int | None
    state_bytes_per_seq: float      # linear-attention recurrent state

    def bytes_for(self, context: int) -> float:
        sliding = min(context, self.window) if self.window else context
        return self.full_bytes_per_token * context + self.sliding_bytes_per_token * sliding + self.state_bytes_per_seq

    def tokens_per_byte_budget(self, budget: float, context: int) -> int:
        """How many KV tokens fit ``budget`` bytes when every sequence has ``context`` tokens."""
        per_seq = self.bytes_for(context)
        return int(budget / per_seq * context) if per_seq > 0 else 0


@dataclass(frozen=True)
class MemoryFit:
    """The memory breakdown of one replica on one device (per device of the TP group)."""

    model: str
    device: str
    tp: int
    weight_dtype: str
    kv_dtype: str
    device_gb: float
    usable_gb: float
    weights_gb: float
    activation_gb: float
    reserve_gb: float
    kv_cache_gb: float
    kv_bytes_per_token: float
    context_len: int
    max_kv_tokens: int
    max_sequences_at_context: int
    fits: bool
    reason: str | None


def weight_bytes(model: ModelArch, weight_dtype: DType | None = None) -> float:
    """Bytes of all weights; experts keep their own format unless overridden."""
    if weight_dtype is not None:
        return model.total_params * weight_dtype.bytes_per_element
    expert_total = model.num_moe_layers * model.moe.num_experts * model.expert_params if model.moe else 0
    expert_dtype = model.expert_dtype or model.dtype
    return (model.total_params - expert_total) * model.dtype.bytes_per_element + expert_total * expert_dtype.bytes_per_element


def default_kv_dtype(model: ModelArch, weight_dtype: DType | None) -> DType:
    """KV in the model's 16-bit activation dtype unless asked otherwise."""
    return model.dtype if model.dtype in (DType.BF16, DType.FP16) else DType.BF16


def kv_layout(model: ModelArch, *, tp: int = 1, kv_dtype: DType = DType.BF16) -> KVLayout:
    """KV bytes per token (per device) for each kind of layer.

    GQA/MHA/MQA shard KV heads across TP (a head is replicated when tp exceeds
    the KV heads); MLA's latent is replicated on every device.
    """
    b = kv_dtype.bytes_per_element
    if model.mla is not None:
        per_layer = (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * b
    else:
        per_layer = 2 * math.ceil(model.num_kv_heads / tp) * model.head_dim * b
    state = 0.0
    if model.linear_attention is not None:
        la = model.linear_attention
        # recurrent state in fp32, conv state in bf16 (the activations'); both sharded by heads
        per_layer_state = (la.recurrent_state_elements * DType.FP32.bytes_per_element
                           + la.conv_state_elements * DType.BF16.bytes_per_element)
        state = model.count(LayerKind.LINEAR) * per_layer_state / tp
    return KVLayout(
        full_bytes_per_token=model.count(LayerKind.FULL) * per_layer,
        sliding_bytes_per_token=model.count(LayerKind.SLIDING) * per_layer,
        window=model.sliding_window,
        state_bytes_per_seq=state,
    )


def activation_bytes(model: ModelArch, *, tp: int, engine: EngineConfig) -> float:
    """Peak activation memory of the largest step (profiled the same way by vLLM)."""
    width = model.moe.expert_intermediate_size * model.moe.experts_per_token if model.moe else model.intermediate_size
    per_token = (4 * model.hidden_size + 2 * width / tp) * 2
    logits = min(engine.max_num_seqs, engine.max_num_batched_tokens) * model.vocab_size / tp * 4
    return engine.max_num_batched_tokens * per_token + logits


def fit(
    model: ModelArch,
    device: Device,
    *,
    tp: int = 1,
    weight_dtype: DType | None = None,
    kv_dtype: DType | None = None,
    context_len: int | None = None,
    engine: EngineConfig = EngineConfig(),
) -> MemoryFit:
    """Memory breakdown of ``model`` on ``tp`` devices; ``fits`` False comes with a reason."""
    kv_dt = kv_dtype or default_kv_dtype(model, weight_dtype)
    context = min(context_len or model.max_context, model.max_context)
    reserve = engine.runtime_reserve_gb * GB if device.accelerator.vendor is not Vendor.CPU else 0.5 * GB
    usable = device.memory_gb * GB * engine.gpu_memory_utilization - reserve
    weights = weight_bytes(model, weight_dtype) / tp
    activation = activation_bytes(model, tp=tp, engine=engine)
    kv_budget = usable - weights - activation
    layout = kv_layout(model, tp=tp, kv_dtype=kv_dt)
    per_seq = layout.bytes_for(context)
    max_seqs = int(kv_budget // per_seq) if kv_budget > 0 else 0
    reason = _tp_reason(model, device, tp)
    if reason is None and kv_budget <= 0:
        reason = (f"needs {(weights + activation) / GB:.1f} GB/device for weights and activations at TP={tp}; "
                  f"{device.id} has {usable / GB:.1f} GB usable")
    elif reason is None and max_seqs < 1:
        reason = (f"no room for one {context}-token sequence: it needs {per_seq / GB:.2f} GB of KV cache, "
                  f"{kv_budget / GB:.2f} GB is left after weights")
    return MemoryFit(
        model=model.name,
        device=device.id,
        tp=tp,
        weight_dtype=str(weight_dtype or model.dtype),
        kv_dtype=str(kv_dt),
        device_gb=device.memory_gb,
        usable_gb=usable / GB,
        weights_gb=weights / GB,
        activation_gb=activation / GB,
        reserve_gb=reserve / GB,
        kv_cache_gb=max(kv_budget, 0.0) / GB,
        kv_bytes_per_token=per_seq / context,
        context_len=context,
        max_kv_tokens=layout.tokens_per_byte_budget(max(kv_budget, 0.0), context),
        max_sequences_at_context=max_seqs,
        fits=reason is None,
        reason=reason,
    )


def _tp_reason(model: ModelArch, device: Device, tp: int) -> str | None:
    if tp < 1:
        return f"tensor-parallel size must be at least 1, got {tp}"
    if tp > 1 and device.profile is not None:
        return f"a partition ({device.id}) serves TP=1 only"
    if tp > device.accelerator.gpus_per_node:
        return f"TP={tp} needs {tp} devices in one node; {device.accelerator.id} nodes have {device.accelerator.gpus_per_node}"
    if model.num_heads % tp:
        return f"{model.num_heads} attention heads do not split evenly over TP={tp}"
    return None


def tp_degrees(model: ModelArch, device: Device) -> list[int]:
    """TP degrees worth trying on this device: powers of two that split the heads."""
    if device.profile is not None:
        return [1]
    return [tp for tp in (1, 2, 4, 8, 16) if tp <= device.accelerator.gpus_per_node and model.num_heads % tp == 0]


def smallest_fit(model: ModelArch, device: Device, *, weight_dtype: DType | None = None,
                 kv_dtype: DType | None = None, context_len: int | None = None,
                 engine: EngineConfig = EngineConfig()) -> MemoryFit:
    """The fit at the smallest TP degree that works, or the largest degree's failure."""
    last: MemoryFit | None = None
    for tp in tp_degrees(model, device):
        last = fit(model, device, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, context_len=context_len,
                   engine=engine)
        if last.fits:
            return last
    assert last is not None
    return last
