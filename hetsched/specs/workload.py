"""Workload and SLO: what traffic a replica sees and what it must promise.

A :class:`Workload` is the *shape* of traffic (arrival burstiness, prompt and
output lengths, prefix sharing), not its volume: the capacity search finds the
largest rate a replica holds. ``expected_rate`` only carries the planned demand
for the optimizer. An :class:`SLO` holds a percentile of TTFT and of TPOT and a
failure budget together; a request meets the SLO when it meets all of them.

Workloads load from YAML/JSON (:func:`load_workload`) or from a request trace
in JSONL/CSV with arrival time and lengths (:func:`load_trace`), and split into
(input, output) length buckets (:func:`split_buckets`) so that different
accelerator types may serve different request sizes.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from hetsched.errors import InputError, invalid_input
from hetsched.specs.files import parse_json, read_document, read_text

if TYPE_CHECKING:
    import numpy as np

Z99 = NormalDist().inv_cdf(0.99)
"""Standard-normal 99th percentile, used to fit a lognormal to a P99. SciPy, which fits and samples the
distributions, loads when one is first fitted or sampled, and NumPy when requests are drawn: commands that only
read a workload's fields (a capacity answered from the cache) go without."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ArrivalKind(StrEnum):
    POISSON = "poisson"
    """Exponential inter-arrival times (CV 1)."""
    GAMMA = "gamma"
    """Gamma inter-arrival times with a chosen coefficient of variation (CV > 1 is bursty)."""
    TRACE = "trace"
    """Inter-arrival times of a recorded trace, rescaled to the target rate."""


class LengthKind(StrEnum):
    FIXED = "fixed"
    LOGNORMAL = "lognormal"
    HISTOGRAM = "histogram"
    EMPIRICAL = "empirical"
    """Resample recorded values (a trace's lengths)."""


class ArrivalProcess(_Frozen):
    """How requests arrive; the rate is set by whoever samples."""

    kind: ArrivalKind = ArrivalKind.POISSON
    cv: float = Field(1.0, gt=0, description="coefficient of variation of inter-arrival times (gamma)")

    def gaps(self, rng: np.random.Generator, n: int, *, rate: float) -> np.ndarray:
        """``n`` inter-arrival gaps in seconds at ``rate`` requests per second."""
        if self.kind is ArrivalKind.GAMMA:
            shape = 1.0 / self.cv**2
            return rng.gamma(shape, 1.0 / (shape * rate), n)
        return rng.exponential(1.0 / rate, n)


