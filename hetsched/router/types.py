"""Typed values the router's decision works on: endpoints, their live view, requests, decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from hetsched.perf.correction import Parts
from hetsched.sim.roles import Role
from hetsched.specs.wire import DEFAULT_OBJECTIVE
from hetsched.specs.workload import SLO


class Policy(StrEnum):
    """How the router picks one endpoint of a model's pool."""

    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"
    POWER_OF_TWO = "power-of-two"
    LEAST_KV = "least-kv"
    PREFIX = "prefix"
    KV_AWARE = "kv-aware"
    SLO = "slo"


class Front(StrEnum):
    """How a request reached the picker: proxied by ``hetsched route``, or asked about by a gateway's ext_proc."""

    HTTP = "http"
    EPP = "epp"


class DecisionReason(StrEnum):
    """Why a decision came out the way it did (a metric label and a log field)."""

    CHOSEN = "chosen"
    """A load-based policy picked the endpoint."""
    PREFIX_HIT = "prefix-hit"
    """The endpoint already served this prompt's leading blocks."""
    SLO_MET = "slo-met"
    """The best-scored endpoint (price, then predicted latency and load) among those predicted to meet the SLO."""
    SLO_FALLBACK = "slo-fallback"
    """No endpoint is predicted to meet the SLO; the least-violating one."""
    ALL_SATURATED = "all-saturated"
    """Every healthy endpoint is at its concurrency or queue limit: answer 429."""
    NO_ENDPOINT = "no-endpoint"
    """No healthy endpoint is left to try: answer 503."""


@dataclass(frozen=True)
class Endpoint:
    """One serving replica of one model."""

    url: str
    model: str
    accelerator: str
    """Catalog device id: ``h100-sxm``, a MIG slice ``h100-sxm:3g.40gb`` or an AMD partition."""
    tp: int = 1
    max_concurrency: int = 256
    """Requests the router keeps in flight here before calling it saturated."""
    price_per_hour: float | None = None
    """Cost of the whole replica (all TP devices); None takes the catalog price × tp."""
    role: Role = Role.UNIFIED
    """A prefill or decode instance serves one stage of a disaggregated model's requests."""
    engine: str = ""
    """The engine build (``vllm 0.11.0``) when known: a correction learned under one is not applied to another."""
    attention_backend: str = ""
    """The engine's attention backend (``FLASH_ATTN``, ``FLASHINFER``, ``TORCH_SDPA``) when known."""
    kv_events: str = ""
    """``tcp://HOST:PORT`` the engine publishes its KV-cache events at (empty: none; the router approximates)."""
    kv_events_replay: str = ""
    """``tcp://HOST:PORT`` of the engine's replay socket, which recovers a gap in the events (empty: none)."""


@dataclass(frozen=True)
class EngineSignals:
    """What an engine's ``/metrics`` said at ``scraped_at``; None where the engine does not report it."""

    scraped_at: float
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    """Share of the KV cache in use, 0..1."""
    kv_capacity_tokens: int | None = None
    """From ``vllm:cache_config_info`` (blocks × block size) when reported."""


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One candidate as a policy sees it: the router's own counts plus fresh engine signals.

    ``running``, ``waiting`` and ``kv_usage`` are None when unknown (stale or
    missing metrics); policies never read unknown as idle. The engine's counts hold every router's requests
    (other processes and replicas too) as of its last reading; ``since_signals`` are this router's sent after it.
    """

    endpoint: Endpoint
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    in_flight_max_tokens: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    max_queue: int = 64
    since_signals: int = 0
    """This router's requests still in flight here that it sent after the engine's signals were read."""
    max_kv_usage: float = 1.0
    prompt_tokens_per_s: float | None = None
    """Prompt tokens this router has lately sent here per second (None: not counted): what comes to share a new
    request's first chunk, counted rather than inferred from the requests in flight."""

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def load(self) -> int:
        """Requests at the endpoint: the engine's count (all routers') plus this router's since, never less than
        this router's own in flight."""
        if self.running is None or self.waiting is None:
            return self.in_flight
        return max(self.in_flight, self.running + self.waiting + self.since_signals)

    @property
    def saturated(self) -> bool:
        """At its concurrency limit, or its engine's queue or KV use at the model's threshold."""
        return self.in_flight >= self.endpoint.max_concurrency or (
            self.waiting is not None and self.waiting >= self.max_queue) or (
            self.kv_usage is not None and self.kv_usage >= self.max_kv_usage)


DEFAULT_CLASS = DEFAULT_OBJECTIVE
"""The class of a request that names none: the model's own SLO, priority 0, not sheddable."""


@dataclass(frozen=True)
class RequestClass:
    """An objective a model serves: its priority, SLO and place under overload (flow control's unit)."""

    name: str
    priority: int = 0
    slo: SLO | None = None
    sheddable: bool = False
    share: float | None = None
    """Share of the model's requests in flight this class is owed under overload, whatever its priority."""
    best_effort: bool = False
    """Its demand never makes the autoscaler add replicas."""


@dataclass(frozen=True)
class RouteRequest:
    """What the decision needs to know about one request."""

    model: str
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    """The approximation's hashes of the prompt text's leading blocks (:mod:`hetsched.router.prefix`)."""
    slo: SLO | None = None
    objective: str = DEFAULT_CLASS
    """The request's class (:class:`RequestClass`): from ``x-gateway-inference-objective`` or its API key."""
    fairness_id: str = ""
    """The tenant it is fair-shared as: ``x-gateway-inference-fairness-id``, else its API key's tenant."""
    arrived: float = 0.0
    """When the picker first read it (the router's clock): its queueing and SLO count from here."""
    kv_hashes: tuple[int, ...] = ()
    """vLLM's block hashes of the prompt's tokens, as its engines compute them (empty: none could be computed)."""


@dataclass(frozen=True)
class Handoff:
    """Where a two-stage request's KV cache goes, as the ``slo`` policy's prefill choice needs it.

    The prefill stage's share of the TTFT target is what the decode stage leaves: the client's first token
    comes after the prefill, the KV transfer over the slower link, and the decode instance's own wait and step.
    """

    network_gbs: float | None
    """The decode instance's network share (None: unknown, the prefill's own link decides)."""
    ttft_s: float = 0.0
    """The decode instance's predicted time from the KV's arrival to the first token."""


@dataclass(frozen=True)
class Prediction:
    """Predicted latency and cost of serving one request on one endpoint.

    For a prefill stage the TTFT runs to the client's first token (the handoff's transfer and decode included),
    TPOT is 0 and the cost is per prompt token; a decode stage's TTFT runs from the KV's arrival.
    """

    ttft_s: float
    tpot_s: float
    cost_per_token: float
    """Dollars per generated token at the endpoint's full batch: what its capacity costs, whatever its load."""
    meets_slo: bool
    violation: float
    """max(TTFT / target, TPOT / target); ≤ 1 meets the SLO (before headroom)."""
    ttft_parts: Parts | None = None
    """The TTFT as the base step model's parts (what the online correction learns from); None for a prefill stage,
    whose TTFT also holds a transfer and another instance's."""
    tpot_parts: Parts | None = None
    queue_wait_s: float = 0.0
    """The share of the TTFT spent waiting for a sequence slot or KV space."""


@dataclass(frozen=True)
class RoutingDecision:
    """The router's answer for one request: where to, by which rule, and why."""

    endpoint: Endpoint | None
    policy: Policy
    reason: DecisionReason
    prediction: Prediction | None = None
    candidates: int = 0
    predictions: dict[str, Prediction] = field(default_factory=dict)
    """Per endpoint URL, for the ``slo`` policy (explains the choice)."""
