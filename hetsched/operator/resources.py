"""The custom resources of group ``hetsched.io/v1alpha1`` as pydantic types.

These types are the one source of truth: ``hetsched crds`` renders the CRD
YAML in ``crds/`` from them, and the operator parses every object it reads
through them, so a bad object fails with the field path in the message.
Field names follow the Kubernetes camelCase convention on the wire.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict

from hetsched.optimizer.spec import Disaggregation
from hetsched.router.types import Policy
from hetsched.settings.operator import Approval
from hetsched.specs.dtypes import DType
from hetsched.specs.durations import DURATION_PATTERN
from hetsched.specs.wire import (ACCELERATOR_POOL_PLURAL, ATTENTION_BACKEND, DEFAULT_OBJECTIVE, GROUP,
                                  MODEL_DEPLOYMENT_PLURAL, OBJECTIVE_NAME, PLACEMENT_PLAN_PLURAL)

_NUMBER, _SUFFIX = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)", r"([KMGTPE]i|[numkMGTPE])"
QUANTITY_PATTERN = rf"^\+?{_NUMBER}({_SUFFIX}|[eE][+-]?[0-9]+)?$"
"""A non-negative Kubernetes quantity (``500m``, ``1.5Gi``, ``1e3``): what the API server accepts for a request."""
_QUANTITY = re.compile(rf"(?P<number>[+-]?{_NUMBER})((?P<suffix>{_SUFFIX})|[eE](?P<exponent>[+-]?[0-9]+))?")
_SUFFIX_FACTOR = {**{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
                  **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9),
                                                        ("T", 12), ("P", 15), ("E", 18))}}
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SERVICE_NAME_PATTERN = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
"""An RFC 1035 label, what a Service's name must be: a ModelDeployment's Service and label values carry its name."""
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


def quantity_value(text: str) -> Decimal | None:
    """The amount a Kubernetes quantity stands for, so ``0.5`` and ``500m`` compare equal; None: not a quantity."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return None
    number = Decimal(match["number"])
    if match["exponent"] is not None:
        return number.scaleb(int(match["exponent"]))
    return number * _SUFFIX_FACTOR.get(match["suffix"] or "", Decimal(1))


class _Wire(BaseModel):
    """Base of CR parts: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class _Status(_Wire):
    """Status parts accept fields they do not know: other writers (the autoscaler) add to status."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    """Conditions the operator reports on ModelDeployments and PlacementPlans."""

    PLANNED = "Planned"
    APPLIED = "Applied"
    READY = "Ready"
    DEGRADED = "Degraded"
    CALIBRATED = "Calibrated"
    """A step-model correction learned from the engine pods moved the model's plan."""


class Condition(_Status):
    """A status condition in the Kubernetes convention (metav1.Condition)."""

    type: str = Field(min_length=1, max_length=316)
    status: ConditionStatus
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN)
    message: str = Field("", max_length=32768)
    last_transition_time: datetime = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


_CONDITION_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


def set_condition(conditions: list[Condition], *, type: ConditionType, status: ConditionStatus, reason: str,
                  message: str, generation: int | None, now: datetime | None = None) -> list[Condition]:
    """Conditions with one set; ``lastTransitionTime`` moves only when the status flips."""
    old = next((c for c in conditions if c.type == type), None)
    if old is not None and old.status == status:
        stamp = old.last_transition_time
    else:
        stamp = now or datetime.now(UTC).replace(microsecond=0)
    new = Condition(type=type.value, status=status, reason=reason, message=message, last_transition_time=stamp,
                    observed_generation=generation)
    return [*(c for c in conditions if c.type != type), new]


# --- AcceleratorPool (cluster-scoped) ---------------------------------------------------------------------------


class PartitionPolicy(StrEnum):
    """Whether the optimizer may split the pool's GPUs (MIG on NVIDIA, compute partitions on AMD)."""

    DISABLED = "disabled"
    ALLOWED = "allowed"


