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

A :class:`~hetsched.perf.tail.Tail` adds what the step model's means leave out
(named helpers of :class:`_Replica`, nothing when it is not given): each step
takes its modelled time × a factor drawn from the tail's dispersion (from a
generator seeded by ``seed``), and a front end stands before the engine, one
server first come first served: an arriving request is *admitted* to the
scheduler (a fourth event) once the front end has served it, and each step's
tokens reach the client once it has sent them. A request's TTFT and TPOT are
then the client's; the engine's own first token is kept beside them.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from hetsched.perf.step import StepLatencyModel
from hetsched.perf.tail import Dispersion, FrontEndQueue, Tail
from hetsched.sim.metrics import RequestTimes, RunResult, TokenGaps
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
        if replica.front is None:
            replica.arrive(self.index)
        else:
            follow.append(_Admit(replica.through_front_end(self.index, self.time), self.index))
        if self.index + 1 < replica.n:
            follow.append(_Arrival(replica.arrival[self.index + 1], self.index + 1))
        if replica.idle and replica.front is None:
            replica.idle = False
            follow.append(_StepStart(self.time))
        return follow


@dataclass(frozen=True, slots=True)
class _Admit:
    """A request through the front end reaches the scheduler (with a tail's front end only)."""

    time: float
    index: int

    def handle(self, replica: _Replica) -> list[_Event]:
        replica.admit(self.index, self.time)
        if replica.idle:
            replica.idle = False
            return [_StepStart(self.time)]
        return []


@dataclass(frozen=True, slots=True)
class _StepStart:
    time: float

    def handle(self, replica: _Replica) -> list[_Event]:
        output = replica.scheduler.schedule(max_steps=replica.decode_steps_before_next_arrival(self.time))
        replica.on_scheduled(output, self.time)
        if output.is_empty:
            replica.idle = True
            return []
        return [_StepEnd(self.time + replica.duration(output, self.time), output)]


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
                 measure: range, slo: SLO | None, budget: ViolationBudget | None, tail: Tail | None = None,
                 seed: int = 0, token_gaps: bool = False) -> None:
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
        # The tail (module docstring): None where it adds nothing, so a run without one takes today's path.
        dispersion = tail.dispersion if tail else None
        self.dispersion: Dispersion | None = None if dispersion is None or dispersion.identity else dispersion
        self.rng = random.Random(seed)
        self.front = FrontEndQueue(tail.front_end) if tail and tail.front_end else None
        self.admitted = self.arrival if self.front is None else list(nan)
        self.engine_first = self.first_token if self.front is None else list(nan)
        self.pending: deque[float] = deque()
        """Times the requests inside the front end reach the scheduler, in order."""
        self.gaps: list[float] | None = [] if token_gaps else None
        self.gap_weights: list[int] = []

    @property
    def stopped(self) -> bool:
        return self.aborted or self.measured_left == 0

    def arrive(self, index: int) -> None:
        self.next_arrival = index + 1
        self.scheduler.add_request(Request(index, self.inputs[index], self.outputs[index], self.cached[index]))

    def through_front_end(self, index: int, now: float) -> float:
        """A request reaches the front end: when it will reach the scheduler."""
        assert self.front is not None
        self.next_arrival = index + 1
        scheduled = self.front.request(now)
        self.admitted[index] = scheduled - self.front.front_end.latency_s
        self.pending.append(scheduled)
        return scheduled

    def admit(self, index: int, now: float) -> None:
        """A request through the front end reaches the scheduler."""
        self.pending.popleft()
        self.scheduler.add_request(Request(index, self.inputs[index], self.outputs[index], self.cached[index]))

    def decode_steps_before_next_arrival(self, now: float) -> int:
        upcoming = self.pending[0] if self.pending else math.inf
        if self.next_arrival < self.n:
            upcoming = min(upcoming, self.arrival[self.next_arrival])
        if upcoming == math.inf:
            return 1 << 30
        if self.decode_dt <= 0:
            return 1
        return max(1, int((upcoming - now) / self.decode_dt))

    def duration(self, output: SchedulerOutput[int], now: float) -> float:
        first = self.step_model.step_time(output.shape)
        if not output.prefills:
            self.decode_dt = first
        if self.dispersion is None and self.gaps is None:
            seconds = first if output.num_steps == 1 else \
                output.num_steps * (first + self.step_model.step_time(output.last_shape)) / 2
        else:
            seconds = self._drawn(output, first)
        if self.front is not None:
            self._announce(output, now, seconds)
        running = self.scheduler.num_running
        self.running_time += running * seconds
        self.max_running = max(self.max_running, running)
        self.min_free_blocks = min(self.min_free_blocks, self.scheduler.free_blocks)
        self.steps += output.num_steps
        return seconds

    def _drawn(self, output: SchedulerOutput[int], first: float) -> float:
        """The steps' seconds, each its modelled time (linear from the first step's to the last's) × a factor drawn
        from the dispersion; each step's time is a token gap for every sequence decoding in it."""
        steps = output.num_steps
        last = first if steps == 1 else self.step_model.step_time(output.last_shape)
        draw = self.dispersion.quantile if self.dispersion is not None else None
        random_ = self.rng.random
        total = 0.0
        for j in range(steps):
            seconds = first + (last - first) * j / (steps - 1) if steps > 1 else first
            if draw is not None:
                seconds *= draw(random_())
            total += seconds
            if self.gaps is not None and output.num_decodes:
                self.gaps.append(seconds)
                self.gap_weights.append(output.num_decodes)
        return total

    def _announce(self, output: SchedulerOutput[int], now: float, seconds: float) -> None:
        """Tell the front end the tokens these steps will send: every decoding sequence's, in every step, and a
        first (or next) token for each prefill chunk that completes its prompt."""
        assert self.front is not None
        completing = sum(1 for c in output.prefills if c.context_tokens + c.new_tokens >= c.request.num_tokens)
        steps = output.num_steps
        self.front.steps(now + seconds / steps, now + seconds, steps=steps, per_step=output.num_decodes + completing)

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
        engine_now = now
        if self.front is not None:  # the client sees the step's tokens once the front end has sent them
            now = self.front.sent(now)
        slo = self.slo
        for req in result.first_token:
            i = req.id
            self.first_token[i] = now
            self.engine_first[i] = engine_now
            if slo and i in self.measure and (now - self.arrival[i]) * 1e3 > slo.ttft_ms:
                self.late_ttft += 1
                self.aborted |= self.late_ttft > self.allowed_ttft
        in_window = self.window[0] <= engine_now <= self.window[1]
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
            rejected=np.array(self.rejected[m]), admitted=np.array(self.admitted[m]),
            engine_first_token=np.array(self.engine_first[m]))
        elapsed = end - self.arrival[0]
        return RunResult(times=times, window_s=self.window[1] - self.window[0],
                         completed_in_window=self.completed_in_window, output_tokens_in_window=self.tokens_in_window,
                         mean_running=self.running_time / elapsed if elapsed > 0 else 0.0,
                         max_running=self.max_running, steps=self.steps,
                         peak_kv_fraction=1 - self.min_free_blocks / self.scheduler.num_blocks,
                         late_ttft=self.late_ttft, late_tpot=self.late_tpot, failed=self.failed,
                         aborted=self.aborted,
                         token_gaps=None if self.gaps is None else TokenGaps(tuple(self.gaps),
                                                                             tuple(self.gap_weights)))


