"""The operator's section of the settings: how the operator process plans, applies and retries."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum

EPP_SERVICE = "hetsched-epp"
"""The Service of the chart's Endpoint Picker (its ``epp.serviceName``): the InferencePools' default picker."""


# How a PlacementPlan's proposal is applied: its ``spec.approval`` (no docstring: it would become the CRD field's
# description), and the operator's default for the plan it creates.
class Approval(StrEnum):
    AUTO = "auto"
    MANUAL = "manual"


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
class OperatorSettings:
    """Settings of the operator process (its store is the ``store`` section, its autoscaler's the ``autoscale``)."""

    namespace: str = "hetsched"
    """The operator's own namespace: events about cluster-scoped objects go there (HETSCHED_NAMESPACE)."""
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
    autoscale: bool = True
    """Scale replicas to the demand the engine pods report, as the ``autoscale`` section says; off: run what the
    plan says (HETSCHED_AUTOSCALE)."""
    serve_namespaces: tuple[str, ...] = ()
    """Namespaces whose ModelDeployments get engines (the RBAC lets the operator write only there); empty: all."""
    epp_service: str = EPP_SERVICE
    """The Endpoint Picker Service an InferencePool names (``spec.gateway.inferencePool``), in the pool's namespace."""
