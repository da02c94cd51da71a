"""Node-label keys and states of partitioning, as the vendors' node labellers and managers use them.

NVIDIA: GPU Feature Discovery says whether a GPU can be split (``mig.capable``) and how the device plugin shows
the instances (``mig.strategy``); the MIG manager applies the mig-parted config named by ``mig.config`` and reports
in ``mig.config.state``. AMD: the node labeller reports the partition mode; the Device Config Manager applies the
profile named by ``gpu-config-profile`` and reports in ``gpu-config-profile-state``.
"""

from __future__ import annotations


class PartitionLabel:
    """Label keys read from, and (the config selectors and ``PARTITIONING_SINCE``) written to, GPU nodes."""

    MIG_CAPABLE = "nvidia.com/mig.capable"
    MIG_STRATEGY = "nvidia.com/mig.strategy"
    MIG_CONFIG = "nvidia.com/mig.config"
    MIG_CONFIG_STATE = "nvidia.com/mig.config.state"
    AMD_PARTITION = "amd.com/gpu.compute-memory-partition"
    AMD_PARTITIONING_SUPPORTED = ("amd.com/compute-partitioning-supported", "amd.com/gpu.compute-partitioning-supported")
    """Where node labeller versions say whether the GPUs can be partitioned."""
    DCM_PROFILE = "dcm.amd.com/gpu-config-profile"
    DCM_PROFILE_STATE = "dcm.amd.com/gpu-config-profile-state"
    PARTITIONING_SINCE = "hetsched.io/partitioning-since"
    """When (Unix seconds) the operator asked for the node's MIG config or partition profile."""


UNUSABLE_MIG_STRATEGIES = ("single", "none")
"""Device plugin MIG strategies under which plans cannot place MIG instances: ``single`` shows them as
``nvidia.com/gpu`` (one profile per node), ``none`` not at all; plans need ``mixed``."""


class MigState:
    """Values the NVIDIA MIG manager writes into ``nvidia.com/mig.config.state``."""

    PENDING = "pending"
    REBOOTING = "rebooting"
    SUCCESS = "success"
    FAILED = "failed"


class DcmState:
    """Values the AMD Device Config Manager writes into ``dcm.amd.com/gpu-config-profile-state``."""

    SUCCESS = "success"
    FAILURE = "failure"


class AmdNaming:
    """The AMD device plugin's ``resource_naming_strategy``."""

    SINGLE = "single"
    MIXED = "mixed"
