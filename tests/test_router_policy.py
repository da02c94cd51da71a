"""Router decision logic as pure functions: policies, prediction, signals, health, discovery, config."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hetsched.errors import InputError
from hetsched.router.config import RouterConfig, parse_router_config
from hetsched.router.discovery import (PodWatcher, endpoints_from_pods, objectives_from_deployments,
                                       policies_from_deployments)
from hetsched.router.health import HealthSettings, HealthTracker
from hetsched.router.policy import decide
from hetsched.router.openai import BYTES_PER_TOKEN
from hetsched.router.prefix import (PREFIX_BLOCK_TOKENS, PREFIX_KEY_BLOCKS, PrefixIndex, prefix_hashes, prefix_key,
                                     rendezvous)
from hetsched.router.profiles import endpoint_profile
from hetsched.router.signals import fresh, parse_engine_metrics
from hetsched.router.state import SENT_RATE_S, RouterState
from hetsched.router.types import DecisionReason, Endpoint, EndpointView, EngineSignals, Policy, RouteRequest
from hetsched.specs.workload import SLO

MODEL = "llama-3.1-8b"


def view(url: str, *, accelerator: str = "h100-sxm", in_flight: int = 0, running: int | None = None,
         waiting: int | None = None, kv: float | None = None, max_concurrency: int = 256,
         price: float | None = None) -> EndpointView:
    endpoint = Endpoint(url, MODEL, accelerator, max_concurrency=max_concurrency, price_per_hour=price)
    return EndpointView(endpoint, in_flight=in_flight, in_flight_prompt_tokens=in_flight * 500,
                        in_flight_max_tokens=in_flight * 100, running=running, waiting=waiting, kv_usage=kv)


REQUEST = RouteRequest(MODEL, prompt_tokens=500, max_tokens=100)


def chosen(policy: Policy, views: list[EndpointView], **kwargs: object) -> str:
    decision = decide(policy, REQUEST if "request" not in kwargs else kwargs.pop("request"), views,  # type: ignore[arg-type]
                      **kwargs)  # type: ignore[arg-type]
    assert decision.endpoint is not None
    return decision.endpoint.url


def test_round_robin_cycles_in_url_order() -> None:
    views = [view("http://c"), view("http://a"), view("http://b")]
    assert [chosen(Policy.ROUND_ROBIN, views, turn=t) for t in range(4)] == \
        ["http://a", "http://b", "http://c", "http://a"]


def test_least_request_uses_engine_queue_when_it_exceeds_own_count() -> None:
    views = [view("http://a", in_flight=2), view("http://b", in_flight=1, running=5, waiting=3), view("http://c")]
    assert chosen(Policy.LEAST_REQUEST, views) == "http://c"
    views[2] = view("http://c", in_flight=4)
    assert chosen(Policy.LEAST_REQUEST, views) == "http://a"  # b's engine reports 8 requests


def test_power_of_two_picks_the_less_loaded_of_its_two_samples() -> None:
    views = [view("http://a", in_flight=9), view("http://b", in_flight=1), view("http://c", in_flight=5)]
    rng = random.Random(3)
    picks = {chosen(Policy.POWER_OF_TWO, views, rng=rng) for _ in range(50)}
    assert "http://a" not in picks  # the most loaded endpoint loses every pair it is in
    assert picks == {"http://b", "http://c"}


def test_least_kv_ranks_unknown_usage_last() -> None:
    views = [view("http://a"), view("http://b", running=3, waiting=0, kv=0.6), view("http://c", running=1, waiting=0,
                                                                                    kv=0.2)]
    assert chosen(Policy.LEAST_KV, views) == "http://c"
    assert chosen(Policy.LEAST_KV, views[:2]) == "http://b"  # unknown is not idle


def test_prefix_affinity_sends_a_prefix_to_its_consistent_hash_owner_within_the_load_bound() -> None:
    text = "You are a helpful assistant. " * 40
    hashes = prefix_hashes(text)
    assert len(hashes) > 4 and hashes == prefix_hashes(text + " and more")[:len(hashes)]
    request = RouteRequest(MODEL, 300, 50, hashes)
    views = [view("http://a"), view("http://b"), view("http://c")]
    owner = rendezvous(prefix_key(hashes), [v.url for v in views])
    assert chosen(Policy.PREFIX, views, request=request, cached={}) == owner[0]
    # another conversation under the same system prompt: the same leading blocks, the same owner
    other = RouteRequest(MODEL, 300, 50, prefix_hashes(text[:prefix_key_bytes()] + "a different question"))
    assert chosen(Policy.PREFIX, views, request=other, cached={}) == owner[0]
    overloaded = [view(url, in_flight=10 if url == owner[0] else 0) for url in ("http://a", "http://b", "http://c")]
    assert chosen(Policy.PREFIX, overloaded, request=request, cached={}) == owner[1]  # spills along its own order
    decision = decide(Policy.PREFIX, request, views, cached={owner[0]: len(hashes) * PREFIX_BLOCK_TOKENS})
    assert decision.reason is DecisionReason.PREFIX_HIT


def prefix_key_bytes() -> int:
    return PREFIX_KEY_BLOCKS * PREFIX_BLOCK_TOKENS * BYTES_PER_TOKEN


def test_router_replicas_agree_on_a_prefix_s_endpoint_whatever_each_has_seen() -> None:
    config = parse_router_config({"policy": "prefix", "models": {MODEL: {"endpoints": [
        {"url": f"http://10.0.0.{i}:8000", "accelerator": "h100-sxm"} for i in range(6)]}}})
    replicas = [RouterState(config, rng=random.Random(seed)) for seed in (1, 2)]
    for state in replicas:
        state.set_endpoints(MODEL, config.static_endpoints())
    prompts = [f"System prompt number {i}. " * 30 for i in range(40)]
    seen = random.Random(5)
    for _ in range(50):  # the first replica alone has routed (and finished) other traffic
        request = RouteRequest(MODEL, 300, 50, prefix_hashes(seen.choice(prompts)))
        replicas[0].finish(replicas[0].start(replicas[0].decide(request, now=0.0).endpoint.url, request))
    owners = set()
    for prompt in prompts:
        request = RouteRequest(MODEL, 300, 50, prefix_hashes(prompt))
        first, second = (state.decide(request, now=0.0).endpoint for state in replicas)
        assert first == second
        owners.add(first.url)
    assert len(owners) == 6  # and the prefixes spread over every endpoint


def test_load_is_the_engine_s_count_plus_what_this_router_sent_since() -> None:
    config = _config()
    state = RouterState(config)
    state.set_endpoints(MODEL, config.static_endpoints())
    request = RouteRequest(MODEL, 300, 50)

    def load() -> int:
        (a,) = [v for v in state.views(MODEL, now=0.0) if v.url == "http://a:1"]
        return a.load

    before = state.start("http://a:1", request)
    state.record_signals("http://a:1", EngineSignals(scraped_at=0.0, running=7, waiting=1))  # other routers' too
    after = [state.start("http://a:1", request) for _ in range(2)]
    assert load() == 8 + 2  # the engine counted this router's first request among its 8
    state.finish(before)
    state.finish(after[0])
    assert load() == 8 + 1  # the engine's 8 stand until its next reading
    state.record_signals("http://a:1", EngineSignals(scraped_at=1.0, running=1, waiting=0))
    assert load() == 1
    state.finish(after[1])  # counted by that reading already
    assert load() == 1 and state.get("http://a:1").since_signals == 0


def test_consistent_hashing_moves_only_about_one_nth_of_the_keys() -> None:
    rng = random.Random(11)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    urls = [f"http://10.0.0.{i}:8000" for i in range(10)]
    owner = {key: rendezvous(key, urls)[0] for key in keys}
    counts = [sum(1 for o in owner.values() if o == url) for url in urls]
    assert max(counts) < 1.1 * len(keys) / 10 and min(counts) > 0.9 * len(keys) / 10  # balanced
    removed = {key: rendezvous(key, urls[1:])[0] for key in keys}
    moved = [key for key in keys if removed[key] != owner[key]]
    assert all(owner[key] == urls[0] for key in moved)  # only the departed endpoint's keys move
    assert len(moved) == counts[0]
    added = {key: rendezvous(key, [*urls, "http://10.0.0.99:8000"])[0] for key in keys}
    gained = [key for key in keys if added[key] != owner[key]]
    assert all(added[key] == "http://10.0.0.99:8000" for key in gained)
    assert 0.8 / 11 < len(gained) / len(keys) < 1.2 / 11


def _profiles(views: list[EndpointView]) -> dict:
    return {v.url: endpoint_profile(v.endpoint, arch=MODEL) for v in views}


def test_slo_policy_prefers_the_cheaper_endpoint_that_meets_the_slo() -> None:
    views = [view("http://h100", price=10.0), view("http://a100", accelerator="a100-80gb")]
    decision = decide(Policy.SLO, REQUEST, views, profiles=_profiles(views), slo=SLO(ttft_ms=500, tpot_ms=50))
    assert decision.endpoint.url == "http://a100" and decision.reason is DecisionReason.SLO_MET
    assert decision.predictions["http://h100"].tpot_s < decision.predictions["http://a100"].tpot_s
    assert decision.prediction.meets_slo


def test_slo_policy_pays_for_the_faster_endpoint_when_only_it_meets_the_slo() -> None:
    views = [view("http://h100", price=10.0), view("http://a100", accelerator="a100-80gb")]
    decision = decide(Policy.SLO, REQUEST, views, profiles=_profiles(views), slo=SLO(ttft_ms=500, tpot_ms=10))
    assert decision.endpoint.url == "http://h100" and decision.reason is DecisionReason.SLO_MET
    assert not decision.predictions["http://a100"].meets_slo


def test_slo_policy_falls_back_to_the_fastest_when_nothing_meets_the_slo() -> None:
    views = [view("http://h100", price=10.0), view("http://a100", accelerator="a100-80gb")]
    decision = decide(Policy.SLO, REQUEST, views, profiles=_profiles(views), slo=SLO(ttft_ms=1, tpot_ms=1))
    assert decision.endpoint.url == "http://h100" and decision.reason is DecisionReason.SLO_FALLBACK


def test_slo_prediction_grows_with_load_and_spills_to_the_next_endpoint() -> None:
    idle = view("http://a", in_flight=0)
    busy = view("http://a", in_flight=200, running=200, waiting=40)
    profile = endpoint_profile(idle.endpoint, arch=MODEL)
    from hetsched.router.predict import predict
    assert predict(profile, busy, REQUEST, slo=None).ttft_s > 5 * predict(profile, idle, REQUEST, slo=None).ttft_s
    views = [busy, view("http://b", accelerator="a100-80gb")]
    assert chosen(Policy.SLO, views, profiles=_profiles(views), slo=SLO(ttft_ms=300, tpot_ms=40)) == "http://b"


def test_prompts_the_router_sends_an_endpoint_share_a_new_request_s_first_chunk() -> None:
    from hetsched.router.predict import predict
    busy = view("http://a", in_flight=64, running=64, waiting=0)
    profile = endpoint_profile(busy.endpoint, arch=MODEL)
    steady = predict(profile, busy, REQUEST, slo=None).ttft_s  # no count: as many come as finish
    nothing_sent = predict(profile, replace(busy, prompt_tokens_per_s=0.0), REQUEST, slo=None).ttft_s
    flooded = predict(profile, replace(busy, prompt_tokens_per_s=2e6), REQUEST, slo=None).ttft_s
    assert nothing_sent < steady < flooded
    assert predict(profile, replace(busy, prompt_tokens_per_s=0.0), REQUEST, slo=None).tpot_s == \
        predict(profile, busy, REQUEST, slo=None).tpot_s  # the rate is what shares its first chunk, not its TPOT


def test_the_router_counts_the_prompt_tokens_it_sends_each_endpoint_per_second() -> None:
    state = _slo_state([{"url": "http://a", "accelerator": "h100-sxm"}])
    request = RouteRequest(MODEL, prompt_tokens=100, max_tokens=10)
    for i in range(200):
        state.finish(state.start("http://a", request, now=i / 50))  # 50 a second: 5,000 prompt tokens a second
    rate = state.views(MODEL, now=4.0)[0].prompt_tokens_per_s
    assert rate == pytest.approx(5000, rel=0.05)
    quiet = state.views(MODEL, now=4.0 + 10 * SENT_RATE_S)[0].prompt_tokens_per_s
    assert quiet is not None and quiet < 0.001 * rate  # sends stopped: it falls away


def test_all_saturated_and_no_endpoint_decisions() -> None:
    full = [view("http://a", in_flight=2, max_concurrency=2), view("http://b", running=4, waiting=64, in_flight=1)]
    assert decide(Policy.LEAST_REQUEST, REQUEST, full).reason is DecisionReason.ALL_SATURATED
    assert decide(Policy.SLO, REQUEST, []).reason is DecisionReason.NO_ENDPOINT


VLLM_NEW = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:num_requests_running{engine="1",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",engine="0"} 1.0
"""
VLLM_OLD = """vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""
SGLANG = """sglang:num_running_reqs{model_name="m"} 12.0
sglang:num_queue_reqs{model_name="m"} 4.0
sglang:token_usage{model_name="m"} 0.75
"""


def test_metrics_parsing_reads_new_and_old_vllm_and_sglang_names() -> None:
    new = parse_engine_metrics(VLLM_NEW, scraped_at=1.0)
    assert (new.running, new.waiting, new.kv_usage, new.kv_capacity_tokens) == (10, 2, 0.5, 16000)
    old = parse_engine_metrics(VLLM_OLD, scraped_at=1.0)
    assert (old.running, old.waiting, old.kv_usage) == (1, 0, 0.25)
    sglang = parse_engine_metrics(SGLANG, scraped_at=1.0)
    assert (sglang.running, sglang.waiting, sglang.kv_usage) == (12, 4, 0.75)
    unrelated = parse_engine_metrics("process_cpu_seconds_total 3.0\n", scraped_at=1.0)
    assert (unrelated.running, unrelated.waiting, unrelated.kv_usage) == (None, None, None)
    with pytest.raises(InputError, match="metrics"):
        parse_engine_metrics("vllm:num_requests_running{ 1 2 3\n", scraped_at=1.0)


def test_stale_signals_are_unknown_not_idle() -> None:
    signals = EngineSignals(scraped_at=100.0, running=50, waiting=10, kv_usage=0.9)
    assert fresh(signals, now=103.0, stale_after_s=5.0) == signals
    assert fresh(signals, now=106.0, stale_after_s=5.0) is None
    config = _config()
    state = RouterState(config)
    state.set_endpoints(MODEL, config.static_endpoints())
    state.record_signals("http://a:1", signals)
    (fresh_view,) = [v for v in state.views(MODEL, now=101.0) if v.url == "http://a:1"]
    (stale_view,) = [v for v in state.views(MODEL, now=200.0) if v.url == "http://a:1"]
    assert fresh_view.load == 60 and fresh_view.kv_usage == 0.9
    assert stale_view.running is None and stale_view.kv_usage is None


def test_health_ejects_after_consecutive_failures_and_recovers_by_active_check() -> None:
    health = HealthTracker(HealthSettings(eject_after_failures=3, base_ejection_s=5, max_ejection_s=60))
    assert not health.record_failure(0.0) and not health.record_failure(0.1)
    assert health.record_failure(0.2) and not health.available(0.3)
    assert not health.record_success(3.0, active=True) and not health.available(3.0)  # ejection time not over
    assert health.record_success(5.3, active=True) and health.available(5.3)
    # failing again right after recovery: ejected for twice as long
    for t in (6.0, 6.1, 6.2):
        health.record_failure(t)
    assert health.ejected_until == pytest.approx(16.2)
    health.record_failure(16.5)  # recovery check fails: ejected again, longer
    assert health.ejected_until == pytest.approx(16.5 + 20)
    assert health.record_success(40.0, active=True)
    health.record_success(41.0)  # a served request resets the backoff
    for t in (50.0, 50.1, 50.2):
        health.record_failure(t)
    assert health.ejected_until == pytest.approx(55.2)


def test_a_success_between_failures_resets_the_count() -> None:
    health = HealthTracker(HealthSettings(eject_after_failures=2))
    health.record_failure(0.0)
    health.record_success(0.1)
    assert not health.record_failure(0.2) and health.available(0.2)


def _pod(name: str, *, model: str | None = MODEL, accelerator: str | None = "h100-sxm", ready: bool = True,
         ip: str | None = "10.0.0.1", deleting: bool = False, extra: dict | None = None,
         port_name: str | None = None) -> SimpleNamespace:
    labels = {k: v for k, v in {"hetsched.io/model": model, "hetsched.io/accelerator": accelerator}.items() if v}
    labels.update(extra or {})
    ports = [SimpleNamespace(name=port_name, container_port=9000)] if port_name else []
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels=labels, deletion_timestamp="now" if deleting else None),
        status=SimpleNamespace(pod_ip=ip, conditions=[SimpleNamespace(type="Ready", status="True" if ready else "False")]),
        spec=SimpleNamespace(containers=[SimpleNamespace(ports=ports)]),
    )


def test_a_pod_s_attention_backend_label_is_its_endpoint_s() -> None:
    [endpoint] = endpoints_from_pods([_pod("fi", extra={"hetsched.io/attention-backend": "FLASHINFER"})],
                                     models=[MODEL], default_port=8000)[MODEL]
    assert endpoint.attention_backend == "FLASHINFER"
    [plain] = endpoints_from_pods([_pod("plain")], models=[MODEL], default_port=8000)[MODEL]
    assert plain.attention_backend == ""


def test_pods_become_endpoints_only_when_ready_labelled_and_addressed() -> None:
    pods = [
        _pod("ok", ip="10.0.0.1"),
        _pod("mig", ip="10.0.0.2", accelerator="h100-sxm_3g.40gb", extra={"hetsched.io/tp": "1"},
             port_name="http"),
        _pod("tp2", ip="10.0.0.3", accelerator="a100-80gb", extra={"hetsched.io/tp": "2"}),
        _pod("not-ready", ip="10.0.0.4", ready=False),
        _pod("deleting", ip="10.0.0.5", deleting=True),
        _pod("no-ip", ip=None),
        _pod("no-accelerator", ip="10.0.0.6", accelerator=None),
        _pod("other-model", ip="10.0.0.7", model="qwen3-8b"),
        _pod("bad-tp", ip="10.0.0.8", extra={"hetsched.io/tp": "two"}),
    ]
    found = endpoints_from_pods(pods, models=[MODEL], default_port=8000)
    assert [(e.url, e.accelerator, e.tp) for e in found[MODEL]] == [
        ("http://10.0.0.1:8000", "h100-sxm", 1),
        ("http://10.0.0.2:9000", "h100-sxm:3g.40gb", 1),
        ("http://10.0.0.3:8000", "a100-80gb", 2),
    ]


def _deployment(name: str, policy: str | None) -> dict:
    spec = {"model": "llama-3.1-8b"} | ({"routing": {"policy": policy}} if policy else {})
    return {"apiVersion": "hetsched.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": name}, "spec": spec}


def test_model_deployments_give_the_routing_policy_of_the_models_the_router_serves(
        caplog: pytest.LogCaptureFixture) -> None:
    items = [_deployment(MODEL, "least-kv"), _deployment("qwen3-8b", "prefix"), _deployment("other", "round-robin"),
             _deployment("unset", None), _deployment("typo", "fastest")]
    found = policies_from_deployments(items, models=[MODEL, "qwen3-8b", "unset", "typo"])
    assert found == {MODEL: Policy.LEAST_KV, "qwen3-8b": Policy.PREFIX}
    assert "typo" in caplog.text and "'fastest'" in caplog.text


def test_model_deployments_give_the_request_classes_of_the_models_the_router_serves(
        caplog: pytest.LogCaptureFixture) -> None:
    chat = _deployment(MODEL, None)
    chat["spec"] |= {"slo": {"ttft": "1s", "tpot": "100ms"}, "objectives": [
        {"name": "interactive", "priority": 10, "slo": {"ttft": "300ms", "tpot": "50ms"}},
        {"name": "batch", "sheddable": True, "share": 0.2, "bestEffort": True}]}
    broken = _deployment("qwen3-8b", None)
    broken["spec"]["objectives"] = [{"name": "x", "slo": {"ttft": "soon", "tpot": "1ms"}}]
    found = objectives_from_deployments([chat, broken, _deployment("unset", None)], models=[MODEL, "qwen3-8b", "unset"])
    assert found["unset"] == [] and "qwen3-8b" not in found and "qwen3-8b" in caplog.text
    interactive, batch = found[MODEL]
    assert (interactive.name, interactive.priority, interactive.slo.ttft_ms if interactive.slo else None) == (
        "interactive", 10, 300.0)
    assert batch.sheddable and batch.best_effort and batch.share == 0.2
    assert batch.slo is not None and batch.slo.ttft_ms == 1000.0  # the resource's own slo


def test_a_discovered_policy_applies_unless_the_router_file_sets_the_models_own() -> None:
    config = _config(policy="least-request")
    state = RouterState(config, rng=random.Random(0))
    state.set_endpoints(MODEL, config.static_endpoints())
    assert state.policy_for(MODEL) is Policy.LEAST_REQUEST
    state.discovered_policies = {MODEL: Policy.ROUND_ROBIN}
    assert state.decide(REQUEST, now=0.0).policy is Policy.ROUND_ROBIN
    pinned = _config(models={MODEL: {"policy": "least-kv", "endpoints": [{"url": "http://a:1", "accelerator": "l4"}]}})
    state = RouterState(pinned)
    state.discovered_policies = {MODEL: Policy.ROUND_ROBIN}
    assert state.policy_for(MODEL) is Policy.LEAST_KV


def test_the_pod_watcher_hands_on_policies_and_carries_on_without_model_deployments() -> None:
    import asyncio

    received: list[dict[str, Policy]] = []
    watcher = PodWatcher(models=[MODEL], namespace="serving", label_selector="hetsched.io/model",
                         default_port=8000, on_change=lambda found: None, on_policies=received.append,
                         on_objectives=lambda found: None)

    class Custom:
        def __init__(self, fail: bool) -> None:
            self.fail, self.calls = fail, []

        def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str) -> dict:
            self.calls.append((group, version, namespace, plural))
            if self.fail:
                raise RuntimeError("403 Forbidden")
            return {"items": [_deployment(MODEL, "power-of-two")]}

    loop = asyncio.new_event_loop()
    try:
        ok = Custom(fail=False)
        watcher._publish_policies(ok, loop)
        watcher._publish_policies(Custom(fail=True), loop)  # no RBAC for the CRD: logged, nothing handed on
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert ok.calls == [("hetsched.io", "v1alpha1", "serving", "modeldeployments")]
    assert received == [{MODEL: Policy.POWER_OF_TWO}]


def _config(**overrides: object) -> RouterConfig:
    raw = {"models": {MODEL: {"slo": {"ttft_ms": 500, "tpot_ms": 50}, "endpoints": [
        {"url": "http://a:1", "accelerator": "h100-sxm"}, {"url": "http://b:1", "accelerator": "l4"}]}}}
    raw.update(overrides)
    return parse_router_config(raw)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(InputError, match="models"):
        parse_router_config({"models": {}})
    with pytest.raises(InputError, match=r"models\.m\.endpoints\[0\]\.url"):
        parse_router_config({"models": {"m": {"endpoints": [{"url": "ftp://x", "accelerator": "l4"}]}}})
    with pytest.raises(InputError, match="policy"):
        _config(policy="fastest")
    with pytest.raises(InputError, match="twice"):
        parse_router_config({"models": {"m": {"endpoints": [{"url": "http://x", "accelerator": "l4"}] * 2}}})


def test_router_state_skips_ejected_endpoints_and_tracks_in_flight() -> None:
    config = _config()
    state = RouterState(config, rng=random.Random(0))
    state.set_endpoints(MODEL, config.static_endpoints())
    for t in (0.0, 0.1, 0.2):
        state.record_failure("http://a:1", now=t)
    decision = state.decide(REQUEST, now=1.0)
    assert decision.endpoint.url == "http://b:1"
    ticket = state.start("http://b:1", REQUEST)
    assert state.get("http://b:1").in_flight == 1
    state.finish(ticket)
    assert state.get("http://b:1").in_flight == 0
    assert state.decide(REQUEST, now=1.0, exclude=frozenset({"http://b:1"})).reason is DecisionReason.NO_ENDPOINT


def test_discovery_updates_keep_the_state_of_endpoints_that_stay() -> None:
    config = _config()
    state = RouterState(config)
    a, b = config.static_endpoints()
    state.set_endpoints(MODEL, [a, b])
    state.start(a.url, REQUEST)
    for t in (0.0, 0.1, 0.2):
        state.record_failure(b.url, now=t)
    c = Endpoint("http://c:1", MODEL, "a100-80gb")
    state.set_endpoints(MODEL, [a, c])
    assert b.url not in state and c.url in state
    assert state.get(a.url).in_flight == 1  # a request in flight survives a discovery update
    state.set_endpoints(MODEL, [a, b])
    assert state.get(b.url).health.available(1.0)  # a pod that comes back starts healthy


def test_the_shipped_router_example_loads_with_endpoints_for_every_model() -> None:
    from pathlib import Path

    from hetsched.router.config import load_router_config

    config = load_router_config(Path(__file__).parent.parent / "examples" / "router-local.yaml")
    assert {e.model for e in config.static_endpoints()} == set(config.models)


def _slo_state(endpoints: list[dict], *, seed: int = 3) -> RouterState:
    config = parse_router_config({"policy": "slo", "models": {MODEL: {
        "slo": {"ttft_ms": 500, "tpot_ms": 50}, "endpoints": endpoints}}})
    state = RouterState(config, rng=random.Random(seed))
    state.set_endpoints(MODEL, config.static_endpoints())
    return state


def _share(state: RouterState, requests: int = 300) -> dict[str, int]:
    """Requests each endpoint takes when each stays in flight for 20 arrivals (a steady load of 20)."""
    taken: dict[str, int] = {}
    tickets = []
    for _ in range(requests):
        decision = state.decide(REQUEST, now=0.0)
        assert decision.endpoint is not None
        taken[decision.endpoint.url] = taken.get(decision.endpoint.url, 0) + 1
        tickets.append(state.start(decision.endpoint.url, REQUEST))
        if len(tickets) > 20:
            state.finish(tickets.pop(0))
    return taken


def test_slo_policy_spreads_over_identical_endpoints() -> None:
    taken = _share(_slo_state([{"url": "http://b", "accelerator": "h100-sxm"},
                               {"url": "http://a", "accelerator": "h100-sxm"}]))
    assert abs(taken["http://a"] - taken["http://b"]) <= 0.1 * 300


def test_slo_policy_spreads_when_both_endpoints_are_idle() -> None:
    views = [view("http://a"), view("http://b")]
    rng = random.Random(5)
    picks = [chosen(Policy.SLO, views, profiles=_profiles(views), slo=SLO(ttft_ms=500, tpot_ms=50), rng=rng)
             for _ in range(200)]
    assert 80 <= picks.count("http://a") <= 120
    again = random.Random(5)
    assert picks == [chosen(Policy.SLO, views, profiles=_profiles(views), slo=SLO(ttft_ms=500, tpot_ms=50),
                            rng=again) for _ in range(200)]  # deterministic under a seeded RNG


def test_a_cheaper_endpoint_takes_more_while_it_meets_the_slo() -> None:
    taken = _share(_slo_state([{"url": "http://dear", "accelerator": "h100-sxm", "price_per_hour": 8.0},
                               {"url": "http://cheap", "accelerator": "h100-sxm", "price_per_hour": 4.0}]))
    assert taken.get("http://cheap", 0) > 2 * taken.get("http://dear", 0)


def test_a_prefix_hit_shortens_the_predicted_ttft_and_attracts_the_request() -> None:
    text = "You are a helpful assistant. " * 200
    hashes = prefix_hashes(text)
    request = RouteRequest(MODEL, prompt_tokens=2000, max_tokens=50, prefix_hashes=hashes)
    views = [view("http://a", in_flight=2), view("http://b", in_flight=2)]
    index = PrefixIndex()
    index.record(hashes, "http://b")
    matches = index.matches(hashes, [v.url for v in views])
    assert matches["http://b"] == len(hashes) > 0 and matches["http://a"] == 0
    cached = {url: blocks * PREFIX_BLOCK_TOKENS for url, blocks in matches.items()}
    slo = SLO(ttft_ms=500, tpot_ms=50)
    for seed in range(10):
        decision = decide(Policy.SLO, request, views, profiles=_profiles(views), slo=slo, cached=cached,
                          rng=random.Random(seed))
        assert decision.endpoint is not None and decision.endpoint.url == "http://b"
    assert decision.predictions["http://b"].ttft_s < 0.8 * decision.predictions["http://a"].ttft_s


def test_a_cached_prefix_wins_over_an_equal_endpoint_whose_requests_in_flight_are_shorter() -> None:
    """The price per token is the request's own on each endpoint's hardware, not that of the mix in flight there:
    the endpoint holding most of a conversation's history (and its long requests) still takes its next turn."""
    holder = EndpointView(Endpoint("http://a", MODEL, "h100-sxm"), in_flight=2, in_flight_prompt_tokens=3600,
                          in_flight_max_tokens=200)
    other = EndpointView(Endpoint("http://b", MODEL, "h100-sxm"), in_flight=1, in_flight_prompt_tokens=600,
                         in_flight_max_tokens=100)
    request = RouteRequest(MODEL, prompt_tokens=1500, max_tokens=100)
    views = [holder, other]
    for seed in range(10):
        decision = decide(Policy.SLO, request, views, profiles=_profiles(views), slo=SLO(ttft_ms=500, tpot_ms=50),
                          cached={"http://a": 1400}, rng=random.Random(seed))
        assert decision.endpoint is not None and decision.endpoint.url == "http://a"
    assert decision.predictions["http://a"].cost_per_token < decision.predictions["http://b"].cost_per_token
    equal = decide(Policy.SLO, request, views, profiles=_profiles(views), slo=SLO(ttft_ms=500, tpot_ms=50))
    assert equal.predictions["http://a"].cost_per_token == equal.predictions["http://b"].cost_per_token


def test_the_slo_policy_reads_the_prefix_index_through_the_state() -> None:
    state = _slo_state([{"url": "http://a", "accelerator": "h100-sxm"}, {"url": "http://b", "accelerator": "h100-sxm"}])
    hashes = prefix_hashes("You are a helpful assistant. " * 200)
    request = RouteRequest(MODEL, prompt_tokens=2000, max_tokens=50, prefix_hashes=hashes)
    first = state.decide(request, now=0.0).endpoint
    assert first is not None
    state.start(first.url, request)
    other = "http://a" if first.url == "http://b" else "http://b"
    state.start(other, RouteRequest(MODEL, prompt_tokens=2000, max_tokens=50))  # equal load, no prefix recorded
    assert all(state.decide(request, now=0.0).endpoint == first for _ in range(10))
