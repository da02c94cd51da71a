"""Vidur's own profiler files (mlp.csv, attention.csv, all_reduce.csv, send_recv.csv) give the Profiles the slimmed
layout gives: same tables, the max of the repeats as the p90, one-node all-reduces, the GPU from the path or
--device, and refusals that name the file, row and column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import HetschedError, InputError, NotFoundError
from hetsched.profiler.profile import Profile, Variable
from hetsched.profiler.vidur import VidurFile, collective_measurements, profiles_from_vidur
from hetsched.store import open_store
from hetsched.store.profiles import list_profiles

runner = CliRunner()

# Verbatim rows of Vidur's public profiling data (github.com/microsoft/vidur, commit 7d47513, MIT licence,
# Copyright (c) Microsoft Corporation): data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv (1, 2 and 8
# tokens and two repeats of 2048 at TP 1; 1 and 2 tokens at TP 4), .../attention.csv (three decode rows, four
# prefill rows at TP 1, 3072 new tokens after 1024 cached measured twice) and data/profiling/network/a100_dgx/
# all_reduce.csv (4 GPUs on one node and over two nodes; 2 GPUs over two nodes) and send_recv.csv.
MLP = (
    "time_stats.emb.min,time_stats.emb.max,time_stats.emb.mean,time_stats.emb.median,time_stats.emb.std,"
    "time_stats.input_layernorm.min,time_stats.input_layernorm.max,time_stats.input_layernorm.mean,"
    "time_stats.input_layernorm.median,time_stats.input_layernorm.std,time_stats.attn_pre_proj.min,"
    "time_stats.attn_pre_proj.max,time_stats.attn_pre_proj.mean,time_stats.attn_pre_proj.median,"
    "time_stats.attn_pre_proj.std,time_stats.attn_rope.min,time_stats.attn_rope.max,"
    "time_stats.attn_rope.mean,time_stats.attn_rope.median,time_stats.attn_rope.std,"
    "time_stats.attn_post_proj.min,time_stats.attn_post_proj.max,time_stats.attn_post_proj.mean,"
    "time_stats.attn_post_proj.median,time_stats.attn_post_proj.std,time_stats.post_attention_layernorm.min,"
    "time_stats.post_attention_layernorm.max,time_stats.post_attention_layernorm.mean,"
    "time_stats.post_attention_layernorm.median,time_stats.post_attention_layernorm.std,"
    "time_stats.mlp_up_proj.min,time_stats.mlp_up_proj.max,time_stats.mlp_up_proj.mean,"
    "time_stats.mlp_up_proj.median,time_stats.mlp_up_proj.std,time_stats.mlp_act.min,time_stats.mlp_act.max,"
    "time_stats.mlp_act.mean,time_stats.mlp_act.median,time_stats.mlp_act.std,time_stats.mlp_down_proj.min,"
    "time_stats.mlp_down_proj.max,time_stats.mlp_down_proj.mean,time_stats.mlp_down_proj.median,"
    "time_stats.mlp_down_proj.std,time_stats.add.min,time_stats.add.max,time_stats.add.mean,"
    "time_stats.add.median,time_stats.add.std,n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,"
    "use_gated_mlp,num_tokens,num_tensor_parallel_workers\n"
    "0.003,0.003,0.0030000000000000005,0.003,4.336808689942018e-19,0.005,0.005,0.005000000000000001,0.005,"
    "8.673617379884035e-19,0.065,0.069,0.06570000000000001,0.065,0.0010049875621120899,0.005,0.006,"
    "0.005450000000000001,0.005,0.0004974937185533101,0.024,0.026000000000000002,0.024850000000000004,0.025,"
    "0.0004769696007084733,0.005,0.005,0.005000000000000001,0.005,8.673617379884035e-19,0.115,0.116,"
    "0.11570000000000003,0.116,0.00045825756949558437,0.007,0.007,0.007000000000000001,0.007,"
    "8.673617379884035e-19,0.06,0.061,0.06015,0.06,0.00035707142142714284,0.002,0.002,0.0020000000000000005,"
    "0.002,4.336808689942018e-19,32,32,4096,11008,32768,True,1,1\n"
    "0.003,0.004,0.003952380952380953,0.004,0.00021295885499997998,0.004,0.005,0.004150000000000001,0.004,"
    "0.0003570714214271425,0.061,0.066,0.0627,0.063,0.0010535653752852749,0.005,0.006,0.005050000000000001,"
    "0.005,0.0002179449471770337,0.024,0.025,0.024950000000000007,0.025,0.00021794494717703385,0.004,0.005,"
    "0.004250000000000001,0.004,0.00043301270189221935,0.108,0.112,0.10974999999999999,0.11,"
    "0.0009937303457175904,0.007,0.008,0.007150000000000001,0.007,0.0003570714214271425,0.06,0.061,0.0602,"
    "0.06,0.00040000000000000034,0.002,0.002,0.0020000000000000005,0.002,4.336808689942018e-19,32,32,4096,"
    "11008,32768,True,2,1\n"
    "0.006,0.008,0.007904761904761906,0.008,0.00042591770999995997,0.004,0.005,0.004200000000000001,0.004,"
    "0.0004,0.062,0.066,0.06340000000000001,0.063,0.0008602325267042634,0.005,0.006,0.00525,0.005,"
    "0.00043301270189221935,0.025,0.026000000000000002,0.025300000000000007,0.025,0.0004582575694955844,"
    "0.004,0.005,0.004450000000000001,0.004,0.0004974937185533101,0.11,0.112,0.11085000000000003,0.111,"
    "0.0007262919523166982,0.007,0.008,0.007850000000000001,0.008,0.0003570714214271425,0.061,0.062,"
    "0.061399999999999996,0.061,0.0004898979485566361,0.002,0.002,0.0020000000000000005,0.002,"
    "4.336808689942018e-19,32,32,4096,11008,32768,True,8,1\n"
    "0.115,0.122,0.11900000000000005,0.11900000000000001,0.0011547005383792496,0.053,0.054,0.0534,0.053,"
    "0.000489897948556636,0.977,0.981,0.9794,0.979,0.0011575836902790236,0.075,0.077,0.0763,0.076,"
    "0.0005567764362830027,0.3,0.302,0.30105000000000004,0.301,0.00038405728739343076,0.054,0.055,0.05475,"
    "0.055,0.00043301270189221973,1.692,1.695,1.6934999999999998,1.694,0.0007416198487095521,0.135,0.136,"
    "0.13509999999999994,0.135,0.0003000000000000003,0.85,0.852,0.8507999999999999,0.851,"
    "0.000509901951359279,0.027,0.028,0.027700000000000002,0.028,0.0004582575694955844,32,32,4096,11008,"
    "32768,True,2048,1\n"
    "0.116,0.121,0.11866666666666668,0.11800000000000001,0.0014907119849998556,0.053,0.054,"
    "0.053349999999999995,0.053,0.0004769696007084733,0.967,0.981,0.9773,0.9795,0.004733920151417855,0.074,"
    "0.077,0.07605,0.076,0.0008645808232895299,0.297,0.302,0.3001,0.301,0.0015132745950421568,0.053,0.055,"
    "0.054400000000000004,0.054,0.0005830951894845306,1.673,1.696,1.6890500000000004,1.693,"
    "0.008552631174089059,0.134,0.136,0.13489999999999996,0.135,0.0006244997998398403,0.84,0.852,0.84855,"
    "0.85,0.004092370950928084,0.027,0.028,0.027700000000000002,0.028,0.0004582575694955844,32,32,4096,11008,"
    "32768,True,2048,1\n"
    "0.003,0.003,0.0030000000000000005,0.003,4.336808689942018e-19,0.004,0.005,0.004800000000000001,0.005,"
    "0.0004,0.021,0.022,0.0211,0.021,0.00029999999999999927,0.003,0.003,0.0030000000000000005,0.003,"
    "4.336808689942018e-19,0.009000000000000001,0.011,0.009100000000000002,0.009000000000000001,"
    "0.00043588989435406706,0.005,0.005,0.005000000000000001,0.005,8.673617379884035e-19,0.03,0.031,"
    "0.030750000000000006,0.031,0.0004330127018922197,0.003,0.003,0.0030000000000000005,0.003,"
    "4.336808689942018e-19,0.019,0.019,0.019000000000000003,0.019,3.469446951953614e-18,0.002,0.002,"
    "0.0020000000000000005,0.002,4.336808689942018e-19,32,32,4096,11008,32768,True,1,4\n"
    "0.003,0.004,0.0034761904761904773,0.003,0.0004994327848429293,0.004,0.005,0.004400000000000001,0.004,"
    "0.0004898979485566357,0.02,0.022,0.0206,0.021,0.0005830951894845302,0.003,0.003,0.0030000000000000005,"
    "0.003,4.336808689942018e-19,0.009000000000000001,0.011,0.009500000000000003,0.009000000000000001,"
    "0.000591607978309961,0.004,0.004,0.004000000000000001,0.004,8.673617379884035e-19,0.03,0.031,"
    "0.030800000000000004,0.031,0.0004000000000000003,0.003,0.003,0.0030000000000000005,0.003,"
    "4.336808689942018e-19,0.019,0.019,0.019000000000000003,0.019,3.469446951953614e-18,0.002,0.002,"
    "0.0020000000000000005,0.002,4.336808689942018e-19,32,32,4096,11008,32768,True,2,4\n"
)
SLIM_OPS = (
    "device,model,n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,use_gated_mlp,num_tokens,"
    "num_tensor_parallel_workers,emb_ms,input_layernorm_ms,attn_pre_proj_ms,attn_rope_ms,attn_post_proj_ms,"
    "post_attention_layernorm_ms,mlp_up_proj_ms,mlp_act_ms,mlp_down_proj_ms,add_ms\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,1,1,0.003,0.005,0.065,0.005,0.025,0.005,0.116,0.007,0.06,"
    "0.002\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,2,1,0.004,0.004,0.063,0.005,0.025,0.004,0.11,0.007,0.06,"
    "0.002\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,8,1,0.008,0.004,0.063,0.005,0.025,0.004,0.111,0.008,"
    "0.061,0.002\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,2048,1,0.11900000000000001,0.053,0.979,0.076,0.301,0.055,"
    "1.694,0.135,0.851,0.028\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,2048,1,0.11800000000000001,0.053,0.9795,0.076,0.301,"
    "0.054,1.693,0.135,0.85,0.028\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,1,4,0.003,0.005,0.021,0.003,0.009000000000000001,0.005,"
    "0.031,0.003,0.019,0.002\n"
    "a100,Llama-2-7b-hf,32,32,4096,11008,32768,True,2,4,0.003,0.004,0.021,0.003,0.009000000000000001,0.004,"
    "0.031,0.003,0.019,0.002\n"
)
ATTENTION = (
    "time_stats.attn_input_reshape.min,time_stats.attn_input_reshape.max,time_stats.attn_input_reshape.mean,"
    "time_stats.attn_input_reshape.median,time_stats.attn_input_reshape.std,time_stats.attn_decode.min,"
    "time_stats.attn_decode.max,time_stats.attn_decode.mean,time_stats.attn_decode.median,"
    "time_stats.attn_decode.std,time_stats.attn_output_reshape.min,time_stats.attn_output_reshape.max,"
    "time_stats.attn_output_reshape.mean,time_stats.attn_output_reshape.median,"
    "time_stats.attn_output_reshape.std,time_stats.attn_prefill.min,time_stats.attn_prefill.max,"
    "time_stats.attn_prefill.mean,time_stats.attn_prefill.median,time_stats.attn_prefill.std,n_embd,n_q_head,"
    "n_kv_head,block_size,num_tensor_parallel_workers,max_model_len,batch_size,prefill_chunk_size,"
    "kv_cache_size,is_prefill,attention_backend\n"
    "0.0,0.0,0.0,0.0,0.0,0.009000000000000001,0.009000000000000001,0.009000000000000001,0.009000000000000001,"
    "0.0,0.001,0.001,0.001,0.001,0.0,,,,,,4096,32,32,16,1,4096,1,0,32,False,"
    "AttentionBackend.FLASH_ATTENTION\n"
    "0.0,0.0,0.0,0.0,0.0,0.018000000000000002,0.018000000000000002,0.018000000000000002,0.018000000000000002,"
    "0.0,0.002,0.002,0.002,0.002,0.0,,,,,,4096,32,32,16,1,4096,8,0,32,False,"
    "AttentionBackend.FLASH_ATTENTION\n"
    "0.0,0.0,0.0,0.0,0.0,0.131,0.133,0.13140000000000002,0.131,0.0008000000000000007,0.002,0.002,0.002,0.002,"
    "0.0,,,,,,4096,32,32,16,1,4096,4,0,2560,False,AttentionBackend.FLASH_ATTENTION\n"
    "0.0,0.0,0.0,0.0,0.0,,,,,,0.032,0.032,0.032,0.032,0.0,1.903,1.944,1.9243999999999999,1.929,"
    "0.014609585894199723,4096,32,32,16,1,4096,1,3072,1024,True,AttentionBackend.FLASH_ATTENTION\n"
    "0.0,0.0,0.0,0.0,0.0,,,,,,0.032,0.033,0.0322,0.032,0.00040000000000000034,1.903,1.946,1.9248,1.928,"
    "0.015816447135814,4096,32,32,16,1,4096,1,3072,1024,True,AttentionBackend.FLASH_ATTENTION\n"
    "0.0,0.0,0.0,0.0,0.0,,,,,,0.033,0.034,0.033600000000000005,0.034,0.000489897948556636,1.67,1.692,1.6776,"
    "1.675,0.008014985963805532,4096,32,32,16,1,4096,1,3136,0,True,AttentionBackend.FLASH_ATTENTION\n"
    "0.0,0.0,0.0,0.0,0.0,,,,,,0.034,0.034,0.034,0.034,0.0,1.72,1.744,1.7298000000000002,1.727,"
    "0.008997777503361594,4096,32,32,16,1,4096,1,3200,0,True,AttentionBackend.FLASH_ATTENTION\n"
)
ALL_REDUCE = (
    ",time_stats.all_reduce.min,time_stats.all_reduce.max,time_stats.all_reduce.mean,"
    "time_stats.all_reduce.median,time_stats.all_reduce.std,rank,num_workers,size,collective,"
    "devices_per_node,max_devices_per_node\n"
    "1988,0.028,0.064,0.04033333333333333,0.029,0.01673983937265296,0,4,2048,all_reduce,2,8\n"
    "1989,0.034,0.036000000000000004,0.035333333333333335,0.036000000000000004,0.0009428090415820641,0,4,"
    "10240,all_reduce,2,8\n"
    "2982,0.045,0.064,0.056666666666666664,0.061,0.008339997335464536,0,4,2048,all_reduce,4,8\n"
    "2983,0.016,0.039,0.02366666666666667,0.016,0.010842303978193728,0,4,10240,all_reduce,4,8\n"
    "0,0.031,0.077,0.050333333333333334,0.043000000000000003,0.01948218559493661,0,2,2048,all_reduce,1,8\n"
)
SEND_RECV = (
    ",time_stats.send_recv.min,time_stats.send_recv.max,time_stats.send_recv.mean,"
    "time_stats.send_recv.median,time_stats.send_recv.std,rank,num_workers,size,collective,devices_per_node,"
    "max_devices_per_node\n"
    "0,0.016,0.064,0.03466666666666667,0.024,0.020997354330698163,0,2,2048,send_recv,1,8\n"
    "994,0.008,0.008,0.008,0.008,0.0,0,2,2048,send_recv,2,8\n"
)
# The same measurements in the slimmed layout (data/measurements/vidur/README.md): medians only, and of the
# all-reduce only the one-node rows.
SLIM_ATTENTION = """device,model,tp,phase,batch,kv_tokens,prefill_tokens,attention_ms
a100,llama-2-7b,1,decode,1,32,0,0.009000000000000001
a100,llama-2-7b,1,decode,8,32,0,0.018000000000000002
a100,llama-2-7b,1,decode,4,2560,0,0.131
a100,llama-2-7b,1,prefill,1,1024,3072,1.929
a100,llama-2-7b,1,prefill,1,1024,3072,1.928
a100,llama-2-7b,1,prefill,1,0,3136,1.675
a100,llama-2-7b,1,prefill,1,0,3200,1.727
"""
SLIM_ALL_REDUCE = """device,topology,collective,num_workers,size_bytes,median_ms
a100,a100_dgx,all_reduce,4,2048,0.061
a100,a100_dgx,all_reduce,4,10240,0.016
"""

COMPUTE = "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf"
NETWORK = "data/profiling/network/a100_dgx"
PATHS = {"mlp": f"{COMPUTE}/mlp.csv", "attention": f"{COMPUTE}/attention.csv",
         "all_reduce": f"{NETWORK}/all_reduce.csv", "send_recv": f"{NETWORK}/send_recv.csv"}
TEXTS = {"mlp": MLP, "attention": ATTENTION, "all_reduce": ALL_REDUCE, "send_recv": SEND_RECV}


def _original(*kinds: str, **replaced: str) -> list[VidurFile]:
    """Vidur's tree: the named files, each with its slice unless ``replaced`` gives other text."""
    return [VidurFile(PATHS[kind], replaced.get(kind, TEXTS[kind])) for kind in kinds]


