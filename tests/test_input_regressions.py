"""One test per input that used to crash or be silently accepted (issue 18, the input half).

Each asserts the clear error a user now gets: an InputError (exit 2), a NotFoundError (exit 3) or a
BackendUnavailableError (exit 5) naming the file, field or option; a 4xx in the API's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from hetsched.cli import app
from hetsched.errors import BackendUnavailableError, HetschedError, InputError, NotFoundError
from hetsched.optimizer.load import load_cluster
from hetsched.profiler.exchange import export_document, parse_document
from hetsched.profiler.profile import Term
from hetsched.router.config import load_router_config
from hetsched.router.openai import ApiKind, parse_request
from hetsched.specs.files import ReadLimits, parse_document as parse_file, read_document
from hetsched.specs.workload import load_workload
from hetsched.store import open_store
from hetsched.store.profiles import list_profiles, save_profile, save_profiles

runner = CliRunner()
MODEL = "qwen3-0.6b"
CLUSTER: dict[str, Any] = {
    "pools": [{"name": "l4", "accelerator": "l4", "nodes": 1}],
    "models": [{"name": MODEL, "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                "workload": {"rate_rps": 1, "input_tokens": 256, "output_tokens": 64}}],
    "capacities": [{"model": MODEL, "device": "l4", "requests_per_s": 5}],
}


def invoke(*args: str) -> tuple[int, str]:
    """A command's exit code and message, as ``hetsched`` would give them (hetsched errors are not re-raised)."""
    result = runner.invoke(app, list(args))
    if isinstance(result.exception, HetschedError):
        return result.exception.exit_code, str(result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


@pytest.fixture
def cli_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'hetsched.sqlite'}"
    monkeypatch.setenv("HETSCHED_DATABASE_URL", url)
    return url


# --- files ----------------------------------------------------------------------------------------------------

def test_a_non_utf8_file_names_the_file_and_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(InputError, match=r"^cluster: cluster.yaml is not UTF-8 text \(byte 9 is 0xe9\)"):
        load_cluster(path)
    assert invoke("plan", str(path))[0] == 2


@pytest.mark.parametrize(("name", "text"), [
    ("deep.json", "[" * 50_000 + "]" * 50_000),
    ("deep.json", '{"a": ' + "[" * 65 + "]" * 65 + "}"),
    ("deep.yaml", "a: " + "[" * 50_000 + "]" * 50_000),
    ("deep.yaml", "".join(f"{'  ' * i}k{i}:\n" for i in range(70)) + "  " * 70 + "v: 1\n"),
    ("unclosed.json", "[" * 50_000),
])
def test_deep_nesting_is_refused_before_the_parser_recurses(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match="deeper than 64 levels"):
        read_document(path, field="--config")


def test_yaml_aliases_cannot_expand_into_a_bomb_or_a_cycle() -> None:
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdef", "bcdefg"))
    with pytest.raises(InputError, match="more than 2,000,000 values"):
        parse_file(bomb, name="bomb.yaml", field="--config")
    with pytest.raises(InputError, match="refers to a node that contains it"):
        parse_file("a: &a [*a]", name="cycle.yaml", field="--config")
    deep_by_alias = "a: &x0 [1]\n" + "".join(f"b{i}: &x{i + 1} [*x{i}]\n" for i in range(70))
    with pytest.raises(InputError, match="deeper than 64"):
        parse_file(deep_by_alias, name="alias.yaml", field="--config")


@pytest.mark.parametrize(("name", "text", "field"), [
    ("a.json", '{"pools": [{"nodes": 1e999}]}', "pools[0].nodes"),
    ("a.json", '{"rate": NaN}', "rate"),
    ("a.json", '{"rate": -Infinity}', "rate"),
    ("a.yaml", "models: [{slo: {ttft_ms: .inf}}]", "models[0].slo.ttft_ms"),
    ("a.yaml", "x: [.nan]", "x[0]"),
    ("a.json", '{"n": 1' + "0" * 400 + "}", "n"),
])
def test_non_finite_numbers_are_refused_naming_the_field(name: str, text: str, field: str) -> None:
    with pytest.raises(InputError, match="expected a finite number") as caught:
        parse_file(text, name=name, field="--config")
    assert caught.value.field == field and name in str(caught.value)


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * 2000)
    with pytest.raises(InputError, match="larger than 1,024 bytes"):
        read_document(path, field="--config", limits=ReadLimits(max_bytes=1024))