class LengthDistribution(_Frozen):
    """A token-length distribution, truncated to ``[min_tokens, max_tokens]``.

    ``lognormal`` is given by its median ``p50`` and one or both of ``mean`` and
    ``p99``; with both, σ is the least-squares fit of the two (real traces are
    rarely exactly lognormal). ``histogram`` samples uniformly inside bins
    ``(edges[i], edges[i+1]]`` weighted by ``weights``.
    """

    kind: LengthKind
    value: StrictInt | None = Field(None, ge=1, description="fixed length")
    mean: float | None = Field(None, gt=0)
    p50: float | None = Field(None, gt=0)
    p99: float | None = Field(None, gt=0)
    edges: tuple[StrictInt, ...] = ()
    weights: tuple[float, ...] = ()
    values: tuple[int, ...] = ()
    min_tokens: StrictInt = Field(1, ge=1)
    max_tokens: StrictInt | None = Field(None, ge=1)

    @classmethod
    def fixed(cls, value: int) -> Self:
        return cls(kind=LengthKind.FIXED, value=value)

    @classmethod
    def lognormal(cls, *, p50: float, mean: float | None = None, p99: float | None = None,
                  max_tokens: int | None = None) -> Self:
        return cls(kind=LengthKind.LOGNORMAL, p50=p50, mean=mean, p99=p99, max_tokens=max_tokens)

    @classmethod
    def histogram(cls, edges: list[int], weights: list[float]) -> Self:
        return cls(kind=LengthKind.HISTOGRAM, edges=tuple(edges), weights=tuple(weights))

    @model_validator(mode="after")
    def _check(self) -> Self:
        hi = self.max_tokens
        if hi is not None and hi < self.min_tokens:
            raise ValueError(f"max_tokens {hi} is below min_tokens {self.min_tokens}")
        if self.kind is LengthKind.FIXED and self.value is None:
            raise ValueError("a fixed length needs 'value'")
        if self.kind is LengthKind.LOGNORMAL:
            if self.p50 is None or (self.mean is None and self.p99 is None):
                raise ValueError("a lognormal needs 'p50' and at least one of 'mean' and 'p99'")
            if (self.mean is not None and self.mean < self.p50) or (self.p99 is not None and self.p99 < self.p50):
                raise ValueError("a lognormal needs mean ≥ p50 and p99 ≥ p50 (it is right-skewed)")
        if self.kind is LengthKind.HISTOGRAM:
            e, w = self.edges, self.weights
            if len(e) < 2 or len(w) != len(e) - 1 or any(b <= a for a, b in zip(e, e[1:])) or e[0] < 0:
                raise ValueError("a histogram needs increasing non-negative 'edges' and one weight per bin")
            if any(x < 0 for x in w) or sum(w) <= 0:
                raise ValueError("histogram weights must be non-negative with a positive sum")
        if self.kind is LengthKind.EMPIRICAL and not self.values:
            raise ValueError("an empirical distribution needs 'values'")
        return self

    @property
    def sigma(self) -> float:
        """σ of the underlying normal of a lognormal (0 for a degenerate one)."""
        assert self.p50 is not None, "checked by _check"
        if self.p99 is None:
            assert self.mean is not None, "checked by _check"
            return math.sqrt(2 * math.log(self.mean / self.p50))
        if self.mean is None:
            return math.log(self.p99 / self.p50) / Z99
        from scipy.optimize import minimize_scalar

        lm, lp = math.log(self.mean / self.p50), math.log(self.p99 / self.p50)
        fitted = minimize_scalar(lambda s: (s * s / 2 - lm) ** 2 + (Z99 * s - lp) ** 2, bounds=(0, 10), method="bounded")
        return float(fitted.x)

    @property
    def upper(self) -> int:
        """Largest length this distribution can produce (∞ tails cut at the 99.99th percentile)."""
        if self.kind is LengthKind.FIXED:
            assert self.value is not None, "checked by _check"
            top = self.value
        elif self.kind is LengthKind.HISTOGRAM:
            top = self.edges[-1]
        elif self.kind is LengthKind.EMPIRICAL:
            top = max(self.values)
        else:
            from scipy.special import ndtri

            assert self.p50 is not None, "checked by _check"
            top = math.ceil(self.p50 * math.exp(self.sigma * float(ndtri(0.9999))))
        return min(top, self.max_tokens) if self.max_tokens else top

    def truncated(self, low: int, high: int | None) -> LengthDistribution:
        """This distribution conditioned on ``low ≤ length ≤ high``."""
        lo = max(low, self.min_tokens)
        hi = min(x for x in (high, self.max_tokens) if x is not None) if (high or self.max_tokens) else None
        return self.model_copy(update={"min_tokens": lo, "max_tokens": hi})

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths as an int64 array."""
        import numpy as np

        lo, hi = self.min_tokens, self.max_tokens
        if self.kind is LengthKind.FIXED:
            assert self.value is not None, "checked by _check"
            return np.full(n, min(max(self.value, lo), hi or self.value), dtype=np.int64)
        if self.kind is LengthKind.LOGNORMAL:
            from scipy.special import ndtr, ndtri

            assert self.p50 is not None, "checked by _check"
            mu, sigma = math.log(self.p50), self.sigma
            if sigma == 0:
                return np.full(n, int(round(self.p50)), dtype=np.int64)

            # inverse-CDF sampling inside the truncation keeps the shape exact
            def cdf(x: float) -> float:
                return float(ndtr((math.log(x) - mu) / sigma))

            a, b = cdf(lo - 0.5) if lo > 1 else 0.0, cdf(hi + 0.5) if hi else 1.0
            u = rng.uniform(a, b, n)
            out: np.ndarray = np.exp(mu + sigma * ndtri(np.clip(u, 1e-12, 1 - 1e-12)))
        elif self.kind is LengthKind.HISTOGRAM:
            edges = np.asarray(self.edges, dtype=float)
            w = np.asarray(self.weights, dtype=float)
            bins = rng.choice(len(w), size=n, p=w / w.sum())
            out = edges[bins] + 1 + rng.uniform(0, 1, n) * (edges[bins + 1] - edges[bins] - 1)
        else:
            values = np.asarray(self.values, dtype=np.int64)
            values = values[(values >= lo) & ((values <= hi) if hi else True)]
            if not len(values):
                raise InputError(f"no recorded length within [{lo}, {hi}]", field="values")
            chosen: np.ndarray = rng.choice(values, size=n)
            return chosen
        lengths: np.ndarray = np.clip(np.rint(out), lo, hi or None).astype(np.int64)
        return lengths


class TraceRequest(_Frozen):
    """One recorded request: arrival time (seconds from any origin) and token counts."""

    arrival_s: float = Field(ge=0)
    input_tokens: StrictInt = Field(ge=1)
    output_tokens: StrictInt = Field(ge=1)


@dataclass(frozen=True)
class RequestBatch:
    """Sampled requests of one simulation run, as parallel arrays."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    """Leading prompt tokens that hit the prefix cache."""

    def __len__(self) -> int:
        return len(self.arrival_s)

    def window(self, start: int, stop: int | None = None) -> RequestBatch:
        """Requests ``start`` to ``stop`` (the same requests at any rate: lengths do not depend on it)."""
        part = slice(start, stop)
        return RequestBatch(arrival_s=self.arrival_s[part], input_tokens=self.input_tokens[part],
                            output_tokens=self.output_tokens[part], cached_tokens=self.cached_tokens[part])


class Workload(_Frozen):
    """The shape of one model's traffic (its volume is not part of it)."""

    name: str = "workload"
    arrival: ArrivalProcess = ArrivalProcess()
    input_len: LengthDistribution
    output_len: LengthDistribution
    prefix_sharing: float = Field(0.0, ge=0, le=1, description="share of each prompt served from the prefix cache")
    expected_rate: float | None = Field(None, gt=0, description="planned demand in requests per second")
    trace: tuple[TraceRequest, ...] = ()
    """Recorded requests; when set, arrivals and (input, output) pairs come from it."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.arrival.kind is ArrivalKind.TRACE and len(self.trace) < 2:
            raise ValueError("trace arrivals need a trace of at least two requests")
        return self

    @classmethod
    def chat(cls) -> Workload:
        """A typical chat workload: prompts around 512 tokens, answers around 128, Poisson arrivals."""
        return cls(name="chat",
                   input_len=LengthDistribution.lognormal(p50=512, p99=2048, max_tokens=3072),
                   output_len=LengthDistribution.lognormal(p50=128, p99=512, max_tokens=1024))

    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + output this workload produces (the context a replica must hold)."""
        if self.trace:
            return max(r.input_tokens + r.output_tokens for r in self.trace)
        return self.input_len.upper + self.output_len.upper

    def sample(self, n: int, *, rate: float, seed: int) -> RequestBatch:
        """``n`` requests arriving at ``rate`` per second on average, deterministic for ``seed``."""
        import numpy as np

        if rate <= 0:
            raise InputError(f"expected a positive rate, got {rate}", field="rate")
        rng = np.random.default_rng(seed)
        if self.trace:
            arrival, inp, out = self._from_trace(rng, n, rate=rate)
        else:
            arrival = np.cumsum(self.arrival.gaps(rng, n, rate=rate))
            inp, out = self.input_len.sample(rng, n), self.output_len.sample(rng, n)
        cached = np.floor(inp * self.prefix_sharing).astype(np.int64)
        return RequestBatch(arrival_s=arrival, input_tokens=inp, output_tokens=out, cached_tokens=cached)

    def _from_trace(self, rng: np.random.Generator, n: int, *, rate: float) -> tuple[np.ndarray, ...]:
        import numpy as np

        rows = sorted(self.trace, key=lambda r: r.arrival_s)
        inp = np.array([r.input_tokens for r in rows], dtype=np.int64)
        out = np.array([r.output_tokens for r in rows], dtype=np.int64)
        if self.arrival.kind is ArrivalKind.TRACE:
            t = np.array([r.arrival_s for r in rows])
            gaps = np.diff(t)
            gaps = np.append(gaps, gaps.mean())  # the gap that wraps round to the start
            start = int(rng.integers(len(rows)))  # a random phase so seeds differ
            idx = (start + np.arange(n)) % len(rows)
            scale = (1.0 / rate) / gaps.mean() if gaps.mean() > 0 else 0.0
            arrival = np.cumsum(gaps[idx] * scale) if scale else np.cumsum(np.full(n, 1.0 / rate))
            return arrival, inp[idx], out[idx]
        idx = rng.integers(len(rows), size=n)
        return np.cumsum(self.arrival.gaps(rng, n, rate=rate)), inp[idx], out[idx]