class Toleration(_Wire):
    """A pod toleration the pool's nodes need (their taints)."""

    key: str | None = None
    operator: str = Field("Equal", pattern="^(Equal|Exists)$")
    value: str | None = None
    effect: str | None = Field(None, pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")


class AcceleratorPoolSpec(_Wire):
    """Which nodes form the pool, what a GPU of it costs, and whether it may be split."""

    node_selector: dict[str, str] = Field(min_length=1, description="labels a node must carry to be in the pool")
    accelerator: str | None = Field(None, pattern=DNS_LABEL_PATTERN,
                                    description="catalog id; default: detected from the nodes' product labels")
    price_per_hour: float | None = Field(None, ge=0, description="per GPU per hour; default: the catalog's")
    partitioning: PartitionPolicy | None = Field(
        None, description="may the plan split these GPUs (MIG on NVIDIA, compute partitions on AMD); default: "
                          "disabled")
    mig: PartitionPolicy | None = Field(None, description="deprecated: the former name of partitioning, read until "
                                                          "the next release")
    max_gpus: int | None = Field(None, ge=0, description="use at most this many GPUs of the pool")
    tolerations: list[Toleration] = Field(default_factory=list, description="added to pods placed on the pool")

    # Neither field has a default in the CRD: the API server would write it into every pool, and a pool that still
    # says only ``mig: allowed`` would read back with ``partitioning: disabled`` beside it.

    @model_validator(mode="after")
    def _one_partitioning(self) -> AcceleratorPoolSpec:
        if self.partitioning is not None and self.mig is not None and self.partitioning is not self.mig:
            raise ValueError(f"partitioning is {self.partitioning.value} but mig, its former name, is "
                             f"{self.mig.value}; keep partitioning alone")
        return self

    @property
    def may_partition(self) -> bool:
        """Whether the plan may split the pool's GPUs: ``partitioning``, else its former name ``mig``."""
        return (self.partitioning or self.mig) is PartitionPolicy.ALLOWED

    @property
    def deprecations(self) -> list[str]:
        """What the spec says with a name that is going away, and the name to use."""
        return (["spec.mig is deprecated and read until the next release: rename it spec.partitioning"]
                if self.mig is not None else [])


class NodeInventory(_Status):
    """One node of a pool as its labels describe it."""

    name: str
    accelerator: str | None = None
    product: str | None = None
    gpus: int = Field(0, ge=0)
    memory_mib: int | None = Field(None, ge=0)
    mig_capable: bool = False
    mig_strategy: str | None = Field(
        None, description="how split GPUs show as resources: the NVIDIA MIG strategy, or the AMD device plugin's "
                          "naming (mixed: one resource per partition mode; single: all amd.com/gpu)")
    mig_config: str | None = None
    mig_config_state: str | None = None
    partition: str | None = Field(None, description="AMD compute_memory partition mode")
    schedulable: bool = True


class AcceleratorPoolStatus(_Status):
    """Inventory discovered from node labels."""

    accelerator: str | None = None
    nodes: int = 0
    gpus: int = 0
    memory_gb: float | None = None
    mig_capable: bool = False
    unknown_products: list[str] = Field(default_factory=list, description="product labels not in the catalog")
    inventory: list[NodeInventory] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_CONDITION_LIST)
    observed_generation: int | None = None


# --- ModelDeployment (namespaced) -------------------------------------------------------------------------------


QUANTIZATIONS = tuple(d for d in DType if d is not DType.FP32)
"""Weight formats a ModelDeployment may name: every dtype but fp32, which no one quantizes to."""


def _quantization(value: Any) -> Any:
    """Refuses what is not in ``QUANTIZATIONS`` (a DType compares equal to its value), naming what is."""
    if value not in [d.value for d in QUANTIZATIONS]:  # a list: an unhashable value is refused, not raised on
        raise ValueError(f"expected one of {', '.join(QUANTIZATIONS)}, got {value!r}")
    return value


QuantizationDType = Annotated[DType, BeforeValidator(_quantization),
                              WithJsonSchema({"enum": [d.value for d in QUANTIZATIONS], "type": "string"})]
"""A model's weight dtype as a ModelDeployment states it (the CRD lists the formats as an enum)."""


class EngineKind(StrEnum):
    """Which engine's command-line flags the operator writes."""

    VLLM = "vllm"
    SGLANG = "sglang"


class KeyRef(_Wire):
    """One key of a Secret or ConfigMap in the ModelDeployment's namespace."""

    name: str = Field(min_length=1, pattern=DNS_SUBDOMAIN_PATTERN)
    key: str = Field(min_length=1, pattern=CONFIG_KEY_PATTERN)
    optional: bool | None = None


