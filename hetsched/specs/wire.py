"""hetsched's own names on the wire, defined once for the side that writes them and every side that reads them:
the custom resources' API group and version, the labels the operator puts on what it creates (the router, the
EPP's pool discovery and the autoscaler find engines by them), how a device id is written as a label value, and
the key replicas are counted by.

A device id (``h100-sxm``, a MIG slice ``h100-sxm:3g.40gb``, an AMD partition ``mi300x:cpx_nps4``) cannot be a
label value as it is: values hold no ``:``. The label writes the ``:`` as ``_`` (``h100-sxm_3g.40gb``) and the
reader splits at the first ``_``, which holds because accelerator ids have none; :func:`device_label` refuses
any id that would not read back as itself.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

GROUP = "hetsched.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ACCELERATOR_POOL_PLURAL = "acceleratorpools"
MODEL_DEPLOYMENT_PLURAL = "modeldeployments"
PLACEMENT_PLAN_PLURAL = "placementplans"

DEFAULT_OBJECTIVE = "default"
"""The request class of a request that names none: its model's own SLO. No declared objective may take it."""
OBJECTIVE_NAME = r"^[a-z0-9]([-a-z0-9._]{0,61}[a-z0-9])?$"
"""An objective's name, in a ModelDeployment, a router file, a cluster file and ``x-gateway-inference-objective``."""

ATTENTION_BACKEND = r"^[A-Z][A-Z0-9_]{0,62}$"
"""An attention backend's name as vLLM spells it (``FLASH_ATTN``, ``FLASHINFER``, ``TORCH_SDPA``): a label value
as it is."""

KV_EVENTS_PORT = "kv-events"
"""The container port an engine publishes its KV-cache events at (vLLM's ZMQ publisher); the router subscribes."""
KV_EVENTS_REPLAY_PORT = "kv-events-replay"
"""The container port of the engine's KV-event replay socket, which recovers a gap."""
KV_EVENTS_PORT_NUMBER, KV_EVENTS_REPLAY_PORT_NUMBER = 5557, 5558
"""Where the operator's vLLM engines publish their KV events and answer replays (vLLM's default publisher port)."""

LABEL_VALUE_MAX = 63
"""The longest value Kubernetes accepts for a label."""
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


class Label:
    """Labels the operator puts on what it creates, and the readers find it by."""

    MODEL = "hetsched.io/model"
    """The served model: the ModelDeployment's name, also the engine's served model name."""
    ACCELERATOR = "hetsched.io/accelerator"
    """The device the engine runs on, written by :func:`device_label`."""
    ROLE = "hetsched.io/role"
    """A :class:`Role` value: the stage of a disaggregated model the engine serves."""
    POOL = "hetsched.io/pool"
    """The AcceleratorPool, by :func:`label_value` of its name; on nodes, it tells pools of one accelerator apart."""
    TP = "hetsched.io/tp"
    """The engine's tensor-parallel degree."""
    ATTENTION_BACKEND = "hetsched.io/attention-backend"
    """The engine's attention backend when the ModelDeployment names one (:data:`ATTENTION_BACKEND`): a
    step-model correction is learned and used per backend."""
    MANAGED_BY = "app.kubernetes.io/managed-by"
    MANAGER = "hetsched"
    """The value of ``MANAGED_BY`` on hetsched's objects: only these does the operator change or delete."""


class Role(StrEnum):
    """What a replica does: everything, or one phase of disaggregated serving."""

    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


class OptionKey(NamedTuple):
    """One kind of replica: how replicas are counted, in a plan, a live fleet and across plans."""

    model: str
    pool: str
    device: str
    """Device id: ``h100-sxm``, ``h100-sxm:3g.40gb``."""
    tp: int
    role: Role


def label_value(name: str) -> str:
    """A valid label value for a name that is matched, never read back (a pool's): other characters become
    ``_``, cut to 63."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:LABEL_VALUE_MAX].strip("_.-")


def device_label(device: str) -> str:
    """The value of the accelerator label for a device id; a ValueError for an id it would not read back as."""
    value = device.replace(":", "_", 1)
    if len(value) > LABEL_VALUE_MAX:
        raise ValueError(f"device id {device!r} is {len(value)} characters; a label value holds at most "
                         f"{LABEL_VALUE_MAX}")
    if not _LABEL_VALUE.fullmatch(value):
        raise ValueError(f"device id {device!r} cannot be a label value: expected letters, digits, '-', '_' and "
                         "'.', an accelerator id and partition that begin and end with a letter or digit")
    if device_of_label(value) != device:
        raise ValueError(f"device id {device!r} would read back as {device_of_label(value)!r}: an accelerator id "
                         "holds no '_' and a device id one ':' at most")
    return value


def device_of_label(value: str) -> str:
    """The device id an accelerator label names: the partition follows the first ``_``."""
    accelerator, _, partition = value.partition("_")
    return f"{accelerator}:{partition}" if partition else accelerator
