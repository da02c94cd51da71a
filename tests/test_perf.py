"""Memory fit and roofline step latency against physics."""

from __future__ import annotations

import pytest

from hetsched.catalog import Device, load_catalog
from hetsched.perf.correction import CorrectedStepModel, StepCorrection, corrected, phase_split
from hetsched.perf.memory import fit, kv_layout, smallest_fit, weight_bytes
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.errors import InputError
from hetsched.specs.registry import load_model

CATALOG = load_catalog()
H100 = Device.whole(CATALOG.get("h100-sxm"))
L4 = Device.whole(CATALOG.get("l4"))
LLAMA8 = load_model("llama-3.1-8b")


def test_weight_bytes_by_dtype() -> None:
    params = LLAMA8.total_params
    assert weight_bytes(LLAMA8) == pytest.approx(params * 2)
    assert weight_bytes(LLAMA8, DType.FP8) == pytest.approx(params)
    assert weight_bytes(LLAMA8, DType.INT4) == pytest.approx(params * (0.5 + 4 / 128))
    assert weight_bytes(LLAMA8, DType.MXFP4) < weight_bytes(LLAMA8, DType.INT8)


def test_experts_keep_their_own_dtype() -> None:
    gpt = load_model("gpt-oss-20b")
    # mxfp4 experts make the checkpoint ~13 GB, far below 2 bytes per parameter.
    assert 11e9 < weight_bytes(gpt) < 15e9


def test_gqa_kv_bytes_per_token() -> None:
    layout = kv_layout(LLAMA8, kv_dtype=DType.BF16)
    assert layout.full_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert kv_layout(LLAMA8, kv_dtype=DType.FP8).full_bytes_per_token == 2 * 32 * 8 * 128
    assert kv_layout(LLAMA8, tp=2).full_bytes_per_token == layout.full_bytes_per_token / 2


def test_mla_kv_is_the_latent_and_is_not_sharded() -> None:
    ds = load_model("deepseek-v3")
    layout = kv_layout(ds, tp=8, kv_dtype=DType.BF16)
    assert layout.full_bytes_per_token == 61 * (512 + 64) * 2


def test_sliding_window_layers_are_capped() -> None:
    gpt = load_model("gpt-oss-20b")
    layout = kv_layout(gpt)
    assert layout.bytes_for(100_000) - layout.bytes_for(50_000) == pytest.approx(50_000 * layout.full_bytes_per_token)
    assert layout.bytes_for(128) == pytest.approx(128 * (layout.full_bytes_per_token + layout.sliding_bytes_per_token))


def test_linear_attention_state_is_constant_per_sequence() -> None:
    nxt = load_model("qwen3-next-80b-a3b")
    layout = kv_layout(nxt)
    # 36 linear layers of 32 value heads of 128 × 128 fp32 state, and 3 bf16 inputs of 2 × 16 × 128 + 32 × 128 channels
    assert layout.state_bytes_per_seq == 36 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2)
    assert kv_layout(nxt, tp=2).state_bytes_per_seq == layout.state_bytes_per_seq / 2
    assert layout.bytes_for(2000) - layout.bytes_for(1000) == pytest.approx(1000 * layout.full_bytes_per_token)


def test_fit_breakdown_adds_up_and_utilisation_matters() -> None:
    f = fit(LLAMA8, H100, context_len=8192)
    assert f.fits and f.reason is None
    assert f.weights_gb + f.activation_gb + f.kv_cache_gb == pytest.approx(f.usable_gb, rel=1e-6)
    lower = fit(LLAMA8, H100, context_len=8192, engine=EngineConfig(gpu_memory_utilization=0.5))
    assert lower.max_kv_tokens < f.max_kv_tokens


def test_infeasible_pair_has_a_readable_reason() -> None:
    f = fit(load_model("llama-3.1-70b"), L4, tp=1)
    assert not f.fits
    assert f.reason is not None and "GB/device" in f.reason and "l4" in f.reason


def test_smallest_tp() -> None:
    # 141 GB of bf16 weights: two 80 GB devices leave no room at 90% utilisation
    assert smallest_fit(load_model("llama-3.1-70b"), H100, context_len=8192).tp == 4
    assert smallest_fit(load_model("llama-3.1-70b"), L4, context_len=8192).tp == 8
    huge = smallest_fit(load_model("deepseek-v3"), L4)
    assert not huge.fits and huge.tp == 8


def test_mig_slice_serves_tp1_only() -> None:
    slice_ = Device.of(CATALOG.get("h100-sxm"), "3g.40gb")
    assert fit(load_model("qwen3-8b"), slice_, context_len=8192).fits
    two = fit(load_model("qwen3-8b"), slice_, tp=2)
    assert not two.fits and "TP=1 only" in (two.reason or "")