class EnvVarSource(_Wire):
    """Where a variable's value comes from: one key of a Secret (a Hugging Face token) or of a ConfigMap."""

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("give exactly one of secretKeyRef and configMapKeyRef")
        return self


class EnvVar(_Wire):
    """A variable of the engine container: a literal ``value``, or ``valueFrom`` a Secret or ConfigMap key."""

    name: str = Field(min_length=1)
    value: str = ""
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _value_or_source(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError(f"{self.name}: give value or valueFrom, not both")
        return self

    def manifest(self) -> dict[str, Any]:
        """The container's ``env`` entry."""
        if self.value_from is None:
            return {"name": self.name, "value": self.value}
        return {"name": self.name, "valueFrom": self.value_from.model_dump(by_alias=True, exclude_none=True)}


class SourceRef(_Wire):
    """A whole Secret or ConfigMap in the ModelDeployment's namespace."""

    name: str = Field(min_length=1, pattern=DNS_SUBDOMAIN_PATTERN)
    optional: bool | None = None


class EnvFromSource(_Wire):
    """Every key of a Secret or ConfigMap as a variable, each name after ``prefix``."""

    prefix: str | None = None
    secret_ref: SourceRef | None = None
    config_map_ref: SourceRef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("give exactly one of secretRef and configMapRef")
        return self


class EngineSecurity(_Wire):
    """Who the engine runs as; its pod meets the restricted Pod Security Standard whatever is set here."""

    run_as_user: int = Field(1000, ge=1, description="a non-root user id; HOME is a writable emptyDir at /cache")
    run_as_group: int = Field(1000, ge=1)
    supplemental_groups: list[int] = Field(default_factory=list,
                                           description="extra groups, e.g. the GPU device nodes' (AMD: video, render)")
    read_only_root_filesystem: bool = Field(True, description="off only for an engine that writes outside /cache, "
                                                              "/tmp and /dev/shm")


class ComputeResources(_Wire):
    """CPU and memory per replica besides the accelerator (Kubernetes quantities), requested and the limit."""

    cpu: str = Field("4", pattern=QUANTITY_PATTERN)
    memory: str = Field("32Gi", pattern=QUANTITY_PATTERN)


class EngineTemplate(_Wire):
    """The serving engine container; the operator appends the args the plan implies."""

    kind: EngineKind = EngineKind.VLLM
    image: str = Field(min_length=1)
    command: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list, description="extra args, before the ones the plan implies")
    env: list[EnvVar] = Field(default_factory=list, description="after the operator's HOME and USER, so they win")
    env_from: list[EnvFromSource] = Field(default_factory=list,
                                          description="whole Secrets or ConfigMaps as variables (a Hugging Face token)")
    port: int = Field(8000, ge=1, le=65535)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int | None = Field(None, ge=1, description="default: the engine's own")
    attention_backend: str | None = Field(None, pattern=ATTENTION_BACKEND, description=(
        "the engine's attention backend as vLLM names it (FLASH_ATTN, FLASHINFER, TORCH_SDPA, ...): vLLM gets it as "
        "VLLM_ATTENTION_BACKEND, SGLang as --attention-backend; step-model corrections are learned and used per "
        "backend. Default: the engine's own choice"))
    resources: ComputeResources = Field(default_factory=ComputeResources)
    security: EngineSecurity = Field(default_factory=EngineSecurity)
    startup_timeout: str = Field("30m", pattern=DURATION_PATTERN,
                                 description="how long the engine may take to download and load the model before "
                                             "its /health must answer")


class SLOSpec(_Wire):
    ttft: str = Field(pattern=DURATION_PATTERN, description="P-th percentile time to first token, e.g. '500ms'")
    tpot: str = Field(pattern=DURATION_PATTERN, description="P-th percentile time per output token, e.g. '50ms'")
    percentile: float = Field(99.0, gt=0, lt=100)
    max_failure_rate: float = Field(0.01, ge=0, lt=1)


class BucketSpec(_Wire):
    name: str | None = None
    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    share: float = Field(gt=0, le=1)