class SLO(_Frozen):
    """Latency targets at a percentile, and a failure budget, held together."""

    ttft_ms: float = Field(gt=0, description="time to first token at the percentile")
    tpot_ms: float = Field(gt=0, description="time per output token after the first, at the percentile")
    percentile: float = Field(99.0, gt=0, lt=100)
    max_failure_rate: float = Field(0.01, ge=0, lt=1, description="share of requests rejected or preempted away")


class WorkloadBucket(_Frozen):
    """Requests of one (input, output) length range, with their share of traffic.

    Ranges are inclusive ``[low, high]``; ``high`` None is unbounded.
    """

    input_range: tuple[int, int | None]
    output_range: tuple[int, int | None]
    share: float = Field(gt=0, le=1)
    workload: Workload

    @property
    def label(self) -> str:
        def r(lo: int, hi: int | None) -> str:
            return f"{lo}-{hi}" if hi is not None else f"{lo}+"
        return f"in {r(*self.input_range)} / out {r(*self.output_range)}"


BUCKET_SAMPLES = 20_000
"""Requests drawn to estimate bucket shares (±0.7 points at a 50 % share, 2σ)."""


def split_buckets(workload: Workload, input_edges: list[int], output_edges: list[int]) -> list[WorkloadBucket]:
    """Split ``workload`` into length buckets with their traffic shares; empty buckets are left out.

    Edges are the inclusive upper bounds of all but the last bucket: input edges
    ``[512, 2048]`` give prompts 1–512, 513–2048 and 2049+.
    """
    import numpy as np

    for field, edges in (("input_edges", input_edges), ("output_edges", output_edges)):
        if any(e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise InputError(f"expected increasing positive token counts, got {list(edges)}", field=field)
    in_ranges = _ranges(input_edges)
    out_ranges = _ranges(output_edges)
    probe = workload.sample(BUCKET_SAMPLES, rate=1.0, seed=0)
    buckets: list[WorkloadBucket] = []
    for ilo, ihi in in_ranges:
        in_mask = (probe.input_tokens >= ilo) & (probe.input_tokens <= (ihi or np.iinfo(np.int64).max))
        for olo, ohi in out_ranges:
            mask = in_mask & (probe.output_tokens >= olo) & (probe.output_tokens <= (ohi or np.iinfo(np.int64).max))
            share = float(mask.mean())
            if share == 0:
                continue
            buckets.append(WorkloadBucket(input_range=(ilo, ihi), output_range=(olo, ohi), share=share,
                                          workload=_restrict(workload, (ilo, ihi), (olo, ohi), share)))
    return buckets


def _ranges(edges: list[int]) -> list[tuple[int, int | None]]:
    lows = [1, *(e + 1 for e in edges)]
    highs: list[int | None] = [*edges, None]
    return list(zip(lows, highs))


def _restrict(workload: Workload, inp: tuple[int, int | None], out: tuple[int, int | None], share: float) -> Workload:
    def inside(r: TraceRequest) -> bool:
        return (inp[0] <= r.input_tokens <= (inp[1] or r.input_tokens)
                and out[0] <= r.output_tokens <= (out[1] or r.output_tokens))

    trace = tuple(r for r in workload.trace if inside(r))
    arrival = workload.arrival
    if workload.trace and len(trace) < 2:
        trace, arrival = (), ArrivalProcess()  # too few rows to keep a trace: fall back to Poisson on its lengths
    return workload.model_copy(update={
        "name": f"{workload.name}[{inp[0]}-{inp[1] or ''}/{out[0]}-{out[1] or ''}]",
        "input_len": workload.input_len.truncated(*inp),
        "output_len": workload.output_len.truncated(*out),
        "expected_rate": workload.expected_rate * share if workload.expected_rate else None,
        "trace": trace,
        "arrival": arrival,
    })


# --- files --------------------------------------------------------------------

def load_workload(path: str | Path) -> Workload:
    """A workload from YAML/JSON, or from a JSONL/CSV request trace (by extension)."""
    p = Path(path)
    if p.suffix.lower() in (".jsonl", ".csv") and p.is_file():
        return load_trace(p)
    return parse_workload(read_document(p, field="workload"), source=p.name)


def parse_workload(raw: Any, *, source: str = "workload") -> Workload:
    """Validate a workload mapping (from a file or an HTTP body)."""
    if not isinstance(raw, dict):
        raise InputError(f"{source}: expected a mapping with input_len and output_len", field="workload")
    try:
        return Workload.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc, source=source) from exc


