"""The vLLM-style scheduler and the discrete-event simulator around it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hetsched.catalog import Device, load_catalog
from hetsched.errors import InfeasibleError, InputError
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import OpTime, StepShape
from hetsched.sim.metrics import summarize
from hetsched.sim.capacity import Replica
from hetsched.sim.scheduler import Request, RequestStatus, Scheduler
from hetsched.sim.simulator import simulate
from hetsched.sim.step_cache import MemoizedStepModel
from hetsched.specs.engine import EngineConfig
from hetsched.specs.registry import load_model
from hetsched.specs.workload import SLO, LengthDistribution, RequestBatch, Workload


@dataclass(frozen=True)
class LinearStep:
    """A step model with known answers: a fixed cost plus a cost per token and per KV token."""

    fixed_s: float = 0.010
    per_token_s: float = 0.0001
    per_kv_token_s: float = 0.0

    def step_time(self, shape: StepShape) -> float:
        return self.fixed_s + self.per_token_s * shape.tokens + self.per_kv_token_s * shape.decode_kv_tokens

    def breakdown(self, shape: StepShape) -> list[OpTime]:
        return [OpTime("all", self.step_time(shape), 0.0, 0.0, "fixed")]


def drive(scheduler: Scheduler, *, max_steps: int = 1, limit: int = 10_000) -> list[tuple[str, int, int]]:
    """Run until idle; return (event, request id, step number) records."""
    events = []
    for step in range(limit):
        if not scheduler.has_work:
            return events
        out = scheduler.schedule(max_steps=max_steps)
        events += [("rejected", r.id, step) for r in out.rejected] + [("preempted", r.id, step) for r in out.preempted]
        result = scheduler.update_from_output(out)
        events += [("first", r.id, step) for r in result.first_token] + [("done", r.id, step) for r in result.finished]
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_then_one_token_per_step() -> None:
    s = Scheduler(EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, block_size=16), num_blocks=100,
                  max_model_len=4096)
    req = Request("a", prompt_tokens=600, max_output_tokens=5)
    s.add_request(req)
    shapes = []
    for _ in range(3):
        out = s.schedule()
        shapes.append((out.shape.prefill_tokens, out.shape.decode_seqs))
        s.update_from_output(out)
    assert shapes == [(256, 0), (256, 0), (88, 0)]  # 600 tokens in chunks of the budget
    assert req.generated == 1 and s.num_decoding == 1
    events = drive(s)
    assert events == [("done", "a", 3)]  # four more decode steps
    assert req.status is RequestStatus.FINISHED and req.generated == 5 and s.free_blocks == 100


def test_decodes_and_prefill_share_a_step_under_the_budget() -> None:
    s = Scheduler(EngineConfig(max_num_batched_tokens=64, max_num_seqs=4), num_blocks=100, max_model_len=4096)
    s.add_request(Request(0, 10, 50))
    s.update_from_output(s.schedule())
    s.add_request(Request(1, 200, 5))
    out = s.schedule()
    assert out.num_decodes == 1 and out.shape.prefill_tokens == 63  # 64 − one decode token
    assert out.shape.decode_kv_tokens == 11  # the decoder attends over its 10 + 1 tokens


def test_max_num_seqs_bounds_running_requests() -> None:
    s = Scheduler(EngineConfig(max_num_batched_tokens=1000, max_num_seqs=2), num_blocks=100, max_model_len=4096)
    for i in range(3):
        s.add_request(Request(i, 10, 3))
    out = s.schedule()
    assert len(out.prefills) == 2 and len(s.waiting) == 1


def test_prefix_cache_hits_skip_whole_blocks() -> None:
    s = Scheduler(EngineConfig(block_size=16), num_blocks=100, max_model_len=4096)
    s.add_request(Request(0, prompt_tokens=100, max_output_tokens=2, cached_tokens=40))
    out = s.schedule()
    assert out.prefills[0].context_tokens == 32 and out.prefills[0].new_tokens == 68


def test_requests_that_never_fit_are_rejected() -> None:
    s = Scheduler(EngineConfig(block_size=16), num_blocks=10, max_model_len=4096)
    s.add_request(Request("big", prompt_tokens=150, max_output_tokens=20))  # 170 tokens > 160 in the cache
    s.add_request(Request("long", prompt_tokens=4000, max_output_tokens=200))  # beyond the model context
    s.add_request(Request("ok", prompt_tokens=100, max_output_tokens=10))
    events = drive(s)
    assert ("rejected", "big", 0) in events and ("rejected", "long", 0) in events
    assert ("done", "ok", 9) in events


def test_running_out_of_blocks_preempts_the_newest_and_recomputes() -> None:
    s = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8), num_blocks=6, max_model_len=4096)
    s.add_request(Request("old", prompt_tokens=8, max_output_tokens=12))
    s.add_request(Request("new", prompt_tokens=8, max_output_tokens=12))
    events = drive(s)
    preempted = [e for e in events if e[0] == "preempted"]
    assert preempted and all(e[1] == "new" for e in preempted)
    done = [e[1] for e in events if e[0] == "done"]
    assert done == ["old", "new"]  # both complete; the newest paid for the shortage
    assert s.free_blocks == 6


def test_multi_step_decoding_matches_single_steps() -> None:
    def run(max_steps: int) -> list[tuple[str, int, int]]:
        s = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8), num_blocks=40, max_model_len=4096)
        for i in range(5):
            s.add_request(Request(i, 10 + 7 * i, 3 + 11 * i))
        events, step = [], 0
        while s.has_work:
            out = s.schedule(max_steps=max_steps)
            result = s.update_from_output(out)
            step += out.num_steps
            events += [("done", r.id, step) for r in result.finished]
        return events

    assert run(1) == run(1000)


def test_scheduler_rejects_a_budget_below_max_num_seqs() -> None:
    with pytest.raises(InputError, match="max_num_batched_tokens"):
        Scheduler(EngineConfig(max_num_batched_tokens=8, max_num_seqs=16), num_blocks=10, max_model_len=100)


def _batch(arrivals: list[float], inputs: list[int], outputs: list[int]) -> RequestBatch:
    return RequestBatch(arrival_s=np.array(arrivals), input_tokens=np.array(inputs),
                        output_tokens=np.array(outputs), cached_tokens=np.zeros(len(inputs), dtype=np.int64))


def test_single_request_latencies_follow_the_step_model() -> None:
    step = LinearStep(fixed_s=0.010, per_token_s=0.0001)
    run = simulate(step, _batch([1.0], [100], [11]), engine=EngineConfig(), num_blocks=100, max_model_len=4096)
    t = run.times
    assert t.ttft[0] == pytest.approx(0.010 + 0.0001 * 100)
    assert t.tpot[0] == pytest.approx(0.0101)  # ten decode steps of one token each
    assert t.queue[0] == 0.0


def test_a_busy_replica_queues_the_second_request() -> None:
    step = LinearStep(fixed_s=0.010, per_token_s=0.0)
    run = simulate(step, _batch([0.0, 0.001], [10, 10], [3, 3]), engine=EngineConfig(), num_blocks=100,
                   max_model_len=4096)
    assert run.times.queue[1] == pytest.approx(0.009)  # waits for the first step to end
    assert run.times.first_token[1] == pytest.approx(0.020)


def test_runs_are_deterministic_for_a_seed() -> None:
    w = Workload(input_len=LengthDistribution.lognormal(p50=200, p99=800),
                 output_len=LengthDistribution.lognormal(p50=50, p99=200))
    step = LinearStep(per_kv_token_s=1e-7)

    def run(seed: int) -> np.ndarray:
        return simulate(step, w.sample(300, rate=20, seed=seed), engine=EngineConfig(), num_blocks=2000,
                        max_model_len=4096).times.e2e

    assert np.array_equal(run(3), run(3)) and not np.array_equal(run(3), run(4))


def test_summary_counts_goodput_and_failures() -> None:
    step = LinearStep(fixed_s=0.010, per_token_s=0.0)
    run = simulate(step, _batch([0.0, 1.0, 2.0], [10, 5000, 10], [5, 5, 5]), engine=EngineConfig(),
                   num_blocks=100, max_model_len=4096)
    s = summarize([run], rate=1.0, slo=SLO(ttft_ms=100, tpot_ms=5))
    assert s.failure_rate == pytest.approx(1 / 3) and s.completed == 2
    assert s.goodput_rps == 0.0  # TPOT 10 ms misses the 5 ms target


def test_memoized_step_model_stays_close_to_the_roofline() -> None:
    catalog = load_catalog()
    roofline = RooflineModel(load_model("qwen3-0.6b"), Device.whole(catalog.accelerators["l4"]))
    memo = MemoizedStepModel(roofline)
    for shape in (StepShape.build(prefill=[(777, 123)], decode_contexts=[1500] * 37),
                  StepShape.build(decode_contexts=[3001] * 200)):
        assert memo.step_time(shape) == pytest.approx(roofline.step_time(shape), rel=0.01)


def test_kv_blocks_come_from_the_memory_model() -> None:
    catalog = load_catalog()
    model = load_model("llama-3.1-8b")
    context_4k = Workload(input_len=LengthDistribution.fixed(2048), output_len=LengthDistribution.fixed(2048))

    def kv_blocks(accelerator: str) -> int:
        return Replica.build(model, Device.whole(catalog.accelerators[accelerator]), workload=context_4k).num_blocks

    assert kv_blocks("h100-sxm") > 10 * kv_blocks("a10g") > 0
    with pytest.raises(InfeasibleError, match="does not fit"):
        kv_blocks("t4")


def test_aborting_frees_blocks_and_stops_the_request() -> None:
    s = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8), num_blocks=20,
                  max_model_len=4096)
    a, b, c = Request("a", 8, 50), Request("b", 8, 50), Request("c", 8, 50)
    for r in (a, b, c):
        s.add_request(r)
    s.update_from_output(s.schedule())  # all three prefilled, now decoding
    for _ in range(5):
        s.update_from_output(s.schedule())
    s.abort(b)
    assert b.status is RequestStatus.ABORTED and b.blocks == 0 and s.num_decoding == 2
    waiting = Request("d", 8, 5)
    s.add_request(waiting)
    s.abort(waiting)
    assert not s.waiting
    events = drive(s)
    assert [e[1] for e in events if e[0] == "done"] == ["a", "c"] and s.free_blocks == 20
