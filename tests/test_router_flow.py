"""Flow control: the queue's order (priority, tenant fairness, first come first served), its bounds, and the
picker waiting on it: a saturated model's requests wait their turn, are refused at their deadline, and leave
the queue when their client goes."""

from __future__ import annotations

import asyncio
import json

import pytest

from hetsched.catalog.host import read_host
from hetsched.errors import InputError
from hetsched.router.config import parse_router_config
from hetsched.router.flow import FlowLimits, FlowQueue, Shed, ShedReason, Waiting
from hetsched.router.openai import ApiKind
from hetsched.router.picker import Picker, Refused
from hetsched.router.types import Front, RequestClass, RouteRequest

MODEL = "qwen3-0.6b"
INTERACTIVE = RequestClass("interactive", priority=10)
BATCH = RequestClass("batch", priority=0, sheddable=True)
LIMITS = FlowLimits(max_requests=100, max_bytes=1 << 20, max_tenants=100, max_wait_s=30)


def _entry(cls: RequestClass = BATCH, tenant: str = "a", tokens: int = 100, size: int = 10) -> Waiting:
    return Waiting(RouteRequest(MODEL, tokens, 0, objective=cls.name, fairness_id=tenant), cls, tenant, size,
                   arrived=0.0, deadline=10.0)


def _drain(queue: FlowQueue) -> list[Waiting]:
    order = []
    while (head := queue.head()) is not None:
        queue.dispatched(head, 0.0)
        order.append(head)
    return order


def test_higher_priority_goes_first_and_each_tenant_first_come_first_served() -> None:
    queue = FlowQueue(LIMITS)
    batch = [_entry(BATCH) for _ in range(3)]
    for e in batch:
        queue.push(e, 0.0)
    urgent = _entry(INTERACTIVE)
    queue.push(urgent, 0.0)
    assert _drain(queue) == [urgent, *batch]


def test_tenants_share_by_tokens_so_a_flood_gets_its_share_not_more() -> None:
    queue = FlowQueue(LIMITS)
    flood = [_entry(tenant="flood") for _ in range(10)]
    for e in flood:
        queue.push(e, 0.0)
    small = [_entry(tenant="small") for _ in range(3)]
    for e in small:
        queue.push(e, 0.0)
    order = [e.tenant for e in _drain(queue)]
    assert order[:6] == ["flood", "small"] * 3  # equal tokens: turns alternate while both wait
    assert order[6:] == ["flood"] * 7
    heavy = FlowQueue(LIMITS)  # a tenant whose requests are 4x as long gets a quarter of the turns
    for _ in range(4):
        heavy.push(_entry(tenant="long", tokens=400), 0.0)
        heavy.push(_entry(tenant="short", tokens=100), 0.0)
    first_five = [e.tenant for e in _drain(heavy)][:5]
    assert first_five.count("short") == 4


def test_a_full_queue_evicts_the_newest_sheddable_request_below_the_newcomer() -> None:
    queue = FlowQueue(FlowLimits(max_requests=3, max_bytes=1 << 20, max_tenants=10, max_wait_s=30))
    older, newer = _entry(BATCH), _entry(BATCH)
    keeper = _entry(INTERACTIVE)
    for e in (older, newer, keeper):
        queue.push(e, 0.0)
    urgent = _entry(INTERACTIVE)
    assert queue.push(urgent, 0.0) == [newer]
    with pytest.raises(Shed) as full:  # a sheddable newcomer evicts nothing of its own priority
        queue.push(_entry(BATCH), 0.0)
    assert full.value.reason is ShedReason.QUEUE_FULL
    assert queue.length == 3 and set(_drain(queue)) == {older, keeper, urgent}


def test_the_byte_bound_counts_bodies() -> None:
    queue = FlowQueue(FlowLimits(max_requests=100, max_bytes=1000, max_tenants=10, max_wait_s=30))
    queue.push(_entry(INTERACTIVE, size=600), 0.0)
    with pytest.raises(Shed):
        queue.push(_entry(INTERACTIVE, size=600), 0.0)
    assert queue.bytes == 600


