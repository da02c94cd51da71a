"""The kernel profiler: sweep planning, worker containment, interpolation, Profile as a step-latency model."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any

import pytest

from hetsched.backends import BackendKind, Timing
from hetsched.catalog import Device, load_catalog
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.profiler.driver import profile_kernels
from hetsched.profiler.interp import LogLogCurve, LogLogSurface
from hetsched.profiler.plan import Kernel, SweepPoint, SweepSettings, model_ops, plan_sweep
from hetsched.profiler.profile import ProfileSource, Variable
from hetsched.profiler.roofline_source import constants_from_profile, roofline_profile
from hetsched.profiler.worker import run_sweep
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import AttentionKind, LayerKind, ModelArch
from hetsched.specs.registry import load_model

TINY = ModelArch(name="tiny", model_type="llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=256, tie_embeddings=True, attention=AttentionKind.GQA,
                 layer_kinds=(LayerKind.FULL,) * 2, moe_layers=(False,) * 2, max_context=1024)
TINY_ENGINE = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8)


# --- sweep planning -----------------------------------------------------------
def test_sweep_walks_token_counts_log_spaced_up_to_the_budget() -> None:
    model = load_model("qwen3-0.6b")
    plan = plan_sweep(model, SweepSettings.for_engine(model, EngineConfig(max_num_batched_tokens=6000), quick=False))
    tokens = [p.params["m"] for p in plan.points if p.op == "qkv_proj"]
    assert tokens == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6000]
    assert [p.params["m"] for p in plan.points if p.op == "lm_head"][-1] == 256  # sampled sequences, not tokens
    quick = plan_sweep(model, SweepSettings.for_engine(model, EngineConfig(), quick=True))
    assert len(quick.points) < len(plan.points) / 2


def test_decode_sweep_is_batch_by_context_within_the_kv_budget() -> None:
    model = load_model("qwen3-0.6b")
    settings = SweepSettings.for_engine(model, EngineConfig(), quick=False, kv_budget_gb=0.5)
    decode = [p for p in plan_sweep(model, settings).points if p.kernel is Kernel.DECODE_ATTENTION]
    batches = sorted({p.params["batch"] for p in decode})
    assert batches == [1, 4, 16, 64, 256]
    kv_per_token = 2 * model.num_kv_heads * model.head_dim * 2
    assert all(p.params["batch"] * p.params["context"] * kv_per_token <= 0.5e9 for p in decode)
    assert len({p.params["context"] for p in decode if p.params["batch"] == 1}) >= 4


def test_model_ops_follow_the_architecture() -> None:
    ops, terms = model_ops(load_model("qwen3-30b-a3b"))
    assert {"moe", "qkv_proj", "decode_attention"} <= {o.op for o in ops}
    assert next(t for t in terms if t.table == "moe").multiplier == 48
    ops, _ = model_ops(load_model("deepseek-v3"))
    assert next(o for o in ops if o.op == "decode_attention").kernel is Kernel.MLA_DECODE_ATTENTION
    assert {"shared_gate_up_proj", "gate_up_proj"} <= {o.op for o in ops}  # dense first layers + shared expert
    _, terms = model_ops(load_model("gpt-oss-20b"))
    windows = {t.window for t in terms if t.table == "decode_attention"}
    assert windows == {None, 128}
    with pytest.raises(InputError, match="linear-attention"):
        model_ops(load_model("qwen3-next-80b-a3b"))


# --- worker containment ---------------------------------------------------------
class ScriptedRunner:
    """Behaves as each point's op says: crash the process, hang, raise, or time ``m`` microseconds."""

    def __call__(self, point: SweepPoint) -> Timing:
        if point.op == "crash":
            os._exit(3)
        if point.op == "hang":
            time.sleep(60)
        if point.op == "boom":
            raise RuntimeError("CUDA out of memory")
        seconds = point.params.get("m", 1) * 1e-6
        return Timing(seconds, seconds * 1.1, 3)

    def describe(self) -> dict[str, Any]:
        return {"device": {"backend": "cpu", "name": "scripted"}, "versions": {"test": "1"}}


def scripted_factory() -> ScriptedRunner:
    return ScriptedRunner()


def failing_factory() -> ScriptedRunner:
    raise BackendUnavailableError("no such device here")


