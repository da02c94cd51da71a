"""The scheduler's prefix cache: vLLM's block-pool semantics for prompt blocks, and the KV events they send."""

from __future__ import annotations

import random

from hetsched.kvcache.events import BlockRemoved, BlockStored, KVEvent
from hetsched.sim.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput, StepResult
from hetsched.specs.engine import EngineConfig

ENGINE = EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=8)


def cached_scheduler(num_blocks: int, *, engine: EngineConfig = ENGINE) -> Scheduler[int]:
    return Scheduler(engine, num_blocks=num_blocks, max_model_len=4096, prefix_caching=True)


def request(key: int, hashes: tuple[int, ...], *, prompt: int | None = None, out: int = 1) -> Request[int]:
    """A prompt of ``prompt`` tokens (default: its full blocks) whose token ids are 1000·key + position."""
    prompt = prompt if prompt is not None else len(hashes) * ENGINE.block_size
    return Request(key, prompt, out, block_hashes=hashes, token_ids=tuple(1000 * key + i for i in range(prompt)))


def step(s: Scheduler[int]) -> tuple[SchedulerOutput[int], StepResult[int]]:
    output = s.schedule()
    return output, s.update_from_output(output)


def run(s: Scheduler[int], *requests: Request[int]) -> list[KVEvent]:
    """Add ``requests`` and step until idle; the events of the run."""
    for r in requests:
        s.add_request(r)
    for _ in range(10_000):
        if not s.has_work:
            return s.drain_events()
        step(s)
    raise AssertionError("the scheduler did not go idle")


def test_a_shared_prefix_hits_the_blocks_another_request_cached() -> None:
    s = cached_scheduler(20)
    first = request(1, (11, 12), prompt=10)
    events = run(s, first)
    assert events == [BlockStored((11, 12), None, tuple(range(1000, 1008)), 4)]
    second = request(2, (11, 13), prompt=10)
    s.add_request(second)
    output, _ = step(s)
    (chunk,) = output.prefills
    assert (chunk.context_tokens, chunk.new_tokens) == (4, 6)  # the shared first block is not computed again
    assert s.drain_events() == [BlockStored((13,), 11, tuple(range(2004, 2008)), 4)]
    assert (s.prefix_queries, s.prefix_hits) == (20, 4)


def test_the_hit_leaves_the_last_token_to_compute() -> None:
    s = cached_scheduler(20)
    run(s, request(1, (11, 12)))
    again = request(2, (11, 12))  # 8 tokens, both blocks cached: only (8 − 1) // 4 = 1 block may hit
    s.add_request(again)
    output, _ = step(s)
    assert (output.prefills[0].context_tokens, output.prefills[0].new_tokens) == (4, 4)
    assert s.prefix_hits == 4


def test_freed_blocks_are_evicted_lru_first_deepest_block_of_a_request_first() -> None:
    s = cached_scheduler(6)
    run(s, request(1, (11, 12)), request(2, (21, 22)))
    assert s.prefix_cache is not None
    assert s.prefix_cache.free_order() == [12, 11, 22, 21] and s.free_blocks == 6
    events = run(s, request(3, (31, 32, 33, 34)))  # 4 blocks: the 2 plain free ones, then 2 evicted
    assert [e for e in events if isinstance(e, BlockRemoved)] == [BlockRemoved((12,)), BlockRemoved((11,))]
    assert events[-1] == BlockStored((31, 32, 33, 34), None, tuple(range(3000, 3016)), 4)
    assert s.prefix_cache.free_order() == [22, 21, 34, 33, 32, 31] and s.free_blocks == 6


def test_free_but_cached_blocks_are_taken_back_not_allocated_again() -> None:
    s = cached_scheduler(8)
    run(s, request(1, (11, 12)))
    assert s.prefix_cache is not None and s.prefix_cache.num_free_cached == 2
    s.add_request(request(2, (11, 12, 13), prompt=13, out=5))
    output, _ = step(s)
    assert output.prefills[0].context_tokens == 8
    assert s.free_blocks == 8 - 4 and s.prefix_cache.num_free_cached == 0  # 2 taken back, 2 new
    assert not [e for e in s.drain_events() if isinstance(e, BlockRemoved)]


def test_a_block_two_running_requests_share_is_counted_once() -> None:
    s = cached_scheduler(20)
    s.add_request(request(1, (11, 12), prompt=9, out=50))
    step(s)
    step(s)  # decoding, holding 3 blocks
    s.add_request(request(2, (11, 12, 13), prompt=13, out=50))
    before = s.free_blocks
    output, _ = step(s)
    assert output.prefills[0].context_tokens == 8
    assert before - s.free_blocks == 2  # its third and fourth block; the first two are the other's
    assert s.prefix_hits == 8


