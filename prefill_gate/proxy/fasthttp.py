"""An httpx transport for the upstream streams: asyncio protocols and httptools' C parser.

httpx's default transport (httpcore over h11 and anyio) parses every relayed chunk in
pure Python and wraps every read in an anyio cancel scope for its timeout; profiled under
load that was most of the proxy's per-chunk CPU. This transport keeps httpx's API (the
client, its requests and responses, its exceptions, which `upstream.mapped_errors`
translates) and replaces what runs per chunk: `data_received` feeds httptools, body
bytes queue on the connection, and the response stream hands the consumer everything
that arrived since its last read as one bytes object (a proxy that falls behind relays
bigger batches instead of more of them).

What it does and does not do:
  * HTTP/1.1 to the configured upstreams, plain or TLS; keep-alive connections reused
    per origin (idle ones expire, and one the server closed is never handed out); a
    response not read to its end closes its connection, which is how vLLM learns the
    client left (it aborts the request and frees its KV cache).
  * Timeouts from the request (httpx.Timeout): connect, read (per wait for bytes), write,
    pool (waiting for a free connection slot).
  * Bounded buffering: past `HIGH_WATER` unread bytes the socket stops being read; a
    response head of more than `MAX_HEADERS` headers or `MAX_HEAD_BYTES` bytes, or more than
    `MAX_INTERIM` 1xx answers, is a protocol error; bytes that arrive on a pooled connection
    (an answer nobody asked for) close it, so they can never reach another request.
  * A request on a reused connection that the server closed before answering is sent
    again once on a fresh connection (the server closed an idle keep-alive; nothing of
    the request was processed).
  * Where the relay's sink takes them (the compiled core's), a chunked body's reads that are
    nothing but whole chunks skip the parser (``FramedConnection``): httptools' ``on_body``
    and the hand-over to the sink were two of the per-read path's seven Python calls, and
    that connection's ``data_received`` is compiled too, so such a read runs no Python.
    Everything else, the last chunk included, is the parser's.
  * No proxies from the environment, no HTTP/2, no request body streaming beyond
    reading it whole (the proxy's bodies are bounded by max_body_bytes).
"""

from __future__ import annotations

import asyncio  # asyncio.TimeoutError throughout: the builtin from 3.11, its own class on 3.10
import collections
import ssl
import time

import httptools
import httpx

try:  # the relay's compiled core, where the install built it (prefill_gate/proxy/relaycore.py)
    from ._relaycore import FramedReads as _FramedReads
except ImportError:
    _FramedReads = None

HIGH_WATER = 1 << 20  # unread body bytes per connection before the socket is paused
MAX_HEAD_BYTES = 64 * 1024  # defaults: a response head (status line and headers) longer than this is refused
MAX_HEADERS = 128
MAX_INTERIM = 8  # 1xx answers before the real one
BODY_READER = "prefill_gate.body_reader"  # a response extension: its body's read() (see body_reader)
BODY_SINK = "prefill_gate.body_sink"  # a response extension: hand body bytes to a callback (see body_sink)


def origin_of(url: httpx.URL) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the port defaulted by scheme: a connection pool key."""
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


class Answer:
    """An upstream's answer as ``FastTransport.open`` gives it: status, raw headers and the
    body's stream, with the two extensions the relay reads (``body_reader``, ``body_sink``).
    What the relay needs of an httpx.Response, without building one per request (its
    headers object, decoded and re-encoded, was ~5% of a short request's CPU); ``response()``
    is the httpx.Response where one is wanted."""

    __slots__ = ("status_code", "raw_headers", "stream", "extensions")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]], stream: "_ResponseStream") -> None:
        self.status_code = status_code
        self.raw_headers = raw_headers
        self.stream = stream
        self.extensions = {"http_version": b"HTTP/1.1", BODY_READER: stream.read, BODY_SINK: stream.set_sink}

    async def aclose(self) -> None:
        await self.stream.aclose()

    def response(self) -> httpx.Response:
        """The same answer as httpx's (for httpx's client, which wants one)."""
        return httpx.Response(self.status_code, headers=self.raw_headers, stream=self.stream,
                              extensions=self.extensions)


def body_reader(resp: httpx.Response | Answer):
    """An async callable that answers the body's next bytes, or None at its end: straight
    from this transport's connection when the response came from it (the relay's path),
    else through httpx's ``aiter_raw`` (any other transport, e.g. the tests' in-memory ones).
    Errors are httpx's either way."""
    read = resp.extensions.get(BODY_READER)
    if read is not None:
        return read
    chunks = resp.aiter_raw().__aiter__()

    async def read_raw() -> bytes | None:
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return None

    return read_raw