def _at(profiles: list[Profile], tp: int) -> Profile:
    return next(p for p in profiles if p.tp == tp)


def test_mlp_csv_becomes_the_ops_tables_with_the_max_as_p90() -> None:
    profiles = profiles_from_vidur(_original("mlp"))
    assert [(p.model, p.accelerator, p.tp) for p in profiles] == [("llama-2-7b", "a100-80gb", 1),
                                                                 ("llama-2-7b", "a100-80gb", 4)]
    single = _at(profiles, 1)
    qkv = single.table("qkv_proj")
    assert (qkv.kernel, qkv.variable, qkv.dims) == ("gemm", Variable.TOKENS, {"k": 4096, "n": 12288, "tp": 1})
    assert [p.coords for p in qkv.points] == [(1.0,), (2.0,), (8.0,), (2048.0,)]
    assert (qkv.points[0].median_s, qkv.points[0].p90_s) == pytest.approx((65e-6, 69e-6))
    # 2048 tokens measured twice: medians 0.979 and 0.9795 ms, maxima 0.981 and 0.981 ms
    assert (qkv.points[-1].median_s, qkv.points[-1].p90_s) == pytest.approx((0.97925e-3, 0.981e-3))
    assert {t.op for t in single.tables} == {"qkv_proj", "o_proj", "rope", "gate_up_proj", "silu_mul", "down_proj",
                                            "input_layernorm", "post_attention_layernorm", "residual_add",
                                            "embedding"}
    assert _at(profiles, 4).table("down_proj").dims == {"k": 2752, "n": 4096, "tp": 4}
    assert single.provenance.device["file"] == PATHS["mlp"]
    assert single.sweep["vidur_model"] == "Llama-2-7b-hf" and single.sweep["vidur_layouts"] == ["original"]
    assert {"attention decode", "attention prefill", "lm head"} <= set(single.sweep["missing_ops"])


