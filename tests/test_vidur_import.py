"""Vidur's profiling CSVs become stored Profiles: tables, units, TP shards, matching, and refusals that say where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import HetschedError, InputError
from hetsched.profiler.calibration import table_samples
from hetsched.profiler.profile import Profile, Variable
from hetsched.profiler.vidur import (
    VidurFile,
    VidurShape,
    collective_measurements,
    match_model,
    profiles_from_vidur,
)
from hetsched.specs.registry import load_model
from hetsched.store import open_store
from hetsched.store.profiles import list_profiles

runner = CliRunner()

OPS_HEADER = ("device,model,n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,use_gated_mlp,num_tokens,"
              "num_tensor_parallel_workers,emb_ms,input_layernorm_ms,attn_pre_proj_ms,attn_rope_ms,attn_post_proj_ms,"
              "post_attention_layernorm_ms,mlp_up_proj_ms,mlp_act_ms,mlp_down_proj_ms,add_ms")
LLAMA = "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True"
# Rows of data/measurements/vidur/a100/ops/Llama-2-7b-hf.csv; 8 tokens at TP 1 is measured twice here.
OPS = "\n".join([
    OPS_HEADER,
    f"{LLAMA},8,1,0.008,0.004,0.063,0.005,0.025,0.004,0.111,0.008,0.061,0.002",
    f"{LLAMA},8,1,0.008,0.004,0.069,0.005,0.025,0.004,0.111,0.008,0.061,0.002",
    f"{LLAMA},2,1,0.004,0.004,0.063,0.005,0.025,0.004,0.11,0.007,0.06,0.002",
    f"{LLAMA},1,1,0.003,0.005,0.065,0.005,0.025,0.005,0.116,0.007,0.06,0.002",
    f"{LLAMA},8,2,0.008,0.004,0.034,0.004,0.015,0.004,0.057,0.005,0.033,0.002",
    f"{LLAMA},2,2,0.004,0.004,0.033,0.004,0.015,0.004,0.056,0.004,0.033,0.002",
    f"{LLAMA},1,2,0.003,0.005,0.033,0.004,0.015,0.005,0.056,0.0045,0.032,0.002",
]) + "\n"
PHI = """device,model,n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,use_gated_mlp,num_tokens,\
num_tensor_parallel_workers,emb_ms,input_layernorm_ms,attn_pre_proj_ms,attn_rope_ms,attn_post_proj_ms,mlp_up_proj_ms,\
mlp_act_ms,mlp_down_proj_ms,add_ms
a100,phi-2,32,32,2560,10240,51200,False,2,1,0.004,0.007,0.03,0.004,0.014,0.038,0.002,0.039,0.004
a100,phi-2,32,32,2560,10240,51200,False,1,1,0.003,0.007,0.03,0.004,0.014,0.038,0.002,0.039,0.004
"""
ATTENTION = """device,model,tp,phase,batch,kv_tokens,prefill_tokens,attention_ms
a100,llama-2-7b,1,decode,1,32,0,0.009
a100,llama-2-7b,1,decode,8,512,0,0.073
a100,llama-2-7b,1,prefill,1,512,128,0.041
a100,llama-2-7b,1,prefill,1,0,128,0.016
"""
DGX = """device,topology,collective,num_workers,size_bytes,median_ms
a100,a100_dgx,all_reduce,2,2048,0.043
a100,a100_dgx,all_reduce,2,10240,0.056
a100,a100_dgx,all_reduce,2,2048,0.01
a100,a100_dgx,all_reduce,4,2048,0.05
"""
PAIRWISE = """device,topology,collective,num_workers,size_bytes,median_ms
a100,a100_pairwise_nvlink,all_reduce,2,2048,0.007
a100,a100_pairwise_nvlink,send_recv,2,2048,0.012
"""


def _files(**named: str) -> list[VidurFile]:
    paths = {"ops": "a100/ops/Llama-2-7b-hf.csv", "phi": "a100/ops/phi-2.csv",
             "attention": "a100/attention/llama-2-7b-flash-attention.csv",
             "dgx": "a100/network/a100_dgx-all_reduce.csv", "pairwise": "a100/network/a100_pairwise_nvlink-mixed.csv"}
    return [VidurFile(paths[key], text) for key, text in named.items()]


def _at(profiles: list[Profile], tp: int) -> Profile:
    return next(p for p in profiles if p.tp == tp)


def test_an_ops_slice_becomes_kernel_profile_tables_in_seconds() -> None:
    profiles = profiles_from_vidur(_files(ops=OPS))
    assert [(p.model, p.accelerator, p.tp) for p in profiles] == [("llama-2-7b", "a100-80gb", 1),
                                                                 ("llama-2-7b", "a100-80gb", 2)]
    profile = _at(profiles, 1)
    assert (profile.source, profile.backend, profile.dtype) == ("kernel", "cuda", "fp16")
    qkv = profile.table("qkv_proj")
    assert (qkv.kernel, qkv.variable, qkv.dims) == ("gemm", Variable.TOKENS, {"k": 4096, "n": 12288, "tp": 1})
    assert [p.coords for p in qkv.points] == [(1.0,), (2.0,), (8.0,)]
    eight = qkv.points[-1]  # two rows at 8 tokens: 0.063 and 0.069 ms
    assert eight.median_s == pytest.approx(66e-6) and eight.p90_s == pytest.approx(69e-6)
    assert profile.table("down_proj").points[0].median_s == pytest.approx(60e-6)
    assert profile.table("embedding").dims == {"vocab": 32768, "hidden": 4096, "tp": 1}
    assert {t.op: t.kernel for t in profile.tables} == {
        "qkv_proj": "gemm", "o_proj": "gemm", "rope": "rope", "gate_up_proj": "gemm", "silu_mul": "silu_mul",
        "down_proj": "gemm", "input_layernorm": "rmsnorm", "post_attention_layernorm": "rmsnorm",
        "residual_add": "add", "embedding": "embedding"}
    terms = {t.table: (t.name, t.multiplier) for t in profile.terms}
    assert terms["qkv_proj"] == ("attention projections", 32) and terms["gate_up_proj"] == ("mlp", 32)
    assert terms["residual_add"] == ("elementwise", 64) and terms["input_layernorm"] == ("elementwise", 32)
    assert terms["embedding"] == ("embedding", 1)
    assert profile.provenance.device == {"catalog": "a100-80gb", "name": "NVIDIA A100 80GB SXM", "origin": "vidur",
                                         "file": "a100/ops/Llama-2-7b-hf.csv"}
    assert profile.provenance.versions == {"vidur": "7d47513"} and profile.provenance.host == ""
    assert profile.sweep["origin"] == "vidur" and profile.sweep["vidur_model"] == "Llama-2-7b-hf"
    assert {"lm head", "attention decode", "attention prefill", "final norm"} <= set(profile.sweep["missing_ops"])
    assert "all-reduce" in _at(profiles, 2).sweep["missing_ops"]


def test_tensor_parallel_shards_split_the_dims() -> None:
    profile = _at(profiles_from_vidur(_files(ops=OPS)), 2)
    dims = {t.op: t.dims for t in profile.tables}
    assert dims["qkv_proj"] == {"k": 4096, "n": 6144, "tp": 2}
    assert dims["o_proj"] == {"k": 2048, "n": 4096, "tp": 2}
    assert dims["gate_up_proj"] == {"k": 4096, "n": 11008, "tp": 2}
    assert dims["down_proj"] == {"k": 5504, "n": 4096, "tp": 2}
    assert dims["silu_mul"] == {"inter": 5504, "gated": 1, "tp": 2}
    assert dims["rope"] == {"heads": 16, "kv_heads": 16, "head_dim": 128, "tp": 2}


def test_attention_and_all_reduce_files_add_their_tables() -> None:
    profiles = profiles_from_vidur(_files(ops=OPS, attention=ATTENTION, dgx=DGX, pairwise=PAIRWISE))
    single, pair = _at(profiles, 1), _at(profiles, 2)
    decode = single.table("decode_attention")
    assert (decode.variable, decode.dims) == (Variable.DECODE, {"heads": 32, "kv_heads": 32, "head_dim": 128, "tp": 1})
    assert [p.coords for p in decode.points] == [(1.0, 32.0), (8.0, 512.0)]
    prefill = single.table("prefill_attention")
    assert prefill.variable is Variable.PREFILL_PAIRS
    assert [p.coords[0] for p in prefill.points] == [128 * 129 / 2, 128 * 512 + 128 * 129 / 2]
    assert prefill.points[1].median_s == pytest.approx(41e-6)
    assert single.sweep["prefill_points"] == [[128, 0], [128, 512]]
    assert {"attention prefill", "attention decode"}.isdisjoint(single.sweep["missing_ops"])
    assert "all_reduce" not in {t.op for t in single.tables}
    reduce = pair.table("all_reduce")  # the NVSwitch node wins over NVLink pairs
    assert (reduce.kernel, reduce.dims) == ("all_reduce", {"workers": 2, "hidden": 4096, "bytes_per_token": 8192,
                                                           "tp": 2})
    assert [p.coords for p in reduce.points] == [(0.25,), (1.25,)]
    # a size measured twice (ranks on one node, ranks over nodes): the one-node placement tensor parallelism uses
    assert (reduce.points[0].median_s, reduce.points[0].p90_s) == pytest.approx((10e-6, 10e-6))
    assert pair.sweep["all_reduce_topology"] == "dgx" and "all-reduce" not in pair.sweep["missing_ops"]
    assert ("all-reduce", 64) in {(t.name, t.multiplier) for t in pair.terms}
    assert "a100/network/a100_dgx-all_reduce.csv" in pair.sweep["files"]


def test_raw_collective_rows_are_returned_for_calibration() -> None:
    rows = collective_measurements(_files(ops=OPS, dgx=DGX, pairwise=PAIRWISE))
    assert len(rows) == 6
    first = rows[0]
    assert (first.accelerator, first.topology, first.collective, first.workers, first.size_bytes) == \
        ("a100-80gb", "dgx", "all_reduce", 2, 2048)
    assert first.median_s == pytest.approx(43e-6)
    assert (first.file, first.row) == ("a100/network/a100_dgx-all_reduce.csv", 2)
    assert {(r.topology, r.collective) for r in rows} == {("dgx", "all_reduce"), ("pairwise_nvlink", "all_reduce"),
                                                          ("pairwise_nvlink", "send_recv")}


def test_models_are_matched_by_shape() -> None:
    phi = profiles_from_vidur(_files(phi=PHI))[0]
    assert phi.model == "phi-2"
    assert phi.table("gate_up_proj").dims["n"] == 10240 and phi.table("silu_mul").dims["gated"] == 0
    assert "post_attention_layernorm" not in {t.op for t in phi.tables}
    # a parallel block times attention + MLP + residual as one add: two launches, once per layer
    add = phi.table("residual_add")
    assert add.dims["launches"] == 2
    assert next(t.multiplier for t in phi.terms if t.table == "residual_add") == load_model("phi-2").num_layers
    halves = [s.seconds for s in table_samples(phi, add)]
    assert halves == pytest.approx([p.median_s / 2 for p in add.points])
    llama = profiles_from_vidur(_files(ops=OPS))[0]
    assert "launches" not in llama.table("residual_add").dims
    assert next(t.multiplier for t in llama.terms if t.table == "residual_add") == 2 * load_model("llama-2-7b").num_layers
    llama_2_70b = VidurShape(heads=64, kv_heads=8, hidden=8192, intermediate=28672, vocab=32768, gated_mlp=True)
    assert match_model(llama_2_70b).name == "llama-2-70b"  # Llama-3.1-70B shares the shape, not the vocabulary
    assert match_model(VidurShape(32, 8, 4096, 14336, 128256, True)).name == "llama-3.1-8b"
    assert match_model(VidurShape(64, 64, 8192, 24576, 152064, True)).name == "qwen-72b"
    assert match_model(VidurShape(40, 40, 5120, 13824, 103168, True)).name == "internlm-20b"
    assert match_model(VidurShape(64, 8, 8192, 22016, 32768, True)).name == "codellama-34b"
    forced = profiles_from_vidur(_files(ops=OPS), model=load_model("llama-2-7b"))
    assert {p.model for p in forced} == {"llama-2-7b"}
    with pytest.raises(InputError, match="row 2, column model: .*llama-3.1-8b does not match.*KV heads is 8"):
        profiles_from_vidur(_files(ops=OPS), model=load_model("llama-3.1-8b"))


@pytest.fixture
def cli_db(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HETSCHED_DATABASE_URL", database_url)
    return database_url


def _layout(root: Path, files: list[VidurFile]) -> Path:
    for file in files:
        path = root / "vidur" / file.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(file.text)
    return root / "vidur"


def _stored(database_url: str) -> int:
    store = open_store(database_url)
    try:
        return len(list_profiles(store))
    finally:
        store.engine.dispose()


def test_the_cli_stores_one_profile_per_gpu_model_and_tp(cli_db: str, tmp_path: Path) -> None:
    folder = _layout(tmp_path, _files(ops=OPS, phi=PHI, attention=ATTENTION, dgx=DGX))
    result = runner.invoke(app, ["profiles", "import-vidur", str(folder), "-o", "json"])
    assert result.exit_code == 0, result.output
    imported = json.loads(result.stdout)
    assert [(r["model"], r["tp"]) for r in imported] == [("llama-2-7b", 1), ("llama-2-7b", 2), ("phi-2", 1)]
    assert "lm head" in imported[0]["missing_ops"] and "all-reduce" not in imported[1]["missing_ops"]
    listed = json.loads(runner.invoke(app, ["profiles", "list", "-o", "json"]).stdout)
    assert sorted(r["id"] for r in listed) == sorted(r["id"] for r in imported)
    assert {(r["accelerator"], r["source"], r["backend"]) for r in listed} == {("a100-80gb", "kernel", "cuda")}
    table = runner.invoke(app, ["profiles", "import-vidur", str(folder / "a100" / "ops" / "phi-2.csv")],
                          env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "phi-2" in table.stdout and "lm head" in table.stdout


def _replace_cell(text: str, row: int, column: str, value: str) -> str:
    lines = text.splitlines()
    header = lines[0].split(",")
    cells = lines[row - 1].split(",")
    cells[header.index(column)] = value
    lines[row - 1] = ",".join(cells)
    return "\n".join(lines) + "\n"


def _drop_column(text: str, column: str) -> str:
    index = text.splitlines()[0].split(",").index(column)
    return "\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != index)
                     for line in text.splitlines()) + "\n"


@pytest.mark.parametrize(("bad", "where"), [
    (_drop_column(OPS, "attn_rope_ms"), "row 1, column attn_rope_ms"),
    (_replace_cell(OPS, 3, "mlp_up_proj_ms", "nan"), "row 3, column mlp_up_proj_ms"),
    (_replace_cell(OPS, 4, "attn_pre_proj_ms", "-0.063"), "row 4, column attn_pre_proj_ms"),
    (_replace_cell(OPS, 2, "add_ms", "0"), "row 2, column add_ms"),
    (_replace_cell(OPS, 5, "emb_ms", "fast"), "row 5, column emb_ms"),
    (_replace_cell(OPS, 6, "num_tokens", "0"), "row 6, column num_tokens"),
    (_replace_cell(OPS, 7, "num_tensor_parallel_workers", "3"), "row 7, column num_tensor_parallel_workers"),
    (_replace_cell(OPS, 2, "device", "tpu-v5"), "row 2, column device"),
    (OPS.replace(",32,32,4096,11008,", ",32,16,4096,11008,"), "row 2, column model"),
])
def test_bad_input_names_file_row_and_column_and_stores_nothing(cli_db: str, tmp_path: Path, bad: str,
                                                                 where: str) -> None:
    folder = _layout(tmp_path, _files(phi=PHI, ops=bad))
    result = runner.invoke(app, ["profiles", "import-vidur", str(folder)])
    assert isinstance(result.exception, HetschedError) and result.exception.exit_code == 2
    assert f"Llama-2-7b-hf.csv, {where}" in str(result.exception)
    assert _stored(cli_db) == 0


def test_unreadable_or_orphan_files_are_refused(cli_db: str, tmp_path: Path) -> None:
    latin = tmp_path / "ops" / "latin.csv"
    latin.parent.mkdir()
    latin.write_bytes(OPS.replace("Llama-2-7b-hf", "Llama-2-7b-\xe9").encode("latin-1"))
    result = runner.invoke(app, ["profiles", "import-vidur", str(latin)])
    assert isinstance(result.exception, InputError) and "latin.csv" in str(result.exception)
    assert "UTF-8" in str(result.exception)
    with pytest.raises(InputError, match="attention.csv, row 2, column model: no ops file"):
        profiles_from_vidur(_files(attention=ATTENTION))
    at_tp_4 = ATTENTION.replace("llama-2-7b,1,decode,1,", "llama-2-7b,4,decode,1,")
    with pytest.raises(InputError, match="attention.csv, row 2, column tp: unknown tensor-parallel size 4"):
        profiles_from_vidur(_files(ops=OPS, attention=at_tp_4))
    assert _stored(cli_db) == 0