def test_integers_of_thousands_of_digits_are_a_syntax_error_not_a_value_error() -> None:
    with pytest.raises(InputError, match="more than 4300 digits"):
        parse_file("a: " + "9" * 5000, name="a.yaml", field="f")


def test_nodes_true_is_not_one_node(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({**CLUSTER, "pools": [{"name": "l4", "accelerator": "l4", "nodes": True}]}))
    with pytest.raises(InputError) as caught:
        load_cluster(path)
    assert caught.value.field == "pools[0].nodes"


def test_a_trace_with_infinite_or_non_numeric_cells_names_the_row(tmp_path: Path) -> None:
    csv = tmp_path / "trace.csv"
    csv.write_text("arrival_s,input_tokens,output_tokens\n0,10,10\n1,inf,10\n")
    with pytest.raises(InputError, match="trace.csv row 2: expected finite numbers"):
        load_workload(csv)
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text('{"arrival_s": 0, "input_tokens": 10, "output_tokens": 10}\n'
                     '{"arrival_s": [1], "input_tokens": 10, "output_tokens": 10}\n')
    with pytest.raises(InputError, match="trace.jsonl row 2"):
        load_workload(jsonl)
    wide = tmp_path / "wide.csv"
    wide.write_text("arrival_s,input_tokens,output_tokens\n0,1," + "1" * 200_000 + "\n")
    with pytest.raises(InputError, match="wide.csv is not valid CSV"):
        load_workload(wide)


def test_router_config_urls_are_checked_when_read(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"models": {MODEL: {"endpoints": [
        {"url": "http://127.0.0.1:99999", "accelerator": "l4"}]}}}))
    with pytest.raises(InputError, match="port in 1..65535") as caught:
        load_router_config(path)
    assert caught.value.field == f"models.{MODEL}.endpoints[0].url"


