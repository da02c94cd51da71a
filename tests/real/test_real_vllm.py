"""hetsched's live paths against a real vLLM engine (CPU build, tiny random-weight Qwen3; see tests/real/run.sh).

The router must be invisible: with greedy decoding (or one seed) every answer through it carries the same
content as the engine's own, streamed or not. The autoscaler's scrape must read what a client measures, the
endpoint profiler must count the engine's tokens, and the sim-worker twin must expose the engine's metric
families with the same meaning. The killed-engine test runs last: it kills a relay, not the shared engine.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from real_support import REAL_ENGINE, Engine, Relay, RouterProcess, start_router, wait_for

from hetsched.cli.profile import summary
from hetsched.engine_metrics import parse as scrape
from hetsched.engine_metrics.parse import parse_metrics_text
from hetsched.engine_metrics.types import EngineMetrics
from hetsched.profiler.endpoint import LoadTestSettings, RequestRecord, profile_endpoint
from hetsched.router.signals import CACHE_CONFIG
from hetsched.simworker import WorkerSpec, start_worker_thread

pytestmark = REAL_ENGINE

ARTIFACTS = Path("test-artifacts/real")
"""Where the tests leave what they compared, for people to read."""
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _artifact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def _body(engine: Engine, path: str, **extra: Any) -> dict[str, Any]:
    """A short greedy request (under one 128-token KV block, so no answer comes from another's prefix cache)."""
    prompt: dict[str, Any] = ({"messages": [{"role": "user", "content": "Write a short poem about routers."}]}
                              if path == CHAT else {"prompt": "def fibonacci(n):"})
    return {"model": engine.model, **prompt, "max_tokens": 24, "temperature": 0.0, "seed": 0, **extra}


def _content(payload: dict[str, Any]) -> dict[str, Any]:
    """What a response says, without what differs per response (id, created, fingerprint)."""
    keys = ("index", "text", "delta", "message", "finish_reason", "stop_reason")
    return {"choices": [{k: c.get(k) for k in keys} for c in payload.get("choices", [])],
            "usage": payload.get("usage")}


def _stream(client: httpx.Client, url: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    """Every SSE event's content, in order (``[DONE]`` as a string)."""
    events: list[dict[str, Any] | str] = []
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else _content(json.loads(data)))
    return events


def _joined(events: list[dict[str, Any] | str]) -> dict[str, Any]:
    """A stream's content per choice, joined: a busy engine may send two tokens in one event, so the events
    themselves differ from run to run while the bytes they carry do not."""
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"] if isinstance(event, dict) else ():
            joined = choices.setdefault(choice["index"], {"role": None, "text": "", "finish_reason": None})
            delta = choice["delta"] or {}
            joined["role"] = joined["role"] or delta.get("role")
            joined["text"] += choice["text"] or delta.get("content") or ""
            joined["finish_reason"] = joined["finish_reason"] or choice["finish_reason"]
    usage = [e["usage"] for e in events if isinstance(e, dict) and e["usage"]]
    return {"choices": choices, "usage": usage, "done": events[-1] == "[DONE]"}


def _metrics(url: str) -> EngineMetrics:
    return parse_metrics_text(httpx.get(f"{url}/metrics", timeout=10).text)


def _series(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture(scope="module")
def client() -> httpx.Client:
    return httpx.Client(timeout=120)


# --- the router is invisible ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_non_streamed_answers_match_the_engines(engine: Engine, router: RouterProcess, client: httpx.Client,
                                                path: str) -> None:
    body = _body(engine, path)
    direct = client.post(engine.url + path, json=body)
    routed = client.post(router.url + path, json=body)
    assert direct.status_code == routed.status_code == 200
    assert routed.headers["x-hetsched-endpoint"] == engine.url
    assert _content(routed.json()) == _content(direct.json())
    assert direct.json()["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_answers_carry_the_engines_bytes(engine: Engine, router: RouterProcess,
                                                           client: httpx.Client, path: str,
                                                           include_usage: bool) -> None:
    body = _body(engine, path, stream=True, stream_options={"include_usage": include_usage})
    direct = _joined(_stream(client, engine.url + path, body))
    routed = _joined(_stream(client, router.url + path, body))
    assert routed == direct and direct["done"] and direct["choices"][0]["finish_reason"] == "length"
    if include_usage:
        assert len(direct["usage"]) == 1 and direct["usage"][0]["completion_tokens"] == 24
    else:
        assert not direct["usage"]


def test_n_choices_and_seeded_sampling_match(engine: Engine, router: RouterProcess, client: httpx.Client) -> None:
    body = _body(engine, COMPLETIONS, n=2, temperature=0.8, seed=7)
    direct, routed = client.post(engine.url + COMPLETIONS, json=body), client.post(router.url + COMPLETIONS, json=body)
    assert [c["index"] for c in direct.json()["choices"]] == [0, 1]
    assert _content(routed.json()) == _content(direct.json())
    assert direct.json()["usage"]["completion_tokens"] == 48
    streamed = _body(engine, CHAT, n=2, temperature=0.8, seed=7, stream=True)
    assert _joined(_stream(client, router.url + CHAT, streamed)) == _joined(_stream(client, engine.url + CHAT, streamed))


def test_token_id_prompts_match(engine: Engine, router: RouterProcess, client: httpx.Client) -> None:
    ids = client.post(f"{engine.url}/tokenize", json={"model": engine.model, "prompt": "import os\nimport sys\n",
                                                      "add_special_tokens": False}).json()["tokens"]
    for prompt in (ids, [ids, ids[:3]]):
        body = _body(engine, COMPLETIONS, prompt=prompt)
        direct, routed = client.post(engine.url + COMPLETIONS, json=body), client.post(router.url + COMPLETIONS,
                                                                                        json=body)
        assert routed.status_code == direct.status_code == 200
        assert _content(routed.json()) == _content(direct.json())
    assert direct.json()["usage"]["prompt_tokens"] == len(ids) + 3 and len(direct.json()["choices"]) == 2


@pytest.mark.parametrize("change", [{"max_tokens": 5000}, {"prompt": list(range(5, 2100))}, {"temperature": -1}],
                         ids=["max_tokens-beyond-max_model_len", "prompt-beyond-max_model_len", "bad-temperature"])
def test_the_engines_400s_pass_through_unchanged(engine: Engine, router: RouterProcess, client: httpx.Client,
                                                 change: dict[str, Any]) -> None:
    body = _body(engine, COMPLETIONS, **change)
    direct, routed = client.post(engine.url + COMPLETIONS, json=body), client.post(router.url + COMPLETIONS, json=body)
    assert direct.status_code == 400 and routed.status_code == 400
    assert routed.json() == direct.json() and set(direct.json()["error"]) >= {"message", "type"}


def test_the_router_counts_the_tokens_the_engine_generated(engine: Engine, router: RouterProcess,
                                                           client: httpx.Client) -> None:
    counted = "hetsched_router_generation_tokens_total"
    before = _series(router.url, counted, model=engine.model)
    events = _stream(client, router.url + CHAT, _body(engine, CHAT, stream=True,
                                                      stream_options={"include_usage": True}))
    assert _series(router.url, counted, model=engine.model) - before == 24  # the usage chunk's count
    before += 24
    events = _stream(client, router.url + CHAT, _body(engine, CHAT, stream=True))
    with_content = sum(1 for e in events if isinstance(e, dict) and any(
        (c["delta"] or {}).get("content") for c in e["choices"]))
    # without usage the router can only count chunks that carry text; never the role chunk or the last one
    assert 0 < _series(router.url, counted, model=engine.model) - before == with_content <= 24


def test_a_client_that_goes_away_aborts_the_engines_request(engine: Engine, router: RouterProcess,
                                                            client: httpx.Client) -> None:
    finished = _series(engine.url, "vllm:request_success_total")
    generated = _series(engine.url, "vllm:generation_tokens_total")
    body = _body(engine, COMPLETIONS, max_tokens=1900, ignore_eos=True, stream=True)
    with client.stream("POST", router.url + COMPLETIONS, json=body) as response:
        assert next(response.iter_lines()).startswith("data: ")  # running: its first token came
    # a busy API server answers /metrics late and stale: what must hold is that the request never finished
    wait_for(lambda: _metrics(engine.url).running == 0, timeout=30, what="vllm:num_requests_running back to 0")
    assert _series(engine.url, "vllm:generation_tokens_total") - generated < 1900, "the request ran to its end"
    # vLLM counts an abandoned request under no finish reason (the twin does the same)
    assert _series(engine.url, "vllm:request_success_total") == finished


# --- the autoscaler's scrape against what the client measured -----------------------------------------------


def _timed(client: httpx.Client, engine: Engine, *, output: int) -> tuple[float, float, float]:
    """(TTFT, per-request TPOT, end to end) as the client sees them: first content chunk, the gaps after it
    over the tokens, and the last chunk."""
    body = _body(engine, COMPLETIONS, max_tokens=output, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True})
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with client.stream("POST", engine.url + COMPLETIONS, json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    return first - sent, (last - first) / (tokens - 1), last - sent


def test_the_scrape_reads_per_request_tpot_kv_usage_and_queue(engine: Engine, client: httpx.Client) -> None:
    requests, output = 6, 64
    before = _metrics(engine.url)
    timings = [_timed(client, engine, output=output) for _ in range(requests)]
    after = _metrics(engine.url)
    assert after.running == 0 and after.waiting == 0 and after.kv_usage == 0.0
    assert None not in (before.tpot_s, before.ttft_s, after.tpot_s, after.ttft_s)
    tpot, ttft = after.tpot_s.minus(before.tpot_s), after.ttft_s.minus(before.ttft_s)  # type: ignore[union-attr]
    assert tpot.count == ttft.count == requests, "one TTFT and one TPOT observation per request, not per token"
    # A busy API server hands a client tokens in bursts, so the client's own TPOT is noise; its end-to-end time
    # is not, and the engine's TTFT + (tokens - 1) × per-request TPOT must add up to it.
    engine_e2e = (ttft.total + (output - 1) * tpot.total) / requests
    client_e2e = sum(e for _, _, e in timings) / requests
    _artifact("scrape-vs-client.json").write_text(json.dumps({
        "engine_tpot_mean_s": tpot.total / requests, "engine_tpot_p50_s": tpot.quantile(0.5),
        "client_tpot_mean_s": sum(t for _, t, _ in timings) / requests,
        "engine_ttft_mean_s": ttft.total / requests, "client_ttft_mean_s": sum(t for t, _, _ in timings) / requests,
        "engine_e2e_mean_s": engine_e2e, "client_e2e_mean_s": client_e2e,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3]}, indent=1))
    assert 0.5 <= engine_e2e / client_e2e <= 1.05, \
        f"the scrape's TTFT + {output - 1} × TPOT is {engine_e2e / client_e2e:.2f}× the client's end-to-end time"

    # KV usage and the queue while the engine is busy: run.sh lets 8 sequences run, so a burst of 24 queues
    burst, slots = 24, 8
    seen: list[EngineMetrics] = []
    with ThreadPoolExecutor(burst) as pool:
        answers = [pool.submit(client.post, engine.url + COMPLETIONS, json=_body(
            engine, COMPLETIONS, prompt=[5 + i, *range(100, 1000)], max_tokens=600, ignore_eos=True))
            for i in range(burst)]
        while not all(a.done() for a in answers):
            seen.append(_metrics(engine.url))
        assert all(a.result().status_code == 200 for a in answers)
    assert max(m.running or 0 for m in seen) == slots and max(m.kv_usage or 0 for m in seen) > 0
    assert max(m.waiting or 0 for m in seen) >= 1, f"{burst} requests on {slots} slots never queued"
    assert _metrics(engine.url).kv_usage == 0.0


