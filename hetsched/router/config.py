"""Router configuration: one YAML file, validated with pydantic (errors name the field).

```yaml
port: 8000
policy: slo                      # default for models that do not set one
auth_token_env: ROUTER_TOKEN     # bearer token every route but /health needs, read from this variable
allowed_hosts: [router.example]  # Host names besides loopback ones (DNS rebinding); default: any off loopback
discovery: {kind: static}        # or {kind: kubernetes, namespace: serving, port: 8000}
flow: {max_queued_requests: 1024}  # the queue a saturated model's requests wait in (see router/flow.py)
api_keys:                        # a key names its holder's tenant and, optionally, class
  - {key_env: TEAM_A_KEY, tenant: team-a, objective: batch}
models:
  llama-3.1-8b:
    slo: {ttft_ms: 500, tpot_ms: 50}   # the default class's
    objectives:                  # classes a request names by x-gateway-inference-objective or its API key
      - {name: interactive, priority: 10, slo: {ttft_ms: 300, tpot_ms: 50}}
      - {name: batch, priority: 0, slo: {ttft_ms: 20000, tpot_ms: 200}, sheddable: true}
    endpoints:
      - {url: "http://10.0.0.5:8000", accelerator: h100-sxm}
      - {url: "http://10.0.0.6:8000", accelerator: l4, tp: 1, kv_events: "tcp://10.0.0.6:5557"}
    kv_cache: {tokenizer: /models/llama-3.1-8b, block_size: 16}   # hash prompts as the engines do
  llama-3.1-70b:                 # disaggregated: each request is prefilled on one endpoint, decoded on another
    endpoints:
      - {url: "http://10.0.1.5:8000", accelerator: h100-sxm, tp: 4, role: prefill}
      - {url: "http://10.0.1.6:8000", accelerator: a100-80gb, tp: 4, role: decode}
```
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from collections.abc import Sequence
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from hetsched.errors import InputError, NotFoundError, invalid_input
from hetsched.kvcache.hashing import DEFAULT_SEED, HashAlgorithm
from hetsched.settings.server import ServerLimits
from hetsched.specs.files import read_document
from hetsched.router.health import HealthSettings
from hetsched.router.types import DEFAULT_CLASS, Endpoint, Policy, RequestClass
from hetsched.sim.roles import Role
from hetsched.specs.wire import ATTENTION_BACKEND, OBJECTIVE_NAME, Label
from hetsched.specs.workload import SLO


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _http_url(value: str) -> str:
    """``http(s)://host[:port][/path]`` with a host, and a port in 1..65535 when one is given."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        port = 0
    else:
        if parts.scheme in ("http", "https") and parts.hostname and port != 0:
            return value
    raise ValueError(f"expected http(s)://host[:port] with a port in 1..65535, got {value!r}"
                     if port == 0 else f"expected http(s)://host[:port], got {value!r}")


HttpUrl = Annotated[str, AfterValidator(_http_url)]
"""A base URL the router or the autoscaler connects to, checked when the file is read rather than at the first request."""


