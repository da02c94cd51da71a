"""ModelArch: what the performance model needs to know about a transformer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from hetsched.specs.dtypes import DType


class AttentionKind(StrEnum):
    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"


class LayerKind(StrEnum):
    """How one decoder layer mixes tokens; decides what it keeps per token."""

    FULL = "full"        # softmax attention over the whole context
    SLIDING = "sliding"  # softmax attention over the last `sliding_window` tokens
    LINEAR = "linear"    # linear attention: a fixed-size recurrent state


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): a compressed KV latent."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoESpec:
    """Routed experts (plus optional always-on shared experts)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared expert(s)
    expert_bias: bool = False           # gpt-oss experts carry biases
    shared_expert_gate: bool = False    # Qwen-MoE: sigmoid gate on the shared expert


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet-style linear attention (Qwen3-Next): state, not a KV cache."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    @property
    def recurrent_state_elements(self) -> int:
        """Elements of one layer's recurrent state per sequence: a key × value matrix per value head."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    @property
    def conv_state_elements(self) -> int:
        """Elements of one layer's short-convolution state per sequence: the last ``conv_kernel_size - 1`` inputs
        of its query, key and value channels."""
        conv_channels = 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        return conv_channels * (self.conv_kernel_size - 1)


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer, per layer where layers differ.

    ``layer_kinds[i]`` says how layer *i* attends; ``moe_layers[i]`` whether
    its MLP is a routed-expert block. Everything the memory and step-latency
    models need is derivable from these fields.
    """

    name: str
    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    attention: AttentionKind
    layer_kinds: tuple[LayerKind, ...]
    moe_layers: tuple[bool, ...]
    max_context: int
    dtype: DType = DType.BF16
    expert_dtype: DType | None = None    # routed experts quantised apart (gpt-oss: mxfp4)
    sliding_window: int | None = None
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    linear_attention: LinearAttentionSpec | None = None
    attention_bias: bool = False
    gated_mlp: bool = True               # SwiGLU-style gate and up projections; False: one up projection (phi-2)
    attention_output_gate: bool = False  # Qwen3-Next gated attention: q_proj also emits a gate
    attention_sinks: bool = False
    mtp_layers: int = 0                  # multi-token-prediction layers, not counted in the base model

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def attention_layers(self) -> int:
        """Layers that keep a KV cache (full or sliding softmax attention)."""
        return sum(kind is not LayerKind.LINEAR for kind in self.layer_kinds)

    def count(self, kind: LayerKind) -> int:
        return sum(k is kind for k in self.layer_kinds)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    # --- parameter counts -------------------------------------------------
    def attention_params(self, kind: LayerKind) -> int:
        """Weights of one token-mixing block of the given kind."""
        h = self.hidden_size
        if kind is LayerKind.LINEAR:
            la = self.linear_attention
            assert la is not None
            qk = la.num_key_heads * la.key_head_dim
            v = la.num_value_heads * la.value_head_dim
            in_proj = h * (2 * qk + 2 * v) + h * 2 * la.num_value_heads  # qkvz + beta/alpha
            conv = (2 * qk + v) * la.conv_kernel_size
            per_head = 2 * la.num_value_heads  # dt_bias, A_log
            return in_proj + conv + per_head + la.value_head_dim + v * h
        if self.mla is not None:
            m = self.mla
            qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * self.num_heads * qk_dim
            else:
                q = h * self.num_heads * qk_dim
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            kv += m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + self.num_heads * m.v_head_dim * h
        q_out = self.num_heads * self.head_dim * (2 if self.attention_output_gate else 1)
        kv_out = 2 * self.num_kv_heads * self.head_dim
        params = h * (q_out + kv_out) + self.num_heads * self.head_dim * h
        if self.attention_bias:
            params += q_out + kv_out + h
        if self.attention_sinks:
            params += self.num_heads
        return params

    @property
    def dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up, down)."""
        assert self.moe is not None
        h, i = self.hidden_size, self.moe.expert_intermediate_size
        return 3 * h * i + ((2 * i + h) if self.moe.expert_bias else 0)

    @property
    def moe_block_params(self) -> int:
        """One MoE MLP block: all experts, the router and the shared expert(s)."""
        assert self.moe is not None
        h, moe = self.hidden_size, self.moe
        router = h * moe.num_experts + (moe.num_experts if moe.expert_bias else 0)
        shared = 3 * h * moe.shared_intermediate_size + (h if moe.shared_expert_gate else 0)
        return moe.num_experts * self.expert_params + router + shared

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def total_params(self) -> int:
        """All weights of the base model (multi-token-prediction heads excluded)."""
        norms = 2 * self.hidden_size * self.num_layers + self.hidden_size
        mixing = sum(self.attention_params(kind) for kind in self.layer_kinds)
        mlp = sum(self.moe_block_params if is_moe else self.dense_mlp_params for is_moe in self.moe_layers)
        return self.embedding_params + norms + mixing + mlp

    @property
    def active_params(self) -> int:
        """Weights touched per token: routed experts counted ``experts_per_token`` times."""
        if self.moe is None:
            return self.total_params
        idle = (self.moe.num_experts - self.moe.experts_per_token) * self.expert_params
        return self.total_params - idle * self.num_moe_layers
