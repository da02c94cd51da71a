"""Workload shapes, SLOs, trace files and request-size buckets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetsched.errors import InputError
from hetsched.specs.workload import (
    SLO, ArrivalKind, ArrivalProcess, LengthDistribution, LengthKind, Workload, load_trace, load_workload,
    parse_workload, split_buckets,
)


def test_lognormal_matches_its_median_and_p99() -> None:
    dist = LengthDistribution.lognormal(p50=400, p99=3000)
    x = dist.sample(np.random.default_rng(0), 50_000)
    assert np.percentile(x, 50) == pytest.approx(400, rel=0.03)
    assert np.percentile(x, 99) == pytest.approx(3000, rel=0.08)


def test_lognormal_from_mean_and_p50() -> None:
    x = LengthDistribution.lognormal(p50=200, mean=260).sample(np.random.default_rng(1), 50_000)
    assert x.mean() == pytest.approx(260, rel=0.03)


def test_lognormal_needs_a_spread() -> None:
    with pytest.raises(ValueError, match="mean' and 'p99"):
        LengthDistribution(kind=LengthKind.LOGNORMAL, p50=100)
    with pytest.raises(ValueError, match="right-skewed"):
        LengthDistribution.lognormal(p50=100, p99=50)


def test_histogram_samples_inside_its_bins_by_weight() -> None:
    x = LengthDistribution.histogram([0, 100, 1000], [3, 1]).sample(np.random.default_rng(2), 20_000)
    assert x.min() >= 1 and x.max() <= 1000
    assert (x <= 100).mean() == pytest.approx(0.75, abs=0.02)


def test_truncation_bounds_samples() -> None:
    x = LengthDistribution.lognormal(p50=500, p99=5000).truncated(513, 2048).sample(np.random.default_rng(3), 5000)
    assert x.min() >= 513 and x.max() <= 2048


def test_sampling_is_deterministic_for_a_seed_and_rate_scales_arrivals() -> None:
    w = Workload.chat()
    a, b = w.sample(500, rate=4.0, seed=7), w.sample(500, rate=4.0, seed=7)
    assert np.array_equal(a.input_tokens, b.input_tokens) and np.array_equal(a.arrival_s, b.arrival_s)
    assert not np.array_equal(a.input_tokens, w.sample(500, rate=4.0, seed=8).input_tokens)
    assert a.arrival_s[-1] / 500 == pytest.approx(0.25, rel=0.15)


def test_gamma_arrivals_are_burstier_than_poisson() -> None:
    rng = np.random.default_rng(0)
    gaps = ArrivalProcess(kind=ArrivalKind.GAMMA, cv=3.0).gaps(rng, 50_000, rate=2.0)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)


def test_prefix_sharing_marks_cached_prompt_tokens() -> None:
    w = Workload.chat().model_copy(update={"prefix_sharing": 0.5})
    batch = w.sample(100, rate=1.0, seed=0)
    assert np.array_equal(batch.cached_tokens, batch.input_tokens // 2)


def test_slo_defaults_and_validation() -> None:
    slo = SLO(ttft_ms=500, tpot_ms=50)
    assert slo.percentile == 99 and slo.max_failure_rate == 0.01
    with pytest.raises(ValueError):
        SLO(ttft_ms=0, tpot_ms=50)


def test_buckets_cover_the_traffic_and_restrict_lengths() -> None:
    buckets = split_buckets(Workload.chat(), [512, 2048], [128])
    assert sum(b.share for b in buckets) == pytest.approx(1.0)
    short = next(b for b in buckets if b.input_range == (1, 512) and b.output_range == (1, 128))
    x = short.workload.sample(2000, rate=1.0, seed=0)
    assert x.input_tokens.max() <= 512 and x.output_tokens.max() <= 128
    assert short.label == "in 1-512 / out 1-128"


def test_buckets_reject_unsorted_edges() -> None:
    with pytest.raises(InputError, match="input_edges"):
        split_buckets(Workload.chat(), [2048, 512], [])


def test_trace_jsonl_and_csv(tmp_path) -> None:
    rows = [{"timestamp": i * 0.5, "prompt_tokens": 100 + i, "completion_tokens": 10 + i} for i in range(20)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    csv_file = tmp_path / "t.csv"
    csv_file.write_text("arrival_s,input_tokens,output_tokens\n" + "\n".join(
        f"{r['timestamp']},{r['prompt_tokens']},{r['completion_tokens']}" for r in rows))
    for path in (jsonl, csv_file):
        w = load_workload(path)
        assert w.arrival.kind is ArrivalKind.TRACE and len(w.trace) == 20
        batch = w.sample(40, rate=4.0, seed=0)  # replayed at twice the recorded rate
        assert np.all(np.diff(batch.arrival_s) == pytest.approx(0.25))
        assert set(batch.input_tokens - batch.output_tokens) == {90}  # pairs stay together


def test_trace_errors_name_the_row(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1}\n{"arrival_s": 1, "input_tokens": 5}\n')
    with pytest.raises(InputError, match="row 2: missing output_tokens"):
        load_trace(bad)
    bad.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1}\n{"arrival_s": 1, "input_tokens": 0, '
                   '"output_tokens": 1}\n')
    with pytest.raises(InputError, match="bad.jsonl row 2: Input should be greater than or equal to 1") as caught:
        load_trace(bad)
    assert caught.value.field == "input_tokens"


def test_workload_file_errors_name_the_field(tmp_path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text("input_len: {kind: fixed, value: 100}\noutput_len: {kind: lognormal, p50: 10}\n")
    with pytest.raises(InputError, match="output_len"):
        load_workload(f)
    with pytest.raises(InputError, match="mapping"):
        parse_workload([1, 2])
    with pytest.raises(InputError, match="no such file"):
        load_workload(tmp_path / "missing.yaml")
