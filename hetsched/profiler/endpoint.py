"""Endpoint profiles: an open-loop Poisson load test of a live OpenAI-compatible server (vLLM, SGLang).

Requests arrive at exponentially spaced times whatever the server's pace
(open loop: a slow server builds a queue rather than slowing the arrivals),
at each of several increasing rates. Every request streams; its TTFT is the
time to the first text chunk and its TPOT the mean gap between the following
tokens. The profile is one table of step time against tokens per step: a
prompt's TTFT at low load is the time of a prefill step of that many tokens,
and TPOT at an observed concurrency is the time of a decode step of that many
sequences.

Lengths are the server's tokens, never words: prompts are token ids drawn
from what the server's ``/tokenize`` makes of a short text (random, so no two
share a cached prefix), every request keeps within the ``max_model_len`` that
``/v1/models`` states, and the counts recorded are the response's ``usage``.
Each rate runs in rounds until two successive rounds agree on their medians
(or the rounds run out, which the result says). Failed requests are kept:
the profile lists each one.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from hetsched.errors import BackendUnavailableError, InputError
from hetsched.profiler.twin import ObservedRequest
from hetsched.profiler.profile import (Measurement, OpTable, PointFailure, Profile, ProfileSource, Provenance, Term,
                                       Variable, hetsched_version)

TOKEN_SOURCE_TEXT = ("The quick brown fox jumps over the lazy dog while a server measures how long each step of "
                     "prefill and decode takes under load, counting tokens the way its own tokenizer does.")
"""Tokenized once by the server: its token ids are the alphabet prompts are drawn from."""


@dataclass(frozen=True)
class LoadTestSettings:
    """Rates (requests/s) tried in order, requests per round, the request shapes, and when a rate is done."""

    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    requests_per_rate: int = 20
    """Requests in one round at one rate."""
    prompt_tokens: tuple[int, ...] = (64, 256, 1024)
    output_tokens: int = 64
    request_timeout_s: float = 120.0
    seed: int = 0
    max_rounds: int = 4
    """Rounds at one rate before its medians are reported unstable."""
    stable_within: float = 0.10
    """Two successive rounds whose medians differ by at most this share end a rate."""

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise InputError(f"expected positive rates, got {self.rates}", field="rates")
        if self.requests_per_rate < 1 or self.output_tokens < 2 or not self.prompt_tokens \
                or any(p < 1 for p in self.prompt_tokens):
            raise InputError("expected requests_per_rate >= 1, output_tokens >= 2 and positive prompt lengths",
                             field="load test settings")
        if self.max_rounds < 2 or not 0 < self.stable_within < 1:
            raise InputError("expected max_rounds >= 2 (stability compares two rounds) and 0 < stable_within < 1",
                             field="load test settings")


@dataclass(frozen=True)
class RequestRecord:
    """One streamed request: when it was sent, when its chunks came, its token counts (the server's when known)."""

    rate: float
    prompt_tokens: int
    sent_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    chunks: int = 0
    error: str | None = None
    output_tokens: int | None = None
    """``usage.completion_tokens``; None when the server sent no usage."""
    round: int = 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Per-request TPOT as vLLM defines it: time after the first token over the tokens after it."""
        tokens = self.output_tokens if self.output_tokens is not None else self.chunks
        if self.first_token_s is None or self.last_token_s is None or tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (tokens - 1)


@dataclass(frozen=True)
class RateSummary:
    rate: float
    completed: int
    failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    rounds: int = 1
    stable: bool = False
    """The last two rounds' medians agreed within ``stable_within``."""


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` says about the served model."""

    model: str
    max_model_len: int | None


@dataclass(frozen=True)
class LoadTestResult:
    records: tuple[RequestRecord, ...]
    server_model: str
    summaries: tuple[RateSummary, ...] = field(default=())
    max_model_len: int | None = None
    notes: tuple[str, ...] = ()
    """What the test changed from its settings to stay valid (prompt lengths capped to fit max_model_len)."""


def fitting_lengths(settings: LoadTestSettings, max_model_len: int | None) -> tuple[tuple[int, ...], list[str]]:
    """Prompt lengths capped so prompt + output fits ``max_model_len``, and a note for each one capped."""
    if max_model_len is None:
        return settings.prompt_tokens, ["the server states no max_model_len: prompt lengths are not checked"]
    room = max_model_len - settings.output_tokens
    if room < 1:
        raise InputError(f"{settings.output_tokens} output tokens leave no room for a prompt within max_model_len "
                         f"{max_model_len}", field="output_tokens")
    notes = [f"prompt length {p} capped to {room} tokens: max_model_len {max_model_len} less "
             f"{settings.output_tokens} output tokens" for p in settings.prompt_tokens if p > room]
    return tuple(dict.fromkeys(min(p, room) for p in settings.prompt_tokens)), notes


def round_medians(records: Iterable[RequestRecord]) -> dict[str, float]:
    """The medians a round is judged by: TPOT, and TTFT per prompt length (requests that failed are left out)."""
    ok = [r for r in records if r.error is None]
    series: dict[str, list[float]] = {"tpot": [r.tpot_s for r in ok if r.tpot_s is not None]}
    for r in ok:
        if r.ttft_s is not None:
            series.setdefault(f"ttft@{r.prompt_tokens}", []).append(r.ttft_s)
    return {name: statistics.median(values) for name, values in series.items() if values}


def medians_agree(earlier: dict[str, float], later: dict[str, float], within: float) -> bool:
    """Both rounds measured the same things and each median moved by at most ``within`` of the earlier one."""
    return bool(earlier) and earlier.keys() == later.keys() and all(
        abs(later[k] - earlier[k]) <= within * earlier[k] for k in earlier)


async def _one_request(client: httpx.AsyncClient, *, model: str, rate: float, round_no: int, prompt: list[int],
                       settings: LoadTestSettings, clock: float) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": settings.output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    sent = time.perf_counter() - clock
    first = last = None
    chunks = 0
    usage: dict[str, Any] = {}

    def record(error: str | None = None) -> RequestRecord:
        return RequestRecord(rate, int(usage.get("prompt_tokens", len(prompt))), sent, first, last, chunks,
                             error=error, output_tokens=usage.get("completion_tokens"), round=round_no)

    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=settings.request_timeout_s) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return record(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                payload = json.loads(line[5:])
                if payload.get("error"):
                    return record(f"error mid-stream: {json.dumps(payload['error'])[:200]}")
                usage = payload.get("usage") or usage
                choices = payload.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter() - clock
                    first = now if first is None else first
                    last = now
                    chunks += 1
    except httpx.HTTPError as exc:
        return record(f"{type(exc).__name__}: {exc}")
    except (json.JSONDecodeError, AttributeError) as exc:
        return record(f"malformed stream chunk: {exc}")
    return record()


def _json(response: httpx.Response, url: str, expected: str) -> Any:
    """The body as JSON, or an error naming the URL and the shape that was expected."""
    if response.status_code >= 400:
        raise BackendUnavailableError(f"{url} answered HTTP {response.status_code}; expected {expected}")
    try:
        return response.json()
    except ValueError as exc:
        raise BackendUnavailableError(f"{url} did not answer JSON; expected {expected}") from exc


async def server_info(client: httpx.AsyncClient, url: str, model: str | None) -> ServerInfo:
    """The served model (``model`` when given, checked) and the ``max_model_len`` the server states for it."""
    try:
        response = await client.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise BackendUnavailableError(f"cannot reach the endpoint {url}: {exc or type(exc).__name__}") from exc
    payload = _json(response, f"{url}/v1/models", "an OpenAI model list {data: [{id, max_model_len}]}")
    entries = [m for m in (payload.get("data") if isinstance(payload, dict) else None) or [] if isinstance(m, dict)]
    served = [m.get("id", "") for m in entries]
    if model is None:
        if not served:
            raise BackendUnavailableError(f"{url} serves no models")
        model = served[0]
    elif model not in served:
        raise InputError(f"{url} serves {served}, not {model!r}", field="--served-model")
    length = next(m.get("max_model_len") for m in entries if m.get("id") == model)
    return ServerInfo(model, length if isinstance(length, int) and length > 0 else None)


async def token_alphabet(client: httpx.AsyncClient, url: str, model: str) -> tuple[int, ...]:
    """Distinct token ids of :data:`TOKEN_SOURCE_TEXT` by the server's own tokenizer (``POST /tokenize``)."""
    expected = "vLLM's /tokenize (POST {model, prompt} answering {tokens: [ids]}) to count prompts in its tokens"
    try:
        response = await client.post("/tokenize", json={"model": model, "prompt": TOKEN_SOURCE_TEXT,
                                                        "add_special_tokens": False}, timeout=10.0)
    except httpx.HTTPError as exc:
        raise BackendUnavailableError(f"cannot reach {url}/tokenize: {exc or type(exc).__name__}") from exc
    tokens = _json(response, f"{url}/tokenize", expected)
    tokens = tokens.get("tokens") if isinstance(tokens, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
        raise BackendUnavailableError(f"{url}/tokenize answered no token ids; expected {expected}")
    return tuple(dict.fromkeys(tokens))


async def _round(client: httpx.AsyncClient, *, model: str, rate: float, round_no: int, alphabet: tuple[int, ...],
                 lengths: tuple[int, ...], settings: LoadTestSettings, rng: random.Random, clock: float,
                 on_request: Callable[[RequestRecord], None] | None) -> list[RequestRecord]:
    """``requests_per_rate`` requests at Poisson arrivals of ``rate``; returns when all have finished."""
    tasks = []
    start = time.perf_counter() - clock
    arrival = 0.0
    for _ in range(settings.requests_per_rate):
        arrival += rng.expovariate(rate)
        delay = start + arrival - (time.perf_counter() - clock)
        if delay > 0:
            await asyncio.sleep(delay)
        prompt = rng.choices(alphabet, k=rng.choice(lengths))
        task = asyncio.create_task(_one_request(client, model=model, rate=rate, round_no=round_no, prompt=prompt,
                                                settings=settings, clock=clock))
        if on_request is not None:
            task.add_done_callback(lambda t: on_request(t.result()))
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


async def run_load_test(url: str, *, served_model: str | None = None, settings: LoadTestSettings = LoadTestSettings(),
                        on_request: Callable[[RequestRecord], None] | None = None) -> LoadTestResult:
    """Open-loop Poisson load at each rate of ``settings``, one rate after another, each until stable."""
    rng = random.Random(settings.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits) as client:
        info = await server_info(client, url, served_model)
        lengths, notes = fitting_lengths(settings, info.max_model_len)
        alphabet = await token_alphabet(client, url, info.model)
        records: list[RequestRecord] = []
        clock = time.perf_counter()
        for rate in settings.rates:
            previous: dict[str, float] = {}
            for round_no in range(1, settings.max_rounds + 1):
                batch = await _round(client, model=info.model, rate=rate, round_no=round_no, alphabet=alphabet,
                                     lengths=lengths, settings=settings, rng=rng, clock=clock, on_request=on_request)
                records.extend(batch)
                medians = round_medians(batch)
                if medians_agree(previous, medians, settings.stable_within):
                    break
                previous = medians
    if not any(r.error is None for r in records):
        first = next((r.error for r in records if r.error), "no requests")
        raise BackendUnavailableError(f"every request to {url} failed; first error: {first}")
    return LoadTestResult(records=tuple(records), server_model=info.model,
                          summaries=tuple(summarize(records, within=settings.stable_within)),
                          max_model_len=info.max_model_len, notes=tuple(notes))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(records: list[RequestRecord] | tuple[RequestRecord, ...], *,
              within: float = LoadTestSettings.stable_within) -> list[RateSummary]:
    """TTFT and TPOT percentiles per rate, with its rounds and whether its last two agreed ``within``."""
    out = []
    for rate in dict.fromkeys(r.rate for r in records):
        at_rate = [r for r in records if r.rate == rate]
        ok = [r for r in at_rate if r.error is None]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
        rounds = max(r.round for r in at_rate)
        stable = rounds > 1 and medians_agree(round_medians(r for r in at_rate if r.round == rounds - 1),
                                              round_medians(r for r in at_rate if r.round == rounds), within)
        out.append(RateSummary(rate=rate, completed=len(ok), failed=len(at_rate) - len(ok),
                               ttft_p50_s=_percentile(ttft, 0.5), ttft_p99_s=_percentile(ttft, 0.99),
                               tpot_p50_s=_percentile(tpot, 0.5), tpot_p99_s=_percentile(tpot, 0.99),
                               rounds=rounds, stable=stable))
    return out


def decode_concurrency(record: RequestRecord, records: tuple[RequestRecord, ...] | list[RequestRecord]) -> float:
    """Mean number of sequences decoding alongside ``record`` (itself included) over its decode interval."""
    assert record.first_token_s is not None and record.last_token_s is not None
    start, end = record.first_token_s, record.last_token_s
    span = max(end - start, 1e-9)
    overlap = 0.0
    for other in records:
        if other.first_token_s is None or other.last_token_s is None or other is record:
            continue
        overlap += max(0.0, min(end, other.last_token_s) - max(start, other.first_token_s))
    return 1.0 + overlap / span


def step_points(result: LoadTestResult) -> list[tuple[float, float]]:
    """(tokens in a step, seconds): decode steps from TPOT at observed concurrency, prefill steps from
    TTFT of requests sent at the lowest rate."""
    ok = [r for r in result.records if r.error is None and r.ttft_s is not None]
    points = [(decode_concurrency(r, ok), r.tpot_s) for r in ok if r.tpot_s is not None]
    lowest = min(r.rate for r in result.records)
    by_prompt: dict[int, list[float]] = {}
    for r in ok:
        if r.rate == lowest and r.ttft_s is not None:
            by_prompt.setdefault(r.prompt_tokens, []).append(r.ttft_s)
    points += [(float(tokens), statistics.median(ttfts)) for tokens, ttfts in by_prompt.items()]
    return [(x, y) for x, y in points if y and y > 0]


def observed_requests(result: LoadTestResult) -> list[ObservedRequest]:
    """The load test's streamed requests as the twin's fit reads them."""
    ok = [r for r in result.records if r.error is None and r.ttft_s is not None]
    return [ObservedRequest(rate=r.rate, prompt_tokens=r.prompt_tokens,
                            output_tokens=r.output_tokens if r.output_tokens is not None else r.chunks,
                            ttft_s=r.ttft_s or 0.0, tpot_s=r.tpot_s,
                            decoding_beside=decode_concurrency(r, ok) if r.tpot_s is not None else 1.0)
            for r in ok]


async def engine_pages(url: str, served_model: str | None = None) -> tuple[str, ServerInfo]:
    """The engine's ``/metrics`` text and what ``/v1/models`` says of the served model."""
    async with httpx.AsyncClient(base_url=url.rstrip("/")) as client:
        info = await server_info(client, url, served_model)
        try:
            response = await client.get("/metrics", timeout=30.0)
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(f"cannot reach {url}/metrics: {exc or type(exc).__name__}") from exc
        if response.status_code >= 400:
            raise BackendUnavailableError(f"{url}/metrics answered HTTP {response.status_code}; expected Prometheus "
                                          "text with vLLM's families")
        return response.text, info


def measured_range(result: LoadTestResult) -> dict[str, float]:
    """How far the test reached: most sequences decoding together, longest prompt, longest context.

    A step beyond these is extrapolated (see :func:`hetsched.profiler.compare.extrapolation`).
    """
    ok = [r for r in result.records if r.error is None and r.ttft_s is not None]
    decoding = [decode_concurrency(r, ok) for r in ok if r.tpot_s is not None]
    return {"decode_seqs": round(max(decoding, default=0.0), 2),
            "prefill_tokens": max((r.prompt_tokens for r in ok), default=0),
            "context_tokens": max((r.prompt_tokens + (r.output_tokens or r.chunks) for r in ok), default=0)}


def warnings(result: LoadTestResult) -> list[str]:
    """What a reader of the profile must know: capped lengths, unstable rates, failed requests."""
    out = list(result.notes)
    for s in result.summaries:
        if not s.stable:
            out.append(f"medians at {s.rate:g} req/s not stable after {s.rounds} round(s): compare runs before "
                       "trusting them")
    failed = [r for r in result.records if r.error is not None]
    if failed:
        out.append(f"{len(failed)} of {len(result.records)} requests failed; first: {failed[0].error}")
    return out


def endpoint_profile(model: str, url: str, result: LoadTestResult, *, settings: LoadTestSettings,
                     accelerator: str = "endpoint", duration_s: float = 0.0) -> Profile:
    """A Profile from a load test: step time against tokens per step, with every failed request listed."""
    points = step_points(result)
    if not points:
        raise BackendUnavailableError(f"{url} streamed no tokens; cannot derive step times")
    table = OpTable(op="step", kernel="endpoint", variable=Variable.TOKENS, dims={},
                    points=tuple(Measurement((round(x, 3),), y, y) for x, y in sorted(points)))
    provenance = Provenance.made_here(device={"url": url, "served_model": result.server_model},
                                      versions={"hetsched": hetsched_version(), "httpx": httpx.__version__},
                                      duration_s=round(duration_s, 2))
    failures = tuple(PointFailure("request", {"prompt_tokens": r.prompt_tokens, "round": r.round},
                                  f"at {r.rate:g} req/s: {r.error}") for r in result.records if r.error is not None)
    return Profile(model=model, accelerator=accelerator, source=ProfileSource.ENDPOINT, backend="endpoint",
                   tables=(table,), terms=(Term("step", "step", 1.0),), provenance=provenance, failures=failures,
                   sweep={**asdict(settings), "max_model_len": result.max_model_len,
                          "rates_summary": [asdict(s) for s in result.summaries],
                          "requests": len(result.records), "failed_requests": len(failures),
                          "measured": measured_range(result), "warnings": warnings(result)})


def profile_endpoint(model: str, url: str, *, served_model: str | None = None,
                     settings: LoadTestSettings = LoadTestSettings(), accelerator: str = "endpoint",
                     on_request: Callable[[RequestRecord], None] | None = None) -> Profile:
    """Load-test ``url`` and return its Profile (blocking)."""
    if not url.startswith(("http://", "https://")):
        raise InputError(f"expected an http:// or https:// URL, got {url!r}", field="--url")
    started = time.perf_counter()
    result = asyncio.run(run_load_test(url, served_model=served_model, settings=settings, on_request=on_request))
    return endpoint_profile(model, url, result, settings=settings, accelerator=accelerator,
                            duration_s=time.perf_counter() - started)
