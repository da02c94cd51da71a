"""Profiles in the store (SQLite and PostgreSQL), the export format, and the profile commands."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from hetsched.catalog import Device, load_catalog
from hetsched.cli import app
from hetsched.errors import HetschedError, InputError, NotFoundError
from hetsched.perf.step import StepShape
from hetsched.profiler.exchange import export_document, parse_document
from hetsched.profiler.profile import Profile, Provenance
from hetsched.profiler.roofline_source import roofline_profile
from hetsched.specs.registry import load_model
from hetsched.store import Store, open_store
from hetsched.store.profiles import (latest_profile, list_profiles, load_profile, load_profile_with_id, save_profile,
                                     save_profiles)
from hetsched.store.tables import AcceleratorSeenRow, ProfileRow

runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command as ``hetsched`` would: a hetsched error becomes its exit code and message."""
    result = runner.invoke(app, list(args), env=env)
    if isinstance(result.exception, HetschedError):
        return result.exception.exit_code, str(result.exception)
    return result.exit_code, result.stdout
SHAPES = (StepShape.build(prefill=[(700, 300)]), StepShape.build(decode_contexts=[900] * 24),
          StepShape.build(prefill=[(128, 0)], decode_contexts=[2000] * 8))


def _profile(accelerator: str = "h100-sxm", *, measured: bool = True) -> Profile:
    profile = roofline_profile(load_model("qwen3-0.6b"), Device.whole(load_catalog().get(accelerator)))
    if not measured:
        return profile
    device = {"backend": "nvidia", "name": "NVIDIA H100 80GB HBM3", "memory_gb": 80.0}
    return dataclasses.replace(profile, provenance=dataclasses.replace(profile.provenance, device=device))


def _count(store: Store, table: type) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(table)) or 0


def test_a_digest_prefix_of_digits_only_still_finds_its_profile(store: Store) -> None:
    profile_id = save_profile(store, _profile())
    with store.transaction() as session:  # a digest that happens to start with ten decimal digits
        session.get(ProfileRow, profile_id).digest = "0753597257" + "ab" * 27
    assert load_profile_with_id(store, "0753597257")[0] == profile_id
    assert load_profile_with_id(store, str(profile_id))[0] == profile_id  # a row id still wins
    with pytest.raises(NotFoundError):
        load_profile(store, "99999")  # neither an id nor a 6-digit prefix


def test_round_trip_keeps_predictions_and_identity(store: Store) -> None:
    profile = _profile()
    profile_id = save_profile(store, profile)
    loaded = load_profile(store, profile_id)
    assert loaded.digest == profile.digest
    assert [loaded.step_time(s) for s in SHAPES] == [profile.step_time(s) for s in SHAPES]
    assert load_profile(store, profile.digest[:10]).digest == profile.digest
    assert load_profile_with_id(store, profile.digest[:10])[0] == profile_id
    assert save_profile(store, profile) == profile_id  # same content, same row
    assert _count(store, ProfileRow) == 1 and _count(store, AcceleratorSeenRow) == 1
    other = save_profile(store, _profile("a100-80gb", measured=False))
    rows = list_profiles(store)
    assert [r.id for r in rows] == [other, profile_id] and rows[1].points == sum(len(t.points) for t in profile.tables)
    assert [r.id for r in list_profiles(store, accelerator="h100-sxm")] == [profile_id]
    newest = latest_profile(store, model="qwen3-0.6b", accelerator="a100-80gb")
    assert newest is not None and newest.accelerator == "a100-80gb"
    assert latest_profile(store, model="qwen3-0.6b", accelerator="l4") is None


def test_an_interrupted_save_leaves_no_rows(store: Store) -> None:
    broken = dataclasses.replace(_profile("a100-80gb"), accelerator=None)  # type: ignore[arg-type]
    with pytest.raises(Exception):
        save_profiles(store, [_profile(), broken])
    assert _count(store, ProfileRow) == 0 and _count(store, AcceleratorSeenRow) == 0


def test_unknown_profiles_are_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError, match="unknown profile '42'"):
        load_profile(store, 42)
    with pytest.raises(InputError, match="at least 6"):
        load_profile(store, "abc")


