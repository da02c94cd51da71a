"""The partition managers' config files and the node labels that select them: one renderer per vendor, used by
the CLI, the web planner and the operator alike.

NVIDIA: the MIG manager reads a mig-parted config (``version: v1``, ``mig-configs``) and applies to each node the
config its ``nvidia.com/mig.config`` label names. AMD: the Device Config Manager reads ``config.json``
(``gpu-config-profiles``) and applies the profile named by ``dcm.amd.com/gpu-config-profile``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import yaml

from hetsched.partition.labels import PartitionLabel
from hetsched.partition.mig import larger_first
from hetsched.partition.naming import ALL_DISABLED
from hetsched.partition.types import MigDeviceGroup, PartitionGroup


class ConfiguredNode(Protocol):
    """A planned node as far as its partitioning goes (``NodePlan`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def mig_config(self) -> str | None: ...

    @property
    def partition_profile(self) -> str | None: ...


def mig_parted_config(configs: Mapping[str, Sequence[MigDeviceGroup]]) -> dict[str, Any]:
    """The mig-parted config holding these layouts, by name, and ``all-disabled``.

    Each GPU's instances are listed largest first: mig-parted reads ``mig-devices`` as an unordered map and creates
    the instances largest first (NVIDIA's placement rule: a mixed layout creates its 3g first, so that small
    instances do not take the few start slices a large one can use); the file reads in that order.
    ``all-disabled`` (MIG off on every GPU) ships with the MIG manager, and the GPU operator labels MIG-capable
    nodes with it by default, so a file that replaces the manager's keeps it.
    """
    body: dict[str, list[dict[str, Any]]] = {
        name: [{"devices": g.devices, "mig-enabled": g.mig_enabled,
                **({"mig-devices": dict(sorted(g.mig_devices.items(), key=lambda kv: larger_first(kv[0])))}
                   if g.mig_enabled else {})} for g in groups]
        for name, groups in sorted(configs.items())}
    body.setdefault(ALL_DISABLED, [{"devices": "all", "mig-enabled": False}])
    return {"version": "v1", "mig-configs": body}


def mig_parted_yaml(configs: Mapping[str, Sequence[MigDeviceGroup]]) -> str:
    """:func:`mig_parted_config` as the YAML file the MIG manager's ConfigMap holds (``config.yaml``)."""
    return yaml.safe_dump(mig_parted_config(configs), sort_keys=False)


def dcm_config(profiles: Mapping[str, Sequence[PartitionGroup]]) -> dict[str, Any]:
    """The AMD Device Config Manager's ``config.json`` (``gpu-config-profiles``) for these profiles, by name; no GPU
    is skipped, so each profile's GPU counts add up to the node's GPUs."""
    return {"gpu-config-profiles": {
        name: {"skippedGPUs": {"ids": []},
               "profiles": [{"computePartition": g.compute, "memoryPartition": g.memory, "numGPUsAssigned": g.gpus}
                            for g in groups]}
        for name, groups in sorted(profiles.items())}}


def dcm_json(profiles: Mapping[str, Sequence[PartitionGroup]]) -> str:
    """:func:`dcm_config` as the JSON file the Device Config Manager's ConfigMap holds (``config.json``)."""
    return json.dumps(dcm_config(profiles), indent=2) + "\n"


def node_config_labels(nodes: Sequence[ConfiguredNode]) -> dict[str, dict[str, str]]:
    """Per node, the label that selects its mig-parted config or its Device Config Manager profile."""
    labels = {node.name: {PartitionLabel.MIG_CONFIG: node.mig_config} for node in nodes if node.mig_config}
    labels.update({node.name: {PartitionLabel.DCM_PROFILE: node.partition_profile} for node in nodes
                   if node.partition_profile})
    return labels