def body_sink(resp: httpx.Response | Answer, sink) -> bool:
    """Have ``sink(data) -> bool`` take the body's bytes in the connection's read callback,
    while the reader is parked in ``read()`` with nothing queued (so bytes keep their order):
    the relay's per-chunk path without a task switch. ``sink`` answers False to leave the
    bytes queued for ``read()`` (it could not take them now); an exception it raises ends
    the body with that error at ``read()``. False: the response is not this transport's.

    A sink with a ``chunked(read) -> None | True | bytes`` method (the compiled relay's,
    ``prefill_gate.proxy._relaycore.DirectRelay``) is offered a chunked body's reads before the HTTP
    parser, where the connection is between two chunks (``FramedConnection``): a read that
    is nothing but whole chunks it decodes and relays itself (True: taken; bytes: the
    payloads, not taken, queued for ``read()``); None leaves the read to the parser."""
    set_sink = resp.extensions.get(BODY_SINK)
    if set_sink is None:
        return False
    set_sink(sink)
    return True


class _Closed(Exception):
    """The server closed the connection before the response head (retryable if reused)."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one response at a time."""

    def __init__(self, origin: tuple, max_head_bytes: int = MAX_HEAD_BYTES, max_headers: int = MAX_HEADERS) -> None:
        self.origin = origin
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.in_use = True  # False while pooled: bytes arriving then are nobody's answer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # the read deadline's check (see wait)
        self._wait_timeout: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self._head_size = 0
        self._fields = 0  # header fields, then trailer fields, of this answer
        self.interim = 0
        self.head_done = False
        self.keep_alive = False
        self.until_eof = False  # a body delimited by the connection's end (no length, no chunks)
        self.complete = False
        self.error: Exception | None = None
        self.any_bytes = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future | None = None
        self.sink = None  # callable(bytes) -> bool: see body_sink
        self.sink_chunked = None  # the sink's ``chunked``, where it has one (see body_sink)
        # Between two chunks of a chunked body, past the head, the answer not complete: a read
        # here may be whole chunks (FramedConnection's callbacks keep it; never True here).
        self.at_boundary = False
        self._deadline = 0.0  # of the current wait (loop time)

    # ---------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        """A read: the HTTP parser's (``FramedConnection`` offers whole chunks to the sink first)."""
        if not self.in_use or self.complete:
            # Unasked-for bytes (a second answer on a pooled keep-alive, or after this one's
            # end) belong to no request: never hand this connection out again.
            self.keep_alive = False
            self.close()
            return
        self.any_bytes = True
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > self.max_head_bytes + HIGH_WATER:  # the parser's own count below is exact
                self._fail(httpx.RemoteProtocolError(f"upstream response head over {self.max_head_bytes} bytes"))
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("upstream tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP from upstream: {exc}"))
        if self.sink is not None and self.chunks and self.error is None and self.waiter is not None \
                and not self.waiter.done() and not self._to_sink():
            return  # taken in this callback; the reader waits on
        self._hand_over()

    _parse_read = data_received  # (FramedConnection's data_received falls back to it)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._stop_timer()
        # The parser holds this connection's callbacks, this connection the parser: a
        # reference cycle per closed connection (an abort, an error, an idle expiry) until a
        # full collection (prefill_gate/proxy/collector.py). Nothing is parsed after the connection's end.
        self.parser = None
        if self.head_done and self.until_eof and exc is None:
            self.complete = True
        if not self.complete and self.error is None:
            if not self.any_bytes:
                self.error = _Closed()
            else:
                self.error = httpx.ReadError(f"upstream closed the connection mid-response{f': {exc}' if exc else ''}")
        self._wake()

    def eof_received(self):
        return False  # close our side too

    def _to_sink(self) -> bool:
        """Offer what arrived to the sink (the reader is parked, nothing else queued). True:
        the reader must wake (bytes left for it, the body's end, or an error)."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # (_queued, inline: per read)
        try:
            taken = self.sink(data)
        except Exception as exc:
            self._sink_failed(exc)
            return True
        if not taken:
            return True
        self.chunks.clear()
        self.buffered = 0
        if self._timer is not None:  # bytes came: the read deadline moves, as a read() would move it
            self._deadline = self._loop.time() + self._wait_timeout
        return self.complete

    # --------------------------------------------------------- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer right behind the first: nobody asked for it
            raise httptools.HttpParserError("upstream sent an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value)
        self._fields += 1
        if self._fields > self.max_headers or self._head_size > self.max_head_bytes:
            raise httptools.HttpParserError(f"more than {self.max_headers} headers or {self.max_head_bytes} "
                                            "bytes of them (max_upstream_headers, max_upstream_head_bytes)")
        if not self.head_done:  # (after the head: a chunked body's trailer, bounded, never a header)
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not 100 <= self.status <= 599:  # llhttp takes any three digits
            raise httptools.HttpParserError(f"status {self.status} is not an HTTP status")
        if 100 <= self.status < 200:  # an interim answer (100 Continue): wait for the real one
            self.headers = []
            self._head_size = self._fields = 0
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise httptools.HttpParserError(f"more than {MAX_INTERIM} interim (1xx) answers")
            return
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()  # valid only inside the callbacks
        names = {name.lower() for name, _ in self.headers}
        self.until_eof = b"content-length" not in names and b"transfer-encoding" not in names

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
        self.at_boundary = False

    # ------------------------------------------------------------------- helpers
    def _fail(self, exc: Exception) -> None:
        self.error = exc
        self.close()

    def _sink_failed(self, exc: Exception) -> None:
        """The sink raised: the reader raises it; the connection is not reused."""
        self.sink = self.sink_chunked = None
        self.chunks.clear()
        self.buffered = 0
        self._fail(exc)

    def _hand_over(self) -> None:
        """Wake the reader for what is queued; past ``HIGH_WATER`` unread, stop reading."""
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        self.closed = True
        self.at_boundary = False
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout: float | None) -> None:
        """Until the parser made progress, the connection ended, or `timeout` passed.

        Called once per chunk of a stream: the timeout is a deadline moved forward here and
        one timer per connection that checks it (re-armed when it fires early), not a timer
        made and cancelled per chunk."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self.waiter = fut = loop.create_future()
        self._wait_timeout = timeout
        if timeout is not None:
            self._deadline = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._check_deadline)
        try:
            await fut
        finally:
            self.waiter = None

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_deadline(self) -> None:
        self._timer = None
        w = self.waiter
        if w is None or w.done():
            return  # not waiting: the next wait arms a timer again
        if self._loop.time() >= self._deadline:
            w.set_exception(asyncio.TimeoutError())
        else:  # progress since this timer was armed: check again at the moved deadline
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)

    def _queued(self) -> bytes:
        """The body bytes queued since the last take, as one object."""
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)

    def take(self) -> bytes:
        """Every body byte that arrived since the last call, as one object."""
        data = self._queued()
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and not self.closed and self.error is None and self.keep_alive