# --- bodies ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "field"), [
    (b'{"model": "m", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "body"),
    (b'{"model": "m", "prompt": "hi", "max_tokens": 1e999}', "max_tokens"),
    (b'{"model": "m", "prompt": "caf\xe9"}', "body"),
    (b'{"model": "m", "prompt": "hi", "temperature": NaN}', "body"),
    (b'{"model": "m", "prompt": ["ok", "a\\ud800"]}', "prompt.1"),
])
def test_openai_bodies_are_bounded_utf8_and_finite(body: bytes, field: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_request(body, ApiKind.COMPLETIONS)
    assert caught.value.field == field


@pytest.mark.parametrize(("kind", "payload", "field", "message"), [
    (ApiKind.COMPLETIONS, {"model": MODEL, "prompt": 5}, "prompt",
     "expected str, list[str], list[int] or list[list[int]], got 5"),
    (ApiKind.CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "expected str or list[ContentPart], got 5"),
    (ApiKind.COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0, "n": 0, "stream": 3, "stream_options": 4},
     "max_tokens", "greater than or equal to 1; n: Input should be greater than or equal to 1; stream: Input should "
                   "be a valid boolean, unable to interpret input (and 1 more)"),
])
def test_a_request_body_error_names_a_unions_field_once_and_lists_the_next_problems(
        kind: ApiKind, payload: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_request(json.dumps(payload).encode(), kind)
    assert caught.value.field == field and message in str(caught.value)


def test_web_bodies_that_crashed_are_4xx(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from hetsched.settings import Settings, StoreSettings, WebSettings
    from hetsched.web import create_app
    from web_support import scaled_capacity

    settings = Settings(store=StoreSettings(database_url=f"sqlite:///{tmp_path / 'web.sqlite'}"),
                        web=WebSettings(solve_timeout_s=30))
    client = TestClient(create_app(settings, capacity_source=scaled_capacity), raise_server_exceptions=False)
    parsed = client.post("/api/specs/parse", json={"text": "[" * 5000 + "]" * 5000, "filename": "c.json"})
    assert parsed.status_code == 422 and parsed.json()["field"] == "text"
    base = client.post("/api/plans", json={"spec": CLUSTER})
    assert base.status_code == 201, base.text
    for changes in ('{"demand": {"qwen3-0.6b": 1e999}}', '{"prices": {"l4": NaN}}'):
        reply = client.post(f"/api/plans/{base.json()['id']}/what-if", content=f'{{"changes": {changes}}}',
                            headers={"content-type": "application/json"})
        assert reply.status_code == 422 and "finite" in reply.json()["detail"], reply.text
    upload = client.put("/api/models/x", content=b'{"model_type": "llama", "hidden_size": 1e999}',
                        headers={"content-type": "application/json"})
    assert upload.status_code == 422 and upload.json()["field"] == "hidden_size"
    assert client.patch("/api/plans").status_code == 405  # no route takes PATCH: not a content-type question
    assert client.post("/api/plans", content=b"x").status_code == 415


# --- options --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "code", "said"), [
    (("estimate", "llama-3.1-8b", "h100-sxm", "--tp", "0"), 2, "at least 1"),
    (("estimate", "llama-3.1-8b", "h100-sxm", "--tp", "7"), 2, "32 attention heads"),
    (("fit", "llama-3.1-8b", "h100-sxm", "--tp", "0"), 2, "at least 1"),
    (("fit", "llama-3.1-8b", "h100-sxm", "--tp", "-2"), 2, "at least 1"),
    (("fit", "llama-3.1-8b", "h100-sxm", "--kv-dtype", "int4"), 2, "bf16, fp16, fp8"),
    (("sim-worker", "--model", MODEL, "--accelerator", "l4", "--tp", "0"), 2, "--tp"),
    (("sim-worker", "--model", MODEL, "--accelerator", "l4", "--time-scale", "nan"), 2, "finite"),
    (("sim-worker", "--model", MODEL, "--accelerator", "l4", "--max-model-len", "0"), 2, "--max-model-len"),
    (("sim-worker", "--model", MODEL, "--accelerator", "l4", "--port", "70000"), 2, "--port"),
    (("sim-worker", "--model", MODEL, "--accelerator", "l4", "--min-step-wall-ms", "inf"), 2, "--min-step-wall-ms"),
    (("sim-worker", "--model", MODEL, "--accelerator", "l4", "--log-level", "shouty"), 2, "debug, trace"),
    (("epp", "--model", MODEL, "--config", "x.yaml", "--log-level", "trace"), 2, "--log-level"),
    (("calibrate", "cpu", "--endpoint", "http://127.0.0.1:9", "--model", MODEL, "--rates", "nan"), 2, "finite"),
    (("calibrations", "--accelerator", "nope"), 3, "unknown accelerator 'nope'"),
    (("fit", MODEL, "h100-sxm", "--context", "100000"), 2, "context window of 40960 tokens"),
    (("estimate", MODEL, "h100-sxm", "--context", "1000000000000000"), 2, "--context"),
    (("estimate", MODEL, "h100-sxm", "--batch", "1000000000000"), 2, "at most 65536"),
    (("models", "show", "x" * 5000), 3, "unknown model"),
])
def test_options_are_validated_by_type(args: tuple[str, ...], code: int, said: str) -> None:
    got, message = invoke(*args)
    assert got == code and said in message, message


def test_a_paired_surrogate_escape_is_text() -> None:
    assert parse_request(b'{"model": "m", "prompt": "\\ud83d\\ude00"}', ApiKind.COMPLETIONS).prompt == "\U0001F600"


def test_route_port_out_of_range_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"models": {MODEL: {"endpoints": []}}}))
    code, message = invoke("route", "-c", str(config), "--port", "70000")
    assert code == 2 and "--port" in message


def test_profile_max_tokens_zero_is_refused(cli_db: str) -> None:
    code, message = invoke("profile", MODEL, "--source", "roofline", "--accelerator", "l4", "--max-tokens", "0")
    assert code == 2 and "--max-tokens" in message
    assert list_profiles(open_store(cli_db)) == []


@pytest.mark.parametrize(("ref", "code"), [("99999999999999999999", 3), ("%%%%%%", 2), ("%%%%", 2), ("abc_ef", 2)])
def test_profile_references_are_ids_or_hex_prefixes(cli_db: str, ref: str, code: int) -> None:
    assert invoke("profiles", "show", ref)[0] == code


