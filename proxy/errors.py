"""The proxy's one exception tree, and how each maps to an OpenAI-style error.

    ProxyError                      base: an HTTP status, an OpenAI error type and code
    +-- BadRequest          400     body is not JSON, or a field has the wrong type
    +-- Unauthorized        401     api_keys_file is set and the Bearer key is not in it
    +-- BodyTooLarge        413     body over ``max_body_bytes``
    +-- QueueFull           429     the large-prefill queue is full (carries Retry-After)
    +-- QueueTimeout        503     waited ``max_queue_wait`` and ``on_queue_timeout=reject``
    +-- UpstreamError               the upstream failed us (mapped in ``upstream.py`` only)
        +-- UpstreamUnavailable 502 cannot connect, no healthy upstream
        +-- UpstreamProtocolError 502 the upstream answered something that is not HTTP/SSE
        +-- UpstreamTimeout     504 connected, but silent past ``read_timeout``

An upstream's own 4xx/5xx *response* is not an exception: its body reaches the
client unchanged. Every error body is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math

from starlette.responses import JSONResponse


class ProxyError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def sse_event(self) -> bytes:
        """The error as one in-stream SSE event, for failures after the first byte."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ProxyError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class ShuttingDown(ProxyError):
    """The proxy is stopping (SIGTERM) and the stream outlived ``shutdown_grace``."""

    status = 503
    type = "server_error"
    code = "proxy_shutting_down"


class BodyTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class HeadersTooLarge(ProxyError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


class QueueFull(ProxyError):
    status = 429
    type = "rate_limit_error"
    code = "prefill_queue_full"

    def __init__(self, message: str, *, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class QueueTimeout(ProxyError):
    status = 503
    type = "server_error"
    code = "prefill_queue_timeout"


class UpstreamError(ProxyError):
    """Base of upstream failures; ``kind`` is the bounded metric label."""

    kind = "other"


class UpstreamUnavailable(UpstreamError):
    status = 502
    type = "server_error"
    code = "upstream_unavailable"
    kind = "connect"


class UpstreamProtocolError(UpstreamError):
    status = 502
    type = "server_error"
    code = "upstream_protocol_error"
    kind = "protocol"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"
    kind = "timeout"
