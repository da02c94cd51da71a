"""Settings of the operator process: the ``operator`` section of :class:`hetsched.settings.Settings`.

Plain dataclasses with defaults, apart from the kopf handlers and the API client, so the settings root reads
them without loading either."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from hetsched.autoscale.settings import AutoscaleSettings
from hetsched.operator.resources import Approval

EPP_SERVICE = "hetsched-epp"
"""The Service of the chart's Endpoint Picker (its ``epp.serviceName``): the InferencePools' default picker."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently API calls are retried."""

    attempts: int = 5
    """Tries in all, the first included."""
    initial_delay_s: float = 0.2
    """Wait before the second try; doubled each time after."""
    max_delay_s: float = 5.0
    """Longest wait between two tries."""
    timeout_s: float = 10.0
    """Per-request timeout."""


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of the operator process."""

    namespace: str = "hetsched"
    """The operator's own namespace: events about cluster-scoped objects go there."""
    plan_name: str = "cluster"
    """Name of the PlacementPlan the operator maintains."""
    default_approval: Approval = Approval.AUTO
    """Approval of a PlacementPlan the operator creates; a person may change it on the object."""
    debounce_s: float = 2.0
    """Quiet time after a change before re-planning."""
    requeue_s: float = 15.0
    """Re-check interval while waiting for replicas to become Ready or for MIG configs."""
    mig_configmap: tuple[str, str] | None = ("gpu-operator", "hetsched-mig-parted-config")
    """(namespace, name) of the mig-parted ConfigMap the NVIDIA MIG manager reads; None: no GPU is MIG-split."""
    dcm_configmap: tuple[str, str] | None = None
    """(namespace, name) of the profile ConfigMap the AMD Device Config Manager reads; None: no AMD GPU is
    partitioned."""
    priority: int = field(default_factory=lambda: secrets.randbelow(2**31 - 1) + 1)
    """Peering priority: the live replica with the highest one leads (distinct per replica, random by default)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    database_url: str | None = None
    """Store each applied plan there (origin ``operator``), next to those of the CLI and web planner."""
    autoscale: AutoscaleSettings | None = None
    """Scale replicas to the demand the engine pods report, every ``interval_s``; None: run what the plan says."""
    serve_namespaces: tuple[str, ...] = ()
    """Namespaces whose ModelDeployments get engines (the RBAC lets the operator write only there); empty: all."""
    epp_service: str = EPP_SERVICE
    """The Endpoint Picker Service an InferencePool names (``spec.gateway.inferencePool``), in the pool's namespace."""
