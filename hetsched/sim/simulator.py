"""Discrete-event simulation of one engine replica around :class:`~hetsched.sim.scheduler.Scheduler`.

Three events, each returning its follow-up events instead of touching the
queue (Vidur's shape): a request *arrives* (and schedules the next arrival);
a *step starts* (the scheduler plans it, the step-latency model says how long it
takes); a *step ends* (the scheduler takes the result back, latencies are
recorded, the next step starts). An idle engine waits for the next arrival.

Runs are deterministic: requests come from a seeded :class:`RequestBatch` and
nothing else is random. With an SLO given, a run stops as soon as more
measured requests have broken a threshold than its percentile allows, because
the answer (it fails) can no longer change.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

from hetsched.perf.step import StepLatencyModel
from hetsched.sim.metrics import RequestTimes, RunResult
from hetsched.sim.scheduler import Request, Scheduler, SchedulerOutput, StepResult
from hetsched.specs.engine import EngineConfig
from hetsched.specs.workload import SLO, RequestBatch


@dataclass(frozen=True)
class ViolationBudget:
    """How many measured requests may still break each SLO threshold before a run fails."""

    late_ttft: int
    late_tpot: int
    failed: int

    @classmethod
    def for_slo(cls, slo: SLO, measured: int, *, with_tpot: int | None = None) -> ViolationBudget:
        """At percentile p, at most ⌊(1 − p/100)·n⌋ requests may be late (nearest-rank percentile), n counting
        the requests that have the metric: a one-token answer has no TPOT (``with_tpot``: those that do; default
        all), so its share of the budget would let the percentile of the others slip past the target."""
        share = 1 - slo.percentile / 100
        late_tpot = math.floor(share * (measured if with_tpot is None else with_tpot) + 1e-9)
        return cls(math.floor(share * measured + 1e-9), late_tpot, math.floor(slo.max_failure_rate * measured + 1e-9))

    def after(self, run: RunResult) -> ViolationBudget:
        return ViolationBudget(self.late_ttft - run.late_ttft, self.late_tpot - run.late_tpot,
                               self.failed - run.failed)

    @property
    def broken(self) -> bool:
        return min(self.late_ttft, self.late_tpot, self.failed) < 0


class _Event(Protocol):
    @property
    def time(self) -> float: ...

    def handle(self, replica: _Replica) -> list[_Event]: ...


@dataclass(frozen=True, slots=True)
class _Arrival:
    time: float
    index: int

    def handle(self, replica: _Replica) -> list[_Event]:
        follow: list[_Event] = []
        replica.arrive(self.index)
        if self.index + 1 < replica.n:
            follow.append(_Arrival(replica.arrival[self.index + 1], self.index + 1))
        if replica.idle:
            replica.idle = False
            follow.append(_StepStart(self.time))
        return follow


@dataclass(frozen=True, slots=True)
class _StepStart:
    time: float

    def handle(self, replica: _Replica) -> list[_Event]:
        output = replica.scheduler.schedule(max_steps=replica.decode_steps_before_next_arrival(self.time))
        replica.on_scheduled(output, self.time)
        if output.is_empty:
            replica.idle = True
            return []
        return [_StepEnd(self.time + replica.duration(output), output)]


@dataclass(frozen=True, slots=True)
class _StepEnd:
    time: float
    output: SchedulerOutput[int]

    def handle(self, replica: _Replica) -> list[_Event]:
        replica.on_result(replica.scheduler.update_from_output(self.output), self.time)
        return [_StepStart(self.time)]


class _Replica:
    """The state events act on: the scheduler, the step model and the latency records."""

    def __init__(self, scheduler: Scheduler[int], step_model: StepLatencyModel, requests: RequestBatch,
                 measure: range, slo: SLO | None, budget: ViolationBudget | None) -> None:
        self.scheduler, self.step_model, self.measure = scheduler, step_model, measure
        self.n = len(requests)
        self.arrival = requests.arrival_s.tolist()
        self.inputs = requests.input_tokens.tolist()
        self.outputs = requests.output_tokens.tolist()
        self.cached = requests.cached_tokens.tolist()
        self.next_arrival = 0
        self.idle = True
        nan = [math.nan] * self.n
        self.scheduled, self.first_token, self.finished = list(nan), list(nan), list(nan)
        self.preemptions = [0] * self.n
        self.rejected = [False] * self.n
        self.decode_dt = 0.0
        self.steps = 0
        self.running_time = 0.0
        self.max_running = 0
        self.min_free_blocks = scheduler.num_blocks
        self.measured_left = len(measure)
        self.window = (self.arrival[measure.start], self.arrival[measure.stop - 1])
        self.completed_in_window = self.tokens_in_window = 0
        with_tpot = sum(1 for i in measure if self.outputs[i] > 1)
        budget = budget or (ViolationBudget.for_slo(slo, len(measure), with_tpot=with_tpot) if slo else None)
        n = len(measure)
        self.allowed_ttft, self.allowed_tpot, self.allowed_failed = \
            (budget.late_ttft, budget.late_tpot, budget.failed) if budget else (n, n, n)
        self.slo = slo
        self.late_ttft = self.late_tpot = self.failed = 0
        self.aborted = False

    @property
    def stopped(self) -> bool:
        return self.aborted or self.measured_left == 0

    def arrive(self, index: int) -> None:
        self.next_arrival = index + 1
        self.scheduler.add_request(Request(index, self.inputs[index], self.outputs[index], self.cached[index]))

    def decode_steps_before_next_arrival(self, now: float) -> int:
        if self.next_arrival >= self.n:
            return 1 << 30
        if self.decode_dt <= 0:
            return 1
        return max(1, int((self.arrival[self.next_arrival] - now) / self.decode_dt))

    def duration(self, output: SchedulerOutput[int]) -> float:
        first = self.step_model.step_time(output.shape)
        if not output.prefills:
            self.decode_dt = first
        seconds = first if output.num_steps == 1 else \
            output.num_steps * (first + self.step_model.step_time(output.last_shape)) / 2
        running = self.scheduler.num_running
        self.running_time += running * seconds
        self.max_running = max(self.max_running, running)
        self.min_free_blocks = min(self.min_free_blocks, self.scheduler.free_blocks)
        self.steps += output.num_steps
        return seconds

    def on_scheduled(self, output: SchedulerOutput[int], now: float) -> None:
        for chunk in output.prefills:
            i = chunk.request.id
            if self.scheduled[i] != self.scheduled[i]:  # NaN: first time it runs
                self.scheduled[i] = now
        for req in output.rejected:
            self.rejected[req.id] = True
            if req.id in self.measure:
                self.measured_left -= 1
                self.failed += 1
                self.aborted |= self.failed > self.allowed_failed

    def on_result(self, result: StepResult[int], now: float) -> None:
        slo = self.slo
        for req in result.first_token:
            i = req.id
            self.first_token[i] = now
            if slo and i in self.measure and (now - self.arrival[i]) * 1e3 > slo.ttft_ms:
                self.late_ttft += 1
                self.aborted |= self.late_ttft > self.allowed_ttft
        in_window = self.window[0] <= now <= self.window[1]
        for req in result.finished:
            i = req.id
            self.finished[i] = now
            if in_window:
                self.completed_in_window += 1
                self.tokens_in_window += req.generated
            self.preemptions[i] = req.preemptions
            if i in self.measure:
                self.measured_left -= 1
                n = self.outputs[i] - 1
                if slo and n > 0 and (now - self.first_token[i]) / n * 1e3 > slo.tpot_ms:
                    self.late_tpot += 1
                    self.aborted |= self.late_tpot > self.allowed_tpot

    def result(self, end: float) -> RunResult:
        import numpy as np  # not with the module: a capacity read from the cache goes without NumPy

        m = slice(self.measure.start, self.measure.stop)
        times = RequestTimes(
            arrival=np.array(self.arrival[m]), scheduled=np.array(self.scheduled[m]),
            first_token=np.array(self.first_token[m]), finished=np.array(self.finished[m]),
            output_tokens=np.array(self.outputs[m]), preemptions=np.array(self.preemptions[m]),
            rejected=np.array(self.rejected[m]))
        elapsed = end - self.arrival[0]
        return RunResult(times=times, window_s=self.window[1] - self.window[0],
                         completed_in_window=self.completed_in_window, output_tokens_in_window=self.tokens_in_window,
                         mean_running=self.running_time / elapsed if elapsed > 0 else 0.0,
                         max_running=self.max_running, steps=self.steps,
                         peak_kv_fraction=1 - self.min_free_blocks / self.scheduler.num_blocks,
                         late_ttft=self.late_ttft, late_tpot=self.late_tpot, failed=self.failed,
                         aborted=self.aborted)


def simulate(step_model: StepLatencyModel, requests: RequestBatch, *, engine: EngineConfig, num_blocks: int,
             max_model_len: int, measure: range | None = None, slo: SLO | None = None,
             budget: ViolationBudget | None = None) -> RunResult:
    """Run ``requests`` through one replica; latencies are kept for the ``measure`` range of requests.

    The run ends when every measured request has finished or been rejected, or,
    with ``slo``, as soon as the violations exceed ``budget`` (default: what the
    SLO allows for this run alone), marked ``aborted``.
    """
    measure = measure if measure is not None else range(len(requests))
    if not len(measure) or measure.start < 0 or measure.stop > len(requests):
        raise ValueError(f"measure range {measure} is not inside the {len(requests)} requests")
    replica = _Replica(Scheduler(engine, num_blocks=num_blocks, max_model_len=max_model_len), step_model,
                       requests, measure, slo, budget)
    queue: list[tuple[float, int, _Event]] = [(replica.arrival[0], 0, _Arrival(replica.arrival[0], 0))]
    seq, now = 1, replica.arrival[0]
    while queue and not replica.stopped:
        now, _, event = heapq.heappop(queue)
        for follow in event.handle(replica):
            heapq.heappush(queue, (follow.time, seq, follow))
            seq += 1
    return replica.result(now)
