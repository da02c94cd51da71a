"""What a disaggregated model's engines need to hand KV caches from prefill to decode replicas (pure).

Disaggregated serving runs a model as two kinds of engine joined by a KV connector. Prefill replicas compute
a prompt's KV cache and hold it (vLLM's ``kv_role`` ``kv_producer``); decode replicas fetch it and generate
(``kv_consumer``). A router sends each request to a prefill replica first, then hands the KV-transfer
parameters of its answer to a decode replica; it finds each role's pods by their ``hetsched.io/role`` label.
Each connector reaches its peer through one port of the pod (``kv-transfer``):

==================  ===========  ============  ==============================================================
connector           GPUs         engines       the port (default)
==================  ===========  ============  ==============================================================
NixlConnector       NVIDIA, AMD  vLLM, SGLang  NIXL's handshake side channel at the pod IP (5600); SGLang: the
                                               prefill bootstrap server (8998)
MooncakeConnector   NVIDIA       vLLM, SGLang  the prefill bootstrap server (8998)
P2pNcclConnector    NVIDIA       vLLM          the ZMQ socket of the NCCL handshake, one per TP rank (14579…)
LMCacheConnectorV1  NVIDIA       vLLM          the decode side's NIXL init port (7300), its alloc port next
==================  ===========  ============  ==============================================================

NIXL runs on AMD GPUs through RIXL, which vLLM's ROCm image holds; the others move KV caches with CUDA
libraries. No connector moves a CPU engine's KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetsched.catalog.types import Vendor
from hetsched.operator.resources import EngineKind, KVConnector, KVTransferSpec, ModelDeploymentSpec
from hetsched.optimizer.spec import Disaggregation, Role

PORT_NAME = "kv-transfer"
"""The container port a connector listens on, named so a router can read it."""
DEFAULT_CONNECTOR = KVConnector.NIXL
SGLANG_BOOTSTRAP_PORT = 8998
MAX_PORT = 65535


@dataclass(frozen=True)
class ConnectorTraits:
    """Where one connector runs and the port vLLM gives it by default."""

    vendors: frozenset[Vendor]
    engines: frozenset[EngineKind]
    port: int


_NVIDIA = frozenset({Vendor.NVIDIA})
_BOTH = frozenset({EngineKind.VLLM, EngineKind.SGLANG})
TRAITS: dict[KVConnector, ConnectorTraits] = {
    KVConnector.NIXL: ConnectorTraits(frozenset({Vendor.NVIDIA, Vendor.AMD}), _BOTH, 5600),
    KVConnector.MOONCAKE: ConnectorTraits(_NVIDIA, _BOTH, SGLANG_BOOTSTRAP_PORT),
    KVConnector.P2P_NCCL: ConnectorTraits(_NVIDIA, frozenset({EngineKind.VLLM}), 14579),
    KVConnector.LMCACHE: ConnectorTraits(_NVIDIA, frozenset({EngineKind.VLLM}), 7300),
}
_SGLANG_BACKEND = {KVConnector.NIXL: "nixl", KVConnector.MOONCAKE: "mooncake"}
"""SGLang's ``--disaggregation-transfer-backend`` for the connectors it has."""


@dataclass(frozen=True)
class RoleParts:
    """What one role adds to the engine container: flags, variables (manifest entries) and the connector's port."""

    args: list[str]
    env: list[dict[str, Any]]
    ports: list[dict[str, Any]]


def connector_of(spec: ModelDeploymentSpec) -> KVConnector:
    """The connector the model's roles use: the one it names, else NIXL."""
    chosen = spec.kv_transfer.connector if spec.kv_transfer is not None else None
    return chosen or DEFAULT_CONNECTOR


def port_of(spec: ModelDeploymentSpec) -> int:
    """The first port the connector listens on (see the module's table)."""
    if spec.kv_transfer is not None and spec.kv_transfer.port is not None:
        return spec.kv_transfer.port
    if spec.engine.kind is EngineKind.SGLANG:
        return SGLANG_BOOTSTRAP_PORT
    return TRAITS[connector_of(spec)].port


def _ports_used(spec: ModelDeploymentSpec) -> int:
    """How many consecutive ports from :func:`port_of` an engine may bind: P2P NCCL one per TP rank, LMCache two."""
    if spec.engine.kind is EngineKind.SGLANG:
        return 1
    return {KVConnector.P2P_NCCL: spec.max_tp, KVConnector.LMCACHE: 2}.get(connector_of(spec), 1)


def transfer_problem(spec: ModelDeploymentSpec) -> str | None:
    """What in a ModelDeployment's KV-transfer settings cannot run, naming the field; None when nothing."""
    if spec.disaggregation is Disaggregation.UNIFIED:
        if spec.kv_transfer is not None:
            return ("spec.kvTransfer: applies to disaggregated models only; set spec.disaggregation: prefill_decode "
                    "or remove it")
        return None
    connector = connector_of(spec)
    config = spec.kv_transfer.config if spec.kv_transfer is not None else {}
    if config and spec.engine.kind is EngineKind.SGLANG:
        return "spec.kvTransfer.config: vLLM's --kv-transfer-config; give SGLang flags in kvTransfer.prefill/decode args"
    for key, field in (("kv_connector", "connector"), ("kv_port", "port")):
        if key in config:
            return f"spec.kvTransfer.config.{key}: set spec.kvTransfer.{field} instead"
    if spec.engine.kind not in TRAITS[connector].engines:
        usable = ", ".join(c.value for c in KVConnector if spec.engine.kind in TRAITS[c].engines)
        return (f"spec.kvTransfer.connector: {connector.value} does not run in {spec.engine.kind.value}, whose "
                f"connectors are {usable}")
    first, count = port_of(spec), _ports_used(spec)
    if first + count - 1 > MAX_PORT:
        return (f"spec.kvTransfer.port: {connector.value} binds {count} ports from {first}, past {MAX_PORT}; "
                f"choose at most {MAX_PORT - count + 1}")
    if first <= spec.engine.port < first + count:
        span = f"{first}" if count == 1 else f"{first}-{first + count - 1}"
        return (f"spec.kvTransfer.port: {connector.value} binds {span}, which holds the engine's port "
                f"{spec.engine.port} (spec.engine.port); choose another")
    return None


