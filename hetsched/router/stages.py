"""The two requests a disaggregated model's request becomes, as vLLM's disaggregated-serving proxy sends them.

The *prefill* request is the client's with one token to generate, not streamed, and ``kv_transfer_params``
asking for a remote decode; the engine answers with a one-token completion whose ``kv_transfer_params`` say
where the prompt's KV cache waits (engine, request, blocks, host and port for vLLM's NixlConnector). The
*decode* request is the client's own, carrying those parameters; its answer is the client's. An answer without
parameters (an engine without a KV connector) leaves the decode request as the client sent it: the decode
instance then computes the prompt itself.
"""

from __future__ import annotations

import json
from typing import Any

from hetsched.errors import InputError
from hetsched.specs.files import parse_json

REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What a prefill request asks: keep the KV cache for a decode instance to fetch."""
NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields a one-token, unstreamed prefill drops: a stream's options, and lower bounds above its one token."""


def prefill_body(payload: dict[str, Any]) -> bytes:
    """The prefill request: ``payload`` generating one token, unstreamed, asking for a remote decode."""
    body = {k: v for k, v in payload.items() if k not in NOT_FOR_PREFILL}
    body.update(stream=False, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
    if "max_completion_tokens" in payload:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


def decode_body(payload: dict[str, Any], params: dict[str, Any] | None) -> bytes:
    """The decode request: ``payload`` with the prefill's ``kv_transfer_params`` (as sent without them)."""
    return json.dumps(payload if params is None else {**payload, "kv_transfer_params": params}).encode()


def handed_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill's answer; None when it has none (or is not a JSON object)."""
    try:
        params = parse_json(answer, name="prefill answer", field="kv_transfer_params").get("kv_transfer_params")
    except (InputError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None