def test_attention_csv_splits_decode_and_prefill_rows() -> None:
    single = _at(profiles_from_vidur(_original("mlp", "attention")), 1)
    decode = single.table("decode_attention")
    assert (decode.variable, decode.dims) == (Variable.DECODE, {"heads": 32, "kv_heads": 32, "head_dim": 128, "tp": 1})
    assert [p.coords for p in decode.points] == [(1.0, 32.0), (4.0, 2560.0), (8.0, 32.0)]
    assert (decode.points[1].median_s, decode.points[1].p90_s) == pytest.approx((131e-6, 133e-6))
    prefill = single.table("prefill_attention")
    assert prefill.variable is Variable.PREFILL_PAIRS
    assert single.sweep["prefill_points"] == [[3136, 0], [3200, 0], [3072, 1024]]
    assert [p.coords[0] for p in prefill.points] == [3136 * 3137 / 2, 3200 * 3201 / 2, 3072 * 1024 + 3072 * 3073 / 2]
    assert (prefill.points[-1].median_s, prefill.points[-1].p90_s) == pytest.approx((1.9285e-3, 1.946e-3))
    assert single.sweep["attention_backend"] == "flash_attention"
    assert {"attention decode", "attention prefill"}.isdisjoint(single.sweep["missing_ops"])