# --- the endpoint profiler counts the engine's tokens --------------------------------------------------------


def test_endpoint_profile_lengths_are_the_engines_tokens(engine: Engine) -> None:
    settings = LoadTestSettings(rates=(2.0, 8.0), requests_per_rate=6, prompt_tokens=(32, 1024, 4096),
                                output_tokens=16, max_rounds=3, stable_within=0.25)
    prompt_before = _series(engine.url, "vllm:prompt_tokens_total")
    records: list[RequestRecord] = []
    profile = profile_endpoint(str(engine.model_dir / "config.json"), engine.url, settings=settings,
                               accelerator="cpu", on_request=records.append)
    assert not profile.failures and all(r.error is None for r in records)
    room = engine.max_model_len - 16
    assert {r.prompt_tokens for r in records} == {32, 1024, room}
    assert any(f"prompt length 4096 capped to {room}" in w for w in profile.sweep["warnings"])
    assert _series(engine.url, "vllm:prompt_tokens_total") - prompt_before == sum(r.prompt_tokens for r in records)
    assert all(r.output_tokens == 16 for r in records)
    prefill = sorted(p.coords[0] for p in profile.table("step").points if p.coords[0] >= 32)
    assert prefill == [32.0, 1024.0, float(room)]
    assert "decode 128 @ 4k ctx" in summary(profile)["extrapolated"]
    _artifact("endpoint-profile.json").write_text(json.dumps(
        {"rates": profile.sweep["rates_summary"], "measured": profile.sweep["measured"],
         "warnings": profile.sweep["warnings"], "loadavg": Path("/proc/loadavg").read_text().split()[:3]}, indent=1))