def simulate(step_model: StepLatencyModel, requests: RequestBatch, *, engine: EngineConfig, num_blocks: int,
             max_model_len: int, measure: range | None = None, slo: SLO | None = None,
             budget: ViolationBudget | None = None, tail: Tail | None = None, seed: int = 0,
             token_gaps: bool = False) -> RunResult:
    """Run ``requests`` through one replica; latencies are kept for the ``measure`` range of requests.

    The run ends when every measured request has finished or been rejected, or,
    with ``slo``, as soon as the violations exceed ``budget`` (default: what the
    SLO allows for this run alone), marked ``aborted``. ``tail`` adds step
    dispersion (drawn with ``seed``) and a front end (see the module docstring);
    ``token_gaps`` keeps every step's time as the token gap of the sequences
    decoding in it (the engine's inter-token latency).
    """
    measure = measure if measure is not None else range(len(requests))
    if not len(measure) or measure.start < 0 or measure.stop > len(requests):
        raise ValueError(f"measure range {measure} is not inside the {len(requests)} requests")
    replica = _Replica(Scheduler(engine, num_blocks=num_blocks, max_model_len=max_model_len), step_model,
                       requests, measure, slo, budget, tail=tail, seed=seed, token_gaps=token_gaps)
    queue: list[tuple[float, int, _Event]] = [(replica.arrival[0], 0, _Arrival(replica.arrival[0], 0))]
    seq, now = 1, replica.arrival[0]
    while queue and not replica.stopped:
        now, _, event = heapq.heappop(queue)
        for follow in event.handle(replica):
            heapq.heappush(queue, (follow.time, seq, follow))
            seq += 1
    return replica.result(now)