def test_all_reduce_csv_keeps_the_one_node_placement() -> None:
    profiles = profiles_from_vidur(_original("mlp", "all_reduce", "send_recv"))
    reduce = _at(profiles, 4).table("all_reduce")
    assert reduce.dims == {"workers": 4, "hidden": 4096, "bytes_per_token": 8192, "tp": 4}
    assert [p.coords for p in reduce.points] == [(0.25,), (1.25,)]
    # 2048 bytes: 0.061 ms with the four ranks on one node, 0.029 ms over two nodes (2 per node), which TP never runs
    assert (reduce.points[0].median_s, reduce.points[0].p90_s) == pytest.approx((61e-6, 64e-6))
    assert (reduce.points[1].median_s, reduce.points[1].p90_s) == pytest.approx((16e-6, 39e-6))
    pair = _at(profiles, 4)
    assert pair.sweep["all_reduce_topology"] == "dgx" and PATHS["all_reduce"] in pair.sweep["files"]
    rows = collective_measurements(_original("all_reduce", "send_recv"))
    assert [(r.collective, r.workers, r.size_bytes, r.one_node) for r in rows] == [
        ("all_reduce", 4, 2048, False), ("all_reduce", 4, 10240, False), ("all_reduce", 4, 2048, True),
        ("all_reduce", 4, 10240, True), ("all_reduce", 2, 2048, False), ("send_recv", 2, 2048, False),
        ("send_recv", 2, 2048, True)]
    first = rows[0]
    assert (first.accelerator, first.topology, first.file, first.row) == ("a100-80gb", "dgx", PATHS["all_reduce"], 2)
    assert (first.median_s, first.p90_s) == pytest.approx((29e-6, 64e-6))


