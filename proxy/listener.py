"""The client-facing HTTP server: uvicorn, with the bounds a public listener needs.

uvicorn closes idle keep-alive connections (``client_idle_timeout``) and caps
connections plus requests (``max_client_connections``), but it has no deadline for a
request's head: a client that connects and sends nothing, or sends its headers a byte at
a time (slowloris), holds a socket for as long as it likes. ``HeadDeadline`` gives each
request's head ``client_header_timeout`` seconds, from the connection's start or from the
first byte after the previous answer, and answers 408 and closes the connection when it
passes. The body is not under that deadline (a large upload may take its time; the
request's own bounds apply to it). A chunked body's trailer fields never join the request's
headers.

Each request's ``send`` (its cycle) carries the connection's list of callbacks for its
loss, which ``proxy.disconnect.DisconnectWatch`` joins instead of running a task per request.

``chunk_writer`` lets the relay write a streamed answer's parts from the upstream's read
callback, without waking the request's task (see ``proxy.exchange.GatedExchange._pump``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

import uvicorn

from .disconnect import ON_LOST
from .settings import Settings

try:  # uvicorn's httptools protocol; without httptools, its pure-Python h11 one
    from uvicorn.protocols.http import httptools_impl
except ImportError:
    httptools_impl = None

log = logging.getLogger("prefill_gate")

_408_BODY = json.dumps({"error": {"message": "the request's headers did not arrive in time (client_header_timeout)",
                                  "type": "invalid_request_error", "param": None,
                                  "code": "request_timeout"}}).encode()
_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(_408_BODY), _408_BODY))


class HeadDeadline:
    """Mixed into uvicorn's HTTP protocol classes. Both keep the request being answered in
    ``self.cycle`` and replace it when a new request's headers are complete: the deadline
    is armed while no head is in progress and disarmed when ``cycle`` changes."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._on_lost: list = []  # what DisconnectWatch asks to run when this connection is lost
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_head()  # the first bytes of the next request on a keep-alive connection
        super().data_received(data)  # type: ignore[misc]
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._disarm_head()  # its headers are complete

    def on_headers_complete(self) -> None:
        """(httptools) The request's headers as its head had them: the parser appends a
        chunked body's trailer fields to the same list while it reads the body, possibly
        before the app first runs, and they would be forwarded upstream as headers."""
        super().on_headers_complete()  # type: ignore[misc]
        self.scope["headers"] = list(self.scope["headers"])
        setattr(self.cycle, ON_LOST, self._on_lost)  # a list, not this protocol: no reference cycle

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head()
        super().connection_lost(exc)  # type: ignore[misc]
        for callback in tuple(self._on_lost):
            callback()

    def _arm_head(self) -> None:
        self._head_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.debug("closing a client connection whose request head took over %g s", self.header_timeout)
            self.transport.write(_408)
            self.transport.close()


class ChunkWriter:
    """Writes the body parts of a chunked answer straight to the client's socket, from a
    callback: exactly what uvicorn's httptools ``send`` writes for an ``http.response.body``
    message with ``more_body`` (``tests/test_direct_relay.py`` holds the two byte for byte), for
    as long as that is all it would do. It refuses when ``send`` has more to do: the client
    stopped reading (flow control), went away, the answer is complete, or it is not chunked;
    the caller then goes through ``send``."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle  # uvicorn's RequestResponseCycle (proxy/relaycore.py's compiled core reads it too)

    def write_through(self, take: Callable[[bytes], bytes], data: bytes) -> bool:
        """``take(data)`` written as one body part (nothing, where it gives nothing), and True;
        or, where ``send`` has more to do, False with ``take`` not called. One call: over
        ``StreamObserver.take`` it is the Python core's read callback for the upstream
        connection (``proxy.relaycore``; the compiled core does the same in C)."""
        c = self.cycle
        if not c.response_started or c.chunked_encoding is not True or c.response_complete \
                or c.disconnected or c.flow.write_paused:
            return False
        body = take(data)
        if body:
            c.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return True


_CYCLE_FIELDS = ("response_started", "chunked_encoding", "response_complete", "disconnected", "flow", "transport",
                 "scope")


def chunk_writer(send: Any) -> ChunkWriter | None:
    """A ChunkWriter for ``send`` when it is uvicorn's httptools ``send`` of a POST; None
    for anything else (uvicorn's h11 protocol, other servers, the tests' in-memory ASGI
    transport), which keeps to ``send``."""
    cycle = getattr(send, "__self__", None)
    if httptools_impl is None or type(cycle) is not httptools_impl.RequestResponseCycle \
            or not all(hasattr(cycle, f) for f in _CYCLE_FIELDS) \
            or cycle.scope.get("method") != "POST":
        return None
    return ChunkWriter(cycle)


def _protocol_class(header_timeout: float) -> type:
    if httptools_impl is not None:
        base = httptools_impl.HttpToolsProtocol
    else:  # httptools missing: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type("PrefillGateHttp", (HeadDeadline, base), {"header_timeout": header_timeout})


def server_config(app: Any, settings: Settings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for the proxy's listener, with every client bound from settings.

    Below log level info nothing prints uvicorn's access log, but uvicorn would still format
    each response's line (client address, quoted path); and the client's address behind a
    trusted proxy (X-Forwarded-For) is only ever read by that line. Both go with it."""
    level = kwargs.get("log_level", settings.log_level)
    kwargs.setdefault("access_log", level.lower() in ("trace", "debug", "info") if isinstance(level, str)
                      else level <= logging.INFO)
    kwargs.setdefault("proxy_headers", kwargs["access_log"])
    return uvicorn.Config(app, http=_protocol_class(settings.client_header_timeout),
                          limit_concurrency=settings.max_client_connections,
                          timeout_keep_alive=settings.client_idle_timeout, **kwargs)
