"""The bounded values of the proxy's metric labels, as string enums (``(str, Enum)`` while
Python 3.10 is supported). ``str()`` of a member is its value, as Prometheus labels need."""

from __future__ import annotations

import enum


class Label(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class OutcomeKind(Label):
    """How a request ended (``requests_total{outcome}``)."""

    COMPLETED = "completed"
    CLIENT_DISCONNECT = "client_disconnect"
    UPSTREAM_ERROR = "upstream_error"  # the proxy failed to get an answer, or the stream carried an error
    UPSTREAM_HTTP_ERROR = "upstream_http_error"  # the upstream answered 4xx/5xx (relayed as it was)
    REJECTED = "rejected"  # the queue was full or the wait bound passed
    BAD_REQUEST = "bad_request"
    SHUTDOWN = "shutdown"


class AdmissionLabel(Label):
    """How a request got past the gate (``admissions_total{decision}``)."""

    IMMEDIATE = "immediate"
    SLICING = "slicing"
    AFTER_WAIT = "after_wait"
    AFTER_TIMEOUT = "after_timeout"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    REJECTED_TIMEOUT = "rejected_timeout"
    CANCELLED = "cancelled"


class ErrorKind(Label):
    """What went wrong upstream (``upstream_errors_total{kind}``)."""

    CONNECT = "connect"
    TIMEOUT = "timeout"
    PROTOCOL = "protocol"
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    OTHER = "other"  # the base class's; no raise site uses it (not pre-initialised)

    @classmethod
    def of_status(cls, status: int) -> "ErrorKind":
        return cls.HTTP_4XX if status < 500 else cls.HTTP_5XX


class UpstreamMode(Label):
    """What the gate does with a large prefill that arrives while protected streams decode on
    an upstream (``upstream_mode{upstream, mode}``; chosen from what the health checks find)."""

    PACED = "paced"  # its engine bounds every step (engine_patches pacing): the prompt goes at once
    SLICED = "sliced"  # stock vLLM that can be sliced (prefix caching, /tokenize): slice or hold (slicing)
    HELD = "held"  # it waits until no protected stream is live, or for its wait bound
