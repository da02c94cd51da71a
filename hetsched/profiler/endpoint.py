"""Endpoint profiles: an open-loop Poisson load test of a live OpenAI-compatible server (vLLM, SGLang).

Requests arrive at exponentially spaced times whatever the server's pace
(open loop: a slow server builds a queue rather than slowing the arrivals),
at each of several increasing rates. Every request streams; its TTFT is the
time to the first text chunk and its TPOT the mean gap between the following
ones. The profile is one table of step time against tokens per step: a
prompt's TTFT at low load is the time of a prefill step of that many tokens,
and TPOT at an observed concurrency is the time of a decode step of that many
sequences.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from hetsched.errors import BackendUnavailableError, InputError
from hetsched.profiler.profile import (Measurement, OpTable, Profile, ProfileSource, Provenance, Term, Variable,
                                       hetsched_version)


@dataclass(frozen=True)
class LoadTestSettings:
    """Rates (requests/s) tried in order, requests per rate, and the request shapes."""

    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    requests_per_rate: int = 20
    prompt_tokens: tuple[int, ...] = (64, 256, 1024)
    output_tokens: int = 64
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise InputError(f"expected positive rates, got {self.rates}", field="rates")
        if self.requests_per_rate < 1 or self.output_tokens < 2 or not self.prompt_tokens:
            raise InputError("expected requests_per_rate >= 1, output_tokens >= 2 and at least one prompt length",
                             field="load test settings")


@dataclass(frozen=True)
class RequestRecord:
    """One streamed request: when it was sent, when its chunks came, what it asked for."""

    rate: float
    prompt_tokens: int
    sent_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    chunks: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None or self.chunks < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.chunks - 1)


@dataclass(frozen=True)
class RateSummary:
    rate: float
    completed: int
    failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None


@dataclass(frozen=True)
class LoadTestResult:
    records: tuple[RequestRecord, ...]
    server_model: str
    summaries: tuple[RateSummary, ...] = field(default=())


def _prompt(tokens: int, rng: random.Random) -> str:
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
    return " ".join(rng.choice(words) for _ in range(tokens))


async def _one_request(client: httpx.AsyncClient, *, model: str, rate: float, prompt_tokens: int, prompt: str,
                       settings: LoadTestSettings, clock: float) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": settings.output_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    sent = time.perf_counter() - clock
    first = last = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=settings.request_timeout_s) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return RequestRecord(rate, prompt_tokens, sent, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                choices = json.loads(payload).get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter() - clock
                    first = now if first is None else first
                    last = now
                    chunks += 1
    except httpx.HTTPError as exc:
        return RequestRecord(rate, prompt_tokens, sent, first, last, chunks, error=f"{type(exc).__name__}: {exc}")
    except json.JSONDecodeError as exc:
        return RequestRecord(rate, prompt_tokens, sent, first, last, chunks, error=f"malformed stream chunk: {exc}")
    return RequestRecord(rate, prompt_tokens, sent, first, last, chunks)


async def _server_model(client: httpx.AsyncClient, url: str, model: str | None) -> str:
    try:
        response = await client.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise BackendUnavailableError(f"cannot reach the endpoint {url}: {exc or type(exc).__name__}") from exc
    if response.status_code >= 400:
        raise BackendUnavailableError(f"{url}/v1/models answered HTTP {response.status_code}")
    served = [m.get("id", "") for m in response.json().get("data", [])]
    if model is None:
        if not served:
            raise BackendUnavailableError(f"{url} serves no models")
        return served[0]
    if model not in served:
        raise InputError(f"{url} serves {served}, not {model!r}", field="--served-model")
    return model


async def run_load_test(url: str, *, served_model: str | None = None, settings: LoadTestSettings = LoadTestSettings(),
                        on_request: Callable[[RequestRecord], None] | None = None) -> LoadTestResult:
    """Open-loop Poisson load at each rate of ``settings``, one rate after another."""
    rng = random.Random(settings.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits) as client:
        model = await _server_model(client, url, served_model)
        records: list[RequestRecord] = []
        clock = time.perf_counter()
        for rate in settings.rates:
            tasks = []
            start = time.perf_counter() - clock
            arrival = 0.0
            for _ in range(settings.requests_per_rate):
                arrival += rng.expovariate(rate)
                delay = start + arrival - (time.perf_counter() - clock)
                if delay > 0:
                    await asyncio.sleep(delay)
                tokens = rng.choice(settings.prompt_tokens)
                task = asyncio.create_task(_one_request(client, model=model, rate=rate, prompt_tokens=tokens,
                                                        prompt=_prompt(tokens, rng), settings=settings, clock=clock))
                if on_request is not None:
                    task.add_done_callback(lambda t: on_request(t.result()))
                tasks.append(task)
            records.extend(await asyncio.gather(*tasks))
    if not any(r.error is None for r in records):
        first = next((r.error for r in records if r.error), "no requests")
        raise BackendUnavailableError(f"every request to {url} failed; first error: {first}")
    return LoadTestResult(records=tuple(records), server_model=model, summaries=tuple(summarize(records)))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(records: list[RequestRecord] | tuple[RequestRecord, ...]) -> list[RateSummary]:
    """TTFT and TPOT percentiles per rate."""
    out = []
    for rate in dict.fromkeys(r.rate for r in records):
        ok = [r for r in records if r.rate == rate and r.error is None]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
        out.append(RateSummary(rate=rate, completed=len(ok), failed=sum(r.rate == rate for r in records) - len(ok),
                               ttft_p50_s=_percentile(ttft, 0.5), ttft_p99_s=_percentile(ttft, 0.99),
                               tpot_p50_s=_percentile(tpot, 0.5), tpot_p99_s=_percentile(tpot, 0.99)))
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


def endpoint_profile(model: str, url: str, result: LoadTestResult, *, settings: LoadTestSettings,
                     accelerator: str = "endpoint", duration_s: float = 0.0) -> Profile:
    """A Profile from a load test: step time against tokens per step."""
    points = step_points(result)
    if not points:
        raise BackendUnavailableError(f"{url} streamed no tokens; cannot derive step times")
    table = OpTable(op="step", kernel="endpoint", variable=Variable.TOKENS, dims={},
                    points=tuple(Measurement((round(x, 3),), y, y) for x, y in sorted(points)))
    provenance = Provenance.made_here(device={"url": url, "served_model": result.server_model},
                                      versions={"hetsched": hetsched_version(), "httpx": httpx.__version__},
                                      duration_s=round(duration_s, 2))
    return Profile(model=model, accelerator=accelerator, source=ProfileSource.ENDPOINT, backend="endpoint",
                   tables=(table,), terms=(Term("step", "step", 1.0),), provenance=provenance,
                   sweep={**asdict(settings), "rates_summary": [asdict(s) for s in result.summaries],
                          "failed_requests": sum(r.error is not None for r in result.records)})


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
