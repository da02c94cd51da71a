"""Model specs: every bundled config parses, counts match published totals, bad configs say why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hetsched.errors import NotFoundError, SpecError
from hetsched.specs.dtypes import DType
from hetsched.specs.hf import parse_hf_config
from hetsched.specs.model import AttentionKind, LayerKind
from hetsched.specs.registry import bundled_model_names, load_model

PUBLISHED = yaml.safe_load((Path(__file__).parent / "data" / "published_params.yaml").read_text())["models"]


def test_at_least_ten_configs_are_bundled_and_all_have_published_counts() -> None:
    names = bundled_model_names()
    assert len(names) >= 10
    assert set(names) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_params_match_published_within_2_percent(name: str) -> None:
    model = load_model(name)
    published = PUBLISHED[name]
    assert model.total_params == pytest.approx(published["total"], rel=0.02)


@pytest.mark.parametrize("name", sorted(n for n, p in PUBLISHED.items() if "active" in p))
def test_moe_active_params_match_published(name: str) -> None:
    """Publishers differ on counting embeddings as active; the data file says which convention applies."""
    model = load_model(name)
    published = PUBLISHED[name]
    active = model.active_params
    if published.get("active_excludes_embedding"):
        active -= model.vocab_size * model.hidden_size
    assert active == pytest.approx(published["active"], rel=published.get("active_tolerance", 0.02))
    assert model.active_params < model.total_params


def test_attention_kinds_are_recognised() -> None:
    assert load_model("llama-2-7b").attention is AttentionKind.MHA
    assert load_model("llama-3.1-8b").attention is AttentionKind.GQA
    assert load_model("deepseek-v3").attention is AttentionKind.MLA
    mqa = json.loads((Path(__file__).parent.parent / "hetsched/specs/models/llama-3.1-8b.json").read_text())
    mqa["num_key_value_heads"] = 1
    assert parse_hf_config(mqa, name="mqa").attention is AttentionKind.MQA


def test_mla_fields() -> None:
    mla = load_model("deepseek-v3").mla
    assert mla is not None
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == \
        (512, 1536, 64, 128, 128)


def test_moe_dense_prefix_and_shared_experts() -> None:
    ds = load_model("deepseek-v3")
    assert ds.moe is not None and ds.moe.num_experts == 256 and ds.moe.experts_per_token == 8
    assert ds.moe.num_shared_experts == 1
    assert ds.moe_layers[:3] == (False, False, False) and all(ds.moe_layers[3:])
    mixtral = load_model("mixtral-8x7b")
    assert mixtral.moe is not None and mixtral.moe.num_shared_experts == 0 and all(mixtral.moe_layers)


def test_sliding_window_patterns() -> None:
    gpt = load_model("gpt-oss-20b")
    assert gpt.sliding_window == 128
    assert gpt.layer_kinds[:2] == (LayerKind.SLIDING, LayerKind.FULL)
    assert gpt.count(LayerKind.SLIDING) == gpt.count(LayerKind.FULL) == 12
    assert gpt.expert_dtype is DType.MXFP4
    gemma = load_model("gemma-2-9b")
    assert gemma.sliding_window == 4096 and gemma.count(LayerKind.SLIDING) == 21 and gemma.tie_embeddings
    assert all(k is LayerKind.SLIDING for k in load_model("mistral-7b").layer_kinds)
    assert all(k is LayerKind.FULL for k in load_model("qwen3-8b").layer_kinds)


def test_hybrid_linear_attention() -> None:
    nxt = load_model("qwen3-next-80b-a3b")
    assert nxt.linear_attention is not None
    assert nxt.count(LayerKind.LINEAR) == 36 and nxt.count(LayerKind.FULL) == 12
    assert nxt.layer_kinds[3] is LayerKind.FULL and nxt.attention_layers == 12
    assert nxt.moe is not None and nxt.moe.shared_expert_gate


def test_unknown_model_type_names_the_field() -> None:
    with pytest.raises(SpecError, match="model_type.*unsupported model_type 'bert'"):
        parse_hf_config({"model_type": "bert"}, name="x")


def test_missing_field_is_named() -> None:
    raw = json.loads((Path(__file__).parent.parent / "hetsched/specs/models/qwen3-8b.json").read_text())
    del raw["intermediate_size"]
    with pytest.raises(SpecError, match="^intermediate_size: required field is missing"):
        parse_hf_config(raw, name="broken")


def test_malformed_field_is_named() -> None:
    raw = json.loads((Path(__file__).parent.parent / "hetsched/specs/models/qwen3-8b.json").read_text())
    raw["num_key_value_heads"] = 5
    with pytest.raises(SpecError, match="num_key_value_heads"):
        parse_hf_config(raw, name="broken")
    raw["num_key_value_heads"] = "8"
    with pytest.raises(SpecError, match="expected an integer in 0..2147483647"):
        parse_hf_config(raw, name="broken")


def test_hybrid_without_linear_fields_is_an_error() -> None:
    raw = json.loads((Path(__file__).parent.parent / "hetsched/specs/models/qwen3-next-80b-a3b.json").read_text())
    del raw["linear_num_value_heads"]
    with pytest.raises(SpecError, match="linear_num_value_heads"):
        parse_hf_config(raw, name="broken")


def test_load_by_path_and_unknown_name(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text((Path(__file__).parent.parent / "hetsched/specs/models/qwen3-0.6b.json").read_text())
    assert load_model(str(folder)).name == "my-model"
    assert load_model(str(folder / "config.json")).total_params == load_model("qwen3-0.6b").total_params
    with pytest.raises(NotFoundError, match="did you mean 'qwen3-8b'"):
        load_model("qwen3-8")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_model(str(tmp_path / "bad.json"))


def test_absurd_layer_count_is_refused_not_allocated() -> None:
    raw = json.loads((Path(__file__).parent.parent / "hetsched/specs/models/qwen3-0.6b.json").read_text())
    raw["num_hidden_layers"] = 10**12
    with pytest.raises(SpecError, match="^num_hidden_layers: expected an integer in 0..1024"):
        parse_hf_config(raw, name="huge")


def test_user_documents_name_the_file_and_option(tmp_path: Path) -> None:
    from hetsched.errors import InputError
    from hetsched.specs.files import parse_document, read_document

    (tmp_path / "c.yaml").write_text("a: [1, 2\n")
    (tmp_path / "c.json").write_text('{"a": 1,}')
    with pytest.raises(InputError, match="^--config: c.yaml is not valid YAML"):
        read_document(tmp_path / "c.yaml", field="--config")
    with pytest.raises(InputError, match="^--config: c.json is not valid JSON"):
        read_document(tmp_path / "c.json", field="--config")
    with pytest.raises(InputError, match="^--config: no such file"):
        read_document(tmp_path / "missing.yaml", field="--config")
    with pytest.raises(InputError, match="is a folder; expected a file$"):
        read_document(tmp_path, field="--config")
    assert parse_document("a: 1", name="upload", field="text") == {"a": 1}
