"""Parse a Hugging Face ``config.json`` into a :class:`ModelArch`.

Only keys whose meaning is known are read. A missing key is an error that
names it, except where the transformers library itself defines the absent
value (``num_key_value_heads`` → MHA, ``head_dim`` → hidden/heads): those are
the model's real shape, not a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetsched.errors import SpecError
from hetsched.specs.dtypes import DType
from hetsched.specs.model import (
    AttentionKind,
    LayerKind,
    LinearAttentionSpec,
    MLASpec,
    ModelArch,
    MoESpec,
)

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "mixtral",
    "deepseek_v2", "deepseek_v3", "gpt_oss", "gemma", "gemma2", "gemma3", "gemma3_text", "internlm", "phi",
)

MAX_LAYERS = 1024
"""Deepest decoder accepted; real models have at most a few hundred layers."""

_LAYER_TYPE_NAMES = {
    "full_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "linear_attention": LayerKind.LINEAR,
}

# fp32 checkpoints are served in bf16 (vLLM's default for them).
_TORCH_DTYPES = {"bfloat16": DType.BF16, "float16": DType.FP16, "float32": DType.BF16}

# transformers' default for an absent tie_word_embeddings, by config class.
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text"}

# Families whose q/k/v projections carry biases when the config has no attention_bias key.
_BIASED_ATTENTION = {"qwen", "qwen2", "phi"}

# Families whose MLP is one up projection and an activation, with no gate.
_UNGATED_MLP = {"phi"}


class _Config:
    """A config mapping that names the missing or malformed field in its errors."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, *, maximum: int = 2**31 - 1) -> int:
        value = self.raw.get(key, default)
        if value is None:
            raise SpecError(f"required field is missing in {self.source}", field=key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
            raise SpecError(f"expected an integer in 0..{maximum} in {self.source}, got {value!r}", field=key)
        return value


def parse_hf_config(raw: Mapping[str, Any], *, name: str, source: str = "config.json") -> ModelArch:
    """Build a ModelArch from a config.json mapping; raise SpecError naming the bad field."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"expected a JSON object in {source}")
    model_type = raw.get("model_type")
    if model_type is None:
        raise SpecError(f"required field is missing in {source}", field="model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecError(
            f"unsupported model_type {model_type!r} in {source}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
            field="model_type",
        )
    if isinstance(raw.get("text_config"), Mapping):
        text = dict(raw["text_config"])
        text.setdefault("model_type", f"{model_type}_text")
        text.setdefault("torch_dtype", raw.get("torch_dtype"))
        cfg = _Config(text, f"{source} (text_config)")
    else:
        cfg = _Config(raw, source)

    num_layers = cfg.int("num_hidden_layers", maximum=MAX_LAYERS)
    hidden = cfg.int("hidden_size")
    heads = cfg.int("num_attention_heads")
    if heads == 0 or num_layers == 0 or hidden == 0:
        raise SpecError(f"num_hidden_layers, hidden_size and num_attention_heads must be positive in {source}")
    kv_heads = cfg.int("num_key_value_heads", heads)
    head_dim = cfg.int("head_dim", hidden // heads)
    if kv_heads == 0 or heads % kv_heads:
        raise SpecError(f"num_attention_heads ({heads}) must be a multiple of it in {source}",
                        field="num_key_value_heads")

    mla = _parse_mla(cfg)
    moe, moe_layers = _parse_moe(cfg, num_layers)
    layer_kinds = _parse_layer_kinds(cfg, num_layers)
    linear = _parse_linear_attention(cfg) if LayerKind.LINEAR in layer_kinds else None
    sliding_window = cfg.int("sliding_window") if LayerKind.SLIDING in layer_kinds else None

    if mla is not None:
        attention = AttentionKind.MLA
    elif kv_heads == heads:
        attention = AttentionKind.MHA
    elif kv_heads == 1:
        attention = AttentionKind.MQA
    else:
        attention = AttentionKind.GQA

    dtype, expert_dtype = _parse_dtypes(raw, cfg)
    return ModelArch(
        name=name,
        model_type=cfg.get("model_type"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_intermediate_size(cfg),
        vocab_size=cfg.int("vocab_size"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT))),
        attention=attention,
        layer_kinds=layer_kinds,
        moe_layers=moe_layers,
        max_context=cfg.int("max_position_embeddings"),
        dtype=dtype,
        expert_dtype=expert_dtype,
        sliding_window=sliding_window,
        mla=mla,
        moe=moe,
        linear_attention=linear,
        attention_bias=_attention_bias(cfg),
        gated_mlp=cfg.get("model_type") not in _UNGATED_MLP,
        attention_output_gate=cfg.get("model_type") == "qwen3_next",
        attention_sinks=cfg.get("model_type") == "gpt_oss",
        mtp_layers=cfg.int("num_nextn_predict_layers", 0),
    )


def _intermediate_size(cfg: _Config) -> int:
    """Width of each of the gate and up projections.

    Qwen (v1) configs give the two projections' combined width: its MLP splits
    ``intermediate_size`` in half between ``w1`` and ``w2``.
    """
    size = cfg.int("intermediate_size")
    return size // 2 if cfg.get("model_type") == "qwen" else size


def _attention_bias(cfg: _Config) -> bool:
    """Whether q/k/v carry biases: the config's flag where it has one, else the family's default."""
    model_type = cfg.get("model_type")
    if model_type == "internlm":
        return bool(cfg.get("bias", True))  # InternLMConfig's own key and default
    return bool(cfg.get("attention_bias", model_type in _BIASED_ATTENTION))


def _parse_mla(cfg: _Config) -> MLASpec | None:
    if not cfg.has("kv_lora_rank"):
        return None
    return MLASpec(
        kv_lora_rank=cfg.int("kv_lora_rank"),
        q_lora_rank=cfg.int("q_lora_rank") if cfg.has("q_lora_rank") else None,
        qk_rope_head_dim=cfg.int("qk_rope_head_dim"),
        qk_nope_head_dim=cfg.int("qk_nope_head_dim"),
        v_head_dim=cfg.int("v_head_dim"),
    )


def _parse_moe(cfg: _Config, num_layers: int) -> tuple[MoESpec | None, tuple[bool, ...]]:
    experts_key = next((k for k in ("n_routed_experts", "num_local_experts", "num_experts") if cfg.has(k)), None)
    if experts_key is None or cfg.int(experts_key) == 0:
        return None, (False,) * num_layers
    per_token_key = "num_experts_per_tok" if cfg.has("num_experts_per_tok") else "experts_per_token"
    expert_size_key = "moe_intermediate_size" if cfg.has("moe_intermediate_size") else "intermediate_size"
    expert_size = cfg.int(expert_size_key)
    if cfg.has("n_shared_experts"):  # DeepSeek: n_shared experts of the routed width
        shared_count = cfg.int("n_shared_experts")
        shared_size, shared_gate = shared_count * expert_size, False
    elif cfg.has("shared_expert_intermediate_size"):  # Qwen-MoE: one gated shared expert
        shared_size = cfg.int("shared_expert_intermediate_size")
        shared_count, shared_gate = (1 if shared_size else 0), shared_size > 0
    else:
        shared_count, shared_size, shared_gate = 0, 0, False
    moe = MoESpec(
        num_experts=cfg.int(experts_key),
        experts_per_token=cfg.int(per_token_key),
        expert_intermediate_size=expert_size,
        num_shared_experts=shared_count,
        shared_intermediate_size=shared_size,
        expert_bias=cfg.get("model_type") == "gpt_oss",
        shared_expert_gate=shared_gate,
    )
    if moe.experts_per_token == 0 or moe.experts_per_token > moe.num_experts:
        raise SpecError(f"expected 1..{moe.num_experts} in {cfg.source}, got {moe.experts_per_token}",
                        field=per_token_key)
    if cfg.has("moe_layer_freq"):  # DeepSeek: dense prefix, then every k-th layer
        first_dense, every = cfg.int("first_k_dense_replace", 0), max(cfg.int("moe_layer_freq"), 1)
        layers = tuple(i >= first_dense and (i - first_dense) % every == 0 for i in range(num_layers))
    else:  # Qwen/Mixtral/gpt-oss: every k-th layer, minus the listed dense ones
        step, dense_only = max(cfg.int("decoder_sparse_step", 1), 1), set(cfg.get("mlp_only_layers", []))
        layers = tuple((i + 1) % step == 0 and i not in dense_only for i in range(num_layers))
    return moe, layers


def _parse_layer_kinds(cfg: _Config, num_layers: int) -> tuple[LayerKind, ...]:
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise SpecError(f"expected a list of {num_layers} layer types in {cfg.source}", field="layer_types")
        unknown = sorted({t for t in layer_types if t not in _LAYER_TYPE_NAMES})
        if unknown:
            raise SpecError(f"unknown layer types {unknown} in {cfg.source}; expected {sorted(_LAYER_TYPE_NAMES)}",
                            field="layer_types")
        return tuple(_LAYER_TYPE_NAMES[t] for t in layer_types)
    model_type = cfg.get("model_type")
    if model_type == "qwen3_next":
        interval = cfg.int("full_attention_interval")
        return tuple(LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.LINEAR for i in range(num_layers))
    if model_type == "gemma2":  # even layers slide, odd layers see everything
        return tuple(LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL for i in range(num_layers))
    if model_type == "gemma3_text":
        pattern = cfg.int("sliding_window_pattern")
        return tuple(LayerKind.FULL if (i + 1) % pattern == 0 else LayerKind.SLIDING for i in range(num_layers))
    slides = cfg.has("sliding_window") and cfg.get("use_sliding_window", True)
    return (LayerKind.SLIDING if slides else LayerKind.FULL,) * num_layers


def _parse_linear_attention(cfg: _Config) -> LinearAttentionSpec:
    return LinearAttentionSpec(
        num_key_heads=cfg.int("linear_num_key_heads"),
        num_value_heads=cfg.int("linear_num_value_heads"),
        key_head_dim=cfg.int("linear_key_head_dim"),
        value_head_dim=cfg.int("linear_value_head_dim"),
        conv_kernel_size=cfg.int("linear_conv_kernel_dim"),
    )


def _parse_dtypes(raw: Mapping[str, Any], cfg: _Config) -> tuple[DType, DType | None]:
    """Weight dtype of the checkpoint, and of the experts where they are quantised apart."""
    name = cfg.get("torch_dtype", raw.get("torch_dtype", cfg.get("dtype", "bfloat16")))
    dtype = _TORCH_DTYPES.get(str(name))
    if dtype is None:
        raise SpecError(f"expected one of {sorted(_TORCH_DTYPES)}, got {name!r}", field="torch_dtype")
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method == "fp8":
        return DType.FP8, None
    if method == "mxfp4":
        return dtype, DType.MXFP4
    return dtype, None