def _tcp_address(value: str) -> str:
    """``tcp://host:port`` with a host and a port in 1..65535 (a ZMQ address the router connects to)."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port or parts.path not in ("", "/"):
        raise ValueError(f"expected tcp://host:port with a port in 1..65535, got {value!r}")
    return value.rstrip("/")


TcpAddress = Annotated[str, AfterValidator(_tcp_address)]


class DiscoveryKind(StrEnum):
    STATIC = "static"
    KUBERNETES = "kubernetes"


class EndpointConfig(_Strict):
    url: HttpUrl = Field(description="base URL of an OpenAI-compatible server")
    accelerator: str = Field(description="catalog device id, e.g. h100-sxm, h100-sxm:3g.40gb")
    tp: StrictInt = Field(1, ge=1)
    max_concurrency: StrictInt = Field(256, ge=1)
    price_per_hour: float | None = Field(None, ge=0)
    role: Role = Field(Role.UNIFIED, description="prefill or decode: one stage of a disaggregated model's requests")
    engine: str = Field("", max_length=63, description="engine build, e.g. 'vllm 0.11.0': corrections are learned "
                                                        "per build")
    attention_backend: str = Field("", pattern=f"^$|{ATTENTION_BACKEND}", description=(
        "the engine's attention backend as vLLM names it, e.g. FLASH_ATTN: corrections are learned per backend"))
    kv_events: TcpAddress | None = Field(None, description=(
        "where the engine publishes its KV-cache events (vLLM --kv-events-config endpoint), e.g. tcp://10.0.0.5:5557"))
    kv_events_replay: TcpAddress | None = Field(None, description="the engine's replay socket, to recover a gap")


MAX_PRIORITY = 1000


class ObjectiveConfig(_Strict):
    """A class of a model's requests (the inference extension's InferenceObjective, with its own SLO)."""

    name: str = Field(pattern=OBJECTIVE_NAME, description="lower-case letters, digits, '-', '.', '_'; 63 at most")
    priority: StrictInt = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="higher goes first under overload")
    slo: SLO | None = Field(None, description="default: the model's")
    sheddable: bool = Field(False, description="refused first when the queue is full")
    share: float | None = Field(None, gt=0, le=1, description="share of the model's requests in flight it is owed")
    best_effort: bool = Field(False, description="its demand never adds replicas")

    @field_validator("name")
    @classmethod
    def _not_default(cls, name: str) -> str:
        if name == DEFAULT_CLASS:
            raise ValueError(f"{DEFAULT_CLASS!r} is the class of requests that name none (the model's own slo)")
        return name


class KVCacheConfig(_Strict):
    """How the model's engines hash their prefix-cache blocks, so the router's hashes of a prompt equal theirs."""

    tokenizer: str | None = Field(None, description=(
        "model directory (or tokenizer cache path) holding tokenizer.json, and tokenizer_config.json's chat template; "
        "default: deterministic ids from the text, as the simulated worker hashes without one"))
    block_size: StrictInt = Field(16, ge=1, le=4096, description="the engines' --block-size")
    hash_algorithm: HashAlgorithm = Field(HashAlgorithm.SHA256, description="the engines' --prefix-caching-hash-algo")
    hash_seed: str = Field(DEFAULT_SEED, min_length=1, description="the engines' PYTHONHASHSEED when they set one")
    max_blocks: StrictInt = Field(4_000_000, ge=1024, description=(
        "distinct blocks the index holds per medium; over it, the endpoint holding most is dropped"))
    resync_s: float = Field(10.0, ge=0, description=(
        "after an endpoint's index was dropped (a gap, a bad frame), how long it refills before it is used"))
    max_blocks_per_s: float = Field(1_000_000.0, gt=0, description=(
        "blocks an endpoint may report per second, averaged over a second; more is a flood and drops its index"))


class ModelConfig(_Strict):
    arch: str | None = Field(None, description="bundled model or config.json for the step-latency model; "
                                               "default: the served model name")
    policy: Policy | None = None
    slo: SLO | None = None
    objectives: list[ObjectiveConfig] = Field(default_factory=list)
    max_queue: StrictInt = Field(64, ge=1, description="engine waiting queue at which an endpoint counts as saturated")
    max_kv_usage: float = Field(0.95, gt=0, le=1, description="KV-cache use at which an endpoint counts as saturated")
    max_model_len: StrictInt = Field(8192, ge=16)
    kv_cache: KVCacheConfig = KVCacheConfig()
    endpoints: list[EndpointConfig] = Field(default_factory=list)

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, objectives: list[ObjectiveConfig]) -> list[ObjectiveConfig]:
        names = [o.name for o in objectives]
        if len(names) != len(set(names)):
            raise ValueError("an objective name appears twice")
        shares = sum(o.share or 0.0 for o in objectives)
        if shares > 1 + 1e-9:
            raise ValueError(f"the objectives' shares add up to {shares:g}; at most 1")
        return objectives

    def classes(self) -> dict[str, RequestClass]:
        """The model's request classes by name: its objectives and :data:`DEFAULT_CLASS`."""
        found = {DEFAULT_CLASS: RequestClass(DEFAULT_CLASS, slo=self.slo)}
        for o in self.objectives:
            found[o.name] = RequestClass(o.name, priority=o.priority, slo=o.slo or self.slo, sheddable=o.sheddable,
                                         share=o.share, best_effort=o.best_effort)
        return found