def load_trace(path: str | Path, *, name: str | None = None) -> Workload:
    """A workload replaying a trace: JSONL objects or CSV rows with ``arrival_s, input_tokens, output_tokens``.

    Column aliases: ``timestamp``/``arrival_time`` for the arrival, ``prompt_tokens``
    and ``completion_tokens`` for the lengths.
    """
    p = Path(path)
    text = read_text(p, field="trace")
    if p.suffix.lower() == ".csv":
        try:
            rows: list[dict[str, Any]] = list(csv.DictReader(text.splitlines()))
        except csv.Error as exc:
            raise InputError(f"{p.name} is not valid CSV: {exc}", field="trace") from exc
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append(parse_json(line, name=f"{p.name} line {n}", field="trace"))
    requests = [_trace_row(row, n, p.name) for n, row in enumerate(rows, 1)]
    if len(requests) < 2:
        raise InputError(f"{p.name} holds {len(requests)} requests; a trace needs at least two", field="trace")
    inp = tuple(r.input_tokens for r in requests)
    out = tuple(r.output_tokens for r in requests)
    return Workload(name=name or p.stem, arrival=ArrivalProcess(kind=ArrivalKind.TRACE),
                    input_len=LengthDistribution(kind=LengthKind.EMPIRICAL, values=inp),
                    output_len=LengthDistribution(kind=LengthKind.EMPIRICAL, values=out),
                    trace=tuple(requests))


