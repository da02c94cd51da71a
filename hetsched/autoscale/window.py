"""Windowed demand and service signals per model, from per-pod scrapes.

:func:`observe` is a reducer: ``history' = observe(history, samples, now)``.
Each good scrape of a pod, compared with the pod's previous good scrape,
becomes an :class:`Increment` spread evenly over the time between the two
(so a pod that was stale for a while and comes back does not look like a
burst). Window sums take each increment's overlap with the window.

A Ready pod whose scrape failed or is older than ``stale_after_s`` is left
out of this round and counted as stale; it never holds up the other pods'
signals, and its last known arrival rate carries on in the windows until it
reports again (then its real increment replaces the estimate). A pod that is
not Ready yet takes no traffic, so its silence is not counted.

The router's refusals come in beside the scrapes: two readings of its
counter become a :class:`Refused` span of demand for that model, spread the
same way. A round without a reading (no router, or it did not answer) keeps
the last one, so the next reading covers the gap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hetsched.autoscale.signals import PodSample, RouterRefusals
from hetsched.engine_metrics.types import EngineMetrics, Histogram
from hetsched.settings.autoscale import AutoscaleSettings
from hetsched.specs.wire import OptionKey
from hetsched.specs.workload import SLO


@dataclass(frozen=True)
class Increment:
    """What one pod did between two good scrapes at ``start`` and ``end``."""

    pod: str
    key: OptionKey
    """The option the pod is a replica of."""
    start: float
    end: float
    arrived: float
    completed: float
    prompt_tokens: float | None
    generation_tokens: float | None
    ttft_s: Histogram | None
    tpot_s: Histogram | None
    input_tokens: Histogram | None
    output_tokens: Histogram | None

    def share_in(self, low: float, high: float) -> float:
        """Share of this increment inside ``[low, high]``."""
        return _share(self.start, self.end, low, high)


@dataclass(frozen=True)
class Refused:
    """Requests the router turned away for one model between two readings at ``start`` and ``end``."""

    start: float
    end: float
    count: float

    def share_in(self, low: float, high: float) -> float:
        """Share of these refusals inside ``[low, high]``."""
        return _share(self.start, self.end, low, high)


def _share(start: float, end: float, low: float, high: float) -> float:
    """Share of the span ``[start, end]`` inside ``[low, high]``; a span of no length is inside or not."""
    span = end - start
    if span <= 0:
        return 1.0 if low <= end <= high else 0.0
    return max(min(end, high) - max(start, low), 0.0) / span


@dataclass(frozen=True)
class History:
    """What the windows need to remember between rounds."""

    started_at: float | None = None
    last: Mapping[str, tuple[float, EngineMetrics]] = field(default_factory=dict)
    """Pod → its last good scrape (time, metrics)."""
    increments: Mapping[str, tuple[Increment, ...]] = field(default_factory=dict)
    """Model → increments still inside the stable window."""
    last_refused: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Model → the router's last reading of its refused requests (time, count)."""
    refused: Mapping[str, tuple[Refused, ...]] = field(default_factory=dict)
    """Model → refusals still inside the stable window."""
    router_queued: Mapping[str, float] = field(default_factory=dict)
    """Model → requests waiting in the router's queue at its last reading."""