class CalibrationConfig(_Strict):
    """Online recalibration of the step model from the router's own timings (see :mod:`hetsched.router.learning`)."""

    online: bool = Field(True, description="learn a correction per model, accelerator, TP, engine and backend; "
                                           "a trusted one is in force for the slo policy's predictions")
    trusted_observations: StrictInt = Field(50, ge=1, description="observations before a correction is trusted")
    trusted_sd: float = Field(0.1, gt=0, le=1, description="relative uncertainty a trusted correction is within")
    samples_per_s: float = Field(20.0, gt=0, description=(
        "requests per second and endpoint learned from, at most: the others cost nothing, and a busy fleet still "
        "gives each type hundreds of observations a minute"))


class FlowConfig(_Strict):
    """The per-model queue saturated requests wait in (see :mod:`hetsched.router.flow`)."""

    enabled: bool = Field(True, description="false: a saturated model answers 429 at once, in arrival order")
    max_queued_requests: StrictInt = Field(1024, ge=1, description="per model")
    max_queued_bytes: StrictInt = Field(64 << 20, ge=1024, description="request bodies queued per model")
    max_tenants: StrictInt = Field(10_000, ge=1, description="tenants tracked per model; the oldest idle go first")
    max_wait_s: float = Field(30.0, gt=0, description="the longest wait of a class without a TTFT SLO")
    recheck_interval_s: float = Field(0.05, gt=0, description="how often a waiting model is checked for room "
                                                              "besides when a request ends")
    reserved_share: float = Field(0.1, ge=0, lt=1, description=(
        "share of each endpoint's max_concurrency only a model's highest-priority class may fill, so its requests "
        "find room without waiting for others to end"))


class ApiKeyConfig(_Strict):
    """A bearer token that names its holder: the tenant it is fair-shared as, and optionally its class."""

    key_env: str = Field(min_length=1, description="environment variable holding the key")
    tenant: str = Field(min_length=1, max_length=256)
    objective: str | None = Field(None, pattern=OBJECTIVE_NAME)


class HealthConfig(_Strict):
    eject_after_failures: StrictInt = Field(3, ge=1)
    base_ejection_s: float = Field(5.0, gt=0)
    max_ejection_s: float = Field(60.0, gt=0)
    check_interval_s: float = Field(1.0, gt=0)
    check_timeout_s: float = Field(1.0, gt=0)

    def settings(self) -> HealthSettings:
        return HealthSettings(**self.model_dump())