if _FramedReads is not None:
    class FramedConnection(_FramedReads, _Connection):
        """A connection that knows where a chunked body's chunks begin (httptools' chunk
        callbacks): between two of them, a parked reader's sink may take whole chunks without
        the parser (``body_sink``). Its ``data_received`` and the state that step reads
        (``at_boundary``, ``sink_chunked``, ``chunks``, ``buffered``, ``waiter`` and the read
        deadline's) are compiled (``prefill_gate.proxy._relaycore.FramedReads``): a read of whole chunks
        takes no Python frame on its way to the sink. What the sink leaves goes to
        ``_parse_read``, the parser's path. Only where the sink can (the compiled relay's):
        the two callbacks cost two Python calls a chunk the parser handles."""

        def on_chunk_header(self) -> None:
            self.at_boundary = False

        def on_chunk_complete(self) -> None:
            self.at_boundary = True  # (after the last chunk, on_message_complete takes it back)

        def _parse_read(self, data: bytes) -> None:
            _Connection.data_received(self, data)
            if self.at_boundary and data[-1:] != b"\n":
                # The read went on past the chunk's end, into the next chunk's size line: the
                # parser holds those digits, so the next read does not start at a chunk.
                self.at_boundary = False
else:
    FramedConnection = None  # no compiled core: the parser takes every read


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, pool: FastTransport, conn: _Connection, read_timeout: float | None, no_body: bool) -> None:
        self._pool = pool
        self._conn = conn
        self._timeout = read_timeout
        self._done = no_body
        self._released = False

    async def read(self) -> bytes | None:
        """Every body byte that arrived since the last call (waiting for some), or None at
        the body's end. The relay's per-chunk path: one await, where iterating goes through
        httpx's three async generators (this stream's, its bound stream's, aiter_raw's)."""
        conn = self._conn
        while not self._done:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                self._done = True
            elif conn.error is not None:  # never _Closed here: the head arrived
                raise conn.error
            else:
                try:
                    await conn.wait(self._timeout)
                except asyncio.TimeoutError:
                    raise httpx.ReadTimeout(f"no bytes from upstream for {self._timeout} s") from None
        await self.aclose()
        return None

    async def __aiter__(self):
        while (data := await self.read()) is not None:
            yield data

    def set_sink(self, sink) -> None:
        if not self._released:
            self._conn.sink = sink
            self._conn.sink_chunked = getattr(sink, "chunked", None)

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.sink = conn.sink_chunked = None  # a pooled connection keeps nothing of its last request
        if self._done and conn.reusable():
            self._pool._give_back(conn)
        else:  # unread body: closing the connection is the abort signal upstream
            self._pool._discard(conn)
        self._pool._release_slot()