class WorkloadSpec(_Wire):
    """Expected load: a rate with mean lengths, or request-size buckets."""

    rate_rps: float = Field(ge=0, description="requests per second, all replicas together")
    input_tokens: int | None = Field(None, ge=1)
    output_tokens: int | None = Field(None, ge=1)
    buckets: list[BucketSpec] | None = None


class ScalingSpec(_Wire):
    """Bounds on the model's replicas: maxReplicas, when set, is at least minReplicas."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.maxReplicas) || !has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
        "message": "maxReplicas must be at least minReplicas", "fieldPath": ".maxReplicas"}]})

    min_replicas: int = Field(1, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    spread_across_nodes: bool = False

    @model_validator(mode="after")
    def _bounds_in_order(self) -> ScalingSpec:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"maxReplicas {self.max_replicas} is below minReplicas {self.min_replicas}")
        return self


class RoutingSpec(_Wire):
    policy: Policy = Policy.SLO
    kv_events: bool = Field(False, description=(
        "vLLM engines publish their KV-cache events (container ports kv-events and kv-events-replay), so the "
        "router and the endpoint picker route on each engine's exact prefix cache"))


class ObjectiveSLO(_Wire):
    ttft: str = Field(pattern=DURATION_PATTERN, description="time to first token, e.g. '300ms'")
    tpot: str = Field(pattern=DURATION_PATTERN, description="time per output token, e.g. '50ms'")


class ObjectiveSpec(_Wire):
    """A class of the model's requests (the inference extension's InferenceObjective, with its own SLO): the
    router's flow control serves it by priority when the model is saturated. Requests name it by
    ``x-gateway-inference-objective``; those naming none are the model's default class (its ``slo``)."""

    name: str = Field(pattern=OBJECTIVE_NAME, description=f"not '{DEFAULT_OBJECTIVE}'")
    priority: int = Field(0, ge=-1000, le=1000, description="higher goes first under overload")
    slo: ObjectiveSLO | None = Field(None, description="default: the model's")
    sheddable: bool = Field(False, description="refused first when the router's queue is full")
    share: float | None = Field(None, gt=0, le=1, description="share of the model's requests in flight it is owed")
    best_effort: bool = Field(False, description="its demand never adds replicas")
    demand_share: float | None = Field(None, gt=0, le=1, description=(
        "share of the model's workload rate this class carries: the plan sizes each class at its own SLO (the "
        "default class carries the rest), so a loose-SLO class may go to cheaper, slower accelerators"))


class KVConnector(StrEnum):
    """How a prefill replica hands its KV cache to a decode replica: the ``kv_connector`` of vLLM's
    ``--kv-transfer-config`` (SGLang's ``--disaggregation-transfer-backend`` for NIXL and Mooncake)."""

    NIXL = "NixlConnector"
    MOONCAKE = "MooncakeConnector"
    P2P_NCCL = "P2pNcclConnector"
    LMCACHE = "LMCacheConnectorV1"


class RoleEngine(_Wire):
    """What the engines of one role (prefill or decode) run with besides the template's."""

    args: list[str] = Field(default_factory=list, description="after the operator's, so they win (a "
                                                              "--kv-transfer-config here replaces the operator's)")
    env: list[EnvVar] = Field(default_factory=list, description="after the engine's and the connector's")


class KVTransferSpec(_Wire):
    """The KV cache transfer between a disaggregated model's prefill and decode replicas."""

    connector: KVConnector | None = Field(
        None, description="default NixlConnector (NVIDIA and AMD GPUs, vLLM and SGLang); MooncakeConnector and "
                          "P2pNcclConnector need NVIDIA GPUs, LMCacheConnectorV1 NVIDIA GPUs and vLLM")
    port: int | None = Field(None, ge=1, le=65535,
                             description="the connector's port on each pod: NIXL's side channel (5600), Mooncake's "
                                         "or SGLang's bootstrap (8998), P2P NCCL's first (14579, one per TP rank), "
                                         "LMCache's decode-side init (7300, alloc the next)")
    config: dict[str, Any] = Field(default_factory=dict,
                                   description="more of vLLM's --kv-transfer-config, merged into the operator's, e.g. "
                                               "{kv_buffer_size: 8e9, kv_connector_extra_config: {backends: [UCX]}}")
    prefill: RoleEngine = Field(default_factory=RoleEngine)
    decode: RoleEngine = Field(default_factory=RoleEngine)