class DiscoveryConfig(_Strict):
    kind: DiscoveryKind = DiscoveryKind.STATIC
    namespace: str | None = Field(None, description="kubernetes: namespace to watch (default: all)")
    port: StrictInt = Field(8000, ge=1, le=65535, description="kubernetes: port when the pod names none 'http'")
    label_selector: str = f"{Label.MODEL},{Label.ACCELERATOR}"


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: StrictInt = Field(8000, ge=0, le=65535, description="0: any free port")
    policy: Policy = Policy.SLO
    slo_headroom: float = Field(0.8, gt=0, le=1, description="share of the SLO a prediction may use")
    time_scale: float = Field(1.0, gt=0, description=(
        "simulated seconds per wall second of the endpoints when they are twins (sim-worker --time-scale): "
        "SLOs and flow control's deadlines are in wall time, predictions are scaled to match"))
    auth_token_env: str | None = Field(None, description="environment variable holding the bearer token")
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    max_body_bytes: StrictInt = Field(ServerLimits.max_body_bytes, ge=1024, description="larger bodies get 413")
    body_timeout_s: float = Field(ServerLimits.body_timeout_s, gt=0,
                                  description="a request body must arrive within this long, else 408")
    header_timeout_s: float = Field(ServerLimits.header_timeout_s, gt=0,
                                    description="a connection must send a request head within this long")
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "Host header names accepted besides loopback ones; empty: any, unless the request came over loopback"))
    max_attempts: StrictInt = Field(3, ge=1, description="endpoints tried before giving up on a request")
    retry_after_s: StrictInt = Field(1, ge=1, description="Retry-After of a 429 when every endpoint is saturated")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often each endpoint's /metrics is read")
    metrics_stale_after_s: float = Field(5.0, gt=0, description="older signals count as unknown")
    health: HealthConfig = HealthConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    flow: FlowConfig = FlowConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    models: dict[str, ModelConfig] = Field(min_length=1)

    @field_validator("models")
    @classmethod
    def _unique_urls(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name, model in models.items():
            urls = [e.url for e in model.endpoints]
            if len(urls) != len(set(urls)):
                raise ValueError(f"model {name!r} lists an endpoint URL twice")
            roles = {e.role for e in model.endpoints}
            if roles & {Role.PREFILL, Role.DECODE} and roles != {Role.PREFILL, Role.DECODE}:
                raise ValueError(f"model {name!r} has {', '.join(sorted(roles))} endpoints: a disaggregated model "
                                 "needs prefill and decode endpoints and no unified ones")
        return models

    def auth_token(self) -> str | None:
        if self.auth_token_env is None:
            return None
        token = os.environ.get(self.auth_token_env)
        if not token:
            raise InputError(f"environment variable {self.auth_token_env} is empty or unset", field="auth_token_env")
        return token

    def api_key_holders(self) -> dict[str, ApiKeyConfig]:
        """Each API key (read from its variable) to whom it names; an empty or unset variable is an error."""
        holders: dict[str, ApiKeyConfig] = {}
        for i, entry in enumerate(self.api_keys):
            key = os.environ.get(entry.key_env)
            if not key:
                raise InputError(f"environment variable {entry.key_env} is empty or unset",
                                 field=f"api_keys[{i}].key_env")
            holders[key] = entry
        return holders

    def limits(self) -> ServerLimits:
        return ServerLimits(max_body_bytes=self.max_body_bytes, body_timeout_s=self.body_timeout_s,
                            header_timeout_s=self.header_timeout_s, allowed_hosts=tuple(self.allowed_hosts))

    def model(self, name: str) -> ModelConfig:
        try:
            return self.models[name]
        except KeyError:
            raise NotFoundError("model", name, self.models) from None

    def static_endpoints(self) -> list[Endpoint]:
        return [Endpoint(url=e.url.rstrip("/"), model=name, accelerator=e.accelerator, tp=e.tp,
                         max_concurrency=e.max_concurrency, price_per_hour=e.price_per_hour, role=e.role,
                         engine=e.engine, attention_backend=e.attention_backend, kv_events=e.kv_events or "",
                         kv_events_replay=e.kv_events_replay or "")
                for name, model in self.models.items() for e in model.endpoints]


def picker_config(file: RouterConfig | None, models: Sequence[str], *, from_pool: bool) -> RouterConfig:
    """What an endpoint picker serves: the router file (each of the named ``models``, ``--model``, must be in it),
    or without one the named models with the defaults. From a pool, the named models (else the file's) with the
    pool's pods as their endpoints, not the file's."""
    if file is None:
        if not models:
            raise InputError("name the model(s) the pool serves with --model, or give a --config file",
                             field="--model")
        return parse_router_config({"models": {name: {} for name in models}}, source="--model")
    missing = [name for name in models if name not in file.models]
    if missing:
        raise InputError(f"{', '.join(missing)} not in the file's models ({', '.join(file.models)})", field="--model")
    if not from_pool:
        return file
    return file.model_copy(update={"models": {name: file.models[name].model_copy(update={"endpoints": []})
                                              for name in (models or file.models)}})


def parse_router_config(raw: Any, *, source: str = "router config") -> RouterConfig:
    try:
        return RouterConfig.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc, source=source) from exc


def load_router_config(path: str | Path) -> RouterConfig:
    path = Path(path)
    raw = read_document(path, field="--config")
    return parse_router_config(raw, source=str(path))
