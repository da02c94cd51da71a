"""The analytic step model's constants: shipped per device, fitted to measurements, stored and used, refused when bad."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hetsched.catalog import Device, load_catalog
from hetsched.catalog.loader import load_perf_table
from hetsched.catalog.perf import GemmConstants, perf_constants_from_dict
from hetsched.cli import app
from hetsched.errors import InputError, SpecError
from hetsched.perf.calibrate import OpClass, OpSample, calibrate, predict
from hetsched.perf.costs import all_reduce_seconds, decode_attention_seconds, gemm_seconds, gemm_tile_fill
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model

runner = CliRunner()
A100 = Device.whole(load_catalog().get("a100-80gb"))
VIDUR = Path(__file__).resolve().parents[1] / "data" / "measurements" / "vidur"


def _synthetic(constants, device: Device, rng: np.random.Generator) -> list[OpSample]:
    """Samples timed by known constants, as a device following the model exactly would give."""
    samples = [OpSample(OpClass.GEMM, {"m": float(m), "k": float(k), "n": float(n)}, 0.0)
               for m in (1, 4, 16, 64, 128, 256, 1024, 4096) for k, n in ((4096, 6144), (14336, 4096), (1024, 4096))]
    samples += [OpSample(OpClass.NORM, {"bytes": 4.0 * m * h, "width": float(h)}, 0.0)
                for m in (1, 16, 256, 4096) for h in (2048, 4096, 8192)]
    samples += [OpSample(OpClass.DECODE_ATTENTION, {"seqs": float(b), "kv_bytes": b * c * 16384.0, "heads": 32.0,
                                                    "context": float(c)}, 0.0)
                for b in (1, 8, 64) for c in (32, 512, 4096)]
    samples += [OpSample(OpClass.ALL_REDUCE, {"bytes": float(s), "ranks": float(r)}, 0.0)
                for s in (2048, 65536, 1 << 20, 1 << 24, 1 << 26) for r in (2, 4, 8)]
    timed = []
    for op in {s.op for s in samples}:
        group = [s for s in samples if s.op is op]
        noise = rng.normal(1.0, 0.01, len(group))
        timed += [dataclasses.replace(s, seconds=float(t)) for s, t in zip(group, predict(group, constants, device) * noise,
                                                                            strict=True)]
    return timed


def test_a_fit_recovers_the_constants_that_made_the_timings() -> None:
    truth = A100.accelerator.perf
    assert truth is not None
    skewed = dataclasses.replace(truth, gemm=GemmConstants(20.0, 0.4, 0.5, 3.0))
    result = calibrate(_synthetic(truth, A100, np.random.default_rng(0)), device=A100, base=skewed, source="test")
    assert result.constants.gemm.compute_efficiency == pytest.approx(truth.gemm.compute_efficiency, rel=0.05)
    assert result.constants.gemm.floor_us == pytest.approx(truth.gemm.floor_us, rel=0.1)
    assert result.constants.collective.bus_efficiency == pytest.approx(truth.collective.bus_efficiency, rel=0.05)
    assert all(stats.median_abs < 0.02 for stats in result.residuals.values()) and result.trusted
    assert "prefill_attention" in result.unmeasured and result.constants.source == "test"


def test_memory_launches_are_fitted_to_an_on_chip_rate_that_follows_the_units_not_the_memory() -> None:
    truth = A100.accelerator.perf
    assert truth is not None
    samples = [s for s in _synthetic(truth, A100, np.random.default_rng(2)) if s.op in (OpClass.GEMM, OpClass.NORM)]
    skewed = dataclasses.replace(truth, norm=dataclasses.replace(truth.norm, bytes_per_cycle=1.0, efficiency=0.3))
    result = calibrate(samples, device=A100, base=skewed, source="test").constants
    fitted = result.norm
    assert fitted.bytes_per_cycle == pytest.approx(truth.norm.bytes_per_cycle, rel=0.1)
    assert fitted.efficiency == result.gemm.memory_efficiency  # the memory's share: the weight-streaming GEMMs'
    # The same memory behind half the SMs: a norm the A100 runs at its on-chip limit takes longer.
    half = Device.whole(dataclasses.replace(A100.accelerator, compute_units=A100.accelerator.compute_units // 2))
    big_norm = [OpSample(OpClass.NORM, {"bytes": 4.0 * 4096 * 8192, "width": 8192.0}, 1.0)]
    assert predict(big_norm, truth, half)[0] > 1.5 * predict(big_norm, truth, A100)[0]
    # A device with no units listed (a CPU) keeps the memory's rate alone.
    unlisted = Device.whole(dataclasses.replace(A100.accelerator, compute_units=0, clock_ghz=0.0))
    assert predict(big_norm, truth, unlisted)[0] < predict(big_norm, truth, A100)[0]


def test_a_curve_that_cannot_follow_the_data_is_not_trusted() -> None:
    rng = np.random.default_rng(1)
    samples = [OpSample(OpClass.RESIDUAL_ADD, {"bytes": 6.0 * m * 4096, "width": 0.0}, float(rng.uniform(1e-6, 1e-3)))
               for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    result = calibrate(samples, device=A100, base=A100.accelerator.perf, source="noise")  # type: ignore[arg-type]
    assert not result.trusted and result.untrusted_classes == ["residual_add"]
    with pytest.raises(InputError, match="positive"):
        calibrate([dataclasses.replace(samples[0], seconds=float("nan"))], device=A100,
                  base=A100.accelerator.perf, source="x")  # type: ignore[arg-type]


def test_every_launch_pays_its_floor_and_all_reduces_ride_the_one_way_link() -> None:
    constants = A100.accelerator.perf
    assert constants is not None
    tiny = gemm_seconds(1.0, 64.0, 64.0, peak_flops=312e12, bandwidth=2e12, c=constants.gemm)
    assert tiny == pytest.approx(constants.gemm.floor_us * 1e-6, rel=0.01)
    model = load_model("llama-3.1-8b")
    tp2 = RooflineModel(model, A100, tp=2)
    reduce = next(op for op in tp2.breakdown(StepShape.build(decode_contexts=[512] * 8)) if op.op == "all-reduce")
    payload = 8 * model.hidden_size * 2.0
    one_way = A100.accelerator.interconnect_gbs / 2 * 1e9
    expected = 2 * model.num_layers * all_reduce_seconds(payload, 2, link_bytes_per_s=one_way, c=constants.collective)
    assert reduce.seconds == pytest.approx(expected)


def test_launches_that_leave_sms_idle_in_their_last_wave_run_slower() -> None:
    constants = A100.accelerator.perf
    assert constants is not None and A100.compute_units == 108
    # 109 tiles of 256x128: the second wave runs one tile; 128-row tiles make it 2 x 109 = 2.02 waves of 108
    # and 128x256 tiles 2 x 55: the library takes the tiling that wastes least.
    assert gemm_tile_fill(256.0 * 109, 128.0, 108) == pytest.approx(max(109 / 216, 218 / 324, 110 / 216))
    assert gemm_tile_fill(64.0, 4096.0, 108) == 1.0  # below one wave the library splits K
    assert gemm_tile_fill(256.0 * 109, 128.0, 0) == 1.0  # a CPU: no unit count, no waves
    big = dict(peak_flops=312e12, bandwidth=2e12, c=constants.gemm, compute_units=108)
    ragged, even = gemm_seconds(256.0, 8192.0, 128.0 * 109, **big), gemm_seconds(256.0, 8192.0, 128.0 * 108, **big)
    assert ragged > 1.3 * even  # compute-bound: one more column of tiles costs a third more
    # Decode attention: one sequence with a short context runs 32 blocks on 108 SMs; its bytes move slower. A long
    # one is split along its context until the SMs are full; eight sequences (256 blocks) are not split: 3 waves.
    def per_byte(seqs: float, context: float) -> float:
        def seconds(kv_bytes: float) -> float:
            return decode_attention_seconds(seqs, kv_bytes, bandwidth=2e12, c=constants.decode_attention, heads=32.0,
                                            context=context, compute_units=108)
        return (seconds(seqs * context * 16384.0) - seconds(0.0)) / (seqs * context * 16384.0)
    assert per_byte(1.0, 256.0) > 2 * per_byte(54.0, 256.0)
    assert per_byte(1.0, 4096.0) == pytest.approx(per_byte(54.0, 4096.0) * 108 / 96, rel=0.05)  # 3 splits: 96 blocks
    assert per_byte(8.0, 4096.0) == pytest.approx(per_byte(54.0, 4096.0) * 324 / 256, rel=0.05)


def test_prefill_attention_prices_the_new_tokens_triangle_and_their_prefix_apart() -> None:
    model = RooflineModel(load_model("llama-2-7b"), A100)
    constants = A100.accelerator.perf
    assert constants is not None
    slower_prefix = RooflineModel(model.model, A100, constants=dataclasses.replace(
        constants, prefill_attention=dataclasses.replace(constants.prefill_attention,
                                                         prefix_efficiency=constants.prefill_attention.prefix_efficiency / 2)))

    def attention(m: RooflineModel, shape: StepShape) -> float:
        return next(op.seconds for op in m.breakdown(shape) if op.op == "attention prefill")

    fresh, cached = StepShape.build(prefill=[(512, 0)]), StepShape.build(prefill=[(512, 2048)])
    assert attention(slower_prefix, fresh) == pytest.approx(attention(model, fresh))
    assert attention(slower_prefix, cached) > 1.5 * attention(model, cached) - attention(model, fresh)
    assert StepShape.build(prefill=[(100, 50), (100, 0)]).prefill_causal_pairs == 2 * 100 * 101 / 2


def test_an_all_reduce_below_blend_one_grows_slower_than_its_bytes_once_large() -> None:
    constants = A100.accelerator.perf
    assert constants is not None
    ramp = dataclasses.replace(constants.collective, blend=0.75)
    times = [all_reduce_seconds(float(s), 8, link_bytes_per_s=300e9, c=ramp) for s in (2 << 20, 16 << 20, 64 << 20)]
    assert (times[2] - times[1]) / (48 << 20) < (times[1] - times[0]) / (14 << 20)


def test_the_engine_step_overhead_is_the_devices_unless_stated() -> None:
    model = load_model("llama-3.1-8b")
    shape = StepShape.build(decode_contexts=[1024])
    default = RooflineModel(model, A100)
    stated = RooflineModel(model, A100, engine=EngineConfig(step_overhead_ms=2.0))
    assert default.step_overhead_s == pytest.approx(A100.accelerator.perf.step_overhead_ms / 1e3)  # type: ignore[union-attr]
    assert stated.step_time(shape) - default.step_time(shape) == pytest.approx(2e-3 - default.step_overhead_s)


def test_devices_nobody_measured_say_so() -> None:
    catalog = load_catalog()
    assert "Vidur" in catalog.get("a100-80gb").perf.source  # type: ignore[union-attr]
    assert "no measurements" in catalog.get("h200").perf.source  # type: ignore[union-attr]
    assert catalog.get("h200").perf.gemm == catalog.get("h100-sxm").perf.gemm  # type: ignore[union-attr]
    assert catalog.get("l4").perf.gemm == catalog.get("a40").perf.gemm  # type: ignore[union-attr]


@pytest.mark.parametrize(("text", "field"), [
    ("schema_version: 1\ndevices: {a: {source: s}}\n", "devices.a.gemm"),
    ("schema_version: 1\ngenerations: {g: {like: nope}}\n", "generations.g.like"),
    ("schema_version: 1\nvendor_defaults: {nvidia: nope}\n", "vendor_defaults.nvidia"),
])
def test_bad_constants_files_name_the_field(text: str, field: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_perf_table(text)
    assert caught.value.field == field


def test_bad_constant_values_are_refused() -> None:
    good = A100.accelerator.perf.to_dict()  # type: ignore[union-attr]
    for path, value in ((("gemm", "blend"), 0), (("norm", "efficiency"), float("nan")), (("rope", "floor_us"), -1),
                        (("collective", "blend"), 0.4), (("prefill_attention", "prefix_efficiency"), 0)):
        data = json.loads(json.dumps(good))
        data[path[0]][path[1]] = value
        with pytest.raises(SpecError, match="expected|must be"):
            perf_constants_from_dict(data, where="c")


@pytest.fixture
def cli_db(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HETSCHED_DATABASE_URL", database_url)
    return database_url


def test_calibrate_stores_a_trusted_set_that_estimate_then_uses(cli_db: str) -> None:
    ops = VIDUR / "a40" / "ops" / "Llama-2-7b-hf.csv"
    imported = runner.invoke(app, ["profiles", "import-vidur", str(ops), "-o", "json"])
    assert imported.exit_code == 0, imported.output
    before = json.loads(runner.invoke(app, ["estimate", "llama-2-7b", "a40", "-o", "json"]).stdout)
    assert "Vidur" in before["step_model"]
    made = runner.invoke(app, ["calibrate", "a40", "-o", "json"])
    assert made.exit_code == 0, made.output
    result = json.loads(made.stdout)
    assert result["trusted"] and result["residuals"]["gemm"]["median_abs"] < 0.1
    assert {"decode_attention", "prefill_attention", "collective"} <= set(result["unmeasured"])
    after = json.loads(runner.invoke(app, ["estimate", "llama-2-7b", "a40", "-o", "json"]).stdout)
    assert after["step_model"].startswith(f"stored calibration #{result['id']}")
    listed = runner.invoke(app, ["calibrations", "-o", "json"])
    assert [r["id"] for r in json.loads(listed.stdout)] == [result["id"]]


def test_calibrate_refuses_what_it_cannot_fit(cli_db: str) -> None:
    empty = runner.invoke(app, ["calibrate", "h100-sxm"])
    assert isinstance(empty.exception, InputError) and "no measured kernel profiles of h100-sxm" in str(empty.exception)
    made = runner.invoke(app, ["profile", "llama-2-7b", "--source", "roofline", "--accelerator", "a40", "-o", "json"])
    assert made.exit_code == 0, made.output
    refused = runner.invoke(app, ["calibrate", "a40", "--profile", str(json.loads(made.stdout)["id"])])
    assert isinstance(refused.exception, InputError) and "measured kernel profiles" in str(refused.exception)
    assert json.loads(runner.invoke(app, ["calibrations", "-o", "json"]).stdout) == []


def test_the_routers_predictions_take_calibrated_constants() -> None:
    from hetsched.router.profiles import endpoint_profile
    from hetsched.router.types import Endpoint

    endpoint = Endpoint(url="http://a100:8000", model="llama-3.1-8b", accelerator="a100-80gb")
    shipped = endpoint_profile(endpoint, arch="llama-3.1-8b")
    slow = A100.accelerator.perf.with_source("stored calibration #7 (slow)")  # type: ignore[union-attr]
    slow = dataclasses.replace(slow, step_overhead_ms=slow.step_overhead_ms + 10.0)
    calibrated = endpoint_profile(endpoint, arch="llama-3.1-8b", perf=(("a100-80gb", slow),))
    shape = StepShape.build(decode_contexts=[1024] * 8)
    assert calibrated.step_model.step_time(shape) == pytest.approx(shipped.step_model.step_time(shape) + 10e-3)
