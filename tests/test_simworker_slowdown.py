"""A simulated worker slower than its step model says (issue 28: a device whose catalog figures are wrong).

Times are the engine's own: its step model summed over the steps its scheduler plans for one request (a
simulated clock), so the comparisons are exact and do not depend on how busy this machine is.
"""

from __future__ import annotations

import pytest

from hetsched.cli import app as cli
from hetsched.errors import InputError
from hetsched.perf.correction import CorrectedStepModel
from hetsched.sim.scheduler import Request
from hetsched.simworker import SimEngine, WorkerSpec, build_engine
from simworker_cli import MODEL, Start, runner, start  # noqa: F401 (the fixture)


def _timeline(engine: SimEngine, *, prompt: int = 512, out: int = 16) -> tuple[float, list[float]]:
    """One request alone on ``engine``, on its simulated clock: its TTFT and its inter-token latencies (s)."""
    engine.scheduler.add_request(Request(0, prompt, out))
    clock, token_times = 0.0, []
    while engine.scheduler.has_work:
        output = engine.scheduler.schedule()
        clock += engine.step_model.step_time(output.shape)
        result = engine.scheduler.update_from_output(output)
        if result.first_token or output.num_decodes:
            token_times.append(clock)
    assert len(token_times) == out
    return token_times[0], [b - a for a, b in zip(token_times, token_times[1:])]


def test_slowdown_decode_doubles_the_inter_token_latency_and_keeps_the_prefill(start: Start) -> None:
    plain, banner = start()
    slow, slow_banner = start("--slowdown-decode", "2")
    ttft, itl = _timeline(plain.engine)
    slow_ttft, slow_itl = _timeline(slow.engine)
    assert slow_ttft == pytest.approx(ttft)  # the first step is all prefill
    assert slow_itl == pytest.approx([2 * gap for gap in itl])
    assert "slowdown" not in banner and "slowdown prefill ×1 decode ×2" in slow_banner


def test_slowdown_scales_both_phases_and_multiplies_with_a_phase_s(start: Start) -> None:
    plain, _ = start()
    slow, banner = start("--slowdown", "1.5")
    both, both_banner = start("--slowdown", "1.5", "--slowdown-decode", "2")
    ttft, itl = _timeline(plain.engine)
    slow_ttft, slow_itl = _timeline(slow.engine)
    assert slow_ttft == pytest.approx(1.5 * ttft) and slow_itl == pytest.approx([1.5 * gap for gap in itl])
    both_ttft, both_itl = _timeline(both.engine)
    assert both_ttft == pytest.approx(1.5 * ttft) and both_itl == pytest.approx([3 * gap for gap in itl])
    assert "slowdown ×1.5;" in banner and "slowdown prefill ×1.5 decode ×3" in both_banner


def test_a_mixed_step_is_slowed_by_the_blend_of_its_phases() -> None:
    plain, _ = build_engine(WorkerSpec(model=MODEL, accelerator="l4", max_model_len=2048))
    slow, _ = build_engine(WorkerSpec(model=MODEL, accelerator="l4", max_model_len=2048, slowdown_decode=2.0))
    assert isinstance(slow.step_model.model, CorrectedStepModel)
    assert not isinstance(plain.step_model.model, CorrectedStepModel)  # no slowdown: the model as it is
    for engine in (plain, slow):  # a long request decoding, then a prompt arriving: steps that mix both phases
        engine.scheduler.add_request(Request(0, 256, 64))
        engine.scheduler.update_from_output(engine.scheduler.schedule())
        engine.scheduler.add_request(Request(1, 256, 8))
    mixed = plain.scheduler.schedule().shape
    assert mixed.prefill_tokens and mixed.decode_seqs and slow.scheduler.schedule().shape == mixed
    base = plain.step_model.step_time(mixed)
    assert base < slow.step_model.step_time(mixed) < 2 * base


@pytest.mark.parametrize("flag", ["--slowdown", "--slowdown-prefill", "--slowdown-decode"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_slowdown_that_is_not_a_finite_factor_above_zero_is_refused(flag: str, value: str) -> None:
    result = runner.invoke(cli, ["sim-worker", "--model", MODEL, "--accelerator", "l4", flag, value])
    assert isinstance(result.exception, InputError), result.output
    assert result.exception.field == flag and "finite factor above 0" in str(result.exception)


def test_a_slowdown_whose_product_overflows_is_refused() -> None:
    result = runner.invoke(cli, ["sim-worker", "--model", MODEL, "--accelerator", "l4", "--slowdown", "1e200",
                                 "--slowdown-decode", "1e200"])
    assert isinstance(result.exception, InputError) and result.exception.field == "--slowdown-decode"