class FastTransport(httpx.AsyncBaseTransport):
    """httpx transport: asyncio + httptools, keep-alive pool per origin."""

    def __init__(self, max_connections: int = 4096, max_idle_per_origin: int = 256,
                 keepalive_expiry: float = 4.0, ssl_context: ssl.SSLContext | None = None,
                 max_head_bytes: int = MAX_HEAD_BYTES, max_headers: int = MAX_HEADERS,
                 framed: bool = False) -> None:
        self._head_limits = (max_head_bytes, max_headers)
        # FramedConnection where the relay's sinks take whole chunks (the compiled core's)
        if framed and FramedConnection is None:
            raise RuntimeError("framed upstream connections need the relay's compiled core (prefill_gate.proxy._relaycore)")
        self._connection = FramedConnection if framed else _Connection
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None
        self._idle: dict[tuple, collections.deque[_Connection]] = {}
        self._max_idle = max_idle_per_origin
        self._expiry = keepalive_expiry  # under uvicorn's default 5 s keep-alive on the vLLM side
        self._ssl = ssl_context
        self._open: set[_Connection] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"{url.scheme!r} URLs are not supported")
        body = await request.aread()
        answer = await self.open(request.method.encode(), origin_of(url), url.raw_path, request.headers.raw, body,
                                 request.extensions.get("timeout", {}))
        return answer.response()

    async def open(self, method: bytes, origin: tuple, target: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes, timeouts: dict) -> Answer:
        """One request from its parts, without an httpx.Request: `headers` complete (Host and
        Content-Length included) and checked by the caller (no CR or LF anywhere). The
        answer's body is read through `body_reader`. ``UpstreamClient`` sends the gated
        requests this way: httpx's client (URL parsing, header merging, cookies, auth and
        redirect machinery) cost a third of a proxied request's CPU."""
        head = bytearray(b"%s %s HTTP/1.1\r\n" % (method, target))
        for name, value in headers:
            head += name + b": " + value + b"\r\n"
        head += b"\r\n"
        payload = bytes(head) + body
        if self._slots is not None:
            if self._slots.locked():  # only then wait (and never race a timeout against a free slot)
                try:
                    await asyncio.wait_for(self._slots.acquire(), timeouts.get("pool"))
                except asyncio.TimeoutError:
                    raise httpx.PoolTimeout("no free upstream connection slot in time") from None
            else:
                await self._slots.acquire()
        try:  # the slot is the response stream's from here; released here only on failure
            for attempt in (0, 1):
                conn, reused = await self._checkout(origin, timeouts.get("connect"))
                try:
                    return await self._exchange(conn, method, payload, timeouts)
                except _Closed:
                    if not reused or attempt:
                        raise httpx.RemoteProtocolError("upstream closed the connection without answering") from None
        except BaseException:
            self._release_slot()
            raise

    async def _exchange(self, conn: _Connection, method: bytes, payload: bytes, timeouts) -> Answer:
        conn.transport.write(payload)
        read_timeout = timeouts.get("read")
        try:
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(read_timeout)
        except asyncio.TimeoutError:
            self._discard(conn)
            raise httpx.ReadTimeout(f"no response head from upstream in {read_timeout} s") from None
        except BaseException:  # an error, or the client left while we waited: abort
            self._discard(conn)
            raise
        no_body = method == b"HEAD" or conn.status in (204, 304)
        return Answer(conn.status, conn.headers, _ResponseStream(self, conn, read_timeout, no_body))

    async def _checkout(self, origin: tuple, connect_timeout: float | None) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive
            if not conn.closed and now - conn.idle_since < self._expiry:
                conn._reset()
                conn.in_use = True
                return conn, True
            self._discard(conn)
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        ctx = None
        if scheme == "https":
            ctx = self._ssl or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: self._connection(origin, *self._head_limits), host, port, ssl=ctx,
                                       server_hostname=host if ctx else None),
                connect_timeout)
        except asyncio.TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        self._open.add(conn)
        return conn, False

    def _give_back(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, collections.deque())
        if len(idle) >= self._max_idle:
            self._discard(conn)
            return
        conn.idle_since = time.monotonic()
        conn.in_use = False
        idle.append(conn)

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)
        # Its error, once raised, holds a traceback whose frames hold the connection: a
        # reference cycle per failed answer until a full collection (prefill_gate/proxy/collector.py).
        # A discarded connection is read no more.
        conn.error = None

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()
