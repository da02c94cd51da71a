"""Names in partitioning: configs (named by content), AMD modes, and the extended resources instances show up as."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from pydantic import BaseModel

ALL_DISABLED = "all-disabled"
"""The mig-parted config name (shipped with the MIG manager) for a node with MIG off on every GPU."""


def config_name(accelerator: str, groups: Sequence[BaseModel]) -> str:
    """A mig-parted config or Device Config Manager profile name: the accelerator and a digest of the config, so
    nodes configured alike share one."""
    digest = hashlib.sha256(json.dumps([g.model_dump(mode="json") for g in groups], sort_keys=True).encode()).hexdigest()[:10]
    return f"hetsched-{accelerator}-{digest}"


def amd_mode(compute: str, memory: str) -> str:
    """An AMD partition mode as the catalog and the device plugin name it: ``CPX``, ``NPS1`` → ``cpx_nps1``."""
    return f"{compute}_{memory}".lower()


def amd_mode_parts(mode: str) -> tuple[str, str]:
    """The compute and memory partitions of a mode as the Device Config Manager names them: ``cpx_nps1`` →
    (``CPX``, ``NPS1``)."""
    compute, _, memory = mode.partition("_")
    return compute.upper(), memory.upper()


def mig_resource(profile: str) -> str:
    """The extended resource one MIG instance is requested as under the device plugin's ``mixed`` strategy."""
    return f"nvidia.com/mig-{profile}"


def amd_resource(mode: str) -> str:
    """The extended resource one AMD partition (or whole GPU) is requested as under ``mixed`` naming."""
    return f"amd.com/{mode}"
