"""SLO capacity of one replica: the largest arrival rate at which the SLO holds.

The search simulates the replica at a rate and asks one question: among the
measured requests, did at most ``(1 − p/100)·n`` miss the TTFT target, at most
as many miss the TPOT target, and at most ``max_failure_rate·n`` fail? Pass/fail
is monotone in the rate (more load never lowers a percentile), so bisection
finds the boundary. It runs in two phases:

1. *coarse*: one seed, :data:`COARSE_MEASURED` requests; bracket the boundary
   (starting from a saturation estimate of the step model) to within
   :data:`COARSE_RATIO`;
2. *fine*: every seed, :data:`MEASURED_PER_SEED` requests each, pooled;
   geometric bisection inside the coarse bracket (widened when the coarse
   answer was off) down to :data:`FINE_RATIO`.

How many requests, and why: a P99 needs enough requests beyond it. With
``n`` pooled measured requests, the count above the true P99 is Binomial(n,
0.01); at n = 2,100 (3 seeds × 700) that is 21 ± 4.6, so the empirical P99
lies between the true P98.6 and P99.4 percentiles 95 % of the time, and
successive searches agree to within the bisection tolerance. Each run also
simulates warm-up requests before the measured ones (the replica starts
empty and must fill to its steady batch; see :func:`search_rate`), and
arrivals keep coming after them until the last measured request finishes.
For one seed, the measured requests are the same at every rate (common
random numbers), so pass/fail changes with the load and not with the draw;
several seeds guard against one lucky draw of long prompts. A run stops as
soon as the pooled violations exceed what the percentile allows: the answer
"fails" can no longer change.

The binding threshold is the one broken at the lowest failing rate; it is
``MEMORY`` when the KV cache was full there and held fewer than
``max_num_seqs`` requests (more memory would have raised the capacity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

from hetsched.catalog.types import Device
from hetsched.errors import InfeasibleError, InputError
from hetsched.perf.in_force import Corrections, NamedCorrection, correction_for, replica_step_model
from hetsched.perf.memory import fit, tp_degrees
from hetsched.perf.step import StepLatencyModel, StepShape
from hetsched.perf.tail import Tail
from hetsched.sim.metrics import LatencyStats, RunResult, RunSummary, summarize
from hetsched.sim.roles import Role, role_query
from hetsched.sim.simulator import ViolationBudget, simulate
from hetsched.sim.step_cache import MemoizedStepModel
from hetsched.specs.dtypes import DType
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import ModelArch
from hetsched.specs.workload import SLO, RequestBatch, Workload, split_buckets

MEASURED_PER_SEED = 700
COARSE_MEASURED = 300
DEFAULT_SEEDS = (0, 1, 2)
COARSE_RATIO = 1.15
FINE_RATIO = 1.04
MIN_RATE = 1e-4
"""Requests per second below which a replica is not worth planning with."""
KV_FULL = 0.95
MIN_WARMUP = 32
LENGTH_SAMPLE = 2000
"""Requests drawn to estimate the workload's length percentiles and means for floors and the search's start."""
TAIL_PER_SEQ = 4
"""Requests drawn after the measured ones, per ``max_num_seqs``; only those arriving before the last
measured request finishes are simulated."""


class Binding(StrEnum):
    """Which limit stops a replica from taking more load."""

    TTFT = "ttft"
    TPOT = "tpot"
    MEMORY = "memory"
    FAILURES = "failures"


@dataclass(frozen=True)
class Replica:
    """What stays fixed while the search varies the rate."""

    model: ModelArch
    device: Device
    tp: int
    engine: EngineConfig
    step_model: StepLatencyModel
    num_blocks: int
    max_model_len: int
    tail: Tail | None = None
    """Step dispersion and a front end (:mod:`hetsched.perf.tail`); None: steps take their mean time and the
    scheduler sees each request as it arrives."""

    @classmethod
    def build(cls, model: ModelArch, device: Device, *, tp: int = 1, workload: Workload,
              engine: EngineConfig = EngineConfig(), step_model: StepLatencyModel | None = None,
              weight_dtype: DType | None = None, kv_dtype: DType | None = None,
              correction: NamedCorrection | None = None, tail: Tail | None = None) -> Replica:
        """Size the KV cache at the workload's longest request; raises InfeasibleError when the model does not fit.

        Steps take ``step_model``'s time (default: the roofline) under ``correction``, spread by ``tail``."""
        context = min(workload.max_request_tokens, model.max_context)
        mem = fit(model, device, tp=tp, engine=engine, context_len=context, weight_dtype=weight_dtype,
                  kv_dtype=kv_dtype)
        if not mem.fits:
            raise InfeasibleError(f"{model.name} does not fit {device.id} at TP={tp}: {mem.reason}")
        base = replica_step_model(model, device, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, engine=engine,
                                  step_model=step_model, correction=correction)
        return cls(model=model, device=device, tp=tp, engine=engine, step_model=MemoizedStepModel(base),
                   num_blocks=mem.max_kv_tokens // engine.block_size, max_model_len=model.max_context, tail=tail)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.engine.block_size


@dataclass(frozen=True)
class Probe:
    """The replica simulated at one rate with some seeds."""

    rate: float
    passed: bool
    summary: RunSummary
    binding: Binding | None
    """What broke, when it failed."""


@dataclass(frozen=True)
class BucketCapacity:
    """Capacity for one request-size bucket alone, or why the replica cannot serve it."""

    label: str
    input_range: tuple[int, int | None]
    output_range: tuple[int, int | None]
    share: float
    capacity: Capacity | None
    reason: str | None = None


@dataclass(frozen=True)
class Capacity:
    """Per-replica SLO capacity and the latencies at that rate."""

    model: str
    device: str
    tp: int
    requests_per_s: float
    max_concurrency: int
    """Most requests running at once at that rate."""
    mean_concurrency: float
    binding: Binding
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    queue_ms: LatencyStats
    failure_rate: float
    output_tokens_per_s: float
    kv_tokens: int
    """KV cache of the replica, in tokens."""
    requests_simulated: int
    """Measured requests (all seeds) behind the latencies at this rate."""
    buckets: tuple[BucketCapacity, ...] = ()

    def dollars_per_million_requests(self, price_per_hour: float) -> float:
        """Cost of a million requests served at this rate by ``tp`` devices at ``price_per_hour`` each."""
        return price_per_hour * self.tp / (self.requests_per_s * 3600) * 1e6

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON form (stored in the capacities table, printed by the CLI)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
            out[k] = _stats_json(out[k])
        out["binding"] = str(self.binding)
        out["buckets"] = [{"label": b.label, "input_range": list(b.input_range), "output_range": list(b.output_range),
                           "share": b.share, "capacity": b.capacity.to_json() if b.capacity else None,
                           "reason": b.reason} for b in self.buckets]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Capacity:
        fields = dict(raw)
        for k in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
            fields[k] = LatencyStats(**raw[k])
        fields["binding"] = Binding(raw["binding"])
        fields["buckets"] = tuple(
            BucketCapacity(label=b["label"], input_range=tuple(b["input_range"]),
                           output_range=tuple(b["output_range"]), share=b["share"],
                           capacity=cls.from_json(b["capacity"]) if b["capacity"] else None, reason=b.get("reason"))
            for b in raw.get("buckets", ()))
        return cls(**fields)


def _stats_json(stats: LatencyStats) -> dict[str, float]:
    return {"p50": stats.p50, "p90": stats.p90, "p99": stats.p99, "at_slo_percentile": stats.at_slo_percentile}


# --- running the replica at one rate -----------------------------------------------

def run_at_rate(replica: Replica, workload: Workload, slo: SLO, rate: float, *,
                seeds: Sequence[int] = DEFAULT_SEEDS, measured_per_seed: int = MEASURED_PER_SEED,
                warmup: int | None = None, stop_early: bool = True) -> Probe:
    """Simulate ``replica`` at ``rate`` req/s for each seed and pool the measured requests.

    ``warmup`` requests (at most, and by default, twice ``max_num_seqs``) arrive
    before the measured ones, and arrivals go on after them until the last
    measured request finishes. For a seed, the measured requests are the same
    at every rate and warm-up (common random numbers), so probes at different
    rates differ only by the load. With ``stop_early`` the runs share one
    violation budget and stop once it is spent (the summary then covers only
    what ran).
    """
    longest = 2 * replica.engine.max_num_seqs
    warmup = longest if warmup is None else min(warmup, longest)
    tail = TAIL_PER_SEQ * replica.engine.max_num_seqs
    measure = range(warmup, warmup + measured_per_seed)
    draws = [workload.sample(longest + measured_per_seed + tail, rate=rate, seed=seed).window(longest - warmup)
             for seed in seeds]
    with_tpot = sum(int((d.output_tokens[measure.start:measure.stop] > 1).sum()) for d in draws)
    allowed = budget = ViolationBudget.for_slo(slo, measured_per_seed * len(seeds), with_tpot=with_tpot)
    runs: list[RunResult] = []
    for seed, requests in zip(seeds, draws):
        run = simulate(replica.step_model, requests, engine=replica.engine, num_blocks=replica.num_blocks,
                       max_model_len=replica.max_model_len, measure=measure,
                       slo=slo if stop_early else None, budget=budget if stop_early else None,
                       tail=replica.tail, seed=seed)
        runs.append(run)
        budget = budget.after(run)
        if stop_early and budget.broken:
            break
    summary = summarize(runs, rate=rate, slo=slo)
    passed = not budget.broken if stop_early else _meets(summary, slo)
    return Probe(rate=rate, passed=passed, summary=summary,
                 binding=None if passed else _binding(replica, runs, allowed))


def _meets(summary: RunSummary, slo: SLO) -> bool:
    return (summary.ttft_ms.at_slo_percentile <= slo.ttft_ms and summary.tpot_ms.at_slo_percentile <= slo.tpot_ms
            and summary.failure_rate <= slo.max_failure_rate)


def _binding(replica: Replica, runs: list[RunResult], allowed: ViolationBudget) -> Binding:
    over = {Binding.TTFT: sum(r.late_ttft for r in runs) / (allowed.late_ttft + 1),
            Binding.TPOT: sum(r.late_tpot for r in runs) / (allowed.late_tpot + 1),
            Binding.FAILURES: sum(r.failed for r in runs) / (allowed.failed + 1)}
    worst = max(over, key=over.__getitem__)
    kv_bound = any(r.peak_kv_fraction >= KV_FULL and r.max_running < replica.engine.max_num_seqs for r in runs)
    return Binding.MEMORY if worst is not Binding.FAILURES and kv_bound else worst


# --- floors: SLOs no rate can meet -------------------------------------------------

def _lengths(workload: Workload) -> RequestBatch:
    """A fixed draw of the workload's request lengths (arrival times unused)."""
    return workload.sample(LENGTH_SAMPLE, rate=1.0, seed=0)


def check_feasible(replica: Replica, workload: Workload, slo: SLO) -> None:
    """Raise InfeasibleError for SLOs the replica misses even alone: too-long requests, TTFT or TPOT floors."""
    import numpy as np  # not with the module: a capacity read from the cache goes without NumPy

    sample = _lengths(workload)
    total = sample.input_tokens + sample.output_tokens
    limit = min(replica.max_model_len, replica.kv_tokens)
    too_long = float(np.mean(total > limit))
    where = f"{replica.model.name} on {replica.device.id} (TP={replica.tp})"
    if too_long > slo.max_failure_rate:
        raise InfeasibleError(
            f"{too_long:.1%} of requests need more than {limit} tokens (model context {replica.max_model_len}, "
            f"KV cache {replica.kv_tokens} tokens) on {where}, above the {slo.max_failure_rate:.1%} failure budget; "
            "use a larger accelerator, more TP, or cap the workload's lengths")
    tpot_floor = batch1_tpot_ms(replica, workload, percentile=slo.percentile)
    if slo.tpot_ms < tpot_floor:
        raise InfeasibleError(
            f"TPOT target {slo.tpot_ms:g} ms is below the batch-1 decode step of {where}: one request alone "
            f"decodes at P{slo.percentile:g} {tpot_floor:.1f} ms per token, so the floor is {tpot_floor:.1f} ms; "
            "relax --slo-tpot or use a faster accelerator or more TP")
    ttft_floor = batch1_ttft_ms(replica, workload, percentile=slo.percentile)
    if slo.ttft_ms < ttft_floor:
        raise InfeasibleError(
            f"TTFT target {slo.ttft_ms:g} ms is below the batch-1 prefill time of {where}: a P{slo.percentile:g} "
            f"prompt alone takes {ttft_floor:.1f} ms to its first token, so the floor is {ttft_floor:.1f} ms; "
            "relax --slo-ttft or use a faster accelerator or more TP")


def batch1_tpot_ms(replica: Replica, workload: Workload, *, percentile: float = 99.0) -> float:
    """Percentile over requests of the TPOT one request gets with the replica to itself."""
    import numpy as np

    sample = workload.sample(500, rate=1.0, seed=0)
    step = replica.step_model.step_time
    tpots = [step(StepShape(decode_seqs=1, decode_kv_tokens=int(i + o // 2)))
             for i, o in zip(sample.input_tokens.tolist(), sample.output_tokens.tolist()) if o > 1]
    return float(np.percentile(tpots, percentile)) * 1e3 if tpots else 0.0


def batch1_ttft_ms(replica: Replica, workload: Workload, *, percentile: float = 99.0) -> float:
    """Time to first token of a percentile-length prompt on an idle replica (chunked by the token budget)."""
    import numpy as np

    sample = _lengths(workload)
    uncached = sample.input_tokens - sample.cached_tokens
    prompt = int(np.percentile(uncached, percentile))
    cached = int(np.percentile(sample.cached_tokens, percentile))
    budget, seconds, done = replica.engine.max_num_batched_tokens, 0.0, 0
    while done < prompt:
        n = min(budget, prompt - done)
        seconds += replica.step_model.step_time(StepShape.build(prefill=[(n, cached + done)]))
        done += n
    return seconds * 1e3


# --- the search -------------------------------------------------------------------

def saturation_rate(replica: Replica, workload: Workload) -> float:
    """Requests per second a replica serves flat out (largest batch that fits, no SLO): the search's start."""
    sample = _lengths(workload)
    mean_in, mean_out = float(sample.input_tokens.mean()), float(sample.output_tokens.mean())
    context = mean_in + mean_out / 2
    batch = max(1, min(replica.engine.max_num_seqs, int(replica.kv_tokens / (mean_in + mean_out))))
    decode = replica.step_model.step_time(StepShape(decode_seqs=batch, decode_kv_tokens=int(batch * context)))
    chunk = min(replica.engine.max_num_batched_tokens, max(1, int(mean_in)))
    prefill = replica.step_model.step_time(StepShape.build(prefill=[(chunk, 0)])) * mean_in / chunk
    return 1.0 / (mean_out * decode / batch + prefill)


def _geomean(a: float, b: float) -> float:
    return math.sqrt(a * b)


def search_rate(replica: Replica, workload: Workload, slo: SLO, *,
                seeds: Sequence[int] = DEFAULT_SEEDS) -> tuple[Probe, Binding]:
    """The highest passing probe (all seeds) and the binding threshold just above it.

    Warm-up: the running batch settles after about one long (P90) end-to-end
    time, during which roughly twice the mean concurrency arrives (Little's
    law, with P90 ≈ 2 × mean for skewed answer lengths). Until a probe has
    failed, runs use ``2 × max_num_seqs``; after that every probe is below a
    failing rate whose peak running count bounds theirs, so twice that peak (at
    least :data:`MIN_WARMUP`) suffices.
    """
    seen_peak = 0
    failed_once = False

    def probe(rate: float, *, fine: bool) -> Probe:
        nonlocal seen_peak, failed_once
        cap = replica.engine.max_num_seqs
        warmup = min(2 * cap, max(MIN_WARMUP, 2 * seen_peak)) if failed_once else 2 * cap
        result = run_at_rate(replica, workload, slo, rate, seeds=seeds if fine else seeds[:1],
                             measured_per_seed=MEASURED_PER_SEED if fine else COARSE_MEASURED, warmup=warmup)
        seen_peak = max(seen_peak, result.summary.max_running)
        failed_once |= not result.passed
        return result

    # 1. Coarse bracket [lo, hi] around the boundary (one seed), from the saturation estimate.
    hi = saturation_rate(replica, workload)
    top = probe(hi, fine=False)
    for _ in range(6):
        if not top.passed:
            break
        hi *= 2
        top = probe(hi, fine=False)
    failing: Probe | None = None if top.passed else top
    lo = hi / 2
    while not (low := probe(lo, fine=False)).passed and not (low := probe(lo, fine=True)).passed:
        failing, hi, lo = low, lo, lo / 4  # confirmed with every seed before going this far down
        if lo < MIN_RATE:
            raise _infeasible_at(replica, slo, low)
    while hi / lo > COARSE_RATIO and failing is not None:
        mid = _geomean(lo, hi)
        coarse = probe(mid, fine=False)
        if coarse.passed:
            lo = mid
        else:
            failing, hi = coarse, mid

    # 2. Fine bisection with every seed; the coarse lower end is only checked when
    #    every fine probe above it fails, and lowered while it fails too.
    best: Probe | None = None
    while best is None or (failing is not None and hi / lo > FINE_RATIO):
        rate = _geomean(lo, hi) if failing is not None and hi / lo > FINE_RATIO else lo
        fine = probe(rate, fine=True)
        if fine.passed:
            best, lo = fine, rate
        elif rate == lo:
            failing, hi, lo = fine, lo, lo / COARSE_RATIO
            if lo < MIN_RATE:
                raise _infeasible_at(replica, slo, fine)
        else:
            failing, hi = fine, rate
    binding = failing.binding if failing is not None and failing.binding is not None else Binding.TTFT
    return best, binding


def _infeasible_at(replica: Replica, slo: SLO, probe: Probe) -> InfeasibleError:
    s = probe.summary
    return InfeasibleError(
        f"{replica.model.name} on {replica.device.id} (TP={replica.tp}) misses the SLO even at {probe.rate:.2g} req/s: "
        f"P{slo.percentile:g} TTFT {s.ttft_ms.at_slo_percentile:.0f} ms (target {slo.ttft_ms:g}), "
        f"TPOT {s.tpot_ms.at_slo_percentile:.1f} ms (target {slo.tpot_ms:g}), failures {s.failure_rate:.1%}")


def find_capacity(model: ModelArch, device: Device, *, tp: int = 1, workload: Workload, slo: SLO,
                  engine: EngineConfig = EngineConfig(), step_model: StepLatencyModel | None = None,
                  weight_dtype: DType | None = None, kv_dtype: DType | None = None,
                  seeds: Sequence[int] = DEFAULT_SEEDS, input_edges: Sequence[int] = (),
                  output_edges: Sequence[int] = (), correction: NamedCorrection | None = None,
                  tail: Tail | None = None) -> Capacity:
    """Largest request rate one replica serves within ``slo`` (see the module docstring).

    ``step_model`` defaults to the roofline; a measured profile plugs in through
    the same :class:`StepLatencyModel` interface; ``correction`` applies over it, ``tail`` (default: the
    correction's) spreads its steps and puts a front end before it. With bucket edges, each (input, output) length bucket gets its own capacity in
    ``buckets``. Raises InfeasibleError when no rate meets the SLO, saying which floor it is below.
    """
    if tail is None and correction is not None:
        tail = correction.tail
    replica = Replica.build(model, device, tp=tp, workload=workload, engine=engine, step_model=step_model,
                            weight_dtype=weight_dtype, kv_dtype=kv_dtype, correction=correction, tail=tail)
    capacity = _capacity(replica, workload, slo, seeds)
    if not input_edges and not output_edges:
        return capacity
    return replace(capacity, buckets=_bucket_capacities(replica, workload, slo, seeds, input_edges, output_edges))


def bucket_capacities(model: ModelArch, device: Device, *, tp: int = 1, workload: Workload, slo: SLO,
                      input_edges: Sequence[int], output_edges: Sequence[int] = (),
                      engine: EngineConfig = EngineConfig(), step_model: StepLatencyModel | None = None,
                      weight_dtype: DType | None = None, kv_dtype: DType | None = None,
                      seeds: Sequence[int] = DEFAULT_SEEDS,
                      correction: NamedCorrection | None = None) -> tuple[BucketCapacity, ...]:
    """Capacity for each request-size bucket alone, even where the whole workload is infeasible.

    A replica that misses the SLO on long prompts may still serve the short
    ones; such buckets carry a capacity, the others a ``reason``. Raises
    InfeasibleError only when the model does not fit the device at all.
    """
    replica = Replica.build(model, device, tp=tp, workload=workload, engine=engine, step_model=step_model,
                            weight_dtype=weight_dtype, kv_dtype=kv_dtype, correction=correction)
    return _bucket_capacities(replica, workload, slo, seeds, input_edges, output_edges)


def _bucket_capacities(replica: Replica, workload: Workload, slo: SLO, seeds: Sequence[int],
                       input_edges: Sequence[int], output_edges: Sequence[int]) -> tuple[BucketCapacity, ...]:
    buckets = []
    for bucket in split_buckets(workload, list(input_edges), list(output_edges)):
        cap, reason = None, None
        try:
            cap = _capacity(replica, bucket.workload, slo, seeds)
        except InfeasibleError as exc:
            reason = str(exc)
        buckets.append(BucketCapacity(label=bucket.label, input_range=bucket.input_range,
                                      output_range=bucket.output_range, share=bucket.share, capacity=cap,
                                      reason=reason))
    return tuple(buckets)


def _capacity(replica: Replica, workload: Workload, slo: SLO, seeds: Sequence[int]) -> Capacity:
    if not seeds:
        raise InputError("expected at least one seed", field="seeds")
    check_feasible(replica, workload, slo)
    best, binding = search_rate(replica, workload, slo, seeds=seeds)
    s = best.summary
    return Capacity(model=replica.model.name, device=replica.device.id, tp=replica.tp,
                    requests_per_s=best.rate, max_concurrency=s.max_running, mean_concurrency=s.mean_running,
                    binding=binding, ttft_ms=s.ttft_ms, tpot_ms=s.tpot_ms, e2e_ms=s.e2e_ms, queue_ms=s.queue_ms,
                    failure_rate=s.failure_rate, output_tokens_per_s=s.output_tokens_per_s,
                    kv_tokens=replica.kv_tokens, requests_simulated=s.requests)


@dataclass(frozen=True)
class DeviceCapacity:
    """One row of a capacity table: the smallest TP that meets the SLO on a device, or why none does."""

    device: str
    tp: int | None
    capacity: Capacity | None
    reason: str | None
    correction: NamedCorrection | None = None
    """The step-model correction ``capacity`` was searched under."""


class CapacityFinder(Protocol):
    """:func:`find_capacity`'s signature as far as its callers use it (a store-cached search fits too)."""

    def __call__(self, model: ModelArch, device: Device, *, tp: int, workload: Workload, slo: SLO,
                 engine: EngineConfig, weight_dtype: DType | None = None,
                 correction: NamedCorrection | None = None) -> Capacity: ...


def device_capacity(model: ModelArch, device: Device, *, workload: Workload, slo: SLO,
                    engine: EngineConfig = EngineConfig(), tp: int | None = None,
                    find: CapacityFinder = find_capacity, role: Role = Role.UNIFIED,
                    corrections: Corrections | None = None) -> DeviceCapacity:
    """Capacity at ``tp``, or at the smallest TP degree where the model fits and the SLO can be met.

    ``role`` asks for one phase of disaggregated serving (:mod:`hetsched.sim.roles`). Each TP degree is searched
    under the correction in force for it among ``corrections`` (:func:`~hetsched.perf.in_force.correction_for`).
    """
    try:
        asked = role_query(role, model=model, device=device, workload=workload, slo=slo)
    except InfeasibleError as exc:
        return DeviceCapacity(device=device.id, tp=None, capacity=None, reason=str(exc))
    workload, slo = asked.workload, asked.slo
    reason = f"no TP degree splits {model.name}'s {model.num_heads} heads on {device.id}"
    for degree in [tp] if tp else tp_degrees(model, device):
        correction = correction_for(corrections, model, device, degree) if corrections else None
        try:
            cap = find(model, device, tp=degree, workload=workload, slo=slo, engine=engine, correction=correction)
        except InfeasibleError as exc:
            reason = str(exc)
            continue
        return DeviceCapacity(device=device.id, tp=degree, capacity=cap, reason=None, correction=correction)
    return DeviceCapacity(device=device.id, tp=None, capacity=None, reason=reason)
