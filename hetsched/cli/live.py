"""``hetsched calibrate --live``: learn the step model's correction from a running fleet's own metrics.

The engines' ``/metrics`` are read every ``--interval`` seconds for ``--window`` seconds (or, from a Prometheus
server, the same series at instants spread over the past ``--window``); each pair of readings of one engine is a
window of observations (:mod:`hetsched.router.learning`) for the online estimator. The estimate is shown with its
provenance and stored; a trusted one is then used by estimate, capacity, plan and the web planner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from hetsched.catalog import Device
from hetsched.cli.output import OutputFormat, console, console_err, print_json, print_table
from hetsched.engine_metrics.parse import ENGINE_SERIES_QUERY, parse_metrics_text, parse_prometheus_vector
from hetsched.engine_metrics.types import EngineMetrics
from hetsched.errors import InputError
from hetsched.perf.correction import StepCorrection
from hetsched.perf.online import CorrectionKey, Estimate, OnlineEstimator
from hetsched.perf.tail import Tail
from hetsched.router.learning import WINDOW_SETTINGS, WindowLearner
from hetsched.router.predict import EndpointProfile
from hetsched.store import Store

log = logging.getLogger(__name__)

Reading = tuple[str, EngineMetrics | None]
"""One engine's metrics at one instant (None: unread)."""


@dataclass(frozen=True)
class LiveSource:
    """Where the fleet's metrics come from: engine URLs read now, or a Prometheus server's past."""

    urls: tuple[str, ...] = ()
    prometheus: str | None = None
    query: str = ENGINE_SERIES_QUERY
    pod_label: str = "pod"

    def check(self) -> None:
        if bool(self.urls) == bool(self.prometheus):
            raise InputError("name the engines to learn from with --url (one or more), or a Prometheus server with "
                             "--prometheus, not both", field="--url")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise InputError(f"expected an engine's base URL such as http://10.0.0.7:8000, got {url!r}",
                                 field="--url")


def _engine_readings(client: httpx.Client, urls: Sequence[str], *, timeout_s: float) -> list[Reading]:
    readings: list[Reading] = []
    for url in urls:
        try:
            response = client.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
            response.raise_for_status()
            readings.append((url, parse_metrics_text(response.text)))
        except (httpx.HTTPError, InputError) as exc:
            log.warning("%s/metrics: %s; this reading is skipped", url, exc or type(exc).__name__)
            readings.append((url, None))
    return readings