def test_a_class_under_its_share_goes_before_higher_priorities() -> None:
    owed = RequestClass("owed", priority=-5, share=0.25)
    queue = FlowQueue(LIMITS)
    for _ in range(4):
        queue.started(INTERACTIVE.name)
    low, high = _entry(owed), _entry(INTERACTIVE)
    queue.push(low, 0.0)
    queue.push(high, 0.0)
    assert queue.head() is low  # 0 of 4 in flight, owed a quarter
    queue.started(owed.name)
    assert queue.head() is low  # 1 of 5 is still under a quarter
    queue.started(owed.name)
    assert queue.head() is high  # 2 of 6: its share is met


def test_tenants_are_capped_dropping_the_oldest_idle_first() -> None:
    forgotten: list[str] = []
    queue = FlowQueue(FlowLimits(max_requests=100, max_bytes=1 << 20, max_tenants=2, max_wait_s=30),
                      on_forget=forgotten.append)
    first = _entry(tenant="one")
    queue.push(first, 0.0)
    queue.dispatched(first, 0.0)
    queue.push(_entry(tenant="two"), 0.0)
    queue.push(_entry(tenant="three"), 0.0)  # "one" is idle and oldest: dropped
    assert forgotten == ["one"] and queue.tenants() == 2
    with pytest.raises(Shed) as full:  # both tenants wait: no room for a fourth
        queue.push(_entry(tenant="four"), 0.0)
    assert full.value.reason is ShedReason.TENANTS


def test_a_request_that_leaves_gives_its_tenant_its_place_back_and_retry_after_follows_the_drain_rate() -> None:
    queue = FlowQueue(LIMITS)
    gone = _entry(tenant="a")
    queue.push(gone, 0.0)
    queue.remove(gone)
    again = _entry(tenant="a")
    queue.push(again, 0.0)
    assert again.start_tag == gone.start_tag and queue.length == 1
    assert queue.retry_after(0.0) == 1  # no rate measured yet
    for t in range(11):
        queue.counted_dispatch(t * 0.5)  # two a second
    for _ in range(9):
        queue.push(_entry(), 5.0)
    assert queue.retry_after(5.0) == 5  # ten waiting at two a second


