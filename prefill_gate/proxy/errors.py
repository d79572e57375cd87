"""The proxy's one exception tree, and how each maps to an OpenAI-style error.

    ProxyError                      base: an HTTP status, an OpenAI error type and code
    +-- BadRequest          400     body is not JSON, or a field has the wrong type, or a path
                                    spelled to reach around the gate (dot segments, %2e, %00...)
    +-- Unauthorized        401     api_keys_file is set and the Bearer key is not in it
    +-- NotFound            404     no such path
    +-- MethodNotAllowed    405     a gated endpoint asked with another method than POST
    +-- BodyTooLarge        413     body over ``max_body_bytes``
    +-- HeadersTooLarge     431     headers over ``max_header_bytes``
    +-- QueueFull           429     the large-prefill queue is full, by count or by bytes (carries Retry-After)
    +-- QueueTimeout        503     waited ``max_queue_wait`` and ``on_queue_timeout=reject``
    +-- ShuttingDown        503     the proxy stops (SIGTERM) and the request outlived ``shutdown_grace``
    +-- UpstreamError               the upstream failed us (mapped in ``upstream.py`` only)
        +-- UpstreamUnavailable 502 cannot connect, no healthy upstream
        +-- UpstreamProtocolError 502 the upstream answered something that is not HTTP/SSE
        +-- UpstreamTimeout     504 connected, but silent past ``read_timeout``, or the request
                                    past ``max_request_seconds``

An upstream's own 4xx/5xx *response* is not an exception: its body reaches the
client unchanged. Every error body is ``{"error": {"message", "type", "param", "code"}}``.

Outside the tree, ``AnswerCut``: an answer that began and cannot end whole (a passthrough
body the upstream broke off) is cut, the connection closed, never ended as if complete.
"""

from __future__ import annotations

import json
import math

from starlette.responses import JSONResponse

from .labels import ErrorKind, OutcomeKind


class AnswerCut(Exception):
    """Raised out of the app after its answer began: the connection must close without the
    answer's end (a chunked body's last chunk, or the rest of a declared length), so that the
    client sees a broken answer, not a complete-looking one. The listener closes quietly."""


class ProxyError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None
    outcome = OutcomeKind.BAD_REQUEST  # the requests_total{outcome} it ends a request with

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
    outcome = OutcomeKind.SHUTDOWN


class BodyTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str):
        super().__init__(message)
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow}


class HeadersTooLarge(ProxyError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


class QueueFull(ProxyError):
    status = 429
    type = "rate_limit_error"
    code = "prefill_queue_full"
    outcome = OutcomeKind.REJECTED

    def __init__(self, message: str, *, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class QueueTimeout(ProxyError):
    status = 503
    type = "server_error"
    code = "prefill_queue_timeout"
    outcome = OutcomeKind.REJECTED


class UpstreamError(ProxyError):
    """Base of upstream failures; ``kind`` is the bounded metric label."""

    kind = ErrorKind.OTHER
    outcome = OutcomeKind.UPSTREAM_ERROR


class UpstreamUnavailable(UpstreamError):
    status = 502
    type = "server_error"
    code = "upstream_unavailable"
    kind = ErrorKind.CONNECT


class UpstreamProtocolError(UpstreamError):
    status = 502
    type = "server_error"
    code = "upstream_protocol_error"
    kind = ErrorKind.PROTOCOL


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"
    kind = ErrorKind.TIMEOUT
