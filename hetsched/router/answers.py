"""Reading an engine's answer as it passes: streamed tokens and their timing, a whole answer's usage, an error's
message. Both fronts read answers the same way: the HTTP front as it proxies them, the EPP as the gateway hands
it the response body."""

from __future__ import annotations

import contextlib
import json
import re

_CONTENT = re.compile(rb'"(?:content|text|reasoning_content|reasoning)":\s*"[^"]|"tool_calls":\s*\[\s*\{')
"""A streamed choice that carries output: non-empty text or reasoning, or a tool call."""
USAGE_TAIL_BYTES = 1 << 20
"""The end of a whole (not streamed) answer kept to find its ``usage``, which engines put after the choices."""
MAX_SSE_LINE = 1 << 20
"""Longest unfinished SSE line kept across chunks; past it the line is dropped, not buffered without end."""
ERROR_DETAIL_BYTES = 4096
"""How much of an engine's 5xx body is read for the message a client gets when no endpoint answers."""


class StreamStats:
    """Generated tokens and their timing in a streamed OpenAI response.

    Not every SSE event is a token: vLLM's first chat chunk carries only the role, its last may carry only the
    finish reason, and with ``include_usage`` a chunk without choices carries the counts. Tokens are that chunk's
    ``usage.completion_tokens`` when the stream has one, else one per chunk with content; the first and last
    content chunks bound TTFT and TPOT. This runs on every chunk: only lines naming ``usage`` are parsed as JSON,
    the others take one regular-expression search.
    """

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.content_chunks = 0
        self.usage_tokens: int | None = None
        self._partial = b""

    @property
    def tokens(self) -> int:
        """The engine's own count when the stream carries one: a token need not show as text (a stop token)."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    def observe(self, chunk: bytes, now: float) -> None:
        lines = (self._partial + chunk if self._partial else chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_SSE_LINE:
            self._partial = b""
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:], now)

    def _event(self, data: bytes, now: float) -> None:
        if b'"usage"' in data:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                self.usage_tokens = int(json.loads(data)["usage"]["completion_tokens"])
        if _CONTENT.search(data) is not None:
            if self.first is None:
                self.first = now
            self.last = now
            self.content_chunks += 1


class AnswerTail:
    """The end of a whole answer, kept as it passes so its ``usage`` can be found when it ends."""

    def __init__(self) -> None:
        self._tail = bytearray()

    def observe(self, chunk: bytes) -> None:
        self._tail += chunk
        if len(self._tail) > 2 * USAGE_TAIL_BYTES:
            del self._tail[:-USAGE_TAIL_BYTES]

    @property
    def completion_tokens(self) -> int:
        return completion_tokens(bytes(self._tail)) if self._tail else 0


_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_tokens(body: bytes) -> int:
    """``usage.completion_tokens`` of a whole answer, 0 without one; found, not parsed (a JSON pass over a long
    answer costs more than the rest of its proxying): engines put ``usage`` after the choices, and a quote in
    generated text is escaped, so the last ``"usage": {`` opens the object that holds the count."""
    at = body.rfind(b'"usage"')
    if at < 0 or _USAGE.match(body, at) is None:
        return 0
    found = _COMPLETION_TOKENS.search(body, at)
    return int(found.group(1)) if found else 0


def error_detail(body: bytes) -> str:
    """What an engine's error body says: its OpenAI error's message, else its text, on one short line."""
    text = body[:ERROR_DETAIL_BYTES].decode(errors="replace")
    with contextlib.suppress(ValueError, TypeError, KeyError):
        text = str(json.loads(text)["error"]["message"])
    return " ".join(text.split())[:300]
