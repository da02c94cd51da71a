"""A server's refusals: the answers its guard gives instead of the app, by the limits of
:class:`hetsched.settings.server.ServerLimits`; no HTTP."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RefusalCode(StrEnum):
    INVALID_HOST = "invalid_host"
    INVALID_API_KEY = "invalid_api_key"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    INVALID_CONTENT_LENGTH = "invalid_content_length"
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"


@dataclass(frozen=True)
class Refusal:
    """An answer a server's guard gives instead of the app; ``header`` names the request header at fault, if one is."""

    status: int
    message: str
    code: RefusalCode
    header: str | None = None