def runs_on(spec: ModelDeploymentSpec, vendor: Vendor | None) -> bool:
    """Whether the model's connector moves KV caches between GPUs of ``vendor``."""
    return vendor in TRAITS[connector_of(spec)].vendors


def vendor_problem(spec: ModelDeploymentSpec, pools: Mapping[str, Vendor | None]) -> str:
    """Why the model cannot run disaggregated on ``pools`` (name → vendor), none of which its connector runs on."""
    connector = connector_of(spec)
    named = spec.kv_transfer is not None and spec.kv_transfer.connector is not None
    gpus = " and ".join(v.value.upper() for v in sorted(TRAITS[connector].vendors))
    held = ", ".join(f"{name} ({vendor.value if vendor else 'unknown'})" for name, vendor in sorted(pools.items()))
    others = [c.value for c in KVConnector if c is not connector and spec.engine.kind in TRAITS[c].engines
              and any(v in TRAITS[c].vendors for v in pools.values())]
    fix = f"choose {' or '.join(others)}" if others else "serve it unified (spec.disaggregation)"
    return (f"spec.kvTransfer.connector: {connector.value}{'' if named else ' (the default)'} moves KV caches "
            f"between {gpus} GPUs only, and the pools this model may use hold none: {held}; allow a pool of those "
            f"GPUs (spec.allowedPools) or {fix}")


def role_parts(spec: ModelDeploymentSpec, role: Role) -> RoleParts:
    """The engine flags, variables and port of one role's replicas; nothing for a unified one."""
    if role is Role.UNIFIED:
        return RoleParts([], [], [])
    settings = spec.kv_transfer or KVTransferSpec()
    own = settings.prefill if role is Role.PREFILL else settings.decode
    port = port_of(spec)
    if spec.engine.kind is EngineKind.SGLANG:
        args, env, listens = _sglang(connector_of(spec), role, port)
    else:
        args, env, listens = _vllm(spec, role, port, settings.config)
    ports = [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}] if listens else []
    return RoleParts([*args, *own.args], [*env, *(e.manifest() for e in own.env)], ports)


def _value(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _pod_ip(name: str) -> dict[str, Any]:
    """A variable holding the pod's IP (the downward API): where the peer reaches this engine."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top, nested mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merged(out[key], value) if both else value
    return out


def _vllm(spec: ModelDeploymentSpec, role: Role, port: int,
          more: Mapping[str, Any]) -> tuple[list[str], list[dict[str, Any]], bool]:
    """vLLM's ``--kv-transfer-config`` (the user's ``more`` merged over the operator's) and the connector's
    variables; whether this role listens on ``port``."""
    connector = connector_of(spec)
    prefill = role is Role.PREFILL
    config: dict[str, Any] = {"kv_connector": connector.value, "kv_role": "kv_producer" if prefill else "kv_consumer"}
    extra_config: dict[str, Any] = {}
    env: list[dict[str, Any]] = []
    listens = True
    if connector is KVConnector.NIXL:
        env = [_pod_ip("VLLM_NIXL_SIDE_CHANNEL_HOST"), _value("VLLM_NIXL_SIDE_CHANNEL_PORT", port)]
    elif connector is KVConnector.MOONCAKE:  # the bootstrap server runs on the prefill side only
        listens = prefill
        env = [_value("VLLM_MOONCAKE_BOOTSTRAP_PORT", port)] if prefill else []
    elif connector is KVConnector.P2P_NCCL:  # http_port: the address it registers with a proxy, when given one
        config["kv_port"] = port
        extra_config["http_port"] = spec.engine.port
    else:  # LMCache: the sender pushes to the receiver's NIXL ports; the rest of its settings are LMCACHE_* variables
        listens = not prefill
        extra_config["discard_partial_chunks"] = False  # a prompt's last, partial chunk goes across too
        env = [_value("LMCACHE_ENABLE_PD", "True"), _value("LMCACHE_TRANSFER_CHANNEL", "nixl"),
               _value("LMCACHE_PD_ROLE", "sender" if prefill else "receiver"),
               _value("LMCACHE_PD_BUFFER_DEVICE", "cuda"), _value("LMCACHE_LOCAL_CPU", "False"),
               _value("LMCACHE_MAX_LOCAL_CPU_SIZE", 0)]
        if not prefill:
            env += [_pod_ip("LMCACHE_PD_PEER_HOST"), _value("LMCACHE_PD_PEER_INIT_PORT", port),
                    _value("LMCACHE_PD_PEER_ALLOC_PORT", port + 1)]
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    config = _merged(config, more)
    return ["--kv-transfer-config", json.dumps(config, sort_keys=True, separators=(",", ":"))], env, listens


def _sglang(connector: KVConnector, role: Role, port: int) -> tuple[list[str], list[dict[str, Any]], bool]:
    """SGLang's disaggregation flags; the prefill side runs the bootstrap server decode replicas reach."""
    args = ["--disaggregation-mode", role.value, "--disaggregation-transfer-backend", _SGLANG_BACKEND[connector]]
    if role is Role.PREFILL:
        args += ["--disaggregation-bootstrap-port", str(port)]
    return args, [], role is Role.PREFILL