def _tables_but_p90(profile: Profile) -> list[tuple[object, ...]]:
    return [(t.op, t.kernel, t.variable, t.dims, [(p.coords, p.median_s) for p in t.points]) for t in profile.tables]


def test_original_files_give_the_tables_of_their_slimmed_equivalents() -> None:
    original = profiles_from_vidur(_original("mlp", "attention", "all_reduce"))
    slimmed = profiles_from_vidur([VidurFile("a100/ops/Llama-2-7b-hf.csv", SLIM_OPS),
                                   VidurFile("a100/attention/llama-2-7b-flash-attention.csv", SLIM_ATTENTION),
                                   VidurFile("a100/network/a100_dgx-all_reduce.csv", SLIM_ALL_REDUCE)])
    assert [(p.model, p.accelerator, p.tp) for p in original] == [(p.model, p.accelerator, p.tp) for p in slimmed]
    for ours, theirs in zip(original, slimmed, strict=True):
        assert _tables_but_p90(ours) == _tables_but_p90(theirs)
        assert ours.terms == theirs.terms
        for key in ("vidur_model", "missing_ops", "prefill_points", "all_reduce_topology"):
            assert ours.sweep.get(key) == theirs.sweep.get(key), key
        assert (ours.sweep["vidur_layouts"], theirs.sweep["vidur_layouts"]) == (["original"], ["slimmed"])
        # the slimmed files keep only medians; the originals' maxima are the p90
        assert all(p.p90_s >= p.median_s for t in ours.tables for p in t.points)
    mixed = profiles_from_vidur([*_original("mlp"), VidurFile("a100/attention/llama.csv", SLIM_ATTENTION)])
    assert _tables_but_p90(_at(mixed, 1)) == _tables_but_p90(_at(slimmed, 1))
    assert _at(mixed, 1).sweep["vidur_layouts"] == ["original", "slimmed"]


