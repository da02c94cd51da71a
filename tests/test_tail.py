"""The tail (issue 28): step dispersion and the front end, their estimators, and the simulator running both.

Everything here is seeded and simulated: no clock, no server.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from hetsched.catalog import Device, load_catalog
from hetsched.errors import InputError
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.tail import (NO_DISPERSION, Dispersion, FrontEnd, FrontEndQueue, FrontEndWindow, GapHistogram, Tail,
                                fit_front_end)
from hetsched.sim.capacity import find_capacity
from hetsched.sim.simulator import simulate
from hetsched.sim.step_cache import MemoizedStepModel
from hetsched.sim.tail_fit import TailWindow, fit_tail
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, Workload

ENGINE = EngineConfig(max_num_seqs=32, max_num_batched_tokens=2048)
WORKLOAD = Workload(input_len=LengthDistribution.fixed(256), output_len=LengthDistribution.fixed(48))


@pytest.fixture(scope="module")
def model() -> MemoizedStepModel:
    device = Device.whole(load_catalog().get("l4"))
    return MemoizedStepModel(RooflineModel(load_model("qwen3-0.6b"), device, engine=ENGINE))


def _run(model: MemoizedStepModel, rate: float, tail: Tail | None = None, *, seed: int = 0, n: int = 600,
         gaps: bool = False):  # type: ignore[no-untyped-def]
    return simulate(model, WORKLOAD.sample(n, rate=rate, seed=seed), engine=ENGINE, num_blocks=20000,
                    max_model_len=4096, measure=range(64, n), tail=tail, seed=seed, token_gaps=gaps)


# --- dispersion ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.1, 0.3, 0.8])
def test_a_lognormal_table_has_mean_one_and_its_quantiles(sigma: float) -> None:
    d = Dispersion.lognormal(sigma)
    assert d.mean == pytest.approx(1.0, rel=1e-9)
    median = math.exp(-sigma * sigma / 2)
    assert d.quantile(0.5) == pytest.approx(median, rel=0.02)
    assert d.quantile(0.99) == pytest.approx(median * math.exp(2.3263 * sigma), rel=0.02)
    draws = [d.quantile(u) for u in np.random.default_rng(0).random(20000)]
    assert np.mean(draws) == pytest.approx(1.0, rel=0.01)


def test_samples_give_their_quantiles_against_their_mean() -> None:
    rng = random.Random(3)
    ratios = [1.3 * rng.lognormvariate(0.0, 0.4) for _ in range(5000)]
    d = Dispersion.of_samples(ratios)
    assert d is not None and d.mean == pytest.approx(1.0)
    mean = sum(ratios) / len(ratios)
    for q in (0.1, 0.5, 0.9, 0.99):  # the table's mean (linear between knots) is 1, the sample's a little off it
        assert d.quantile(q) == pytest.approx(float(np.quantile(ratios, q)) / mean, rel=0.03)
    assert Dispersion.of_samples([1.0] * 10) is None  # too few
    assert Dispersion.of_samples([math.nan, -1.0] * 50) is None


def test_a_histogram_gives_its_shape_and_coarse_buckets_give_none() -> None:
    bounds = tuple(0.001 * 1.1 ** i for i in range(60)) + (math.inf,)
    rng = random.Random(1)
    values = [0.004 * rng.lognormvariate(0.0, 0.3) for _ in range(20000)]
    cumulative = tuple(float(sum(v <= b for v in values)) for b in bounds)
    histogram = GapHistogram(bounds, cumulative, sum(values))
    d = histogram.dispersion()
    assert d is not None
    mean = sum(values) / len(values)
    for q in (0.5, 0.9, 0.99):
        assert d.quantile(q) == pytest.approx(float(np.quantile(values, q)) / mean, rel=0.05)
    assert histogram.quantile(0.5) == pytest.approx(float(np.quantile(values, 0.5)), rel=0.05)
    coarse = GapHistogram((0.01, math.inf), (20000.0, 20000.0), sum(values))  # vLLM's default first bucket
    assert coarse.dispersion() is None


def test_the_flag_forms_parse_and_bad_ones_are_refused() -> None:
    assert Dispersion.parse("0.3") == Dispersion.lognormal(0.3)
    knots = Dispersion.parse("0:0.5, 0.5:1, 0.99:2, 1:3")
    assert knots.mean == pytest.approx(1.0) and knots.knots[0][0] == 0.0
    assert Dispersion.parse(knots.spec).quantile(0.99) == pytest.approx(knots.quantile(0.99), rel=1e-3)
    for bad in ("0.5:1,1:2", "0:1,0.5:0.5,1:2", "0:1,1:nan", "fast", "-0.2", "0:0,1:1"):
        with pytest.raises(InputError) as caught:
            Dispersion.parse(bad)
        assert caught.value.field == "dispersion"
    assert NO_DISPERSION.identity and not Dispersion.lognormal(0.1).identity


# --- the front end ---------------------------------------------------------------------------------------------


def test_the_queue_serves_in_order_of_arrival_across_announced_steps() -> None:
    front = FrontEnd(request_s=0.010, token_s=0.002)
    queue = FrontEndQueue(front)
    queue.steps(0.004, 0.040, steps=10, per_step=2)  # steps end every 4 ms with 4 ms of work each
    admitted = queue.request(0.0205)  # after the five steps that ended before it, before the other five
    free, done = -math.inf, {}  # the same work one item at a time, in order of arrival
    for at, work in sorted([(0.004 + 0.004 * j, 0.004) for j in range(10)] + [(0.0205, 0.010)]):
        free = done[at] = max(free, at) + work
    assert admitted == pytest.approx(done[0.0205]) and admitted == pytest.approx(0.034)
    assert queue.sent(0.040) == pytest.approx(free)
    busy = FrontEndQueue(FrontEnd(token_s=0.003))
    busy.steps(0.001, 0.010, steps=10, per_step=1)  # 3 ms of work a 1 ms step: it falls behind
    assert busy.sent(0.010) == pytest.approx(0.001 + 10 * 0.003)
    assert FrontEndQueue(FrontEnd(latency_s=0.005)).request(1.0) == pytest.approx(1.005)


def test_the_front_end_is_fitted_back_from_its_own_gaps() -> None:
    true = FrontEnd(request_s=0.004, token_s=0.0002)
    windows = [FrontEndWindow(rate, true.mean_gap(rate, output_tokens=64, batch=b), 64, b)
               for rate, b in ((2, 1.0), (15, 4.0), (40, 12.0))]
    fitted = fit_front_end(windows)
    assert fitted is not None
    assert fitted.request_s == pytest.approx(true.request_s, rel=0.05)
    assert fitted.token_s == pytest.approx(true.token_s, rel=0.1)
    assert fit_front_end([FrontEndWindow(5, -1.0, 64)]) is None
    assert true.mean_gap(1000, output_tokens=64) == math.inf


def test_the_simulated_front_end_follows_the_queueing_formula(model: MemoizedStepModel) -> None:
    front = FrontEnd(request_s=0.004, token_s=0.0003)
    for rate in (5.0, 20.0):
        run = _run(model, rate, Tail(front_end=front), n=1500)
        gap = float(np.mean(run.times.ttft - run.times.engine_ttft))
        assert gap == pytest.approx(front.mean_gap(rate, output_tokens=48, batch=run.mean_running), rel=0.15)


def test_a_saturated_front_end_holds_clients_back_while_the_engine_idles(model: MemoizedStepModel) -> None:
    front = FrontEnd(request_s=0.02, token_s=0.0005)  # 44 ms a request: full at about 23 req/s
    calm = _run(model, 10.0, Tail(front_end=front))
    full = _run(model, 30.0, Tail(front_end=front))
    assert np.median(full.times.ttft) > 5 * np.median(calm.times.ttft)
    assert np.median(full.times.engine_ttft) < 2 * np.median(calm.times.engine_ttft)


# --- the simulator with the tail --------------------------------------------------------------------------------


def test_no_tail_is_todays_simulation(model: MemoizedStepModel) -> None:
    plain = simulate(model, WORKLOAD.sample(400, rate=20, seed=0), engine=ENGINE, num_blocks=20000,
                     max_model_len=4096)
    for tail in (None, Tail(), Tail(dispersion=NO_DISPERSION)):
        same = simulate(model, WORKLOAD.sample(400, rate=20, seed=0), engine=ENGINE, num_blocks=20000,
                        max_model_len=4096, tail=tail, seed=5)
        assert np.array_equal(same.times.first_token, plain.times.first_token)
        assert np.array_equal(same.times.finished, plain.times.finished) and same.steps == plain.steps
    assert np.array_equal(plain.times.engine_ttft, plain.times.ttft)


def test_dispersion_is_seeded_keeps_the_mean_and_widens_the_tail(model: MemoizedStepModel) -> None:
    tail = Tail(dispersion=Dispersion.lognormal(0.6))
    plain, a, b, c = (_run(model, 15.0, t, seed=s, n=1500, gaps=True)
                      for t, s in ((None, 0), (tail, 0), (tail, 0), (tail, 1)))
    assert np.array_equal(a.times.finished, b.times.finished)
    assert not np.array_equal(a.times.finished[:100], c.times.finished[:100]) or a.steps != c.steps
    assert np.mean(a.times.tpot) == pytest.approx(np.mean(plain.times.tpot), rel=0.05)
    assert np.percentile(a.times.ttft, 99) > 1.3 * np.percentile(plain.times.ttft, 99)
    assert a.token_gaps is not None and plain.token_gaps is not None
    assert a.token_gaps.quantile(0.99) > 1.5 * plain.token_gaps.quantile(0.99)  # type: ignore[operator]


def test_the_capacity_search_runs_the_tail(model: MemoizedStepModel) -> None:
    device = Device.whole(load_catalog().get("l4"))
    arch = load_model("qwen3-0.6b")
    slo = SLO(ttft_ms=150, tpot_ms=1000)
    kwargs = dict(workload=WORKLOAD, slo=slo, engine=ENGINE, seeds=(0,))
    plain = find_capacity(arch, device, **kwargs).requests_per_s  # type: ignore[arg-type]
    jittery = find_capacity(arch, device, tail=Tail(Dispersion.lognormal(1.0)), **kwargs).requests_per_s  # type: ignore[arg-type]
    slow_front = find_capacity(arch, device, tail=Tail(front_end=FrontEnd(request_s=0.01, token_s=0.0004)),
                               **kwargs).requests_per_s  # type: ignore[arg-type]
    assert jittery < 0.95 * plain and slow_front < 0.95 * plain
    assert slow_front < 1 / (0.01 + 48 * 0.0004)  # no more than the front end can serve


def test_the_fit_finds_a_known_dispersion_and_front_end_from_simulated_observations(
        model: MemoizedStepModel) -> None:
    true = Tail(Dispersion.lognormal(0.5), FrontEnd(request_s=0.003, token_s=0.0001))
    bounds = tuple(0.0005 * 1.1 ** i for i in range(112)) + (math.inf,)
    windows = []
    for rate in (4.0, 12.0, 24.0):
        run = _run(model, rate, true, seed=11, n=1500, gaps=True)
        assert run.token_gaps is not None
        gaps = np.repeat(np.array(run.token_gaps.seconds), np.array(run.token_gaps.weights))
        cumulative = tuple(float(np.sum(gaps <= b)) for b in bounds)
        windows.append(TailWindow(rate, WORKLOAD, GapHistogram(bounds, cumulative, float(gaps.sum())),
                                  float(np.mean(run.times.ttft)), float(np.mean(run.times.engine_ttft))))
    fit = fit_tail(model, windows, engine=ENGINE, num_blocks=20000, max_model_len=4096, requests=1200)
    assert fit.tail.dispersion is not None and fit.tail.front_end is not None
    for p, observed, simulated in zip(fit.probabilities, fit.observed_gaps_s, fit.simulated_gaps_s):
        if 0.05 <= p <= 0.99:
            assert simulated == pytest.approx(observed, rel=0.1), p
    assert fit.tail.front_end.request_s == pytest.approx(0.003, rel=0.25)
    for q in (0.5, 0.9, 0.99):
        assert fit.tail.dispersion.quantile(q) == pytest.approx(true.dispersion.quantile(q), rel=0.2)  # type: ignore[union-attr]


def test_a_tail_is_stored_as_json_and_read_back() -> None:
    tail = Tail(Dispersion.lognormal(0.3), FrontEnd(0.001, 0.0001, 0.002))
    assert Tail.from_json(tail.to_json()) == tail
    assert Tail.from_json({"dispersion": [[0, 1], [0.5, 2]], "front_end": None}) is None  # not a table
    assert Tail.from_json(None) is None and Tail().empty