def test_engine_settings_are_validated() -> None:
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(InputError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


# --- roofline ----------------------------------------------------------------

def test_decode_is_bounded_below_by_weight_bytes_over_bandwidth() -> None:
    model = RooflineModel(LLAMA8, H100)
    step = model.step_time(StepShape.build(decode_contexts=[1024]))
    floor = weight_bytes(LLAMA8) / (3.35e12)
    assert step > floor
    assert step < 3 * floor  # and not absurdly above it


def test_prefill_scales_linearly_when_compute_bound() -> None:
    model = RooflineModel(LLAMA8, H100)
    t4k = model.step_time(StepShape.build(prefill=[(4096, 0)]))
    t8k = model.step_time(StepShape.build(prefill=[(8192, 0)]))
    assert t8k / t4k == pytest.approx(2.0, rel=0.15)


def test_decode_step_grows_slowly_with_batch_until_compute_bound() -> None:
    model = RooflineModel(LLAMA8, H100)
    one = model.step_time(StepShape.build(decode_contexts=[512]))
    many = model.step_time(StepShape.build(decode_contexts=[512] * 32))
    assert one < many < 4 * one


def test_tensor_parallel_adds_allreduce_and_cuts_time() -> None:
    seventy = load_model("llama-3.1-70b")
    tp2 = RooflineModel(seventy, H100, tp=2).breakdown(StepShape.build(decode_contexts=[1024] * 8))
    tp4 = RooflineModel(seventy, H100, tp=4).breakdown(StepShape.build(decode_contexts=[1024] * 8))
    assert any(op.op == "all-reduce" for op in tp2)
    assert sum(op.seconds for op in tp4) < sum(op.seconds for op in tp2)


def test_moe_reads_only_touched_experts_at_small_batch() -> None:
    moe = load_model("qwen3-30b-a3b")
    model = RooflineModel(moe, H100)
    one = {op.op: op for op in model.breakdown(StepShape.build(decode_contexts=[512]))}["moe"]
    many = {op.op: op for op in model.breakdown(StepShape.build(decode_contexts=[512] * 256))}["moe"]
    assert one.bytes < many.bytes / 5


def test_faster_hardware_is_faster() -> None:
    shape = StepShape.build(prefill=[(1024, 0)], decode_contexts=[2048] * 16)
    assert RooflineModel(LLAMA8, H100).step_time(shape) < RooflineModel(LLAMA8, L4).step_time(shape)


def test_mig_slice_is_slower_than_the_whole_gpu() -> None:
    shape = StepShape.build(decode_contexts=[1024] * 4)
    qwen = load_model("qwen3-0.6b")
    whole = RooflineModel(qwen, H100).step_time(shape)
    sliced = RooflineModel(qwen, Device.of(CATALOG.get("h100-sxm"), "1g.10gb")).step_time(shape)
    assert sliced > whole


def test_every_attention_kind_has_a_step_time() -> None:
    shape = StepShape.build(prefill=[(256, 256)], decode_contexts=[4096] * 4)
    for name in ("llama-2-7b", "deepseek-v3", "gpt-oss-20b", "qwen3-next-80b-a3b", "gemma-2-9b", "mixtral-8x7b"):
        ops = {op.op for op in RooflineModel(load_model(name), Device.whole(CATALOG.get("b200")), tp=8).breakdown(shape)}
        assert {"attention prefill", "attention decode", "step overhead"} <= ops
    assert "linear attention" in {op.op for op in RooflineModel(load_model("qwen3-next-80b-a3b"), H100).breakdown(shape)}


def test_a_step_costs_the_same_whatever_steps_came_before() -> None:
    # the roofline keeps token-count operators by count: a shape sharing a count with another must not take its
    # attention or LM head, and a model that saw other shapes first must answer as a fresh one
    shapes = [StepShape.build(prefill=[(96, 0)], decode_contexts=[700] * 32), StepShape.build(prefill=[(128, 4096)]),
              StepShape.build(decode_contexts=[300] * 128), StepShape.build(prefill=[(64, 0)] * 2)]
    warm = RooflineModel(load_model("llama-3.1-70b"), H100, tp=4)
    for shape in shapes:
        warm.breakdown(shape)
    for shape in reversed(shapes):
        fresh = RooflineModel(load_model("llama-3.1-70b"), H100, tp=4)
        assert warm.breakdown(shape) == fresh.breakdown(shape)
    assert shapes[0].tokens == shapes[1].tokens and warm.step_time(shapes[0]) != warm.step_time(shapes[1])


def test_a_correction_scales_each_phase_share_of_a_step() -> None:
    base = RooflineModel(LLAMA8, H100)
    model = CorrectedStepModel(base, StepCorrection(prefill_scale=1.5, decode_scale=3.0, step_overhead_s=0.002))
    prefill = StepShape.build(prefill=[(512, 0)])
    decode = StepShape.build(decode_contexts=[1024] * 16)
    mixed = StepShape.build(prefill=[(512, 0)], decode_contexts=[1024] * 16)
    assert model.step_time(prefill) == pytest.approx(1.5 * base.step_time(prefill) + 0.002)
    assert model.step_time(decode) == pytest.approx(3.0 * base.step_time(decode) + 0.002)
    prefill_share, decode_share = phase_split(base, mixed)
    assert prefill_share > 0 and decode_share > 0
    assert prefill_share + decode_share == pytest.approx(base.step_time(mixed))
    assert model.step_time(mixed) == pytest.approx(1.5 * prefill_share + 3.0 * decode_share + 0.002)
    assert sum(op.seconds for op in model.breakdown(mixed)) == pytest.approx(model.step_time(mixed))
    assert corrected(base, StepCorrection()) is base and corrected(base, None) is base