_ALIASES = {"arrival_s": ("arrival_s", "timestamp", "arrival_time"),
            "input_tokens": ("input_tokens", "prompt_tokens", "input_len"),
            "output_tokens": ("output_tokens", "completion_tokens", "output_len")}


def _trace_row(row: Any, n: int, source: str) -> TraceRequest:
    if not isinstance(row, dict):
        raise InputError(f"{source} row {n}: expected an object", field="trace")
    values: dict[str, Any] = {}
    for key, aliases in _ALIASES.items():
        found = next((row[a] for a in aliases if a in row and row[a] not in (None, "")), None)
        if found is None:
            raise InputError(f"{source} row {n}: missing {key} (or {', '.join(aliases[1:])})", field="trace")
        values[key] = found
    try:
        return TraceRequest.model_validate({"arrival_s": float(values["arrival_s"]),
                                            "input_tokens": int(float(values["input_tokens"])),
                                            "output_tokens": int(float(values["output_tokens"]))})
    except ValidationError as exc:
        raise invalid_input(exc, source=f"{source} row {n}") from exc
    except (ValueError, TypeError, OverflowError) as exc:  # not a number, or an infinite token count
        raise InputError(f"{source} row {n}: expected finite numbers for arrival_s, input_tokens and output_tokens "
                         f"({exc})", field="trace") from exc
