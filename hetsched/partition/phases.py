"""The per-node phase machine of re-partitioning: where a node stands on its way to its planned MIG config or AMD
partition profile, and the label and taint changes that move it on.

Pure: it reads a node as the API returns it (labels, taints) and the hetsched pods still on it; the operator
applies what it returns.

NVIDIA: a node whose planned mig-parted config differs from its ``nvidia.com/mig.config`` label is first drained
of hetsched pods, then labelled; it is ready once the MIG manager reports ``nvidia.com/mig.config.state=success``
(the stale state label is removed with the switch, so the old config's ``success`` cannot pass for the new one).
``failed`` is reported and the old placement keeps serving, and so is no answer at all within
``PARTITION_TIMEOUT_S``.

AMD: the Device Config Manager needs idle GPUs: once drained, the node is tainted ``amd-dcm=up:NoExecute``
(evicting the GPU daemons), one pass later labelled ``dcm.amd.com/gpu-config-profile`` (its stale state label
removed), and untainted once ``dcm.amd.com/gpu-config-profile-state`` reads ``success`` or ``failure``, or when the
manager has not answered within ``PARTITION_TIMEOUT_S`` (taken as a failure: a node must not stay tainted because
no manager runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hetsched.catalog import Accelerator, Vendor
from hetsched.partition.labels import DcmState, MigState, PartitionLabel
from hetsched.partition.naming import ALL_DISABLED, amd_mode
from hetsched.partition.types import PartitionGroup

DCM_TAINT = {"key": "amd-dcm", "value": "up", "effect": "NoExecute"}
"""The taint the AMD Device Config Manager expects on a node it re-partitions (its own pods tolerate it)."""
PARTITION_TIMEOUT_S = 20 * 60
"""How long a node waits for the MIG manager's or Device Config Manager's first answer before the switch counts as
failed."""


class PartitionPhase(StrEnum):
    """Where one node is on its way to the planned MIG config or AMD partition profile."""

    DRAINING = "draining"
    CONFIGURING = "configuring"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class NodeStep:
    """One node's phase and message, and what to change on it now: labels to set (None: remove) and its whole
    taint list, each None when nothing changes."""

    phase: PartitionPhase
    message: str
    labels: dict[str, str | None] | None = None
    taints: list[dict[str, Any]] | None = None


def mig_step(node: Mapping[str, Any] | None, config: str, pods_on_node: int, *, now: float) -> NodeStep:
    """The next step of an NVIDIA node towards mig-parted ``config`` at time ``now`` (Unix seconds)."""
    phase, message = mig_phase(node, config, pods_on_node, now=now)
    labels = None
    if phase is PartitionPhase.CONFIGURING and _labels(node).get(PartitionLabel.MIG_CONFIG) != config:
        labels = {PartitionLabel.MIG_CONFIG: config, PartitionLabel.MIG_CONFIG_STATE: None,
                  PartitionLabel.PARTITIONING_SINCE: str(int(now))}
    return NodeStep(phase, message, labels=labels)


def dcm_step(node: Mapping[str, Any] | None, profile: str, pods_on_node: int, *, unpartitioned: bool,
             now: float) -> NodeStep:
    """The next step of an AMD node towards Device Config Manager ``profile`` at time ``now`` (Unix seconds):
    taint, then label, then untaint once the manager has answered (or not in time)."""
    phase, message = dcm_phase(node, profile, pods_on_node, unpartitioned=unpartitioned, now=now)
    have = _taints(node)
    tainted = any(is_dcm_taint(t) for t in have)
    if phase is PartitionPhase.CONFIGURING and not tainted:
        return NodeStep(phase, message, taints=[*have, dict(DCM_TAINT)])
    if phase is PartitionPhase.CONFIGURING and _labels(node).get(PartitionLabel.DCM_PROFILE) != profile:
        return NodeStep(phase, message, labels={PartitionLabel.DCM_PROFILE: profile,
                                                PartitionLabel.DCM_PROFILE_STATE: None,
                                                PartitionLabel.PARTITIONING_SINCE: str(int(now))})
    if phase in (PartitionPhase.READY, PartitionPhase.FAILED) and tainted:
        return NodeStep(phase, message, taints=[t for t in have if not is_dcm_taint(t)])
    return NodeStep(phase, message)


def mig_phase(node: Mapping[str, Any] | None, config: str, pods_on_node: int, *,
              now: float) -> tuple[PartitionPhase, str]:
    """Where a node stands on its way to ``config`` at time ``now`` (Unix seconds), from its labels and the hetsched
    pods still on it."""
    labels = _labels(node)
    current, state = labels.get(PartitionLabel.MIG_CONFIG), labels.get(PartitionLabel.MIG_CONFIG_STATE)
    if current is None and config == ALL_DISABLED:
        return PartitionPhase.READY, "MIG is off and the MIG manager was never asked otherwise"
    if current == config:
        if state == MigState.SUCCESS:
            return PartitionPhase.READY, f"MIG config {config} applied"
        if state == MigState.FAILED:
            return (PartitionPhase.FAILED,
                    f"the MIG manager reports failed for config {config}; the old placement keeps serving")
        if state is None and _unanswered(labels, now):
            return (PartitionPhase.FAILED, f"no answer from the MIG manager for config {config} in "
                                           f"{PARTITION_TIMEOUT_S // 60} min (is it deployed, reading this ConfigMap?); "
                                           "the old placement keeps serving")
        return PartitionPhase.CONFIGURING, f"waiting for the MIG manager to apply {config} (state {state or 'unset'})"
    if pods_on_node:
        return (PartitionPhase.DRAINING,
                f"draining {pods_on_node} hetsched pods before switching MIG config {current} → {config}")
    return PartitionPhase.CONFIGURING, f"switching MIG config {current or 'unset'} → {config}"


def dcm_phase(node: Mapping[str, Any] | None, profile: str, pods_on_node: int, *, unpartitioned: bool,
              now: float) -> tuple[PartitionPhase, str]:
    """Where an AMD node stands on its way to Device Config Manager ``profile`` at time ``now`` (Unix seconds); an
    ``unpartitioned`` profile (every GPU one device) holds on a node the manager was never asked about."""
    labels = _labels(node)
    current, state = labels.get(PartitionLabel.DCM_PROFILE), labels.get(PartitionLabel.DCM_PROFILE_STATE)
    if current is None and unpartitioned:
        return PartitionPhase.READY, "no GPU is partitioned and the Device Config Manager was never asked otherwise"
    if current == profile:
        if state == DcmState.SUCCESS:
            return PartitionPhase.READY, f"partition profile {profile} applied"
        if state == DcmState.FAILURE:
            return (PartitionPhase.FAILED, f"the Device Config Manager reports failure for profile {profile}; "
                                           "the old placement keeps serving")
        if _unanswered(labels, now):
            return (PartitionPhase.FAILED, f"no answer from the Device Config Manager for profile {profile} in "
                                           f"{PARTITION_TIMEOUT_S // 60} min (is it deployed, reading this ConfigMap?); "
                                           "the old placement keeps serving")
        return (PartitionPhase.CONFIGURING,
                f"waiting for the Device Config Manager to apply {profile} (state {state or 'unset'})")
    if pods_on_node:
        return PartitionPhase.DRAINING, f"draining {pods_on_node} hetsched pods before switching partition profile " \
                                        f"{current or 'unset'} → {profile}"
    return PartitionPhase.CONFIGURING, f"switching partition profile {current or 'unset'} → {profile}"


def unpartitioned(accelerator: Accelerator, profile: Sequence[PartitionGroup], node: Mapping[str, Any] | None) -> bool:
    """Whether every GPU of a Device Config Manager profile is one device, and the node labeller (when it reports
    the mode) says the node's GPUs are so now."""
    whole = accelerator.amd_partitions.unpartitioned_mode() if accelerator.amd_partitions else None
    now = _labels(node).get(PartitionLabel.AMD_PARTITION, whole)
    return now == whole and all(amd_mode(g.compute, g.memory) == whole for g in profile)


def is_dcm_taint(taint: Mapping[str, Any]) -> bool:
    return taint.get("key") == DCM_TAINT["key"] and taint.get("effect") == DCM_TAINT["effect"]


def _unanswered(labels: Mapping[str, str], now: float) -> bool:
    """Whether the partitioning the operator asked for (``hetsched.io/partitioning-since``) has gone unanswered
    for longer than ``PARTITION_TIMEOUT_S``."""
    since = labels.get(PartitionLabel.PARTITIONING_SINCE, "")
    return since.isdigit() and now - int(since) > PARTITION_TIMEOUT_S


def _labels(node: Mapping[str, Any] | None) -> dict[str, str]:
    return ((node or {}).get("metadata") or {}).get("labels") or {}


def _taints(node: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((node or {}).get("spec") or {}).get("taints") or [])


def ready_selector(vendor: Vendor) -> dict[str, str]:
    """The node label a replica on partitioned GPUs waits for: its manager's success state (the instances exist
    only once the node's partitioning succeeded)."""
    if vendor is Vendor.AMD:
        return {PartitionLabel.DCM_PROFILE_STATE: DcmState.SUCCESS}
    return {PartitionLabel.MIG_CONFIG_STATE: MigState.SUCCESS}