def test_export_to_a_folder_and_crds_to_a_file_are_clear_errors(cli_db: str, tmp_path: Path) -> None:
    invoke("profile", MODEL, "--source", "roofline", "--accelerator", "l4")
    code, message = invoke("profiles", "export", "--all", "-f", str(tmp_path))
    assert code == 2 and "--file" in message
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, message = invoke("crds", "--out", str(blocker))
    assert code == 2 and "--out" in message


@pytest.mark.parametrize("env", [{"HETSCHED_WEB_MAX_BODY_BYTES": "nan"}, {"HETSCHED_WEB_SOLVE_TIMEOUT_S": "1e999"},
                                 {"HETSCHED_PRICES": "l4=nan"}])
def test_environment_numbers_are_finite(env: dict[str, str]) -> None:
    from hetsched.settings import Settings

    with pytest.raises(InputError, match="finite") as caught:
        Settings.from_env(env)
    assert caught.value.field == next(iter(env))


def test_an_sqlite_url_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        open_store(f"sqlite:///{tmp_path / 'nowhere' / 'h.sqlite'}")
    assert not (tmp_path / "nowhere").exists()


def test_export_then_import_does_not_duplicate_an_integer_multiplier(tmp_path: Path) -> None:
    from hetsched.catalog import Device, load_catalog
    from hetsched.profiler.roofline_source import roofline_profile
    from hetsched.specs.registry import load_model

    profile = roofline_profile(load_model(MODEL), Device.whole(load_catalog().get("l4")))
    profile = dataclasses.replace(profile, terms=tuple(dataclasses.replace(t, multiplier=28) for t in profile.terms))
    store = open_store(f"sqlite:///{tmp_path / 'p.sqlite'}")
    stored = save_profile(store, profile)
    (again,) = parse_document(json.dumps(export_document([profile])))
    assert isinstance(again.terms[0], Term) and again.terms[0].multiplier == 28
    assert again.digest == profile.digest and save_profiles(store, [again]) == [stored]
    assert len(list_profiles(store)) == 1


def test_autoscale_refuses_more_starting_replicas_than_max_replicas(tmp_path: Path) -> None:
    config = tmp_path / "autoscale.yaml"
    config.write_text(yaml.safe_dump({"cluster": CLUSTER, "max_replicas": {MODEL: 2},
                                      "workers": [{"model": MODEL, "pool": "l4", "device": "l4", "replicas": 100000}]}))
    code, message = invoke("autoscale", "--config", str(config), "--duration", "0")
    assert code == 2 and "max_replicas 2" in message
    config.write_text(yaml.safe_dump({"cluster": CLUSTER,
                                      "workers": [{"model": MODEL, "pool": "l4", "device": "l4", "replicas": 100000}]}))
    code, message = invoke("autoscale", "--config", str(config), "--duration", "0")
    assert code == 2 and "pool l4" in message


def test_off_cluster_kubernetes_discovery_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kubernetes")
    from hetsched.router.discovery import load_kubernetes_config

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    with pytest.raises(BackendUnavailableError, match="use discovery kind 'static'"):
        load_kubernetes_config()
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"discovery": {"kind": "kubernetes"}, "models": {MODEL: {}}}))
    assert invoke("route", "-c", str(config))[0] == 5


# --- errors are text ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["[/x]", "[bold red]boom[/]"])
def test_error_text_is_not_rich_markup(name: str) -> None:
    done = subprocess.run([sys.executable, "-m", "hetsched", "models", "show", name], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "500"})
    assert done.returncode == NotFoundError("model", name).exit_code, done.stderr
    assert f"unknown model {name!r}" in done.stderr


@pytest.mark.parametrize(("model", "said"), [("/dev/zero", "not a regular file"), ("missing/config.json", "no such file"),
                                             ("./nowhere", "no such file"), ("folder", "no such file")])
def test_a_cluster_models_file_that_cannot_be_read_is_an_error_even_beside_a_capacities_table(
        tmp_path: Path, model: str, said: str) -> None:
    (tmp_path / "folder").mkdir()
    cluster = {**CLUSTER, "models": [{**CLUSTER["models"][0], "model": model}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    code, message = invoke("plan", str(path))
    assert code == 2 and "models[0].model" in message and said in message, message
