"""Corrections in the store: saved with their provenance, the newest trusted one per key in force."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate, Outlier
from hetsched.store import Store
from hetsched.store.db import open_store
from hetsched.store.corrections import corrections_in_force, list_corrections, save_correction
from hetsched.store.peek import StoreOnDemand

KEY = CorrectionKey("llama-3.1-8b", "a100-80gb", 1)


def _estimate(scale: float, *, trusted: bool = True, key: CorrectionKey = KEY) -> Estimate:
    return Estimate(key=key, correction=StepCorrection(scale, scale, 0.001, 0.002), sd=(0.02, 0.03, 1e-4, 1e-3),
                    observations=420, sources=3, first_at=10.0, last_at=310.0, residual_median=0.04,
                    residual_p90=0.12, trusted=trusted, outliers=(Outlier("pod-c", 2.1, 80),))


def test_a_saved_correction_keeps_its_provenance(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'h.db'}")
    row_id = save_correction(store, _estimate(1.4), origin="calibrate --live http://a:8000")
    [stored] = list_corrections(store)
    assert stored.id == row_id and stored.key == KEY
    assert stored.correction == StepCorrection(1.4, 1.4, 0.001, 0.002)
    assert stored.window_s == pytest.approx(300.0) and stored.sources == 3 and stored.observations == 420
    assert stored.outliers == [{"source": "pod-c", "ratio": 2.1, "observations": 80}]
    assert stored.sd == {"prefill_scale": 0.02, "decode_scale": 0.03, "step_overhead_s": 1e-4,
                         "request_overhead_s": 1e-3}
    assert "420 observations" in stored.label and "x1.4" in stored.label


def test_the_newest_trusted_per_key_is_in_force_from_the_file_or_the_opened_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    store = open_store(url)
    save_correction(store, _estimate(1.3), origin="old")
    newest = save_correction(store, _estimate(1.4), origin="new")
    save_correction(store, _estimate(2.0, trusted=False), origin="not trusted")
    other = CorrectionKey("llama-3.1-8b", "a100-80gb", 1, attention_backend="FLASHINFER")
    save_correction(store, _estimate(0.9, key=other), origin="another backend")
    for source in (store, StoreOnDemand(url, open=_never_opened)):
        found = corrections_in_force(source)
        assert found[KEY].id == newest and found[KEY].correction.prefill_scale == 1.4
        assert found[other].correction.prefill_scale == 0.9


def test_a_fresh_store_has_no_corrections(tmp_path: Path) -> None:
    assert corrections_in_force(StoreOnDemand(f"sqlite:///{tmp_path / 'none.db'}", open=_never_opened)) == {}


def _never_opened() -> Store:
    raise AssertionError("the store was opened")


def test_a_correction_keeps_the_tail_learned_with_it_from_the_file_or_the_opened_store(tmp_path: Path) -> None:
    from hetsched.perf.tail import Dispersion, FrontEnd, Tail

    url = f"sqlite:///{tmp_path / 'h.db'}"
    store = open_store(url)
    tail = Tail(Dispersion.lognormal(0.3), FrontEnd(request_s=0.003, token_s=0.0001, latency_s=0.002))
    with_tail = save_correction(store, _estimate(1.4), origin="calibrate --live", tail=tail)
    other = CorrectionKey("llama-3.1-8b", "h100-sxm", 1)
    save_correction(store, _estimate(1.1, key=other), origin="no tail", tail=Tail())
    stored = {c.id: c for c in list_corrections(store)}
    assert stored[with_tail].tail == tail
    for source in (store, StoreOnDemand(url, open=_never_opened)):
        found = corrections_in_force(source)
        assert found[KEY].tail == tail and found[other].tail is None
