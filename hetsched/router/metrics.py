"""The router's own Prometheus metrics (names are a public interface: the autoscaler reads them).

With several router processes on one port (``hetsched route --workers N``), each keeps its samples in files
under ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, chosen when it is first imported) and
``/metrics`` answers with all of them summed, whichever process it reaches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from hetsched.engine_metrics.parse import ROUTER_QUEUED_DEMAND

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
ENDPOINT_LABELS = ("model", "endpoint", "accelerator", "role")
"""``role``: unified, or the stage a disaggregated model's endpoint serves (prefill, decode)."""
TRAFFIC_LABELS = (*ENDPOINT_LABELS, "front")
"""Request series also say which front took the request: ``http`` (``hetsched route``) or ``epp``."""
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Where router processes sharing a port keep their samples; set before prometheus_client is imported."""


class RouterMetrics:
    """One registry per router app, so several routers (tests, benchmarks) can live in one process; ``front`` is
    the value of every request series' ``front`` label (one front per process)."""

    def __init__(self, front: str) -> None:
        self.front = front
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hetsched_router_requests", "Requests answered, by upstream endpoint and status code",
                                (*TRAFFIC_LABELS, "code"), registry=r)
        self.ttft = Histogram("hetsched_router_time_to_first_token_seconds",
                              "Time to the first streamed token: from the upstream request, or for a two-stage "
                              "request from the client's to the decode's first token",
                              TRAFFIC_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hetsched_router_time_per_output_token_seconds",
                              "Mean time between streamed tokens after the first, per request",
                              TRAFFIC_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hetsched_router_request_latency_seconds",
                             "Request latency at the router: a prefill stage's own, a decode's from the client's request",
                             TRAFFIC_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hetsched_router_prompt_tokens",
                                     "Prompt tokens routed (by the model's tokenizer where the router has it, else "
                                     "estimated from text)", ("model", "front"), registry=r)
        self.generation_tokens = Counter("hetsched_router_generation_tokens",
                                         "Tokens generated: the engine's usage count, else one per content chunk",
                                         ("model", "front"), registry=r)
        self.decisions = Counter("hetsched_router_routing_decisions", "Routing decisions by policy and reason",
                                 ("model", "policy", "reason", "front"), registry=r)
        self.retries = Counter("hetsched_router_retries", "Attempts moved to another endpoint, by cause",
                               ("model", "reason", "front"), registry=r)
        self.rejected = Counter("hetsched_router_rejected", "Requests refused before reaching an engine",
                                ("model", "reason", "front"), registry=r)
        self.ejections = Counter("hetsched_router_ejections", "Endpoints ejected after consecutive failures",
                                 ENDPOINT_LABELS, registry=r)
        self.in_flight = Gauge("hetsched_router_in_flight_requests", "Requests the router has in flight",
                               TRAFFIC_LABELS, registry=r, multiprocess_mode="livesum")
        self.healthy = Gauge("hetsched_router_endpoint_healthy", "1 while the endpoint takes traffic, 0 when ejected",
                             ENDPOINT_LABELS, registry=r, multiprocess_mode="livemin")
        self.signals_fresh = Gauge("hetsched_router_endpoint_signals_fresh",
                                   "1 while the endpoint's /metrics is fresh, 0 when stale or unreadable",
                                   ENDPOINT_LABELS, registry=r, multiprocess_mode="livemin")

        self.step_model_scale = Gauge("hetsched_router_step_model_scale",
                                      "The correction in force over the step model, by phase (prefill, decode): "
                                      "what the router learned from its own timings, 1.0 for none",
                                      ("model", "accelerator", "phase"), registry=r, multiprocess_mode="mostrecent")
        self.learning_cpu = Counter("hetsched_router_calibration_cpu_seconds",
                                    "CPU seconds spent on the online correction: predicting the requests it learns "
                                    "from as they are sent, and learning from their answers", registry=r)
        self.prediction_error_ratio = Gauge("hetsched_router_prediction_error_ratio",
                                            "Predicted over observed p50 of TTFT or TPOT (metric) over the recent "
                                            "window of answered requests", ("model", "accelerator", "metric"),
                                            registry=r, multiprocess_mode="mostrecent")

        self.kv_blocks = Counter("hetsched_router_kv_event_blocks",
                                 "Blocks the engines' KV events reported, by kind (stored, removed, cleared)",
                                 ("model", "endpoint", "kind"), registry=r)
        self.kv_event_errors = Counter("hetsched_router_kv_event_errors",
                                       "KV-event problems that dropped an endpoint's index to the approximation, "
                                       "by reason (frames, msgpack, schema, unknown_tag, gap, late_join, "
                                       "block_size, flood, cap, connection)", ("model", "endpoint", "reason"), registry=r)
        self.kv_tokenize_errors = Counter("hetsched_router_kv_tokenize_errors",
                                          "Prompts the model's tokenizer failed on (routed by the approximation)",
                                          ("model", "front"), registry=r)
        self.kv_index_entries = Gauge("hetsched_router_kv_index_entries",
                                      "Distinct blocks in the model's KV index, over its media",
                                      ("model",), registry=r, multiprocess_mode="max")
        self.kv_index_bytes = Gauge("hetsched_router_kv_index_bytes", "Memory of the model's KV index",
                                    ("model",), registry=r, multiprocess_mode="max")
        self.kv_source = Gauge("hetsched_router_prefix_source_events",
                               "1 while the endpoint's cached prefix comes from its KV events, 0 while the "
                               "approximation stands in", ("model", "endpoint"), registry=r,
                               multiprocess_mode="livemin")

        flow = ("model", "objective", "tenant")
        self.flow_queued = Gauge("hetsched_router_flow_queued_requests",
                                 "Requests waiting in flow control's queue, by class (objective) and tenant",
                                 (*flow, "front"), registry=r, multiprocess_mode="livesum")
        self.flow_queued_demand = Gauge(ROUTER_QUEUED_DEMAND,
                                        "Requests waiting in flow control's queue whose class may add replicas "
                                        "(not best-effort): the backlog the autoscaler drains",
                                        ("model", "front"), registry=r, multiprocess_mode="livesum")
        self.flow_wait = Histogram("hetsched_router_flow_queue_seconds",
                                   "Time a request that waited spent in flow control's queue", (*flow, "front"),
                                   buckets=QUEUE_BUCKETS, registry=r)
        self.flow_dispatched = Counter("hetsched_router_flow_dispatched",
                                       "Requests sent on to an endpoint, queued first or not", (*flow, "front"),
                                       registry=r)
        self.flow_shed = Counter("hetsched_router_flow_shed", "Requests flow control refused (429), by reason",
                                 (*flow, "reason", "front"), registry=r)
        self.flow_slo = Counter("hetsched_router_flow_slo", "Answered requests by whether they met their class's "
                                "SLO (met: true or false), TTFT and TPOT counted from their arrival at the router",
                                (*flow, "met", "front"), registry=r)
        self.unknown_objective = Counter("hetsched_router_unknown_objective",
                                         "Requests naming an objective their model does not declare (served as "
                                         "its default class)", ("model", "front"), registry=r)

        self._endpoints: dict[tuple[str, str, str, str], EndpointSeries] = {}
        self._models: dict[str, ModelSeries] = {}

    def endpoint(self, labels: tuple[str, str, str, str]) -> EndpointSeries:
        """The request series of the endpoint with these :data:`ENDPOINT_LABELS` values, resolved on first use."""
        series = self._endpoints.get(labels)
        if series is None:
            series = self._endpoints[labels] = EndpointSeries(self, labels)
        return series

    def model(self, name: str) -> ModelSeries:
        """The per-model series of ``name``, resolved on first use."""
        series = self._models.get(name)
        if series is None:
            series = self._models[name] = ModelSeries(self, name)
        return series

    def forget(self, labels: tuple[str, str, str, str]) -> None:
        """Drop a gone endpoint's gauge series (so dashboards show no ghosts) and its resolved children."""
        self._endpoints.pop(labels, None)
        for gauge in (self.healthy, self.signals_fresh):
            gauge.remove(*labels)
        self.in_flight.remove(*labels, self.front)

    def forget_tenant(self, model: str, tenant: str, classes: list[str], reasons: list[str]) -> None:
        """Drop a tenant's flow series (flow control dropped the tenant: the ids a flood sends stay bounded)."""
        for objective in classes:
            labels = (model, objective, tenant, self.front)
            for metric in (self.flow_queued, self.flow_wait, self.flow_dispatched):
                _remove(metric, labels)
            for met in ("true", "false"):
                _remove(self.flow_slo, (model, objective, tenant, met, self.front))
            for reason in reasons:
                _remove(self.flow_shed, (model, objective, tenant, reason, self.front))

    def rejected_requests(self, model: str, reason: str) -> Any:
        return self.rejected.labels(model, reason, self.front)

    def retried(self, model: str, reason: str) -> Any:
        return self.retries.labels(model, reason, self.front)

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers: every router process's samples summed when several share the port."""
        if os.environ.get(MULTIPROCESS_ENV):
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)