# --- the twin against the engine --------------------------------------------------------------------------------

READ_BY_HETSCHED = (*scrape.RUNNING, *scrape.WAITING, *scrape.KV_USAGE, *scrape.COMPLETED, *scrape.PROMPT_TOKENS,
                    *scrape.GENERATION_TOKENS, *scrape.TTFT, *scrape.TPOT, *scrape.ITL, *scrape.INPUT_TOKENS,
                    *scrape.OUTPUT_TOKENS, CACHE_CONFIG)


def _families(text: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """vLLM families by name: (type, label names, bucket bounds)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:") and not family.name.endswith("_created"):
            labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
            bounds = tuple(dict.fromkeys(s.labels["le"] for s in family.samples if s.name.endswith("_bucket")))
            out[family.name] = (family.type, labels, bounds)
    return out


def _observations(text: str) -> Counter[str]:
    """Per family: histogram observations, or the counter's value (one engine, every label set summed)."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_count") or (family.type == "counter" and sample.name.endswith("_total")):
                counts[family.name] += sample.value
            if family.name == "vllm:request_success" and sample.name.endswith("_total"):
                counts[f"{family.name}{{{sample.labels['finished_reason']}}}"] += sample.value
    return counts


def test_the_twin_exposes_the_engines_metric_families_with_their_meaning(engine: Engine,
                                                                         client: httpx.Client) -> None:
    requests, output = 3, 8
    twin = start_worker_thread(WorkerSpec(model=str(engine.model_dir / "config.json"), accelerator="cpu",
                                          max_model_len=engine.max_model_len, served_name=engine.model,
                                          time_scale=20.0))
    try:
        pages, counts = {}, {}
        for name, url in (("engine", engine.url), ("twin", twin.url)):
            before = _observations(client.get(f"{url}/metrics").text)
            for i in range(requests):
                body = _body(engine, COMPLETIONS, prompt=list(range(10 + i, 30 + i)), max_tokens=output,
                             ignore_eos=True)
                assert client.post(url + COMPLETIONS, json=body).status_code == 200
            pages[name] = client.get(f"{url}/metrics").text
            counts[name] = _observations(pages[name]) - before
    finally:
        twin.stop()
    real, sim = _families(pages["engine"]), _families(pages["twin"])
    missing = sorted(set(real) - set(sim))
    _artifact("metric-families.txt").write_text(
        "vLLM families the twin lacks:\n" + "".join(f"  {n} ({real[n][0]})\n" for n in missing)
        + "families whose type, labels or buckets differ:\n"
        + "".join(f"  {n}\n    engine {real[n]}\n    twin   {sim[n]}\n" for n in sorted(set(real) & set(sim))
                  if real[n] != sim[n]))
    read = [n for n in READ_BY_HETSCHED if n in real]
    assert len(read) >= 12, f"the engine lacks families hetsched reads: {sorted(set(READ_BY_HETSCHED) - set(real))}"
    for name in read:
        assert name in sim, f"the twin lacks {name}, which hetsched reads"
        engine_type, engine_labels, engine_bounds = real[name]
        twin_type, twin_labels, twin_bounds = sim[name]
        assert twin_type == engine_type and twin_bounds == engine_bounds, name
        if name == CACHE_CONFIG:  # hetsched reads two of its many labels
            assert {"block_size", "num_gpu_blocks"} <= twin_labels & engine_labels
        else:
            assert twin_labels == engine_labels, name
    # what one observation means: the same requests leave the same counts
    expected = {"vllm:time_to_first_token_seconds": requests, "vllm:request_time_per_output_token_seconds": requests,
                "vllm:inter_token_latency_seconds": requests * (output - 1), "vllm:e2e_request_latency_seconds": requests,
                "vllm:request_prompt_tokens": requests, "vllm:request_generation_tokens": requests,
                "vllm:prompt_tokens": requests * 20, "vllm:generation_tokens": requests * output,
                "vllm:request_success{length}": requests}
    for name, count in expected.items():
        assert (counts["engine"][name], counts["twin"][name]) == (count, count), name


def _shape(events: list[dict[str, Any] | str]) -> list[str]:
    """A chat stream's kinds of event in order, runs of content events as one (a busy engine merges tokens)."""
    kinds: list[str] = []
    for event in events:
        if isinstance(event, str):
            kind = event
        elif not event["choices"]:
            kind = "usage"
        else:
            delta = event["choices"][0]["delta"]
            kind = "role" if delta.get("role") else "content"
            kind += "+finish" if event["choices"][0]["finish_reason"] else ""
        if not (kinds and kind == "content" == kinds[-1]):
            kinds.append(kind)
    return kinds


def test_the_twins_chat_stream_has_the_engines_shape(engine: Engine, client: httpx.Client) -> None:
    twin = start_worker_thread(WorkerSpec(model=str(engine.model_dir / "config.json"), accelerator="cpu",
                                          max_model_len=engine.max_model_len, served_name=engine.model,
                                          time_scale=20.0))
    body = _body(engine, CHAT, stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    try:
        shapes = {url: _shape(_stream(client, url + CHAT, body)) for url in (engine.url, twin.url)}
    finally:
        twin.stop()
    assert shapes[twin.url] == shapes[engine.url] == ["role", "content", "content+finish", "usage", "[DONE]"]


# --- last: the engine dies under the router ------------------------------------------------------------------


def test_a_killed_engine_gives_openai_errors_and_is_ejected(engine: Engine, client: httpx.Client,
                                                           tmp_path: Path) -> None:
    relay = Relay(int(engine.url.rsplit(":", 1)[1])).start()
    dying = start_router(engine, relay.url, tmp_path)
    try:
        assert client.post(dying.url + COMPLETIONS, json=_body(engine, COMPLETIONS)).status_code == 200
        body = _body(engine, COMPLETIONS, max_tokens=1900, ignore_eos=True, stream=True)
        with client.stream("POST", dying.url + COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            relay.kill()
            last = [line for line in lines if line.startswith("data: ")][-1]
        error = json.loads(last[6:])["error"]
        assert {"message", "type"} <= set(error) and relay.url in error["message"]

        refused = client.post(dying.url + COMPLETIONS, json=_body(engine, COMPLETIONS))
        assert refused.status_code in (502, 503)
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}

        def ejected() -> bool:
            (row,) = client.get(f"{dying.url}/router/endpoints").json()["endpoints"]
            return not row["healthy"]

        wait_for(ejected, timeout=10, what=f"the router ejecting {relay.url}")
        assert _series(dying.url, "hetsched_router_ejections_total") >= 1
        after = client.post(dying.url + COMPLETIONS, json=_body(engine, COMPLETIONS))
        assert after.status_code == 503 and after.json()["error"]["code"] == "no_endpoint"
    finally:
        dying.stop()
