"""The gated endpoints in the proxy's OpenAPI document.

`POST /v1/chat/completions` and `POST /v1/completions` are served by the ASGI hot path
(`GateApp`), before FastAPI routes anything, so FastAPI cannot describe them by itself.
These models describe what the proxy reads from a request; every other field passes
through to vLLM untouched (`extra="allow"`). They validate nothing at run time: the hot
path checks the fields it uses (`bodies.parse_body`) and leaves the rest to vLLM.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None


class ContentPart(_Open):
    type: str = Field(description="text, image_url, ... (passed to vLLM as is)")


class ChatMessage(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class _Request(_Open):
    model: str | None = Field(None, description="The upstream model (the gate is per upstream, not per model).")
    stream: bool | None = Field(None, description="Stream SSE chunks; a streaming decode is protected.")
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    priority: int | None = Field(None, description="Queue order for large prefills (as vLLM's `priority`).")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


ERRORS = {
    400: "Bad JSON, a wrong type, or a bad gate header (or the upstream's own 400, passed through)",
    401: "Missing or invalid API key (when api_keys_file is set)",
    413: "Body over max_body_bytes",
    429: "Queue full (Retry-After says when to retry)",
    431: "Headers over max_header_bytes",
    502: "Upstream unreachable or broken",
    503: "Wait bound passed with on_queue_timeout=reject, or shutting down",
    504: "Upstream silent past read_timeout",
}


def gated_responses() -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "vLLM's answer: JSON, or SSE chunks when streaming",
              "content": {"application/json": {}, "text/event-stream": {}}},
    }
    for status, why in ERRORS.items():
        responses[status] = {"model": ErrorResponse, "description": why}
    responses["4XX"] = {"description": "The upstream's other client errors, passed through unchanged"}
    responses["5XX"] = {"description": "The upstream's own server errors, passed through unchanged"}
    return responses