def _remove(metric: Any, labels: tuple[str, ...]) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never recorded
        pass


@dataclass(eq=False)
class EndpointSeries:
    """One endpoint's children of the per-endpoint metrics.

    ``labels()`` joins, hashes and looks up its label values under a lock on every call; the router's hot
    path counts each request in five to seven series, so it resolves them once per endpoint instead.
    """

    metrics: RouterMetrics
    labels: tuple[str, str, str, str]
    in_flight: Any = field(init=False)
    e2e: Any = field(init=False)
    ttft: Any = field(init=False)
    tpot: Any = field(init=False)
    _codes: dict[str, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        m, labels = self.metrics, (*self.labels, self.metrics.front)
        self.in_flight = m.in_flight.labels(*labels)
        self.e2e, self.ttft, self.tpot = (h.labels(*labels) for h in (m.e2e, m.ttft, m.tpot))

    def requests(self, code: str) -> Any:
        """The request counter child for status ``code``."""
        child = self._codes.get(code)
        if child is None:
            child = self._codes[code] = self.metrics.requests.labels(*self.labels, self.metrics.front, code)
        return child


@dataclass(eq=False)
class ModelSeries:
    """One model's children of the per-model counters (see :class:`EndpointSeries` for why)."""

    metrics: RouterMetrics
    model: str
    prompt_tokens: Any = field(init=False)
    generation_tokens: Any = field(init=False)
    _decisions: dict[tuple[str, str], Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        front = self.metrics.front
        self.prompt_tokens = self.metrics.prompt_tokens.labels(self.model, front)
        self.generation_tokens = self.metrics.generation_tokens.labels(self.model, front)

    def decisions(self, policy: str, reason: str) -> Any:
        """The routing-decision counter child for ``policy`` and ``reason``."""
        key = (policy, reason)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self.metrics.decisions.labels(self.model, policy, reason, self.metrics.front)
        return child