def test_the_gpu_comes_from_the_path_or_from_device() -> None:
    output = "profiling_outputs/mlp/2024-06-01_12-00-00/meta-llama/Llama-2-7b-hf/mlp.csv"
    with pytest.raises(InputError, match=f"{output}: Vidur's profiler output does not name its GPU.*--device"):
        profiles_from_vidur([VidurFile(output, MLP)])
    named = profiles_from_vidur([VidurFile(output, MLP)], device="a40")
    assert {p.accelerator for p in named} == {"a40"} and named[0].provenance.device["name"]
    h100 = profiles_from_vidur([VidurFile(PATHS["mlp"].replace("/a100/", "/h100/"), MLP)])
    assert {p.accelerator for p in h100} == {"h100-sxm"}
    with pytest.raises(InputError, match="mlp.csv: the path says the GPU is a100-80gb, --device says a40"):
        profiles_from_vidur(_original("mlp"), device="a40")
    with pytest.raises(NotFoundError, match="tpu-v5"):
        profiles_from_vidur(_original("mlp"), device="tpu-v5")
    spread = profiles_from_vidur([*_original("mlp"), VidurFile("collective/2024-06-01/all_reduce.csv", ALL_REDUCE)],
                                 device="a100-80gb")
    assert _at(spread, 4).sweep["all_reduce_topology"] == "2024-06-01"


