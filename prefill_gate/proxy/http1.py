"""The proxy's HTTP/1.1 server protocol: one client connection, its requests to an ASGI app.

uvicorn runs the server (its sockets, the lifespan, signals, graceful shutdown) and this
protocol on each client connection (``uvicorn.Config(http=...)``, set up by
``prefill_gate.proxy.listener.server_config``), in place of uvicorn's own httptools protocol. To clients
and to the app it speaks as that one does: keep-alive, pipelined requests answered in turn,
``Expect: 100-continue``, flow control both ways, HTTP/1.0, HEAD; the same ASGI scope and
messages, the same bytes on the wire (``tests/test_http1.py`` holds the two to each other
on the same requests). What it adds, for a public listener:

- A deadline for each request's head (``client_header_timeout``), from the connection's
  start or from the first byte after the previous answer: 408 and the connection closed
  when it passes (a client that connects and sends nothing, or its headers a byte at a
  time). The body is not under it: a large upload may take its time.
- A bound on the head's size: header names and values over ``max_header_bytes`` (or more
  than ``MAX_HEADERS`` fields) get 431, a request target over ``MAX_TARGET_BYTES`` 414,
  before the app runs. The parser holds a header (or a chunked body's trailer) field until
  it ends; bytes it has made nothing of are counted as they arrive, so none is held past
  that bound either (uvicorn's holds a field however long).
- A chunked body's trailer fields never join the request's headers.
- Garbage after a request whose answer is under way does not land inside that answer
  (uvicorn writes its 400 into the stream): the connection closes once the answer ends.
  Every refusal closes by lingering: what the client still sends is read and dropped for a
  moment, so that the answer is not lost to a reset.
- The connection's loss runs the callbacks its requests' ``send`` list (``ON_LOST``,
  prefill_gate.proxy.disconnect) instead of a task per request waiting on ``receive``; and
  it is seen while the app works on a request whose body is whole (a long prompt held at
  the gate): reading goes on behind it, bounded, where uvicorn's stays paused after a large
  body or a pipelined head, and a client that left is found only when its answer is written.
- At most ``MAX_PIPELINED`` requests queue behind the one being answered (one read can
  hold thousands of heads); past the bound nothing more is read, and the connection closes
  after those queued are answered.

And it does less per request, which is what relaying many short streams pays for (issue
27; bench/request_costs.py): no logger lookups or socket objects per connection, one timer
at a time, no Event per request, objects with ``__slots__``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import urllib.parse
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT as HIGH_WATER  # body bytes held before reading pauses
from uvicorn.protocols.http.flow_control import service_unavailable  # the 503 over max_client_connections
# uvicorn's status lines and its checks of an answer's header names and values (header
# injection), shared: the same bytes and refusals as its protocol by construction.
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from .disconnect import ON_LOST
from .errors import AnswerCut

# The loggers uvicorn's protocol logs to: logging set up for uvicorn (and prefill-gate
# serve's filters on them, prefill_gate/proxy/cli.py) applies as before.
log = logging.getLogger("uvicorn.error")
access = logging.getLogger("uvicorn.access")

MAX_TARGET_BYTES = 16384  # the request target (path and query)
MAX_HEADERS = 512  # header fields in one request head
MAX_PIPELINED = 16  # requests queued behind the one being answered (more: the connection closes after it)
LINGER_S = 2.0  # after a refusal, how long what the client still sends is read and dropped


def _plain(status: int, text: str, *, json_error: str | None = None) -> bytes:
    """A whole answer that closes the connection: the protocol's own refusals."""
    if json_error is None:
        ctype, body = b"text/plain; charset=utf-8", text.encode()
    else:
        ctype = b"application/json"
        body = b'{"error": {"message": "%s", "type": "invalid_request_error", "param": null, "code": "%s"}}' % (
            text.encode(), json_error.encode())
    return (STATUS_LINE[status] + b"content-type: %s\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (ctype, len(body), body))


_400 = _plain(400, "Invalid HTTP request received.")
_408 = _plain(408, "the request's headers did not arrive in time (client_header_timeout)", json_error="request_timeout")
_408_BODY = _plain(408, "the request's body did not arrive in time (client_body_timeout)", json_error="request_timeout")
BODY_MIN_RATE = 65536  # bytes a second: each such many received give a body's deadline one more second
_HEAD, _BODY, _IDLE = "head", "body", "idle"  # what the connection's one timer bounds
_414 = _plain(414, "the request target is over %d bytes" % MAX_TARGET_BYTES, json_error="uri_too_long")
_READING, _PAUSED, _STOPPED = "reading", "paused", "stopped"  # a connection's reads
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DISCONNECT = {"type": "http.disconnect"}


class _Refused(Exception):
    """Raised from a parser callback: what was read is answered with ``answer`` and the
    connection closed (``Connection._refuse``)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer


class _TooManyPipelined(Exception):
    """Raised from the parser's head callback: more requests queued than ``MAX_PIPELINED``.
    Those queued are answered; nothing more is read, and the connection closes after them."""


class Cycle:
    """One request and its answer: the app's ``receive`` and ``send``. Fields read from
    outside keep the names of uvicorn's RequestResponseCycle: ``prefill_gate.proxy.listener.ChunkWriter``
    and the compiled relay read ``response_started``, ``chunked_encoding``,
    ``response_complete``, ``disconnected``, ``transport`` and ``flow.write_paused`` (the
    connection), and prefill_gate.proxy.disconnect reads ``ON_LOST``."""

    __slots__ = ("flow", "transport", "scope", "keep_alive", "continue_expected", "parts", "buffered", "more_body",
                 "delivered", "waiter", "response_started", "response_complete", "chunked_encoding", "length_left",
                 "disconnected", "prefill_gate_on_lost")

    def __init__(self, conn: "Connection", scope: dict, keep_alive: bool, continue_expected: bool) -> None:
        self.flow = conn
        self.transport = conn.transport
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_expected = continue_expected
        self.parts: list[bytes] = []  # body bytes not yet received by the app
        self.buffered = 0
        self.more_body = True
        self.delivered = False  # the app has had the body's end
        self.waiter: asyncio.Future | None = None  # receive() waiting
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.length_left = 0
        self.disconnected = False
        self.prefill_gate_on_lost = conn.on_lost  # (ON_LOST) a list, not the connection: no reference cycle

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def run(self, app: Any) -> None:
        try:
            result = await app(self.scope, self.receive, self.send)
        except AnswerCut as exc:  # the app's own verdict: its answer, begun, cannot end whole
            log.debug("answer cut: %s", exc)
            self.transport.close()
        except BaseException as exc:
            log.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if result is not None:
                log.error("ASGI callable should return None, but returned '%s'.", result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self.transport.close()

    async def _send_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500,
                         "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"),
                                     (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})

    async def receive(self) -> dict:
        if self.continue_expected:
            self.continue_expected = False
            if not self.transport.is_closing():
                self.transport.write(_CONTINUE)
        while not (self.parts or self.disconnected or self.response_complete) and (self.more_body or self.delivered):
            # Nothing new: the body's next bytes, or after its end the connection's loss or the answer's end.
            self.flow.resume_reading_for(self)
            self.waiter = waiter = self.flow.loop.create_future()
            try:
                await waiter
            finally:
                self.waiter = None
        if self.disconnected or self.response_complete:
            return _DISCONNECT
        parts = self.parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts = []
        self.buffered = 0
        if not self.more_body:
            self.delivered = True
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: dict) -> None:
        conn = self.flow
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")

    def _start(self, status: int, headers: Any) -> None:
        line = STATUS_LINE.get(status)
        if line is None:  # (the app's error: refused before anything is written, so it can still get a 500)
            raise RuntimeError(f"ASGI response status {status!r} is not an HTTP status")
        self.response_started = True
        self.continue_expected = False
        conn = self.flow
        if conn.access_log and access.isEnabledFor(logging.INFO):
            scope = self.scope
            access.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                        get_path_with_query_string(scope), scope["http_version"], status)
        head = [line]
        for name, value in conn.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        closes = False
        for name, value in headers:
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.length_left = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.length_left = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [t.lower().strip() for t in value.split(b",")]:
                self.keep_alive = False
                closes = True
            head += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not closes:
            head.append(b"connection: close\r\n")
        if self.chunked_encoding is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked_encoding = True  # neither a length nor chunked: chunked
            head.append(b"transfer-encoding: chunked\r\n")
        head.append(b"\r\n")
        self.transport.write(b"".join(head))

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.length_left = 0
        elif self.chunked_encoding:
            if body:
                self.transport.write(b"%x\r\n%s\r\n%s" % (len(body), body, b"" if more_body else b"0\r\n\r\n"))
            elif not more_body:
                self.transport.write(b"0\r\n\r\n")
        else:
            if len(body) > self.length_left:
                raise RuntimeError("Response content longer than Content-Length")
            self.length_left -= len(body)
            self.transport.write(body)
        if not more_body:
            if self.length_left != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.wake()
            if not self.keep_alive:
                self.flow.close_answered()
            self.flow.answered(self)


assert ON_LOST in Cycle.__slots__


class Connection(asyncio.Protocol):
    """One client connection. ``protocol_class`` binds the settings; uvicorn makes one per
    accepted connection with its config and the server's shared state."""

    header_timeout = 10.0  # client_header_timeout
    body_timeout = 30.0  # client_body_timeout
    max_header_bytes = 65536
    access_log = False

    __slots__ = ("config", "server_state", "app_state", "app", "loop", "transport", "parser", "client", "server",
                 "scheme", "url", "headers", "head_bytes", "quiet", "surfaced", "in_head", "continue_expected", "cycle",
                 "active", "queued", "read_state", "write_paused", "drainers", "timer", "timer_kind", "body_deadline",
                 "on_lost", "lingering")

    def __init__(self, config: Any, server_state: Any, app_state: dict, _loop: Any = None) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        # As uvicorn's: bytes after a request that closes the connection are not an error.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.in_head = False  # a head begun and not complete
        self.cycle: Cycle | None = None  # the request the parser reads now (the latest)
        self.active: Cycle | None = None  # the request being answered
        self.queued: collections.deque | None = None  # pipelined requests to answer after it
        self.read_state = _READING
        self.write_paused = False
        self.drainers: list = []
        self.timer: asyncio.TimerHandle | None = None
        self.timer_kind: str | None = None  # _HEAD, _BODY or _IDLE (keep-alive, lingering)
        self.body_deadline = 0.0  # loop time; while timer_kind is _BODY
        self.on_lost: list = []  # callbacks for the connection's loss (prefill_gate.proxy.disconnect)
        self.lingering = False  # refused: what the client still sends is dropped
        self.quiet = 0  # bytes read since the parser last made something of them

    # -------------------------------------------------------------- the transport's calls
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.server_state.connections.add(self)
        self.transport = transport
        self.client = _address(transport.get_extra_info("peername"))
        self.server = _address(transport.get_extra_info("sockname"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._disarm()
        for cycle in (self.active, self.cycle):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
            if cycle is not None:
                cycle.wake()
        self.queued = None
        self.resume_writing()
        if exc is None:
            self.transport.close()
        self.parser = None  # it holds this protocol: no reference cycle
        for callback in tuple(self.on_lost):
            callback()

    def eof_received(self) -> None:
        pass  # the transport closes: a client that half-closes is done

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        kind = self.timer_kind
        if kind is _IDLE:  # kept alive, and bytes came: a head begins (or a CRLF: no deadline-free idling)
            self._arm_head()
        elif kind is _BODY:
            self.body_deadline += len(data) / BODY_MIN_RATE
        self.surfaced = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade()
            return
        except httptools.HttpParserError as exc:
            cause = exc.__cause__ or exc.__context__  # what a callback raised
            if isinstance(cause, _TooManyPipelined):
                self._stop_reading()
                self.queued[-1][0].keep_alive = False
                return
            refusal = cause if isinstance(cause, _Refused) else None
            if refusal is None:
                log.warning("Invalid HTTP request received.")
            self._refuse(_400 if refusal is None else refusal.answer)
            return
        if self.surfaced:
            self.quiet = 0
        else:  # nothing came of these bytes yet: the parser holds them (a header or trailer field unfinished)
            self.quiet += len(data)
            if self.quiet > self.max_header_bytes + MAX_TARGET_BYTES:
                self._refuse(self._431() if self.in_head else _400)
                return
        if self.timer is None:
            cycle = self.cycle
            if self.in_head and self._idle():
                self._arm_head()
            elif cycle is not None and cycle.more_body and not self.in_head and not cycle.response_complete:
                self._arm_body()  # a body under way: it has a deadline too

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drainers, self.drainers = self.drainers, []
        for waiter in drainers:
            if not waiter.done():
                waiter.set_result(None)

    async def drain(self) -> None:
        waiter = self.loop.create_future()
        self.drainers.append(waiter)
        await waiter

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now if idle, else after the answer under way."""
        if self._idle():
            self.transport.close()
        else:
            for cycle in (self.active, self.cycle):
                if cycle is not None:
                    cycle.keep_alive = False
            self.queued = None

    # -------------------------------------------------------------- the parser's calls
    def on_message_begin(self) -> None:
        self.in_head = True
        self.url = b""
        self.headers: list = []
        self.head_bytes = 0
        self.continue_expected = False

    def on_url(self, url: bytes) -> None:
        self.surfaced = True
        self.url += url
        if len(self.url) > MAX_TARGET_BYTES:
            raise _Refused(_414)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.surfaced = True
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > self.max_header_bytes or len(self.headers) >= MAX_HEADERS:
            raise _Refused(self._431())
        if not self.in_head:
            return  # a chunked body's trailer field: counted against the bound, never a header
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.continue_expected = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.surfaced = True
        self.in_head = False
        if self.timer_kind is _HEAD:
            self._disarm()
        parser = self.parser
        version = parser.get_http_version()
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.config.root_path
        scope = {"type": "http", "asgi": {"version": self.config.asgi_version, "spec_version": "2.3"},
                 "http_version": version, "server": self.server, "client": self.client, "scheme": self.scheme,
                 "method": parser.get_method().decode("ascii"), "root_path": root,
                 "path": root + path if root else path, "raw_path": root.encode("ascii") + raw_path if root else raw_path,
                 "query_string": url.query or b"", "headers": self.headers, "state": self.app_state.copy()}
        cycle = Cycle(self, scope, version != "1.0" and parser.should_keep_alive(), self.continue_expected)
        self.cycle = cycle
        limit = self.config.limit_concurrency
        state = self.server_state
        app = self.app
        if limit is not None and (len(state.connections) >= limit or len(state.tasks) >= limit):
            log.warning("Exceeded concurrency limit.")
            app = service_unavailable
        if self.active is None or self.active.response_complete:
            self._start(cycle, app)
        else:  # pipelined: answered after the one under way
            if self.queued is None:
                self.queued = collections.deque()
            elif len(self.queued) >= MAX_PIPELINED:  # one read can hold thousands of heads: bound their state
                raise _TooManyPipelined
            self.queued.append((cycle, app))

    def on_body(self, body: bytes) -> None:
        self.surfaced = True
        cycle = self.cycle
        if cycle.response_complete:
            return  # answered already: the rest of its body goes nowhere
        cycle.parts.append(body)
        cycle.buffered += len(body)
        if cycle.buffered > HIGH_WATER:
            self._pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        self.surfaced = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.more_body = False
            cycle.wake()
        if self.timer_kind is _BODY:
            self._disarm()
        # The body is whole: read on, bounded as what follows arrives (a pipelined head by its
        # size, its body by HIGH_WATER, their number by MAX_PIPELINED), so that a client that
        # leaves now is seen at once, not when its answer is written (a body's last read over
        # HIGH_WATER paused reading, and nothing else would have resumed it).
        self._resume_reading()

    # -------------------------------------------------------------- requests and answers
    def _start(self, cycle: Cycle, app: Any) -> None:
        self.active = cycle
        task = self.loop.create_task(cycle.run(app))
        tasks = self.server_state.tasks
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def answered(self, cycle: Cycle) -> None:
        """``cycle``'s answer is complete: the next pipelined request, or the wait for one."""
        if cycle is not self.active:
            return
        self.server_state.total_requests += 1
        if self.transport.is_closing() or self.lingering:
            return
        if self.queued:
            self._start(*self.queued.popleft())
            if not self.queued:
                self._resume_reading()
            return
        self._resume_reading()
        if self.in_head:
            self._arm_head()  # the next head began while this one was answered
        else:
            self._disarm()
            self.timer = self.loop.call_later(self.config.timeout_keep_alive, self._idle_timed_out)
            self.timer_kind = _IDLE

    def close_answered(self) -> None:
        """The end of a connection whose last answer is complete. Where reading stopped at
        bytes refused (:meth:`_refuse`), more may wait unread, and a close on unread bytes
        resets the connection, which can cost the client the answer's tail: linger instead."""
        if self.read_state is _STOPPED and not self.transport.is_closing():
            self._linger()
        else:
            self.transport.close()

    def resume_reading_for(self, cycle: Cycle) -> None:
        """The app waits on ``cycle``'s body: read, unless requests are queued behind it."""
        if self.read_state is _PAUSED and cycle is self.active and not self.queued:
            self._resume_reading()

    def _idle(self) -> bool:
        return self.active is None or self.active.response_complete

    def _pause_reading(self) -> None:
        if self.read_state is _READING:
            self.read_state = _PAUSED
            self.transport.pause_reading()

    def _stop_reading(self) -> None:
        """Nothing more is read from this connection (it closes after the answer under way)."""
        self._pause_reading()
        self.read_state = _STOPPED

    def _resume_reading(self) -> None:
        if self.read_state is _PAUSED:
            self.read_state = _READING
            self.transport.resume_reading()

    def _431(self) -> bytes:
        return _plain(431, "the request's headers are over %d bytes or %d fields (max_header_bytes)"
                      % (self.max_header_bytes, MAX_HEADERS), json_error="headers_too_large")

    def _refuse(self, answer: bytes) -> None:
        """Bytes that cannot be served (malformed, a head too large, a field without end):
        ``answer`` and the end of the connection. Where a request is being answered: if its
        own bytes were whole, the bad ones are the next request's, and its answer ends whole
        before the connection does (no error inside it); if they cut its body, the app hears
        that its client is gone (its answer, begun, is cut)."""
        self._disarm()
        self.in_head = False
        self.queued = None
        active = self.active
        if active is not None and not active.response_complete:
            if not active.more_body:
                self._stop_reading()
                active.keep_alive = False
                return
            active.disconnected = True  # its body can never be read to its end
            active.wake()
            if active.response_started:
                self.transport.close()
                return
        if not self.transport.is_closing():
            self.transport.write(answer)
            self._linger()

    def _linger(self) -> None:
        """Close after the answer; until then (``LINGER_S`` at most) read and drop what the
        client still sends: closing on unread bytes resets the connection, and a client still
        sending its head would likely never read the answer that says why."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.lingering = True
        self.transport.write_eof()
        if self.read_state is _PAUSED:
            self.transport.resume_reading()
        self.read_state = _READING
        self.timer = self.loop.call_later(LINGER_S, self._idle_timed_out)
        self.timer_kind = _IDLE

    def _upgrade(self) -> None:
        """A request asking to switch protocols: served as HTTP (nothing here speaks
        another protocol; the parser has ended its message), and the connection closed after
        its answer; what follows its head is not read."""
        self._stop_reading()
        if self.cycle is not None:
            self.cycle.keep_alive = False

    # -------------------------------------------------------------- timers
    def _arm_head(self) -> None:
        self._disarm()
        self.timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
        self.timer_kind = _HEAD

    def _arm_body(self) -> None:
        self._disarm()
        self.body_deadline = self.loop.time() + self.body_timeout
        self.timer = self.loop.call_at(self.body_deadline, self._body_timed_out)
        self.timer_kind = _BODY

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.timer_kind = None

    def _head_timed_out(self) -> None:
        self.timer = None
        self.timer_kind = None
        if not self.transport.is_closing():
            log.debug("closing a client connection whose request head took over %g s", self.header_timeout)
            self._refuse(_408)

    def _body_timed_out(self) -> None:
        """The body's deadline (moved on by every read) passed: 408, unless this connection
        itself stopped reading (the app has not taken what came: its delay, not the client's)."""
        self.timer = None
        self.timer_kind = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self.read_state is not _READING:
            self.body_deadline = now + self.body_timeout
        if now < self.body_deadline:
            self.timer = self.loop.call_at(self.body_deadline, self._body_timed_out)
            self.timer_kind = _BODY
            return
        log.debug("closing a client connection whose request body took too long")
        self._refuse(_408_BODY)

    def _idle_timed_out(self) -> None:
        self.timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _address(addr: Any) -> tuple | None:
    """An ASGI address from a transport's: (host, port) for IP sockets, else None."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return str(addr[0]), int(addr[1])
    return None


def protocol_class(header_timeout: float, max_header_bytes: int, access_log: bool, body_timeout: float = 30.0) -> type:
    return type("PrefillGateHttp", (Connection,), {"__slots__": (), "header_timeout": header_timeout,
                                                     "body_timeout": body_timeout,
                                                     "max_header_bytes": max_header_bytes,
                                                     "access_log": access_log})
