"""What one phase of disaggregated serving asks of a replica, as a workload and an SLO the simulator can search.

A prefill replica computes each prompt and its first token, then ships the prompt's KV cache to a decode
replica; a decode replica receives that cache and generates the rest. As DistServe splits the SLO, the prefill
replica answers for time to first token, the transfer included, and the decode replica for time per output
token:

- *prefill*: one-token outputs; the TTFT target less the transfer of a long (P99) prompt's KV cache over the
  prefill GPU's network share, which is what leaves its node; no TPOT target.
- *decode*: every prompt token already in the KV cache (it arrived with the request, and holds memory from the
  start); the TPOT target, and the TTFT target as a bound on the wait to be admitted (a decode replica that
  cannot keep up queues without end while its running requests still meet the TPOT target).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetsched.catalog.types import Device
from hetsched.errors import InfeasibleError, InputError
from hetsched.perf.memory import default_kv_dtype, kv_layout
from hetsched.specs.dtypes import DType
from hetsched.specs.model import ModelArch
from hetsched.specs.wire import Role as Role
from hetsched.specs.workload import SLO, LengthDistribution, Workload

RELAXED_MS = 1e6
"""A latency target that never binds."""

TRANSFER_PERCENTILE = 99.0
"""The prompt length whose transfer the prefill replica budgets for: as long as the SLO's tail."""


@dataclass(frozen=True)
class RoleQuery:
    """The workload and SLO one role's capacity search runs."""

    workload: Workload
    slo: SLO


def kv_cache_bytes(model: ModelArch, prompt_tokens: float, *, kv_dtype: DType | None = None) -> float:
    """The whole model's KV cache (every layer, every head) for one prompt: what a prefill replica ships."""
    layout = kv_layout(model, tp=1, kv_dtype=kv_dtype or default_kv_dtype(model, None))
    return layout.bytes_for(max(int(prompt_tokens), 1))


def kv_transfer_seconds(model: ModelArch, prompt_tokens: float, *, link_gbs: float,
                        kv_dtype: DType | None = None) -> float:
    """Time to move one prompt's KV cache over ``link_gbs``."""
    if link_gbs <= 0:
        raise InputError("the device has no network bandwidth in the catalog (network_gbs); a KV cache cannot "
                         "leave its node", field="network_gbs")
    return kv_cache_bytes(model, prompt_tokens, kv_dtype=kv_dtype) / (link_gbs * 1e9)


def long_prompt_tokens(workload: Workload, *, percentile: float = TRANSFER_PERCENTILE, seed: int = 0,
                       samples: int = 4000) -> float:
    """The workload's prompt length at ``percentile`` (:data:`TRANSFER_PERCENTILE` by default)."""
    import numpy as np  # not with the module: a capacity read from the cache goes without NumPy

    lengths = workload.input_len.sample(np.random.default_rng(seed), samples)
    return float(np.percentile(lengths, percentile))


def role_query(role: Role, *, model: ModelArch, device: Device, workload: Workload, slo: SLO,
               kv_dtype: DType | None = None) -> RoleQuery:
    """The workload and SLO that one replica of ``role`` on ``device`` must hold."""
    if role is Role.UNIFIED:
        return RoleQuery(workload, slo)
    if role is Role.DECODE:
        return RoleQuery(workload.model_copy(update={"prefix_sharing": 1.0}), slo)
    prompt = long_prompt_tokens(workload)
    transfer_ms = 1e3 * kv_transfer_seconds(model, prompt, link_gbs=device.accelerator.network_gbs, kv_dtype=kv_dtype)
    if transfer_ms >= slo.ttft_ms:
        raise InfeasibleError(f"moving a {prompt:,.0f}-token prompt's KV cache of {model.name} "
                              f"off {device.id} ({device.accelerator.network_gbs:g} GB/s) takes {transfer_ms:,.0f} ms, "
                              f"more than the TTFT target of {slo.ttft_ms:g} ms")
    return RoleQuery(workload.model_copy(update={"output_len": LengthDistribution.fixed(1)}),
                     slo.model_copy(update={"ttft_ms": slo.ttft_ms - transfer_ms, "tpot_ms": RELAXED_MS}))
