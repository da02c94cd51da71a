"""A real-time driver of the shared scheduler: one simulated engine replica on asyncio.

The loop is the same as the discrete-event simulator's, with wall-clock
sleeps instead of an event queue: plan a step (:meth:`Scheduler.schedule`),
sleep for its step-latency-model time divided by ``time_scale``, hand the
step back (:meth:`Scheduler.update_from_output`) and wake the requests that
got a token. Steps are kept on a deadline schedule, so sleep jitter does not
add up. When single decode steps would be shorter than ``min_step_wall_s``,
several identical decode steps run as one (the scheduler's multi-step mode),
and their tokens are delivered together at the end.

A cancelled request leaves the queue at once; one cancelled while running is
aborted when the step in flight comes back (the scheduler takes aborts only
between steps), which frees its KV blocks as vLLM does.

With ``prefix_caching`` the scheduler keeps vLLM's prefix cache of prompt
blocks, found by the hashes each request brings
(:mod:`hetsched.sim.prefix_cache`); each step's KV events go to
``kv_events`` as one batch, as vLLM publishes them.

A :class:`~hetsched.perf.tail.Tail` runs as the simulator runs it: each step
takes its modelled time × a factor drawn from the dispersion (seeded), and a
front end stands before the engine: a request reaches the scheduler once the
front end has served it, and each step's tokens reach their clients once it
has sent them. The engine's own metrics (TTFT, ITL, e2e) stay the engine's, as
vLLM's do.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from hetsched.errors import InfeasibleError, InputError
from hetsched.kvcache.events import KVEvent
from hetsched.perf.step import StepLatencyModel
from hetsched.perf.tail import FrontEndQueue, Tail
from hetsched.sim.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from hetsched.sim.step_cache import MemoizedStepModel
from hetsched.specs.engine import EngineConfig


@dataclass(frozen=True)
class RequestTiming:
    """Simulated-hardware seconds of one finished request (wall seconds × time scale)."""

    queue_s: float
    ttft_s: float
    e2e_s: float
    output_tokens: int
    preemptions: int


@dataclass(eq=False)
class _Handle:
    request: Request
    arrived: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False
    error: str | None = None
    cancelled: bool = False
    delivered: int | None = None
    """Tokens the front end has sent (None without a front end: the client sees what the engine generated)."""


class StepObserver:
    """Hooks for metrics; the default does nothing."""

    def on_step(self, engine: SimEngine) -> None: ...

    def on_tokens(self, gap_s: float, count: int) -> None:
        """``count`` tokens of one request, each ``gap_s`` simulated seconds after the one before (vLLM's ITL)."""

    def on_finished(self, timing: RequestTiming) -> None: ...

    def on_preempted(self, count: int) -> None: ...

    def on_aborted(self) -> None: ...


class SimEngine:
    """One simulated replica: add requests, iterate their tokens as the engine 'generates' them."""

    def __init__(self, step_model: StepLatencyModel, *, engine: EngineConfig, num_blocks: int, max_model_len: int,
                 time_scale: float = 1.0, min_step_wall_s: float = 0.002, request_overhead_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, observer: StepObserver | None = None,
                 tail: Tail | None = None, seed: int = 0, prefix_caching: bool = False,
                 kv_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        if time_scale <= 0:
            raise InputError(f"expected a positive factor, got {time_scale}", field="time_scale")
        self.engine_config = engine
        self.scheduler: Scheduler[int] = Scheduler(engine, num_blocks=num_blocks, max_model_len=max_model_len,
                                                   prefix_caching=prefix_caching)
        self.step_model = MemoizedStepModel(step_model)
        self.time_scale = time_scale
        self.min_step_wall_s = min_step_wall_s
        self.request_overhead_s = request_overhead_s
        """Time a request spends in the front end (HTTP, tokenizing) before the scheduler sees it."""
        self.clock = clock
        self.observer = observer or StepObserver()
        self.kv_events = kv_events
        """Takes each step's KV events (None: they are dropped)."""
        self.max_model_len = max_model_len
        self._handles: dict[int, _Handle] = {}
        self._cancelled_running: list[Request] = []
        self._ids = itertools.count()
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.lag_s = 0.0
        """How far the loop is behind its step deadlines (wall seconds); grows when the CPU cannot keep up."""
        dispersion = tail.dispersion if tail else None
        self.dispersion = None if dispersion is None or dispersion.identity else dispersion
        self.rng = random.Random(seed)
        self.front = FrontEndQueue(tail.front_end, scale=1 / time_scale) if tail and tail.front_end else None
        """The front end in wall seconds (module docstring); None: requests and tokens pass at once."""
        self._outbox: list[tuple[_Handle, int, bool]] = []

    # --- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    @property
    def failure(self) -> str | None:
        """Why the engine loop died (an exception it raised), or None while it runs or before it starts."""
        task = self._task
        if task is None or not task.done() or task.cancelled() or task.exception() is None:
            return None
        return f"{type(task.exception()).__name__}: {task.exception()}"

    # --- views for metrics ----------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.scheduler.free_blocks / self.scheduler.num_blocks

    @property
    def prefix_queries(self) -> int:
        return self.scheduler.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.scheduler.prefix_hits

    # --- requests -------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse what the engine could never serve, as vLLM does before queueing."""
        if prompt_tokens + max_tokens > self.max_model_len:
            raise InputError(f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"model's context of {self.max_model_len} tokens", field="max_tokens")
        blocks = -(-(prompt_tokens + max_tokens) // self.engine_config.block_size)
        if blocks > self.scheduler.num_blocks:
            raise InfeasibleError(f"request needs {blocks} KV blocks; this replica has {self.scheduler.num_blocks}")

    async def generate(self, prompt_tokens: int, max_tokens: int, *, cached_tokens: int = 0,
                       delay_s: float = 0.0, block_hashes: tuple[int, ...] = (),
                       token_ids: tuple[int, ...] = ()) -> AsyncGenerator[int, None]:
        """Yield how many tokens the request has so far, each time that grows; ends after the last.

        ``delay_s`` simulated seconds pass before the scheduler sees the request (a KV cache arriving from a
        prefill instance). ``block_hashes`` (the prompt's full blocks) and ``token_ids`` feed the prefix cache.
        Cancelling the iteration (closing it) cancels the request.
        """
        self.check(prompt_tokens, max_tokens)
        if self.front is not None:
            await asyncio.sleep(max(self.front.request(self.clock()) - self.clock(), 0.0))
        if wait := self.request_overhead_s + delay_s:
            await asyncio.sleep(wait / self.time_scale)
        request = Request(next(self._ids), prompt_tokens, max_tokens, cached_tokens, block_hashes, token_ids)
        handle = _Handle(request, self.clock(), delivered=None if self.front is None else 0)
        self._handles[handle.request.id] = handle
        self.scheduler.add_request(handle.request)
        self._work.set()
        emitted = 0
        try:
            while True:
                await handle.wake.wait()
                handle.wake.clear()
                if handle.error is not None:
                    raise InfeasibleError(handle.error)
                if handle.delivered is None:
                    self.scheduler.refresh(handle.request)
                    produced = handle.request.generated
                else:
                    produced = handle.delivered
                if produced > emitted:
                    emitted = produced
                    yield produced
                if handle.done:
                    return
        finally:
            if not handle.done:
                self._cancel(handle)

    def _cancel(self, handle: _Handle) -> None:
        handle.cancelled = True
        self.observer.on_aborted()
        request = handle.request
        if request.status is RequestStatus.WAITING:
            self.scheduler.abort(request)
            self._handles.pop(request.id, None)
        else:
            self._cancelled_running.append(request)

    def _abort_cancelled(self) -> None:
        """Abort requests cancelled during the last step; their blocks go back to the cache."""
        for request in self._cancelled_running:
            self.scheduler.abort(request)
            self._handles.pop(request.id, None)
        self._cancelled_running.clear()

    # --- the loop -------------------------------------------------------------------
    async def _run(self) -> None:
        deadline = self.clock()
        decode_step_s = 0.0
        while True:
            if not self.scheduler.has_work:
                self._work.clear()
                await self._work.wait()
                deadline = self.clock()
            max_steps = 1
            if decode_step_s > 0 and decode_step_s / self.time_scale < self.min_step_wall_s:
                max_steps = max(1, int(self.min_step_wall_s * self.time_scale / decode_step_s))
            output = self.scheduler.schedule(max_steps=max_steps)
            now = self.clock()
            for chunk in output.prefills:
                handle = self._handles.get(chunk.request.id)
                if handle is not None and handle.scheduled is None:
                    handle.scheduled = now
            for request in output.rejected:
                self._fail(request, "the request can never fit this replica's KV cache")
            if output.preempted:
                self.observer.on_preempted(len(output.preempted))
            if output.is_empty:
                if self.scheduler.has_work and not output.rejected:
                    await asyncio.sleep(self.min_step_wall_s)  # nothing admissible yet; wait for space
                continue
            first = self.step_model.step_time(output.shape)
            seconds = first if output.num_steps == 1 else \
                output.num_steps * (first + self.step_model.step_time(output.last_shape)) / 2
            if self.dispersion is not None:
                seconds = self._drawn(output, first)
            if not output.prefills:
                decode_step_s = first
            deadline = max(deadline, now - 0.05) + seconds / self.time_scale  # never bank more than 50 ms
            if self.front is not None:
                self._announce(output, deadline, seconds / self.time_scale)
            await asyncio.sleep(max(deadline - self.clock(), 0.0))
            self.lag_s = max(self.clock() - deadline, 0.0)
            result = self.scheduler.update_from_output(output)
            self.steps += output.num_steps
            now = self.clock()
            started = {request.id for request in result.first_token}
            for request in result.first_token:
                handle = self._handles.get(request.id)
                if handle is not None:
                    handle.first_token = handle.last_token = now
            for request in self.scheduler.decoding():
                handle = self._handles.get(request.id)
                if handle is not None and not handle.cancelled:
                    if request.id not in started:
                        self._token_gaps(handle, output.num_steps, now)
                    self._release(handle)
            for request in result.first_token:
                handle = self._handles.get(request.id)
                if handle is not None and not handle.cancelled:
                    self._release(handle)
            for request in result.finished:
                self._complete(request, now, tokens=0 if request.id in started else output.num_steps)
            self._send(now)
            self._abort_cancelled()
            if (events := self.scheduler.drain_events()) and self.kv_events is not None:
                self.kv_events(events)
            self.observer.on_step(self)

    def _drawn(self, output: SchedulerOutput[int], first: float) -> float:
        """The steps' seconds, each its modelled time (linear from the first step's to the last's) × a factor drawn
        from the dispersion."""
        assert self.dispersion is not None
        steps, draw, uniform = output.num_steps, self.dispersion.quantile, self.rng.random
        if steps == 1:
            return first * draw(uniform())
        last = self.step_model.step_time(output.last_shape)
        return sum((first + (last - first) * j / (steps - 1)) * draw(uniform()) for j in range(steps))

    def _announce(self, output: SchedulerOutput[int], ends: float, wall_s: float) -> None:
        """Tell the front end the tokens of the steps ending at ``ends`` (wall): every decoding sequence's in each,
        and one for each prefill chunk that completes its prompt."""
        assert self.front is not None
        completing = sum(1 for c in output.prefills if c.context_tokens + c.new_tokens >= c.request.num_tokens)
        steps = output.num_steps
        self.front.steps(ends - wall_s * (steps - 1) / steps, ends, steps=steps,
                         per_step=output.num_decodes + completing)

    def _release(self, handle: _Handle, *, done: bool = False) -> None:
        """Let the client see what ``handle``'s request has now: at once, or once the front end has sent it."""
        if handle.delivered is None:
            handle.done |= done
            handle.wake.set()
            return
        self.scheduler.refresh(handle.request)
        self._outbox.append((handle, handle.request.generated, done))

    def _send(self, now: float) -> None:
        """Hand the step's tokens to their clients when the front end has sent them."""
        if not self._outbox:
            return
        assert self.front is not None
        outbox, self._outbox = self._outbox, []
        delay = self.front.sent(now) - self.clock()
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._delivered, outbox)
        else:
            self._delivered(outbox)

    @staticmethod
    def _delivered(outbox: list[tuple[_Handle, int, bool]]) -> None:
        for handle, produced, done in outbox:
            handle.delivered = max(handle.delivered or 0, produced)
            handle.done |= done
            handle.wake.set()

    def _token_gaps(self, handle: _Handle, tokens: int, now: float) -> None:
        """The gaps before ``tokens`` tokens that arrived at ``now`` after the request's first (steps run together
        share their time evenly)."""
        assert handle.last_token is not None, "a request decodes only after its first token"
        self.observer.on_tokens((now - handle.last_token) * self.time_scale / tokens, tokens)
        handle.last_token = now

    def _complete(self, request: Request, now: float, *, tokens: int) -> None:
        """Finish ``request``, whose last ``tokens`` tokens (0: it finished at its first) arrived at ``now``."""
        handle = self._handles.pop(request.id, None)
        if handle is None:
            return
        self._release(handle, done=True)
        if handle.cancelled:
            return
        if tokens:
            self._token_gaps(handle, tokens, now)
        scale = self.time_scale
        first = handle.first_token if handle.first_token is not None else now
        self.observer.on_finished(RequestTiming(
            queue_s=((handle.scheduled or handle.arrived) - handle.arrived) * scale,
            ttft_s=(first - handle.arrived) * scale, e2e_s=(now - handle.arrived) * scale,
            output_tokens=request.generated, preemptions=request.preemptions))

    def _fail(self, request: Request, message: str) -> None:
        handle = self._handles.pop(request.id, None)
        if handle is not None:
            handle.error, handle.done = message, True
            handle.wake.set()