def test_equal_prompts_admitted_together_compute_twice_and_cache_once() -> None:
    s = cached_scheduler(20)
    events = run(s, request(1, (11, 12)), request(1, (11, 12)))
    assert events == [BlockStored((11, 12), None, tuple(range(1000, 1008)), 4)]
    assert s.free_blocks == 20 and s.prefix_hits == 0


def test_preemption_frees_cached_blocks_and_readmission_is_no_new_query() -> None:
    s = cached_scheduler(6)
    first, second = request(1, (11, 12), out=12), request(2, (21, 22), out=12)
    s.add_request(first)
    s.add_request(second)
    readmitted: list[int] = []
    while s.has_work:
        output, _ = step(s)
        readmitted += [c.context_tokens for c in output.prefills if c.request is second and second.preemptions]
    assert second.preemptions == 1 and first.preemptions == 0
    assert first.status is second.status is RequestStatus.FINISHED
    events = s.drain_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed[0] == BlockRemoved((22,))  # evicted while it waited: its deepest block first
    assert readmitted == [4]  # its first block was still cached
    assert (s.prefix_queries, s.prefix_hits) == (16, 0)  # the readmission is no new query
    assert s.free_blocks == 6


def test_the_counters_count_each_request_once_at_its_first_admission() -> None:
    s = cached_scheduler(40)
    run(s, request(1, (11, 12, 13), prompt=14), request(2, (11, 12, 14), prompt=13), request(3, (99,), prompt=5))
    assert s.prefix_queries == 14 + 13 + 5
    assert s.prefix_hits == 0  # admitted together: nothing was cached yet
    run(s, request(4, (11, 12, 14, 15), prompt=16))
    assert s.prefix_queries == 14 + 13 + 5 + 16 and s.prefix_hits == 12


def _workload(seed: int, *, shared: bool) -> list[Request[int]]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1 << 60) for _ in range(rng.randint(1, 6))) for _ in range(4)]
    out = []
    for key in range(60):
        prompt = rng.randint(5, 60)
        blocks = prompt // ENGINE.block_size
        head = rng.choice(prefixes) if shared else ()
        hashes = (head + tuple(rng.randrange(1 << 60) for _ in range(blocks)))[:blocks]
        out.append(Request(key, prompt, rng.randint(1, 12), block_hashes=hashes))
    return out


def _trace(s: Scheduler[int], requests: list[Request[int]]) -> list[tuple[int, int, int, tuple[int, ...]]]:
    trace = []
    for r in requests:
        s.add_request(r)
        for _ in range(3):
            output, result = step(s)
            trace.append((output.shape.prefill_tokens, output.num_decodes, s.free_blocks,
                          tuple(r.id for r in result.finished)))
    while s.has_work:
        output, result = step(s)
        trace.append((output.shape.prefill_tokens, output.num_decodes, s.free_blocks,
                      tuple(r.id for r in result.finished)))
    return trace


def test_without_shared_prefixes_the_cache_schedules_as_no_cache() -> None:
    """Blocks are evicted as they run out, yet the counts match (no preemption: a readmission would hit its own)."""
    plain = _trace(Scheduler(ENGINE, num_blocks=40, max_model_len=4096), _workload(7, shared=False))
    cached, requests = cached_scheduler(40), _workload(7, shared=False)
    assert _trace(cached, requests) == plain
    assert not any(r.preemptions for r in requests)
    assert any(isinstance(e, BlockRemoved) for e in cached.drain_events())
    assert cached.prefix_hits == 0 and cached.prefix_queries == sum(r.prompt_tokens for r in requests)


def test_disabled_mode_ignores_hashes_and_sends_no_events() -> None:
    without = _trace(Scheduler(ENGINE, num_blocks=30, max_model_len=4096),
                     [Request(r.id, r.prompt_tokens, r.max_output_tokens) for r in _workload(3, shared=True)])
    s = Scheduler(ENGINE, num_blocks=30, max_model_len=4096)
    assert _trace(s, _workload(3, shared=True)) == without
    assert s.prefix_cache is None and s.drain_events() == [] and (s.prefix_queries, s.prefix_hits) == (0, 0)


def test_the_events_describe_the_cache_and_every_block_comes_back() -> None:
    s, requests = cached_scheduler(30), _workload(11, shared=True)
    _trace(s, requests)
    assert s.free_blocks == 30 and s.prefix_hits > 0 and any(r.preemptions for r in requests)
    cached: set[int] = set()
    for event in s.drain_events():
        if isinstance(event, BlockStored):
            assert not cached & set(event.block_hashes)
            cached |= set(event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved) and set(event.block_hashes) <= cached
            cached -= set(event.block_hashes)
    assert s.prefix_cache is not None and cached == set(s.prefix_cache.free_order())
    assert s.prefix_cache.num_cached == s.prefix_cache.num_free_cached == len(cached)