@pytest.fixture
def cli_db(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HETSCHED_DATABASE_URL", database_url)
    return database_url


def _tree(root: Path, files: list[VidurFile]) -> None:
    for file in files:
        path = root / file.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(file.text)


def _stored(database_url: str) -> int:
    store = open_store(database_url)
    try:
        return len(list_profiles(store))
    finally:
        store.engine.dispose()


def test_the_cli_imports_vidurs_own_tree(cli_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path, _original("mlp", "attention", "all_reduce", "send_recv"))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profiles", "import-vidur", "data/profiling", "-o", "json"])
    assert result.exit_code == 0, result.output
    imported = json.loads(result.stdout)
    assert [(r["model"], r["accelerator"], r["tp"]) for r in imported] == [("llama-2-7b", "a100-80gb", 1),
                                                                          ("llama-2-7b", "a100-80gb", 4)]
    assert "attention decode" not in imported[0]["missing_ops"] and "all-reduce" not in imported[1]["missing_ops"]
    assert _stored(cli_db) == 2
    output = tmp_path / "profiling_outputs" / "mlp.csv"
    output.parent.mkdir()
    output.write_text(MLP)
    refused = runner.invoke(app, ["profiles", "import-vidur", "profiling_outputs"])
    assert isinstance(refused.exception, InputError) and "--device" in str(refused.exception)
    named = runner.invoke(app, ["profiles", "import-vidur", "profiling_outputs", "--device", "a40", "-o", "json"])
    assert named.exit_code == 0, named.output
    assert {r["accelerator"] for r in json.loads(named.stdout)} == {"a40"}


def _cell(text: str, row: int, column: str, value: str) -> str:
    lines = text.splitlines()
    cells = lines[row - 1].split(",")
    cells[lines[0].split(",").index(column)] = value
    lines[row - 1] = ",".join(cells)
    return "\n".join(lines) + "\n"


def _without(text: str, column: str) -> str:
    index = text.splitlines()[0].split(",").index(column)
    return "\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != index)
                     for line in text.splitlines()) + "\n"


SHAPE = "n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp"


@pytest.mark.parametrize(("kind", "bad", "where"), [
    ("mlp", _without(MLP, "time_stats.attn_rope.median"), "row 1, column time_stats.attn_rope.median"),
    ("mlp", _cell(MLP, 3, "time_stats.mlp_up_proj.median", "nan"), "row 3, column time_stats.mlp_up_proj.median"),
    ("mlp", _cell(MLP, 4, "time_stats.attn_pre_proj.median", "-0.063"), "row 4, column time_stats.attn_pre_proj"),
    ("mlp", _cell(MLP, 2, "time_stats.add.median", "0.0"), "row 2, column time_stats.add.median"),
    ("mlp", _cell(MLP, 2, "time_stats.emb.max", "0.001"), "row 2, column time_stats.emb.max: the maximum is below"),
    ("mlp", _cell(MLP, 7, "num_tensor_parallel_workers", "3"), "row 7, column num_tensor_parallel_workers"),
    ("mlp", MLP.replace(",32,32,4096,11008,", ",32,16,4096,11008,"), f"row 2, column {SHAPE}: Llama-2-7b-hf: no"),
    ("attention", _cell(ATTENTION, 3, "time_stats.attn_decode.median", ""),
     "row 3, column time_stats.attn_decode.median"),
    ("attention", _cell(ATTENTION, 5, "time_stats.attn_prefill.median", "inf"),
     "row 5, column time_stats.attn_prefill.median"),
    ("attention", _cell(ATTENTION, 4, "n_q_head", "64"), "row 4, column n_q_head"),
    ("attention", _cell(ATTENTION, 2, "is_prefill", "maybe"), "row 2, column is_prefill"),
    ("attention", _cell(ATTENTION, 2, "num_tensor_parallel_workers", "2"),
     "row 2, column num_tensor_parallel_workers: unknown tensor-parallel size 2"),
    ("attention", _cell(ATTENTION, 6, "prefill_chunk_size", "0"), "row 6, column prefill_chunk_size"),
    ("all_reduce", _cell(ALL_REDUCE, 4, "size", "-2048"), "row 4, column size"),
    ("all_reduce", _cell(ALL_REDUCE, 5, "time_stats.all_reduce.median", "NaN"),
     "row 5, column time_stats.all_reduce.median"),
    ("all_reduce", _without(ALL_REDUCE, "num_workers"), "row 1, column num_workers"),
])
def test_bad_original_input_names_file_row_and_column_and_stores_nothing(cli_db: str, tmp_path: Path, kind: str,
                                                                          bad: str, where: str) -> None:
    _tree(tmp_path, _original("mlp", "attention", "all_reduce", **{kind: bad}))
    result = runner.invoke(app, ["profiles", "import-vidur", str(tmp_path / "data")])
    assert isinstance(result.exception, HetschedError) and result.exception.exit_code == 2
    assert f"{Path(PATHS[kind]).parent.name}/{kind}.csv, {where}" in str(result.exception)
    assert _stored(cli_db) == 0