def _point(op: str, m: int = 1) -> SweepPoint:
    return SweepPoint(op=op, kernel=Kernel.GEMM, params={"m": m}, coords=(float(m),))


def test_a_crashing_or_hanging_point_is_reported_and_the_sweep_goes_on() -> None:
    points = [_point("ok", 1), _point("crash"), _point("ok", 2), _point("hang"), _point("boom"), _point("ok", 4)]
    seen = []
    outcome = run_sweep(points, scripted_factory, point_timeout_s=1.5, on_result=seen.append)
    assert [r.point for r in outcome.results] == points
    assert seen == list(outcome.results)
    by_op = [(r.point.op, r.timing is not None, r.error) for r in outcome.results]
    assert by_op[0][:2] == ("ok", True) and by_op[2][:2] == ("ok", True) and by_op[5][:2] == ("ok", True)
    assert by_op[1][2] == "crashed: worker exited with status 3"
    assert by_op[3][2] == "timeout after 1.5 s"
    assert by_op[4][2].startswith("RuntimeError: CUDA out of memory")
    assert outcome.restarts == 2
    assert outcome.device["device"]["name"] == "scripted"


def test_a_worker_that_cannot_open_its_backend_fails_the_sweep_clearly() -> None:
    with pytest.raises(BackendUnavailableError, match="no such device here"):
        run_sweep([_point("ok")], failing_factory, point_timeout_s=5)


# --- interpolation ---------------------------------------------------------------
def test_curve_is_log_log_linear_and_proportional_past_the_grid() -> None:
    curve = LogLogCurve.through([(1, 1e-3), (4, 1e-3), (16, 4e-3), (64, 16e-3)])
    assert curve(4) == pytest.approx(1e-3)
    assert curve(8) == pytest.approx(2e-3)  # slope 1 between 4 and 16
    assert curve(2) == pytest.approx(1e-3)
    assert curve(128) == pytest.approx(32e-3)  # proportional beyond the largest point
    assert curve(0.5) == pytest.approx(1e-3)  # launch-bound floor below the smallest
    assert curve(0) == 0.0


def test_a_disturbed_point_is_lowered_to_the_larger_point_after_it() -> None:
    curve = LogLogCurve.through([(1, 1e-3), (2, 9e-3), (4, 2e-3), (8, 4e-3)])
    assert curve(2) == pytest.approx(2e-3)
    assert curve(1) == pytest.approx(1e-3)


def test_surface_interpolates_between_rows_and_handles_missing_cells() -> None:
    surface = LogLogSurface.through([(1, 100, 1.0), (1, 400, 4.0), (4, 100, 4.0)])  # (4, 400) not measured
    assert surface(1, 200) == pytest.approx(2.0)
    assert surface(2, 100) == pytest.approx(2.0)
    assert surface(4, 400) == pytest.approx(16.0)  # row 4 extrapolated proportionally in context
    assert surface(8, 100) == pytest.approx(8.0)  # past the largest batch: proportional


# --- profiles ------------------------------------------------------------------------
class AnalyticRunner(ScriptedRunner):
    """Times from a formula, so predictions can be checked exactly."""

    def __call__(self, point: SweepPoint) -> Timing:
        p = point.params
        if point.kernel is Kernel.DECODE_ATTENTION:
            seconds = 1e-9 * p["batch"] * p["context"]
        elif point.kernel is Kernel.PREFILL_ATTENTION:
            seconds = 1e-9 * point.coords[0]
        else:
            seconds = 1e-6 * p["m"]
        return Timing(seconds, seconds, 3)


def analytic_factory() -> AnalyticRunner:
    return AnalyticRunner()