# --- the picker waiting on the queue ----------------------------------------------------------------
def _picker(**flow: object) -> Picker:
    raw = {"flow": {"recheck_interval_s": 0.01, **flow}, "models": {MODEL: {
        "slo": {"ttft_ms": 5000, "tpot_ms": 500},
        "objectives": [{"name": "interactive", "priority": 10, "slo": {"ttft_ms": 5000, "tpot_ms": 500}},
                       {"name": "batch", "priority": 0, "sheddable": True,
                        "slo": {"ttft_ms": 20000, "tpot_ms": 500}}],
        "policy": "least-request",
        "endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "h100-sxm", "max_concurrency": 1}]}}}
    return Picker(parse_router_config(raw), front=Front.HTTP, host=read_host())


def _route(picker: Picker, objective: str | None = None, tenant: str | None = None,
           ttft_ms: float | None = None) -> RouteRequest:
    headers = {k: v for k, v in (("x-gateway-inference-objective", objective),
                                 ("x-gateway-inference-fairness-id", tenant),
                                 ("x-slo-ttft-ms", None if ttft_ms is None else str(ttft_ms))) if v is not None}
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 8}).encode()
    return picker.route_request(body, ApiKind.COMPLETIONS, headers)


async def _hold(picker: Picker, route: RouteRequest):  # type: ignore[no-untyped-def]
    decision = await picker.admit(route)
    assert decision.endpoint is not None
    return picker.start(decision.endpoint, route), decision.endpoint


@pytest.mark.asyncio
async def test_a_saturated_model_serves_waiting_requests_by_priority_when_room_comes() -> None:
    picker = _picker()
    ticket, endpoint = await _hold(picker, _route(picker, "batch"))
    order: list[str] = []

    async def wait(objective: str) -> None:
        await _hold(picker, _route(picker, objective))
        order.append(objective)

    waiters = [asyncio.create_task(wait("batch")), asyncio.create_task(wait("interactive"))]
    await asyncio.sleep(0.05)
    assert order == [] and picker.flows[MODEL].queue.length == 2
    picker.finish(ticket, endpoint)
    await asyncio.wait_for(waiters[1], 2)
    assert order == ["interactive"]  # the batch request came first but waits: the endpoint is full again
    waiters[0].cancel()


@pytest.mark.asyncio
async def test_a_request_that_cannot_get_room_before_its_ttft_gets_429_with_retry_after() -> None:
    picker = _picker()
    await _hold(picker, _route(picker))
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(picker.admit(_route(picker, ttft_ms=50)), 2)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    assert "past this request's time to first token" in str(refused.value)
    assert picker.flows[MODEL].queue.length == 0
    assert picker.metrics.flow_shed.labels(MODEL, "default", "", "deadline", "http")._value.get() == 1


@pytest.mark.asyncio
async def test_a_client_that_goes_leaves_the_queue_at_once() -> None:
    picker = _picker()
    await _hold(picker, _route(picker))
    waiter = asyncio.create_task(picker.admit(_route(picker)))
    await asyncio.sleep(0.02)
    assert picker.flows[MODEL].queue.length == 1
    waiter.cancel()
    await asyncio.sleep(0)
    assert picker.flows[MODEL].queue.length == 0


@pytest.mark.asyncio
async def test_without_flow_control_a_saturated_model_answers_429_at_once() -> None:
    picker = _picker(enabled=False)
    await _hold(picker, _route(picker))
    with pytest.raises(Refused) as refused:
        await picker.admit(_route(picker))
    assert refused.value.status == 429 and refused.value.code == "saturated"


@pytest.mark.asyncio
async def test_classes_and_tenants_come_from_headers_or_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    picker = _picker()
    unknown = _route(picker, "nightly", "team-b")
    assert (unknown.objective, unknown.fairness_id) == ("default", "team-b")
    assert picker.metrics.unknown_objective.labels(MODEL, "http")._value.get() == 1
    batch = _route(picker, "batch")
    assert batch.objective == "batch" and batch.slo is not None and batch.slo.ttft_ms == 20000
    for bad, expected in (("x" * 257, "at most 256 bytes"), ("a\x01b", "control characters")):
        with pytest.raises(Refused) as refused:
            _route(picker, tenant=bad)
        assert refused.value.status == 400 and refused.value.param == "x-gateway-inference-fairness-id"
        assert expected in str(refused.value)
    monkeypatch.setenv("TEAM_A_KEY", "k-a")
    keyed = Picker(parse_router_config({"api_keys": [{"key_env": "TEAM_A_KEY", "tenant": "team-a",
                                                       "objective": "batch"}],
                                        "models": {MODEL: {"objectives": [{"name": "batch"}]}}}),
                   front=Front.HTTP, host=read_host())
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    route = keyed.route_request(body, ApiKind.COMPLETIONS, {"authorization": "Bearer k-a"})
    assert (route.objective, route.fairness_id) == ("batch", "team-a")


def test_objectives_out_of_range_are_refused_at_their_field(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(objectives: list[dict]) -> str:
        with pytest.raises(InputError) as error:
            parse_router_config({"models": {MODEL: {"objectives": objectives}}})
        return str(error.value)

    assert "priority" in refused([{"name": "x", "priority": 5000}])
    assert "share" in refused([{"name": "x", "share": 1.5}])
    assert "add up to 1.2" in refused([{"name": "x", "share": 0.6}, {"name": "y", "share": 0.6}])
    assert "twice" in refused([{"name": "x"}, {"name": "x"}])
    assert "'default' is the class" in refused([{"name": "default"}])
    monkeypatch.delenv("MISSING_KEY", raising=False)
    config = parse_router_config({"api_keys": [{"key_env": "MISSING_KEY", "tenant": "t"}], "models": {MODEL: {}}})
    with pytest.raises(InputError) as missing:
        config.api_key_holders()
    assert missing.value.field == "api_keys[0].key_env"


def test_lower_priorities_stop_short_of_where_a_more_urgent_request_would_miss_its_ttft() -> None:
    raw = {"models": {MODEL: {
        "objectives": [{"name": "interactive", "priority": 10, "slo": {"ttft_ms": 300, "tpot_ms": 1000}},
                       {"name": "batch", "priority": 0, "slo": {"ttft_ms": 60000, "tpot_ms": 1000}}],
        "endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "l4", "max_concurrency": 10_000}]}}}
    picker = Picker(parse_router_config(raw), front=Front.HTTP, host=read_host())
    batch, urgent = _route(picker, "batch"), _route(picker, "interactive")
    held = None
    for _ in range(5000):  # fill the endpoint with batch work until batch is held back
        decision = picker._open_decision(batch, frozenset(), waited_s=0.0, detail="")
        if decision is None:
            held = decision
            break
        assert decision.endpoint is not None
        picker.start(decision.endpoint, batch)
    else:
        pytest.fail("batch requests were never held back")
    assert held is None
    room = picker._open_decision(urgent, frozenset(), waited_s=0.0, detail="")
    assert room is not None and room.predictions  # the urgent class still has the room batch left it
    predicted = next(iter(room.predictions.values())).ttft_s * 1000
    assert 300 * 0.8 < predicted <= 300


@pytest.mark.asyncio
async def test_queued_and_refused_best_effort_requests_are_no_demand_for_the_autoscaler() -> None:
    raw = {"flow": {"recheck_interval_s": 0.01}, "models": {MODEL: {
        "slo": {"ttft_ms": 5000, "tpot_ms": 500}, "policy": "least-request",
        "objectives": [{"name": "eval", "priority": -1, "best_effort": True, "sheddable": True,
                        "slo": {"ttft_ms": 60, "tpot_ms": 500}}],
        "endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "h100-sxm", "max_concurrency": 1}]}}}
    picker = Picker(parse_router_config(raw), front=Front.HTTP, host=read_host())
    await _hold(picker, _route(picker))
    demand = picker.metrics.flow_queued_demand.labels(MODEL, "http")
    waiter = asyncio.create_task(picker.admit(_route(picker)))
    await asyncio.sleep(0.02)
    assert demand._value.get() == 1
    with pytest.raises(Refused):  # the best-effort request waits too, then misses its 60 ms
        await picker.admit(_route(picker, "eval"))
    assert demand._value.get() == 1
    assert picker.metrics.rejected_requests(MODEL, "best-effort")._value.get() == 1
    assert picker.metrics.rejected_requests(MODEL, "saturated")._value.get() == 0
    waiter.cancel()
    await asyncio.sleep(0)
    assert demand._value.get() == 0


@pytest.mark.asyncio
async def test_a_full_queue_refuses_the_sheddable_request_an_urgent_one_displaces() -> None:
    picker = _picker(max_queued_requests=1)
    await _hold(picker, _route(picker))
    displaced = asyncio.create_task(picker.admit(_route(picker, "batch")))
    await asyncio.sleep(0.02)
    urgent = asyncio.create_task(picker.admit(_route(picker, "interactive")))
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(displaced, 2)
    assert refused.value.status == 429 and "higher priority took this one's place" in str(refused.value)
    assert picker.flows[MODEL].queue.length == 1 and not urgent.done()
    urgent.cancel()


def test_classes_a_model_deployment_declares_apply_unless_the_router_file_declares_its_own() -> None:
    from hetsched.router.types import RequestClass

    picker = Picker(parse_router_config({"models": {MODEL: {"slo": {"ttft_ms": 900, "tpot_ms": 90}}, "pinned": {
        "objectives": [{"name": "own"}]}}}), front=Front.HTTP, host=read_host())
    picker.set_objectives({MODEL: [RequestClass("urgent", priority=5)], "pinned": [RequestClass("other")]})
    assert set(picker.classes[MODEL]) == {"default", "urgent"} and set(picker.classes["pinned"]) == {"default", "own"}
    assert picker.classes[MODEL]["default"].slo is not None and picker.classes[MODEL]["default"].slo.ttft_ms == 900
    assert _route(picker, "urgent").objective == "urgent"
    picker.set_objectives({MODEL: []})  # the resource dropped them
    assert _route(picker, "urgent").objective == "default"


@pytest.mark.asyncio
async def test_a_share_of_each_endpoint_is_kept_for_the_highest_priority() -> None:
    raw = {"flow": {"reserved_share": 0.2}, "models": {MODEL: {
        "policy": "least-request", "objectives": [{"name": "interactive", "priority": 10}, {"name": "batch"}],
        "endpoints": [{"url": "http://127.0.0.1:9", "accelerator": "h100-sxm", "max_concurrency": 10}]}}}
    picker = Picker(parse_router_config(raw), front=Front.HTTP, host=read_host())
    for _ in range(8):
        await _hold(picker, _route(picker, "batch"))
    assert picker._open_decision(_route(picker, "batch"), frozenset(), waited_s=0.0, detail="") is None
    for _ in range(2):  # the reserved two go to the urgent class at once
        await asyncio.wait_for(_hold(picker, _route(picker, "interactive")), 1)
    assert picker._open_decision(_route(picker, "interactive"), frozenset(), waited_s=0.0, detail="") is None
