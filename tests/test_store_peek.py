"""Reading a store's SQLite file without opening it: the same rows as the opened store, or no answer at all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory

from hetsched.catalog import Device, load_catalog
from hetsched.perf.calibrate import Calibration, ErrorStats
from hetsched.store import Store, open_store
from hetsched.sim.capacity import find_capacity
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, Workload
from hetsched.store import cache
from hetsched.store.calibrations import calibrated_constants, save_calibration
from hetsched.store.db import alembic_config
from hetsched.store.peek import StoreOnDemand, peek, schema_head, sqlite_file


def _never_opened() -> Store:
    raise AssertionError("the store was opened")


def _calibration(constants_source: str, *, trusted: bool) -> Calibration:
    perf = load_catalog().get("a100-80gb").perf
    assert perf is not None
    error = 0.01 if trusted else 0.9
    residuals = {"gemm": ErrorStats(count=4, median_abs=error, p90_abs=error, median_signed=error)}
    return Calibration(dataclasses.replace(perf, source=constants_source), residuals, ())


def test_the_migrations_head_is_the_one_their_file_names_end_at(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'head.sqlite'}"
    assert ScriptDirectory.from_config(alembic_config(url)).get_current_head() == schema_head()


def test_the_calibrations_in_use_read_from_the_file_are_the_opened_stores(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    store = open_store(url)
    for accelerator, source, trusted in (("a100-80gb", "first", True), ("a100-80gb", "second", True),
                                         ("a100-80gb", "rough", False), ("l4", "only", True)):
        save_calibration(store, accelerator, _calibration(source, trusted=trusted), profile_ids=[])
    peeked = calibrated_constants(StoreOnDemand(url, open=_never_opened))
    assert peeked == calibrated_constants(store)
    assert peeked["a100-80gb"].source == "stored calibration #2 (second)" and set(peeked) == {"a100-80gb", "l4"}
    store.engine.dispose()


def test_a_file_not_there_yet_holds_nothing_and_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "later.sqlite"
    assert calibrated_constants(StoreOnDemand(f"sqlite:///{path}", open=_never_opened)) == {}
    assert not path.exists()


@pytest.mark.parametrize("url", ["postgresql+psycopg://user@db/hetsched", "sqlite:///:memory:",
                                 "sqlite:///store.sqlite?timeout=5"])
def test_a_store_that_is_not_a_plain_sqlite_file_is_not_peeked_at(url: str) -> None:
    assert sqlite_file(url) is None and peek(url, "SELECT 1") is None


def test_a_file_at_another_revision_or_in_a_missing_folder_is_left_to_the_opened_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    command.upgrade(alembic_config(url), "0001")
    assert peek(url, "SELECT 1") is None
    opened: list[Store] = []

    def open_and_keep() -> Store:
        opened.append(open_store(url))
        return opened[-1]

    assert calibrated_constants(StoreOnDemand(url, open=open_and_keep)) == {} and len(opened) == 1
    assert peek(url, "SELECT count(*) FROM calibrations") == [(0,)]  # opening it brought the schema up to date
    assert peek(f"sqlite:///{tmp_path / 'nowhere' / 'store.sqlite'}", "SELECT 1") is None
    opened[0].engine.dispose()


def test_a_file_that_is_not_a_database_is_left_to_the_opened_store(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite"
    path.write_text("not a database")
    assert peek(f"sqlite:///{path}", "SELECT 1") is None


def test_a_cached_capacity_is_read_from_the_file_and_a_new_one_opens_the_store(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    searched: list[int] = []
    monkeypatch.setattr(cache, "find_capacity",
                        lambda *a, **kw: searched.append(1) or find_capacity(*a, **{**kw, "seeds": (0,)}))
    args = (load_model("qwen3-0.6b"), Device.whole(load_catalog().get("l4")))
    kwargs = {"workload": Workload.chat(), "slo": SLO(ttft_ms=500, tpot_ms=50)}
    opened: list[Store] = []

    def open_and_keep() -> Store:
        opened.append(open_store(url))
        return opened[-1]

    first = cache.cached_capacity(StoreOnDemand(url, open=open_and_keep), *args, **kwargs)
    assert searched == [1] and len(opened) == 1  # not cached: searched, and saved through the opened store
    assert cache.cached_capacity(StoreOnDemand(url, open=_never_opened), *args, **kwargs) == first
    assert searched == [1]
    opened[0].engine.dispose()
