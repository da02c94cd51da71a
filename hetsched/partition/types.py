"""The config entries a plan hands to the vendors' partition managers (pydantic: they are part of the plan)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MigDeviceGroup(BaseModel):
    """One entry of a mig-parted config: these GPU indices, MIG on or off, instance counts per GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: list[int]
    mig_enabled: bool
    mig_devices: dict[str, int] = Field(default_factory=dict)


class PartitionGroup(BaseModel):
    """One entry of an AMD Device Config Manager profile: the node's next ``gpus`` GPUs, in index order, in one
    compute and memory partition mode."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute: str = Field(description="compute partition, e.g. SPX or CPX")
    memory: str = Field(description="memory partition, e.g. NPS1 or NPS4")
    gpus: int
