"""The parts of the OpenAI API that the router and the simulated worker share.

Requests are validated with pydantic models that accept unknown fields (the
router forwards the body untouched). Token counts are estimated from text the
same way on both sides: about four bytes of UTF-8 per token.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hetsched.errors import InputError, invalid_input
from hetsched.kvcache.hashing import BYTES_PER_TOKEN
from hetsched.server.refusals import Refusal

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""
DEFAULT_CHAT_MAX_TOKENS = 256
"""Tokens a chat request without a limit generates (a simulated engine has no end-of-sequence token)."""
MAX_CHOICES = 128
"""Most sequences (``n``) one request asks for: OpenAI's own limit."""


class ApiKind(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


API_PATHS = {"/v1/completions": ApiKind.COMPLETIONS, "/v1/chat/completions": ApiKind.CHAT}
"""The request paths routed by their body: both fronts read these, and pass or pick any other by load alone."""


class ErrorType(StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_exceeded"
    UPSTREAM = "upstream_error"
    UNAVAILABLE = "service_unavailable"
    TIMEOUT = "timeout"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class CompletionRequest(_Open):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregated-serving handshake: asks a prefill for ``do_remote_decode``, hands a decode its KV."""


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None


OpenAIRequest = CompletionRequest | ChatRequest


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A ``\\uD800``–``\\uDFFF`` escape: half of a pair (an escaped emoji), or a lone surrogate no engine can encode."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (the OpenAI API refuses non-finite numbers)")


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where a string holding a lone surrogate is, or None (only walked when the body escapes a surrogate)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def parse_request(body: bytes, kind: ApiKind) -> OpenAIRequest:
    """Validate the fields a request is routed and served by; InputError names the field.

    This runs on every proxied request, so it is one pass of the C JSON parser, whose recursion guard refuses
    deep nesting (the regular-expression depth scan and finite-number walk of ``specs.files`` cost ten times as
    much on a long chat); the rest of the body is the engine's to check.
    """
    try:
        payload = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, a huge integer, nesting, NaN
        raise InputError(f"request body is not valid JSON: {str(exc)[:200]}", field="body") from exc
    if not isinstance(payload, dict):
        raise InputError("expected a JSON object", field="body")
    if _SURROGATE_ESCAPE.search(body) is not None and (where := _lone_surrogate(payload)) is not None:
        raise InputError("expected text, got a lone UTF-16 surrogate escape (\\uD800-\\uDFFF without its pair)",
                         field=where)
    model = CompletionRequest if kind is ApiKind.COMPLETIONS else ChatRequest
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise invalid_input(exc, source="request body") from exc


def estimate_tokens(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


def prompt_text(request: OpenAIRequest) -> str:
    """The prompt as one string (chat: ``role: content`` lines); token-id prompts give ''."""
    if isinstance(request, ChatRequest):
        lines = []
        for message in request.messages:
            if isinstance(message.content, list):
                content = "".join(part.text or "" for part in message.content)
            else:
                content = message.content or ""
            lines.append(f"{message.role}: {content}")
        return "\n".join(lines)
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return "".join(prompt)
    return ""


def prompt_tokens(request: OpenAIRequest) -> int:
    """Prompt length in tokens: exact for token-id prompts, estimated for text."""
    if isinstance(request, CompletionRequest) and isinstance(request.prompt, list) and request.prompt \
            and not isinstance(request.prompt[0], str):
        first = request.prompt[0]
        return len(first) if isinstance(first, list) else len(request.prompt)
    return estimate_tokens(prompt_text(request))


def max_tokens(request: OpenAIRequest) -> int:
    if isinstance(request, ChatRequest):
        return request.max_completion_tokens or request.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    return request.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS


def error_body(message: str, *, type: ErrorType, code: str | None = None, param: str | None = None) -> bytes:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps({"error": {"message": message, "type": str(type), "param": param, "code": code}}).encode()


def refusal_body(refusal: Refusal) -> bytes:
    """A server guard's refusal as an OpenAI-style error."""
    type_ = {401: ErrorType.AUTHENTICATION, 408: ErrorType.TIMEOUT}.get(refusal.status, ErrorType.INVALID_REQUEST)
    return error_body(refusal.message, type=type_, code=str(refusal.code))


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