def test_export_format_is_versioned_and_round_trips() -> None:
    profile = _profile()
    document = export_document([profile])
    assert document["schema_version"] == 1 and document["kind"] == "hetsched-profiles"
    (parsed,) = parse_document(json.dumps(document))
    assert parsed.digest == profile.digest


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d.update(schema_version=7), "schema_version"),
    (lambda d: d["profiles"][0].pop("tables"), "profiles[0].tables"),
    (lambda d: d["profiles"][0]["tables"][0]["points"][0].update(median_s=-1.0),
     "profiles[0].tables[0].points[0].median_s"),
    (lambda d: d["profiles"][0].update(source="guess"), "profiles[0].source"),
    (lambda d: d["profiles"][0]["tables"][0]["points"][0].update(coords=[1.0, 2.0]), "profiles[0].tables[0]"),
    (lambda d: d["profiles"][0]["terms"][0].update(table="nowhere"), "profiles[0]"),
])
def test_malformed_documents_name_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    document = export_document([_profile()])
    mutate(document)
    with pytest.raises(InputError) as caught:
        parse_document(json.dumps(document), source="bad.json")
    assert caught.value.field == f"bad.json: {field}"
    with pytest.raises(InputError, match="not valid JSON"):
        parse_document("{", source="bad.json")


@pytest.fixture
def cli_db(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HETSCHED_DATABASE_URL", database_url)
    return database_url


def test_profile_commands_end_to_end(cli_db: str, tmp_path: Path) -> None:
    made = runner.invoke(app, ["profile", "qwen3-0.6b", "--source", "roofline", "--accelerator", "l4", "-o", "json"])
    assert made.exit_code == 0, made.output
    made_id = json.loads(made.stdout)["id"]
    listed = json.loads(runner.invoke(app, ["profiles", "list", "-o", "json"]).stdout)
    assert [p["id"] for p in listed] == [made_id] and listed[0]["accelerator"] == "l4"
    shown = runner.invoke(app, ["profiles", "show", str(made_id)])
    assert shown.exit_code == 0 and "decode 32 @ 1k ctx" in shown.stdout
    by_digest = runner.invoke(app, ["profiles", "show", listed[0]["digest"][:8]], env={"COLUMNS": "200"})
    assert by_digest.exit_code == 0 and f"Profile {made_id} qwen3-0.6b on l4" in by_digest.stdout
    exported = tmp_path / "profiles.json"
    assert runner.invoke(app, ["profiles", "export", "--all", "--file", str(exported)]).exit_code == 0
    fresh = tmp_path / "fresh.sqlite"
    result = runner.invoke(app, ["profiles", "import", str(exported), "-o", "json"],
                           env={"HETSCHED_DATABASE_URL": f"sqlite:///{fresh}"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["digest"] == listed[0]["digest"]


def test_a_malformed_import_writes_nothing(cli_db: str, tmp_path: Path) -> None:
    good, bad = _profile(), export_document([_profile("a100-80gb")])
    bad["profiles"][0]["tables"][1]["points"][0]["p90_s"] = "slow"
    document = export_document([good])
    document["profiles"].append(bad["profiles"][0])
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(document))
    code, message = invoke("profiles", "import", str(path))
    assert code == 2
    assert "mixed.json: profiles[1].tables[1].points[0].p90_s" in message
    store = open_store(cli_db)
    assert _count(store, ProfileRow) == 0
    store.engine.dispose()


def test_profile_command_errors(cli_db: str) -> None:
    assert invoke("profile", "no-such-model", "--source", "roofline")[0] == 3
    code, message = invoke("profile", "qwen3-0.6b", "--source", "roofline")
    assert code == 2 and "--accelerator" in message
    assert invoke("profiles", "show", "99")[0] == 3
    assert invoke("profile", "qwen3-0.6b", "--source", "endpoint")[0] == 2
    assert invoke("profiles", "import", "no-such-file.json")[0] == 2


def test_unavailable_backend_exit_code(cli_db: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runtime is present")
    code, message = invoke("profile", "qwen3-0.6b", "--backend", "rocm")
    assert code == 5 and "ROCm" in message


def test_provenance_is_kept(store: Store) -> None:
    profile = _profile()
    loaded = load_profile(store, save_profile(store, profile))
    assert isinstance(loaded.provenance, Provenance)
    assert loaded.provenance.device["name"] == "NVIDIA H100 80GB HBM3"
    assert loaded.sweep == profile.sweep