def readings(source: LiveSource, *, window_s: float, interval_s: float,
             timeout_s: float = 5.0) -> Iterator[tuple[float, list[Reading]]]:
    """(instant, each engine's metrics then) over the window: read live every interval, or from Prometheus at
    instants spread over the past window."""
    steps = max(int(window_s // interval_s), 1)
    with httpx.Client() as client:
        if source.prometheus is None:
            start = time.monotonic()
            for step in range(steps + 1):
                time.sleep(max(0.0, start + step * interval_s - time.monotonic()))
                yield time.monotonic() - start, _engine_readings(client, source.urls, timeout_s=timeout_s)
            return
        end = time.time()
        for step in range(steps + 1):
            at = end - window_s + step * interval_s
            try:
                response = client.get(f"{source.prometheus.rstrip('/')}/api/v1/query",
                                      params={"query": source.query, "time": f"{at:.3f}"}, timeout=timeout_s)
                response.raise_for_status()
                found = parse_prometheus_vector(response.json(), pod_label=source.pod_label)
            except (httpx.HTTPError, ValueError, InputError) as exc:
                log.warning("%s: %s; the instant %.0f is skipped", source.prometheus, exc or type(exc).__name__, at)
                continue
            yield at - (end - window_s), [(pod, metrics) for pod, (_at, metrics) in sorted(found.items())]


def learn(key: CorrectionKey, profile: EndpointProfile, stream: Iterator[tuple[float, list[Reading]]],
          estimator: OnlineEstimator) -> dict[str, str]:
    """Feed every reading to the estimator; returns, per engine, the last reason it taught nothing (warned once)."""
    learner = WindowLearner(estimator)
    reasons: dict[str, str] = {}
    for at, found in stream:
        for source, metrics in found:
            reason = learner.scraped(key, profile, source, metrics, at=at)
            if reason and reasons.get(source) != reason:
                log.warning("%s: %s", source, reason)
            if reason:
                reasons[source] = reason
    return reasons


def show(estimate: Estimate, correction_id: int | None, reasons: dict[str, str], *, output: OutputFormat,
         tail: Tail | None = None) -> None:
    c, sd = estimate.correction, estimate.sd
    if output is OutputFormat.json:
        print_json({"id": correction_id, "key": {"model": estimate.key.model, "accelerator": estimate.key.accelerator,
                                                "tp": estimate.key.tp, "engine": estimate.key.engine,
                                                "attention_backend": estimate.key.attention_backend},
                    "correction": {"prefill_scale": c.prefill_scale, "decode_scale": c.decode_scale,
                                   "step_overhead_s": c.step_overhead_s, "request_overhead_s": c.request_overhead_s},
                    "sd": dict(zip(("prefill_scale", "decode_scale", "step_overhead_s", "request_overhead_s"), sd)),
                    "observations": estimate.observations, "sources": estimate.sources, "trusted": estimate.trusted,
                    "residuals": {"median_abs": estimate.residual_median, "p90_abs": estimate.residual_p90},
                    "outliers": [{"source": o.source, "ratio": o.ratio} for o in estimate.outliers],
                    "skipped": reasons, "note": estimate.note,
                    "tail": tail.to_json() if tail is not None else None})
        return
    print_table(f"Correction of {estimate.key.label}, learned from {estimate.observations} observations of "
                f"{estimate.sources} engine(s)", ["parameter", "value", "± sd"],
                [["prefill scale", f"{c.prefill_scale:.3f}", f"{sd[0]:.3f}"],
                 ["decode scale", f"{c.decode_scale:.3f}", f"{sd[1]:.3f}"],
                 ["step overhead", f"{c.step_overhead_s * 1e3:.3f} ms", f"{sd[2] * 1e3:.3f} ms"],
                 ["request overhead", f"{c.request_overhead_s * 1e3:.3f} ms", f"{sd[3] * 1e3:.3f} ms"]])
    console.print(f"prediction error before each update: median {estimate.residual_median:.1%}, "
                  f"p90 {estimate.residual_p90:.1%}", markup=False)
    if tail is not None and tail.dispersion is not None:
        console.print(f"step dispersion: steps × ({tail.dispersion.describe()}) of their mean, from the engines' "
                      "token gaps", markup=False)
    for outlier in estimate.outliers:
        console_err.print(f"outlier: {outlier.source} runs {outlier.ratio:.2f}x its siblings' times; kept out of "
                          "the estimate", markup=False)
    for source, reason in sorted(reasons.items()):
        console_err.print(f"skipped: {source}: {reason}", markup=False)
    if estimate.trusted:
        where = (f"stored as correction #{correction_id}; estimate, capacity, plan and the web planner use it"
                 if correction_id is not None else "not stored (--no-save)")
        console.print(f"[green]trusted[/]: {where}")
    else:
        why = estimate.note or "too few observations, or they leave it uncertain; let it run longer or under load"
        stored = f"stored as correction #{correction_id}, not used" if correction_id is not None else "not stored"
        console_err.print(f"[yellow]not trusted[/]: {why}; {stored}")


def calibrate_live(store: Store, device: Device, profile: EndpointProfile, key: CorrectionKey, source: LiveSource, *,
                   window_s: float, interval_s: float, save: bool, output: OutputFormat, origin: str) -> None:
    """Learn ``key``'s correction from ``source`` over the window; show it and store it."""
    from hetsched.store.corrections import save_correction

    source.check()
    estimator = OnlineEstimator(WINDOW_SETTINGS)
    ends: dict[str, list[tuple[float, EngineMetrics]]] = {}
    with console_err.status(f"reading {len(source.urls) or 'the'} engine(s)' metrics for {window_s:g} s"
                            if source.prometheus is None else f"querying {source.prometheus}"):
        reasons = learn(key, profile, _ends(readings(source, window_s=window_s, interval_s=interval_s), ends),
                        estimator)
    estimate = estimator.estimate(key)
    tail = None
    if estimate.observations:
        with console_err.status("fitting the step dispersion to the engines' token gaps"):
            tail = live_tail(profile, estimate.correction, ends)
    correction_id = (save_correction(store, estimate, origin=origin, tail=tail)
                     if save and estimate.observations else None)
    show(estimate, correction_id, reasons, output=output, tail=tail)


def _ends(stream: Iterator[tuple[float, list[Reading]]],
          ends: dict[str, list[tuple[float, EngineMetrics]]]) -> Iterator[tuple[float, list[Reading]]]:
    """``stream`` as it is, keeping each engine's first and last reading in ``ends``."""
    for at, found in stream:
        for source, metrics in found:
            if metrics is not None:
                ends[source] = [ends[source][0], (at, metrics)] if source in ends else [(at, metrics)]
        yield at, found


def live_tail(profile: EndpointProfile, correction: StepCorrection,
              ends: dict[str, list[tuple[float, EngineMetrics]]]) -> Tail | None:
    """The step dispersion that makes ``profile``'s step model under ``correction`` show the engines' token gaps
    between their first and last readings (:func:`~hetsched.sim.tail_fit.fit_tail`, each engine a window at its
    own rate and mean sizes); None where no engine's gaps can tell it (too few, or buckets too coarse). The front
    end is not learned here: the engines' metrics hold no client's TTFT."""
    from hetsched.perf.correction import corrected
    from hetsched.perf.tail import GapHistogram
    from hetsched.sim.step_cache import MemoizedStepModel
    from hetsched.sim.tail_fit import TailWindow, fit_tail
    from hetsched.specs.engine import EngineConfig
    from hetsched.specs.workload import LengthDistribution, Workload

    windows = []
    for kept in ends.values():
        if len(kept) < 2:
            continue
        (t0, first), (t1, last) = kept
        if (last.itl_s is None or first.itl_s is None or last.completed is None or first.completed is None
                or last.input_tokens is None or last.output_tokens is None or t1 <= t0):
            continue
        gaps = last.itl_s.minus(first.itl_s)
        prompts = last.input_tokens.minus(first.input_tokens) if first.input_tokens else last.input_tokens
        outputs = last.output_tokens.minus(first.output_tokens) if first.output_tokens else last.output_tokens
        finished = last.completed - first.completed
        if finished <= 0 or prompts.count <= 0 or outputs.count <= 0:
            continue
        workload = Workload(input_len=LengthDistribution.fixed(max(round(prompts.total / prompts.count), 1)),
                            output_len=LengthDistribution.fixed(max(round(outputs.total / outputs.count), 2)))
        windows.append(TailWindow(finished / (t1 - t0), workload, GapHistogram(gaps.le, gaps.counts, gaps.total)))
    if not windows:
        return None
    engine = EngineConfig(max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens)
    fit = fit_tail(MemoizedStepModel(corrected(profile.step_model, correction)), windows, engine=engine,
                   num_blocks=max(profile.kv_capacity_tokens // engine.block_size, 1), max_model_len=8192)
    return Tail(dispersion=fit.tail.dispersion) if fit.tail.dispersion is not None else None