class GatewaySpec(_Wire):
    """How a Gateway API gateway reaches the model, besides the router: through an inference-extension pool."""

    inference_pool: bool = Field(False, description="create an InferencePool (inference.networking.k8s.io/v1) of the "
                                                    "model's engine pods, named like its Service, whose endpoint "
                                                    "picker is the operator's EPP Service; needs the Gateway API "
                                                    "Inference Extension CRDs")


class ModelDeploymentSpec(_Wire):
    """One model to serve: what, in which container, at which SLO and load, where."""

    model: str = Field(min_length=1, description="bundled model name or Hugging Face id")
    config: dict[str, Any] | None = Field(None, description="inline Hugging Face config.json")
    quantization: QuantizationDType | None = None
    engine: EngineTemplate
    slo: SLOSpec
    workload: WorkloadSpec
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    allowed_pools: list[str] | None = None
    disaggregation: Disaggregation = Disaggregation.UNIFIED
    kv_transfer: KVTransferSpec | None = Field(None, description="with disaggregation prefill_decode: how KV caches "
                                                                 "move from prefill to decode replicas")
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    objectives: list[ObjectiveSpec] = Field(default_factory=list, description=(
        "classes of the model's requests, each with its priority and SLO (see docs/router.md, Flow control)"),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    max_tp: int = Field(8, ge=1, le=64)

    @model_validator(mode="after")
    def _kv_events(self) -> ModelDeploymentSpec:
        if self.routing.kv_events and self.engine.kind is not EngineKind.VLLM:
            raise ValueError("routing.kvEvents: KV-cache events are vLLM's (--kv-events-config); engine.kind is "
                             f"{self.engine.kind}")
        return self

    @model_validator(mode="after")
    def _objectives(self) -> ModelDeploymentSpec:
        names = [o.name for o in self.objectives]
        if len(names) != len(set(names)):
            raise ValueError("objectives: an objective name appears twice")
        if DEFAULT_OBJECTIVE in names:
            raise ValueError(f"objectives: {DEFAULT_OBJECTIVE!r} is the class of requests that name none (the model's "
                             "slo)")
        shares = sum(o.share or 0.0 for o in self.objectives)
        if shares > 1 + 1e-9:
            raise ValueError(f"objectives: the shares add up to {shares:g}; at most 1")
        demand = sum(o.demand_share or 0.0 for o in self.objectives)
        if demand > 1 + 1e-9:
            raise ValueError(f"objectives: the demand shares add up to {demand:g}; at most 1 (the default class "
                             "carries the rest)")
        return self


class PlacementEntry(_Status):
    """Replicas of the model on one accelerator config and role."""

    pool: str
    accelerator: str
    profile: str | None = None
    tp: int
    role: str
    replicas: int
    ready_replicas: int = 0


class RoleReplicas(_Status):
    """Replicas of one role of a disaggregated model, every accelerator config together."""

    role: str
    replicas: int
    ready_replicas: int = 0


class ModelDeploymentStatus(_Status):
    replicas: int = 0
    ready_replicas: int = 0
    roles: list[RoleReplicas] = Field(default_factory=list, description="per role of a disaggregated model",
                                      json_schema_extra={"x-kubernetes-list-type": "map",
                                                         "x-kubernetes-list-map-keys": ["role"]})
    cost_per_hour: float | None = None
    summary: str = ""
    placement: list[PlacementEntry] = Field(default_factory=list)
    observed_rps: float | None = Field(None, description="live request rate (written by the autoscaler)")
    slo_attainment: float | None = Field(None, ge=0, le=1, description="share of requests meeting the SLO")
    scaling_reasons: list[str] = Field(default_factory=list, description="why replicas differ from the plan")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_CONDITION_LIST)
    observed_generation: int | None = None


# --- PlacementPlan (cluster-scoped) -----------------------------------------------------------------------------


class PlanPhase(StrEnum):
    PROPOSED = "Proposed"
    APPLYING = "Applying"
    APPLIED = "Applied"
    FAILED = "Failed"


