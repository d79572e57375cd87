"""The client-facing HTTP server: uvicorn's server, the proxy's own protocol on each
connection (``prefill_gate.proxy.http1``: uvicorn's behaviour to clients and the app, plus a deadline
and a size bound for each request's head, and less work per request), with the bounds a
public listener needs from settings.

uvicorn closes idle keep-alive connections (``client_idle_timeout``) and caps connections
plus requests (``max_client_connections``); the protocol gives each request's head
``client_header_timeout`` seconds and ``max_header_bytes``.

``chunk_writer`` lets the relay write a streamed answer's parts from the upstream's read
callback, without waking the request's task (see ``prefill_gate.proxy.exchange.GatedExchange._pump``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import uvicorn

from .http1 import Cycle, protocol_class
from .settings import Settings


class ChunkWriter:
    """Writes the body parts of a chunked answer straight to the client's socket, from a
    callback: exactly what the cycle's ``send`` writes for an ``http.response.body``
    message with ``more_body`` (``tests/test_direct_relay.py`` holds the two byte for byte), for
    as long as that is all it would do. It refuses when ``send`` has more to do: the client
    stopped reading (flow control), went away, the answer is complete, or it is not chunked;
    the caller then goes through ``send``."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle  # prefill_gate.proxy.http1.Cycle (prefill_gate/proxy/relaycore.py's compiled core reads it too)

    def write_through(self, take: Callable[[bytes], bytes], data: bytes) -> bool:
        """``take(data)`` written as one body part (nothing, where it gives nothing), and True;
        or, where ``send`` has more to do, False with ``take`` not called. One call: over
        ``StreamObserver.take`` it is the Python core's read callback for the upstream
        connection (``prefill_gate.proxy.relaycore``; the compiled core does the same in C)."""
        c = self.cycle
        if not c.response_started or c.chunked_encoding is not True or c.response_complete \
                or c.disconnected or c.flow.write_paused:
            return False
        body = take(data)
        if body:
            c.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return True


def chunk_writer(send: Any) -> ChunkWriter | None:
    """A ChunkWriter for ``send`` when it is the proxy's protocol's ``send`` of a POST; None
    for anything else (uvicorn's own protocols, other servers, the tests' in-memory ASGI
    transport), which keeps to ``send``."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not Cycle or cycle.scope.get("method") != "POST":
        return None
    return ChunkWriter(cycle)


def server_config(app: Any, settings: Settings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for the proxy's listener, with every client bound from settings.

    Below log level info nothing prints uvicorn's access log, but uvicorn would still format
    each response's line (client address, quoted path); and the client's address behind a
    trusted proxy (X-Forwarded-For) is only ever read by that line. Both go with it."""
    level = kwargs.get("log_level", settings.log_level)
    kwargs.setdefault("access_log", level.lower() in ("trace", "debug", "info") if isinstance(level, str)
                      else level <= logging.INFO)
    kwargs.setdefault("proxy_headers", kwargs["access_log"])
    http = protocol_class(settings.client_header_timeout, settings.max_header_bytes, kwargs["access_log"],
                          settings.client_body_timeout)
    return uvicorn.Config(app, http=http,
                          limit_concurrency=settings.max_client_connections,
                          timeout_keep_alive=settings.client_idle_timeout, **kwargs)