@dataclass(frozen=True)
class PodCounts:
    """How many pods of one model reported in this round."""

    fresh: int = 0
    stale: int = 0
    """Pods that reported nothing usable or only old data: excluded, never blocking."""
    not_ready: int = 0
    fresh_by_key: Mapping[OptionKey, int] = field(default_factory=dict)
    stale_by_key: Mapping[OptionKey, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSignals:
    """One model's demand and service as the windows see it now (fresh pods only)."""

    model: str
    stable_rps: float
    panic_rps: float
    requests: float
    """Requests that arrived inside the stable window."""
    mean_input_tokens: float | None
    mean_output_tokens: float | None
    input_tokens: Histogram | None
    output_tokens: Histogram | None
    waiting: int
    running: int
    kv_usage: float | None
    """Mean KV-cache usage of the fresh pods that report it."""
    ttft_s: Histogram | None
    """Time to first token over the SLO window."""
    tpot_s: Histogram | None
    pods: PodCounts
    by_option: Mapping[OptionKey, tuple[Histogram | None, Histogram | None]] = field(default_factory=dict)
    """Option → its replicas' (TTFT, TPOT) over the SLO window: which configs miss when the model misses."""

    @property
    def latency_requests(self) -> float:
        """Requests the latency histograms hold (the SLO window)."""
        return max((h.count for h in (self.ttft_s, self.tpot_s) if h is not None), default=0.0)

    def attainment(self, slo: SLO, *, optimistic: bool = False) -> float | None:
        """Share of requests meeting both latency targets, as 1 − (TTFT misses + TPOT misses); None without data.

        A target inside a histogram bucket is interpolated; ``optimistic``
        counts the whole bucket as meeting it instead, which gives the highest
        attainment the histograms allow (misses beyond it are certain).
        """
        return attainment(self.ttft_s, self.tpot_s, slo, optimistic=optimistic)

    def option_attainment(self, key: OptionKey, slo: SLO, *, min_requests: float,
                          optimistic: bool = False) -> float | None:
        """:meth:`attainment` of one option's replicas; None with fewer than ``min_requests`` in the window."""
        ttft, tpot = self.by_option.get(key, (None, None))
        if max((h.count for h in (ttft, tpot) if h is not None), default=0.0) < min_requests:
            return None
        return attainment(ttft, tpot, slo, optimistic=optimistic)

    def percentile_ms(self, slo: SLO) -> tuple[float | None, float | None]:
        """Observed TTFT and TPOT at the SLO's percentile, in milliseconds."""
        q = slo.percentile / 100

        def at(hist: Histogram | None) -> float | None:
            value = hist.quantile(q) if hist is not None else None
            return value * 1e3 if value is not None else None

        return at(self.ttft_s), at(self.tpot_s)


def attainment(ttft: Histogram | None, tpot: Histogram | None, slo: SLO, *,
               optimistic: bool = False) -> float | None:
    """Share meeting both targets, 1 − (TTFT misses + TPOT misses), from the two histograms; None without data."""
    misses = 0.0
    seen = False
    for hist, target_ms in ((ttft, slo.ttft_ms), (tpot, slo.tpot_ms)):
        if hist is not None and hist.count > 0:
            seen = True
            target = target_ms / 1e3
            if optimistic:
                target = next((le for le in hist.le if le >= target), target)
            misses += 1.0 - hist.at_most(target) / hist.count
    return max(0.0, 1.0 - misses) if seen else None


def observe(history: History, samples: Iterable[PodSample], *, now: float, settings: AutoscaleSettings,
            refusals: RouterRefusals | None = None) -> tuple[History, dict[str, PodCounts]]:
    """Fold one round of scrapes, and the router's refusals when it was read, into the history; returns it with
    per-model pod counts."""
    last = dict(history.last)
    increments = {m: list(v) for m, v in history.increments.items()}
    tallies: dict[str, _Tally] = {}
    seen: set[str] = set()
    for sample in samples:
        seen.add(sample.pod)
        tally = tallies.setdefault(sample.model, _Tally())
        tally.not_ready += not sample.ready
        metrics = sample.metrics
        if metrics is None or metrics.arrived is None or now - sample.scraped_at > settings.stale_after_s:
            if sample.ready:  # a starting pod takes no traffic yet: nothing is missing
                tally.stale[sample.key] += 1
            continue
        tally.fresh[sample.key] += 1
        previous = last.get(sample.pod)
        last[sample.pod] = (sample.scraped_at, metrics)
        if previous is not None and sample.scraped_at > previous[0]:
            increments.setdefault(sample.model, []).append(
                _increment(sample.pod, sample.key, previous, (sample.scraped_at, metrics)))
    last_refused, refused = _fold_refusals(history, refusals)
    horizon = now - settings.stable_window_s
    kept = {m: tuple(i for i in incs if i.end > horizon) for m, incs in increments.items()}
    kept_refused = {m: tuple(r for r in spans if r.end > horizon) for m, spans in refused.items()}
    new = History(started_at=history.started_at if history.started_at is not None else now,
                  last={pod: v for pod, v in last.items() if pod in seen},
                  increments={m: v for m, v in kept.items() if v},
                  last_refused=last_refused, refused={m: v for m, v in kept_refused.items() if v},
                  router_queued=dict(refusals.queued) if refusals is not None else history.router_queued)
    return new, {model: t.counts() for model, t in tallies.items()}


def _fold_refusals(history: History, refusals: RouterRefusals | None
                   ) -> tuple[dict[str, tuple[float, float]], dict[str, list[Refused]]]:
    """The router's last reading per model and the refusal spans, with ``refusals`` folded in."""
    last = dict(history.last_refused)
    spans = {m: list(v) for m, v in history.refused.items()}
    if refusals is None:
        return last, spans
    for model, count in refusals.refused.items():
        previous = last.get(model)
        last[model] = (refusals.read_at, count)
        if previous is not None and refusals.read_at > previous[0]:
            since, before = previous
            added = count - before if count >= before else count  # a counter that went down: the router restarted
            spans.setdefault(model, []).append(Refused(since, refusals.read_at, added))
    return last, spans


@dataclass
class _Tally:
    fresh: defaultdict[OptionKey, int] = field(default_factory=lambda: defaultdict(int))
    stale: defaultdict[OptionKey, int] = field(default_factory=lambda: defaultdict(int))
    not_ready: int = 0

    def counts(self) -> PodCounts:
        return PodCounts(fresh=sum(self.fresh.values()), stale=sum(self.stale.values()), not_ready=self.not_ready,
                         fresh_by_key=dict(self.fresh), stale_by_key=dict(self.stale))


def model_signals(history: History, model: str, samples: Iterable[PodSample], pods: PodCounts, *, now: float,
                  settings: AutoscaleSettings) -> ModelSignals:
    """Windowed rates (the router's refusals among the arrivals), length mix and latency, and current queue and KV
    state of ``model``."""
    incs = history.increments.get(model, ())
    refused = history.refused.get(model, ())
    age = now - history.started_at if history.started_at is not None else 0.0

    observed = min(age, now - min([i.start for i in incs] + [r.start for r in refused], default=now))
    samples = list(samples)
    carried = _carried_rates(history, incs, samples, model, now=now, settings=settings)

    def rate(window: float) -> tuple[float, float]:
        low = now - window
        arrived = sum(i.arrived * i.share_in(low, now) for i in incs)
        arrived += sum(r.count * r.share_in(low, now) for r in refused)
        arrived += sum(r * max(0.0, now - max(last, low)) for last, r in carried)
        span = min(window, observed)
        return (arrived / span if span > 0 else 0.0), arrived

    stable, requests = rate(settings.stable_window_s)
    panic, _ = rate(settings.panic_window_s)
    low = now - settings.stable_window_s
    weights = [(i, i.share_in(low, now)) for i in incs]
    recent = [(i, i.share_in(now - settings.slo_window_s, now)) for i in incs]
    fresh = [s for s in samples if s.model == model and s.metrics is not None
             and s.metrics.arrived is not None and now - s.scraped_at <= settings.stale_after_s]
    usage = [s.metrics.kv_usage for s in fresh if s.metrics and s.metrics.kv_usage is not None]
    return ModelSignals(
        model=model, stable_rps=stable, panic_rps=panic, requests=requests,
        mean_input_tokens=_mean(weights, "prompt_tokens", "arrived", "input_tokens"),
        mean_output_tokens=_mean(weights, "generation_tokens", "completed", "output_tokens"),
        input_tokens=_merged(weights, "input_tokens"), output_tokens=_merged(weights, "output_tokens"),
        waiting=sum(s.metrics.waiting or 0 for s in fresh if s.metrics) + round(history.router_queued.get(model, 0.0)),
        running=sum(s.metrics.running or 0 for s in fresh if s.metrics),
        kv_usage=sum(usage) / len(usage) if usage else None,
        ttft_s=_merged(recent, "ttft_s"), tpot_s=_merged(recent, "tpot_s"), pods=pods,
        by_option={key: (_merged(mine, "ttft_s"), _merged(mine, "tpot_s"))
                   for key in {i.key for i, _ in recent} for mine in [[(i, w) for i, w in recent if i.key == key]]})


def _carried_rates(history: History, incs: tuple[Increment, ...], samples: list[PodSample], model: str, *,
                   now: float, settings: AutoscaleSettings) -> list[tuple[float, float]]:
    """(last good scrape, arrival rate) of each Ready pod that is stale now: its last known rate carries on."""
    out = []
    for sample in samples:
        if sample.model != model or not sample.ready or sample.pod not in history.last:
            continue
        last, _ = history.last[sample.pod]
        if now - last <= settings.stale_after_s and sample.metrics is not None and sample.metrics.arrived is not None:
            continue  # fresh
        low = now - settings.stable_window_s
        own = [i for i in incs if i.pod == sample.pod]
        span = last - max(low, min((i.start for i in own), default=last))
        if span > 0:
            out.append((last, sum(i.arrived * i.share_in(low, last) for i in own) / span))
    return out


def _increment(pod: str, key: OptionKey, before: tuple[float, EngineMetrics],
               after: tuple[float, EngineMetrics]) -> Increment:
    (t0, a), (t1, b) = before, after

    def delta(x: float | None, y: float | None) -> float | None:
        if x is None or y is None:
            return None
        return y - x if y >= x else y  # a counter that went down was reset

    def hist(x: Histogram | None, y: Histogram | None) -> Histogram | None:
        if y is None:
            return None
        return y.minus(x) if x is not None else y

    arrived = b.arrived - a.arrived if b.arrived is not None and a.arrived is not None else 0.0
    if arrived < 0:  # restarted: everything it reports now arrived since
        arrived = b.arrived or 0.0
    return Increment(pod=pod, key=key, start=t0, end=t1, arrived=arrived,
                     completed=delta(a.completed, b.completed) or 0.0,
                     prompt_tokens=delta(a.prompt_tokens, b.prompt_tokens),
                     generation_tokens=delta(a.generation_tokens, b.generation_tokens),
                     ttft_s=hist(a.ttft_s, b.ttft_s), tpot_s=hist(a.tpot_s, b.tpot_s),
                     input_tokens=hist(a.input_tokens, b.input_tokens),
                     output_tokens=hist(a.output_tokens, b.output_tokens))


def _merged(weights: list[tuple[Increment, float]], name: str) -> Histogram | None:
    merged: Histogram | None = None
    for inc, w in weights:
        hist = getattr(inc, name)
        if hist is None or w <= 0:
            continue
        part = hist.scaled(w)
        merged = part if merged is None else merged.plus(part)
    return merged


def _mean(weights: list[tuple[Increment, float]], tokens: str, requests: str, histogram: str) -> float | None:
    """Mean length per request: from the length histogram when exported, else tokens over requests."""
    hist = _merged(weights, histogram)
    if hist is not None and hist.count > 0:
        return hist.total / hist.count
    total = sum((getattr(i, tokens) or 0.0) * w for i, w in weights if getattr(i, tokens) is not None)
    count = sum(getattr(i, requests) * w for i, w in weights if getattr(i, tokens) is not None)
    return total / count if count > 0 else None