class PlacementPlanSpec(_Wire):
    """The solved plan and whether it may be applied."""

    approval: Approval = Approval.AUTO
    approved: bool = Field(False, description="with manual approval: set true to apply this plan")
    plan_hash: str = Field("", description="digest of the plan; approval holds for this digest only")
    plan: dict[str, Any] = Field(default_factory=dict, description="the solved Plan (hetsched.optimizer.plan.Plan)")

    def approves(self, plan_hash: str) -> bool:
        """The plan with this digest may be applied: approval is automatic, or a person approved this very plan."""
        return self.approval is Approval.AUTO or (self.approved and self.plan_hash == plan_hash)


class MigNodeStatus(_Status):
    node: str
    config: str
    state: str


class PlacementPlanStatus(_Status):
    phase: PlanPhase = PlanPhase.PROPOSED
    applied_hash: str = ""
    applied_plan: dict[str, Any] = Field(default_factory=dict, description="the plan in force (differs while one awaits approval)")
    cost_per_hour: float | None = None
    replicas: int = 0
    models: int = 0
    message: str = ""
    mig: list[MigNodeStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_CONDITION_LIST)
    observed_generation: int | None = None


# --- CRD descriptions ---------------------------------------------------------------------------------------------


class Scope(StrEnum):
    CLUSTER = "Cluster"
    NAMESPACED = "Namespaced"


class PrinterColumn(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0


class ResourceKind(BaseModel):
    """Everything the CRD of one kind needs besides the schema of its types."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    scope: Scope
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[PrinterColumn, ...]
    description: str

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


_AGE = PrinterColumn(name="Age", type="date", json_path=".metadata.creationTimestamp")

ACCELERATOR_POOL = ResourceKind(
    kind="AcceleratorPool", plural=ACCELERATOR_POOL_PLURAL, singular="acceleratorpool", short_names=("apool", "pools"),
    scope=Scope.CLUSTER, spec=AcceleratorPoolSpec, status=AcceleratorPoolStatus,
    description="Nodes of one accelerator type the placement may use, their price and partitioning policy.",
    columns=(
        PrinterColumn(name="Accelerator", type="string", json_path=".status.accelerator"),
        PrinterColumn(name="Nodes", type="integer", json_path=".status.nodes"),
        PrinterColumn(name="GPUs", type="integer", json_path=".status.gpus"),
        PrinterColumn(name="Partitioning", type="string", json_path=".spec.partitioning"),
        PrinterColumn(name="Price/h", type="number", json_path=".spec.pricePerHour"),
        _AGE,
    ),
)
MODEL_DEPLOYMENT = ResourceKind(
    kind="ModelDeployment", plural=MODEL_DEPLOYMENT_PLURAL, singular="modeldeployment", short_names=("md", "mdep"),
    scope=Scope.NAMESPACED, spec=ModelDeploymentSpec, status=ModelDeploymentStatus,
    description="A model served at an SLO and expected load on the cheapest accelerators that meet it.",
    columns=(
        PrinterColumn(name="Model", type="string", json_path=".spec.model"),
        PrinterColumn(name="Replicas", type="integer", json_path=".status.replicas"),
        PrinterColumn(name="Ready", type="integer", json_path=".status.readyReplicas"),
        PrinterColumn(name="Cost/h", type="number", json_path=".status.costPerHour"),
        PrinterColumn(name="Placement", type="string", json_path=".status.summary", priority=1),
        _AGE,
    ),
)
PLACEMENT_PLAN = ResourceKind(
    kind="PlacementPlan", plural=PLACEMENT_PLAN_PLURAL, singular="placementplan", short_names=("pplan",),
    scope=Scope.CLUSTER, spec=PlacementPlanSpec, status=PlacementPlanStatus,
    description="A solved placement of every ModelDeployment on the pools, and its approval.",
    columns=(
        PrinterColumn(name="Phase", type="string", json_path=".status.phase"),
        PrinterColumn(name="Approval", type="string", json_path=".spec.approval"),
        PrinterColumn(name="Models", type="integer", json_path=".status.models"),
        PrinterColumn(name="Replicas", type="integer", json_path=".status.replicas"),
        PrinterColumn(name="Cost/h", type="number", json_path=".status.costPerHour"),
        _AGE,
    ),
)
KINDS: tuple[ResourceKind, ...] = (ACCELERATOR_POOL, MODEL_DEPLOYMENT, PLACEMENT_PLAN)