def test_a_profile_answers_the_step_latency_interface() -> None:
    profile = profile_kernels(TINY, backend=BackendKind.CPU, engine=TINY_ENGINE, quick=True, factory=analytic_factory)
    model: StepLatencyModel = profile
    assert profile.source is ProfileSource.KERNEL and profile.accelerator == "cpu"
    assert model.step_time(StepShape()) == 0.0
    shape = StepShape.build(decode_contexts=[256, 1024])  # inside the quick grid: batch 1..8, context 64..1024
    # every token op runs once per layer (rmsnorm 2·L+1, adds 2·L, …) at 1 µs per token, plus attention.
    token_multiplier = sum(t.multiplier for t in profile.terms if profile.table(t.table).variable is Variable.TOKENS)
    expected = token_multiplier * 2e-6 + 1 * 2e-6 + 2 * 1e-9 * 2 * 640 + profile.step_overhead_s
    assert model.step_time(shape) == pytest.approx(expected, rel=1e-6)
    parts = model.breakdown(shape)
    assert sum(p.seconds for p in parts) == pytest.approx(model.step_time(shape))
    assert {"attention decode", "mlp", "lm head", "step overhead"} <= {p.op for p in parts}
    prefill = StepShape.build(prefill=[(32, 0), (32, 0)])
    attention = next(p for p in profile.breakdown(prefill) if p.op == "attention prefill")
    assert attention.seconds == pytest.approx(2 * 2 * 1e-9 * (32 * 33 / 2))  # 2 layers × 2 sequences


def test_incomplete_sweeps_do_not_make_a_profile() -> None:
    from hetsched.errors import InfeasibleError

    with pytest.raises(InfeasibleError, match="no timing for .*lm_head"):
        profile_kernels(TINY, backend=BackendKind.CPU, engine=TINY_ENGINE, quick=True,
                        factory=functools.partial(_lm_head_fails))


class _NoLmHead(AnalyticRunner):
    def __call__(self, point: SweepPoint) -> Timing:
        if point.op == "lm_head":
            raise RuntimeError("kernel failed")
        return super().__call__(point)


def _lm_head_fails() -> _NoLmHead:
    return _NoLmHead()


def test_real_cpu_sweep_of_a_tiny_model() -> None:
    profile = profile_kernels(TINY, backend=BackendKind.CPU, engine=TINY_ENGINE, quick=True, point_timeout_s=60)
    assert not profile.failures
    assert profile.provenance.device["backend"] == "cpu" and "torch" in profile.provenance.versions
    small, large = StepShape.build(decode_contexts=[16]), StepShape.build(prefill=[(64, 0)])
    assert 0 < profile.step_time(small) < profile.step_time(large) < 10.0


def test_roofline_profile_matches_the_roofline_model() -> None:
    model, device = load_model("llama-3.1-8b"), Device.whole(load_catalog().get("h100-sxm"))
    profile = roofline_profile(model, device)
    roofline = RooflineModel(model, device)
    # the tables interpolate between their token grid's points; the GEMMs' waves of tiles are steps in between
    for shape in (StepShape.build(prefill=[(512, 0)]), StepShape.build(decode_contexts=[1024] * 64),
                  StepShape.build(prefill=[(2048, 0)], decode_contexts=[256] * 16)):
        assert profile.step_time(shape) == pytest.approx(roofline.step_time(shape), rel=0.05)
    # a profile tables prefill attention by causal pairs alone: a chunk after a cached prefix reads as a longer
    # prompt, whose pairs all run at the triangle's rate, slower than a prefix's
    chunk = StepShape.build(prefill=[(2048, 4096)])
    assert roofline.step_time(chunk) <= profile.step_time(chunk) <= 1.3 * roofline.step_time(chunk)


def test_calibration_fits_constants_to_a_measured_profile() -> None:
    measured = profile_kernels(TINY, backend=BackendKind.CPU, engine=TINY_ENGINE, quick=True, factory=analytic_factory)
    cpu = Device.whole(load_catalog().get("cpu", host=__import__("hetsched.catalog.host").catalog.host.read_host()))
    constants = constants_from_profile(measured, target=cpu)
    assert "fitted to kernel profile" in constants.source
    # the analytic runner times every token op at 2 µs per token: a GEMM at m=1 costs about 2 µs
    assert constants.gemm.floor_us < 10 and constants != cpu.accelerator.perf
    with pytest.raises(InputError, match="same vendor"):
        constants_from_profile(measured, target=Device.whole(load_catalog().get("h100-sxm")))
    roofline = roofline_profile(TINY, cpu)
    with pytest.raises(InputError, match="kernel profile"):
        constants_from_profile(dataclasses.replace(roofline), target=cpu)


def test_unknown_model_is_not_found() -> None:
    from hetsched.errors import NotFoundError

    with pytest.raises(NotFoundError):
        load_model("no-such-model")
    assert math.isfinite(1.0)
