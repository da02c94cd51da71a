"""Property tests over every file loader and the commands that read files: whatever the bytes, a HetschedError
(a clear message) or success, never another exception.

Inputs are random bytes, unicode, deep nesting, huge and non-finite numbers, and valid example files with one
value swapped for a hostile one. Bounded and deterministic: small inputs, ``derandomize=True``, no database.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import HetschedError
from hetsched.optimizer.load import load_cluster, load_plan
from hetsched.profiler.exchange import export_document
from hetsched.profiler.exchange import parse_document as parse_profiles
from hetsched.router.config import load_router_config
from hetsched.router.openai import ApiKind, parse_request
from hetsched.specs.files import parse_document, read_document, read_text
from hetsched.specs.registry import load_model
from hetsched.specs.workload import load_workload
from hetsched.autoscale.config import load_autoscale_file

EXAMPLES = Path(__file__).parent.parent / "examples"
MODEL_CONFIG = Path(__file__).parent.parent / "hetsched" / "specs" / "models" / "qwen3-0.6b.json"
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _profiles_file(path: Path) -> object:
    return parse_profiles(read_text(path, field="file"), source=path.name)


LOADERS: dict[str, Callable[[Path], object]] = {
    "cluster.yaml": load_cluster,
    "cluster.json": load_cluster,
    "plan.yaml": load_plan,
    "router.yaml": load_router_config,
    "autoscale.yaml": load_autoscale_file,
    "workload.yaml": load_workload,
    "trace.jsonl": load_workload,
    "trace.csv": load_workload,
    "config.json": lambda path: load_model(str(path)),
    "profiles.json": _profiles_file,
    "any.yaml": lambda path: read_document(path, field="--config"),
}


def _profiles_seed() -> dict[str, Any]:
    from hetsched.catalog import Device, load_catalog
    from hetsched.profiler.roofline_source import roofline_profile

    profile = roofline_profile(load_model("qwen3-0.6b"), Device.whole(load_catalog().get("l4")))
    document = export_document([profile])
    document["profiles"][0]["tables"] = document["profiles"][0]["tables"][:2]  # small: fast to mutate and validate
    names = {t["op"] for t in document["profiles"][0]["tables"]}
    document["profiles"][0]["terms"] = [t for t in document["profiles"][0]["terms"] if t["table"] in names]
    return document


SEEDS: dict[str, Any] = {
    "cluster.yaml": yaml.safe_load((EXAMPLES / "chat.yaml").read_text()),
    "router.yaml": yaml.safe_load((EXAMPLES / "router-local.yaml").read_text()),
    "autoscale.yaml": yaml.safe_load((EXAMPLES / "autoscale-local.yaml").read_text()),
    "workload.yaml": {"name": "w", "arrival": {"kind": "gamma", "cv": 2},
                      "input_len": {"kind": "lognormal", "p50": 500, "p99": 4000, "max_tokens": 8000},
                      "output_len": {"kind": "fixed", "value": 128}},
    "config.json": json.loads(MODEL_CONFIG.read_text()),
    "profiles.json": _profiles_seed(),
}

HOSTILE = st.one_of(
    st.sampled_from([True, False, None, 0, -1, 2**63, 10**400, -(10**400), 1e308, -1e308, 5e-324, "", "NaN",
                     [], {}, [[]], {"": None}, "[/x]", "\x00", "\ud7ff\ue000"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.text(max_size=12),
    st.integers(min_value=60, max_value=300).map(lambda n: json.loads("[" * n + "]" * n)),
)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*path, i))


def _swap(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    changed = copy.deepcopy(document)
    holder = changed
    for part in path[:-1]:
        holder = holder[part]
    holder[path[-1]] = value
    return changed


def _text(document: Any, suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(document, allow_nan=True)
    return yaml.safe_dump(document, allow_unicode=True)


def _clear_or_fine(call: Callable[[], object]) -> None:
    """The property: success, or a HetschedError with a message; anything else fails the test."""
    try:
        call()
    except HetschedError as exc:
        assert str(exc).strip()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("name", sorted(LOADERS))
@FUZZ
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_random_bytes(folder: Path, name: str, data: bytes) -> None:
    path = folder / name
    path.write_bytes(data)
    _clear_or_fine(lambda: LOADERS[name](path))


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.json", "router.yaml", "profiles.json", "trace.jsonl"])
@FUZZ
@given(depth=st.integers(min_value=1, max_value=3000), opener=st.sampled_from(["[", "{\"a\": ", "- ", "a:\n"]))
def test_deep_nesting(folder: Path, name: str, depth: int, opener: str) -> None:
    closer = {"[": "]", "{\"a\": ": "}"}.get(opener, "")
    indent = opener.endswith("\n")
    text = "".join(("  " * i if indent else "") + opener for i in range(depth)) + ("1" if indent else "") + \
        closer * depth
    path = folder / name
    path.write_text(text)
    _clear_or_fine(lambda: LOADERS[name](path))


@pytest.mark.parametrize("name", sorted(SEEDS))
@FUZZ
@given(data=st.data())
def test_one_hostile_value_in_a_valid_file(folder: Path, name: str, data: st.DataObject) -> None:
    seed = SEEDS[name]
    where = data.draw(st.sampled_from(list(_paths(seed))), label="path")
    document = _swap(seed, where, data.draw(HOSTILE, label="value"))
    path = folder / name
    path.write_text(_text(document, path.suffix))
    _clear_or_fine(lambda: LOADERS[name](path))


@FUZZ
@given(number=st.one_of(st.floats(), st.integers(), st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "1" * 5000])),
       name=st.sampled_from(["a.json", "a.yaml"]))
def test_numbers_are_finite_or_refused(number: object, name: str) -> None:
    text = f'{{"x": {number}}}' if name.endswith(".json") else f"x: {number}"
    try:
        parsed = parse_document(text, name=name, field="f")
    except HetschedError:
        return
    value = parsed["x"] if isinstance(parsed, dict) else None
    assert not isinstance(value, float) or math.isfinite(value)


@FUZZ
@given(body=st.one_of(st.binary(max_size=300),
                      st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
                                   lambda inner: st.lists(inner, max_size=4)
                                   | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                                   max_leaves=30).map(lambda v: json.dumps({"model": "m", "prompt": v, "x": v}).encode())),
       kind=st.sampled_from(list(ApiKind)))
def test_openai_bodies(body: bytes, kind: ApiKind) -> None:
    _clear_or_fine(lambda: parse_request(body, kind))


# --- commands ---------------------------------------------------------------------------------------------------

runner = CliRunner()
SMALL_CLUSTER: dict[str, Any] = {
    "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
    "models": [{"name": "qwen3-0.6b", "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                "workload": {"rate_rps": 1, "input_tokens": 256, "output_tokens": 64}}],
    "capacities": [{"model": "qwen3-0.6b", "device": "l4", "requests_per_s": 5}],
    "solver": {"time_limit_s": 2},
}
COMMANDS: dict[str, tuple[Callable[[Path], list[str]], Any]] = {  # file → (command line, a valid file to mutate)
    "cluster.yaml": (lambda path: ["plan", str(path), "-o", "json"], SMALL_CLUSTER),
    "config.json": (lambda path: ["models", "show", str(path), "-o", "json"], SEEDS["config.json"]),
    "profiles.json": (lambda path: ["profiles", "import", str(path), "-o", "json"], SEEDS["profiles.json"]),
}


@pytest.fixture(scope="module")
def cli_env(folder: Path) -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setenv("HETSCHED_DATABASE_URL", f"sqlite:///{folder / 'cli.sqlite'}")
    yield
    patch.undo()


@pytest.mark.parametrize("name", sorted(COMMANDS))
@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_commands_reading_files(folder: Path, cli_env: None, name: str, data: st.DataObject) -> None:
    args, seed = COMMANDS[name]
    path = folder / name
    if data.draw(st.booleans(), label="mutate a valid file"):
        where = data.draw(st.sampled_from(list(_paths(seed))), label="path")
        path.write_text(_text(_swap(seed, where, data.draw(HOSTILE, label="value")), path.suffix))
    else:
        path.write_bytes(data.draw(st.binary(max_size=200), label="bytes"))
    failure = runner.invoke(app, args(path)).exception
    assert failure is None or isinstance(failure, SystemExit | HetschedError), repr(failure)
    assert not isinstance(failure, HetschedError) or str(failure).strip()
