"""How a twin plays one role of disaggregated serving, as vLLM's instances do behind a KV connector.

The handshake is vLLM's (NixlConnector and its kin), carried in the request and response field
``kv_transfer_params``:

- the proxy sends the *prefill* instance the request with ``max_tokens`` 1 and ``do_remote_decode: true``; it
  computes the prompt and one token and answers with parameters for the decode side (``do_remote_prefill:
  true``, the engine, request and blocks that hold the KV cache, where to fetch it);
- the proxy sends the *decode* instance the original request with those parameters; it pulls the KV cache,
  then schedules the request with every prompt token already computed (the last one is computed again for its
  logits, so the first token the client sees comes from the decode instance) and generates the answer.

A twin has no KV to move, so its decode instance waits what moving it would take: the model's KV bytes for the
prompt over the slower of the two devices' ``network_gbs``. The prefill twin adds its own network to the
parameters (``remote_network_gbs``, an extension a real engine does not send) so the decode twin knows the
slower side. Simplifications: the prefill twin frees its blocks at once (vLLM holds them until the decode has
read them) and the decode twin holds none while it waits (vLLM allocates them first).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from hetsched.sim.roles import Role, kv_transfer_seconds
from hetsched.specs.model import ModelArch

NETWORK_PARAM = "remote_network_gbs"
"""The prefill twin's network share, GB/s, in its ``kv_transfer_params`` (a twin's extension)."""


@dataclass(frozen=True)
class Admission:
    """What one request asks of the engine under the worker's role."""

    max_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV is already there (arrived from a prefill instance)."""
    delay_s: float = 0.0
    """Simulated seconds before the scheduler sees the request: the KV transfer."""
    hands_off: bool = False
    """Answer with ``kv_transfer_params`` for a decode instance."""


@dataclass(frozen=True)
class RolePlay:
    """One worker's role, model and network: turns requests into admissions and answers into handoffs."""

    role: Role
    model: ModelArch
    network_gbs: float
    block_size: int
    tp: int = 1
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def admit(self, *, prompt_tokens: int, max_tokens: int, params: dict[str, Any] | None) -> Admission:
        """A unified worker ignores the parameters, as vLLM without a KV connector does."""
        params = params or {}
        if self.role is Role.PREFILL:
            return Admission(1, hands_off=params.get("do_remote_decode") is True)
        if self.role is Role.DECODE and params.get("do_remote_prefill") is True:
            return Admission(max_tokens, cached_tokens=prompt_tokens,
                             delay_s=self.transfer_s(prompt_tokens, remote_gbs=params.get(NETWORK_PARAM)))
        return Admission(max_tokens)

    def transfer_s(self, prompt_tokens: int, *, remote_gbs: object) -> float:
        """Moving the prompt's KV cache over the slower side; a remote that names no network is as fast as this one."""
        link = self.network_gbs
        if isinstance(remote_gbs, int | float) and not isinstance(remote_gbs, bool) and math.isfinite(remote_gbs) \
                and remote_gbs > 0:
            link = min(link, float(remote_gbs))
        return kv_transfer_seconds(self.model, prompt_tokens, link_gbs=link)

    def handoff(self, *, prompt_tokens: int, request_id: str, host: str, port: int) -> dict[str, Any]:
        """The prefill's answer to a decode instance, shaped as vLLM's NixlConnector returns it."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(range(-(-prompt_tokens // self.block_size))),
                "remote_engine_id": self.engine_id, "remote_request_id": request_id,
                "remote_host": host, "remote_port": port, "tp_size": self.tp, NETWORK_PARAM: self.network_gbs}
