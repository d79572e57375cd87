"""Relaying one request: SSE framing, phase tracking, disconnect -> abort.

A proxied request runs as an ASGI response object (``Exchange``) so that one
coroutine owns its whole life: the wait in the queue, the upstream request and
the relay of every chunk. A ``DisconnectWatch`` cancels that coroutine the
moment the client disconnects, in any phase; the ``async with`` blocks it is in
then close the upstream connection (vLLM aborts the request and frees its KV
cache) and release the admission lease, exactly once.

Events are forwarded byte for byte as they complete; the only event ever held
back is the usage-only chunk the proxy asked for on the client's behalf.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from .disconnect import DisconnectWatch
from .errors import (
    AnswerCut,
    ProxyError,
    ShuttingDown,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from .labels import ErrorKind, OutcomeKind
from .fasthttp import body_reader
from .upstream import Answered, mapped_errors

DONE_EVENT = b"data: [DONE]\n\n"
_LF = ord("\n")

# The per-read tests below search bytes with ``find`` rather than ``in``: CPython's
# ``bytes.__contains__`` first tries its argument as an integer (``65 in b"A"``), and for a
# bytes argument builds and discards a TypeError with its message each time: 2-9x a find
# (CPython 3.10-3.13, ~140-240 ns against ~25-70 at 80 bytes).


class SSESplitter:
    """Cuts a byte stream into complete SSE events (each ending in a blank line).

    Linear in the bytes fed, however they are cut: a partial event is kept in a bytearray
    that grows in place and is searched only where the new bytes could end it. An event
    longer than ``limit`` bytes is an UpstreamProtocolError (a stream that never ends an
    event must not grow the proxy without bound)."""

    __slots__ = ("held", "_scan", "_cr", "limit")

    def __init__(self, limit: int = 8 * 1024 * 1024) -> None:
        self.held = bytearray()
        self._scan = 0  # where to resume the search for an event's end in held
        self._cr = False  # a CR was seen: look for CRLF blank lines too
        self.limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        cr = self._cr = self._cr or data.find(b"\r") >= 0
        if self.held:
            self.held += data
            buf, pos = self.held, self._scan
        else:
            buf, pos = data, 0
        events = []
        start = 0
        while True:
            end = buf.find(b"\n\n", pos)  # the event ends after buf[end + 1]
            if cr:
                crlf = buf.find(b"\r\n\r\n", pos)
                if crlf >= 0 and (end < 0 or crlf + 2 < end):
                    end = crlf + 2
            if end < 0:
                break
            events.append(bytes(buf[start : end + 2]))
            start = pos = end + 2
        rest = len(buf) - start
        if rest > self.limit:
            raise UpstreamProtocolError(f"an upstream SSE event exceeds {self.limit} bytes (max_upstream_event_bytes)")
        if buf is self.held:
            del buf[:start]
        elif rest:
            self.held = bytearray(buf[start:])
        self._scan = max(0, rest - 3)  # a blank line may straddle this feed and the next
        return events

    def flush(self) -> bytes:
        rest = bytes(self.held)
        self.held = bytearray()
        self._scan = 0
        return rest


def event_json(event: bytes) -> Any:
    """The JSON payload of a ``data:`` event, or None."""
    lines = [ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:")]
    if not lines:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None


def is_content(obj: Any) -> bool:
    """A chunk that carries generated output (not just the role header)."""
    if not isinstance(obj, dict):
        return False
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("finish_reason"):
            return True
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
        ):
            return True
    return False


def is_token(obj: Any) -> bool:
    """A chunk that reports a generated step, whether or not its text is empty: vLLM streams
    one chunk a step, and a token that decodes to nothing (a special token it skips, such as
    an end-of-sequence token under ``ignore_eos``, or bytes of a character not yet complete)
    comes as ``"content": ""``. Everything ``is_content`` counts, plus those; not the role
    header (a delta with ``"role"`` and no text) nor a usage-only chunk. A client timing
    streams counts these: counting text alone would read a run of empty tokens as a stall."""
    if is_content(obj):
        return True
    if not isinstance(obj, dict):
        return False
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str) or choice.get("token_ids"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and "role" not in delta and isinstance(delta.get("content"), str):
            return True
    return False


def plain_events(data: bytes) -> int:
    """How many content events ``data`` is, where it is nothing else: one-line ``data: {``
    events, each ending in its blank line, with nothing ``StreamObserver.filter`` looks for
    (no [DONE], usage, error or empty choices, no CR); else 0 (the read is cut and filtered).
    The rule of the relay's fast path; prefill_gate/proxy/_relaycore.c compiles it as it stands here."""
    # (Ordered for the hottest line of the proxy: each bytes method call costs more than
    # its scan; an index is cheaper than endswith.)
    if not (data.startswith(b"data: {") and data[-1] == data[-2] == _LF != data[-3]) or data.find(b"\r") >= 0 \
            or data.find(b'"usage"') >= 0 or data.find(b'"error"') >= 0 or data.find(b'"choices":[]') >= 0:
        return 0
    # n one-line events: two LFs each, every LF but the last two in a "\n\ndata: {" between
    # events. (Counting one byte costs about half of counting two; a read of events of
    # several lines goes through filter.)
    lfs = data.count(b"\n")
    n = lfs >> 1
    if lfs == 2 or (not lfs & 1 and data.count(b"\n\ndata: {") == n - 1):
        return n
    return 0


@dataclass
class StreamObserver:
    """Watches the events of one stream: first token (-> decoding), ITL, usage, errors.

    Per read, not per token: ``filter`` takes the events of one upstream read, reads the
    clock once and reports its content chunks in one call, ``on_tokens(gap, n)``: ``n``
    chunks arrived now, the first ``gap`` seconds after the stream's previous one and the
    others right behind it (gaps of 0: that is what the proxy saw of them)."""

    on_first_content: Any  # callable() -> None
    on_tokens: Any  # callable(gap_seconds, n) -> None
    drop_usage: bool = False
    clock: Any = time.monotonic
    first_at: float | None = None
    last_at: float | None = None
    usage: dict | None = None
    done: bool = False
    saw_error: bool = False
    tokens: int = 0
    splitter: SSESplitter = field(default_factory=SSESplitter)  # this stream's events, cut

    def take(self, data: bytes) -> bytes:
        """One upstream read, cut by this stream's ``splitter`` and observed: the bytes to
        forward.

        The usual read, one or more whole content chunks of a stream under way, is counted
        without being cut (``plain_events``; nothing held over from the last read).
        ``filter(splitter.feed(data))`` returns and records the same, in more steps
        (tests/test_relay.py holds the two equal)."""
        if self.first_at is not None and not self.splitter.held:
            n = plain_events(data)
            if n:
                self.counted(n)
                return data
        return self.filter(self.splitter.feed(data))

    def counted(self, n: int) -> None:
        """``n`` content chunks of a stream under way arrived now, in one read. (The compiled
        core takes these steps itself, in this order: prefill_gate/proxy/_relaycore.c, ``counted``.)"""
        now = self.clock()
        self.tokens += n
        self.on_tokens(now - self.last_at, n)
        self.last_at = now

    def filter(self, events: list[bytes]) -> bytes:
        """Observe one read's events; return the bytes to forward (all of them but a usage
        chunk we asked for)."""
        now = self.clock()
        dropped: list[int] = []
        n = 0  # content chunks after the first one
        for i, ev in enumerate(events):
            if ev.startswith(b"data: [DONE]"):
                self.done = True
                continue
            obj = None
            if ev.find(b'"usage":{') >= 0 or ev.find(b'"usage": {') >= 0:
                obj = event_json(ev)
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]
                    if self.drop_usage and not obj.get("choices"):
                        dropped.append(i)
                        continue
            if self.first_at is None:
                obj = event_json(ev) if obj is None else obj
                if is_token(obj):  # the first step, its text empty or not (after it every chunk counts)
                    self.first_at = self.last_at = now
                    self.tokens = 1
                    self.on_first_content()
                elif _is_error(obj):
                    self.saw_error = True
            elif ev.find(b'"error"') >= 0 and _is_error(event_json(ev)):  # (a cheap test first: the hot path skips it)
                self.saw_error = True
            elif ev.startswith(b"data:") and ev.find(b'"choices":[]') < 0:
                n += 1
        if n:
            self.tokens += n
            self.on_tokens(now - self.last_at, n)
            self.last_at = now
        if dropped:
            return b"".join(ev for i, ev in enumerate(events) if i not in dropped)
        return events[0] if len(events) == 1 else b"".join(events)


def _is_error(obj: Any) -> bool:
    """An error event (``{"error": ...}``), not a chunk whose text says "error"."""
    return isinstance(obj, dict) and "error" in obj and "choices" not in obj


@dataclass
class Outcome:
    """How an exchange ended: the label, the error if one ended it, and for an upstream's
    own 4xx/5xx answer (relayed as it was) its kind."""

    kind: OutcomeKind = OutcomeKind.COMPLETED
    error: ProxyError | None = None
    http_kind: ErrorKind | None = None


def _untraced(exc: BaseException) -> BaseException:
    """``exc``, and every exception it chains, without their tracebacks. An error kept on the
    exchange (its outcome) with its traceback holds the frames it passed through, and they
    hold the exchange: a reference cycle per failed request, which only a full collection
    frees (prefill_gate/proxy/collector.py defers those; an upstream that fails every request would pile
    them up meanwhile)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += (e.__cause__, e.__context__)
    return exc


async def send_start(send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def send_body(send, body: bytes, more: bool) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


class Exchange(Response):
    """Base of an ASGI response that owns one proxied request until its end.

    Subclasses implement ``run(send)`` and ``finished(outcome)``. A ProxyError
    raised by ``run`` becomes an OpenAI error response before the first byte,
    or an in-stream error event and a clean end after it.
    """

    # After its answer began, an error ends it: with an in-stream error event (an SSE stream,
    # which the client parses), or by a cut (any other body: an event there would look like
    # the body's own last bytes).
    cut_on_error = False

    def __init__(self, registry: set | None = None, deadline: float | None = None) -> None:
        # (Response.__init__ is not called)
        self.background = None
        self.status_code = 200
        self.started = False
        self.outcome = Outcome()
        self._watch: DisconnectWatch | None = None
        self._registry = registry  # the app's requests in progress, for shutdown
        self._deadline = deadline  # seconds this request may take in all
        self._task: asyncio.Task | None = None
        self._ended_by: ProxyError | None = None  # why the proxy itself cancelled the request

    def stop(self) -> None:
        """End this request now with a ShuttingDown error (shutdown's grace is over)."""
        self._end_with(ShuttingDown("the proxy is shutting down; retry against another instance"))

    def _end_with(self, error: ProxyError) -> None:
        if self._task is not None and self._ended_by is None:
            self._ended_by = error
            self._task.cancel()

    def _overdue(self) -> None:
        self._end_with(UpstreamTimeout(f"the request took longer than {self._deadline:g} s in all "
                                       "(max_request_seconds)"))

    async def run(self, send) -> None:
        raise NotImplementedError

    def finished(self, outcome: Outcome) -> None:
        pass

    async def start(self, send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and headers; once only (after SSE keep-alives, the
        upstream's own headers are not sent)."""
        if self.started:
            return
        self.started = True
        await send_start(send, status, headers)

    async def end(self, send, body: bytes = b"") -> None:
        self._watch.closing = True  # from here on a disconnect is no longer news
        await send_body(send, body, False)

    async def __call__(self, scope, receive, send) -> None:
        self._task = asyncio.current_task()
        if self._registry is not None:
            self._registry.add(self)
        timer = None
        if self._deadline is not None:
            timer = asyncio.get_running_loop().call_later(self._deadline, self._overdue)
        try:
            async with DisconnectWatch(receive, send) as self._watch:
                try:
                    await self.run(send)
                except ProxyError as exc:
                    self.outcome.error = _untraced(exc)
                    self.outcome.kind = exc.outcome
                    if self.started and self.cut_on_error:
                        raise AnswerCut(exc.message) from None
                    await self._send_error(send, exc)
                except OSError:  # the socket went away under a send
                    self.outcome.kind = OutcomeKind.CLIENT_DISCONNECT
                except asyncio.CancelledError:
                    exc = self._ended_by
                    if exc is None:
                        raise
                    if hasattr(self._task, "uncancel"):  # Python 3.11+
                        self._task.uncancel()
                    self.outcome.error, self.outcome.kind = exc, exc.outcome
                    await self._send_error(send, exc)
            if self._watch.gone:
                self.outcome.kind = OutcomeKind.CLIENT_DISCONNECT
        finally:
            if timer is not None:
                timer.cancel()
            if self._registry is not None:
                self._registry.discard(self)
            self.finished(self.outcome)

    async def _send_error(self, send, exc: ProxyError) -> None:
        try:
            if not self.started:
                body = json.dumps(exc.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
                await send_start(send, exc.status, headers)
                await self.end(send, body)
            else:
                await self.end(send, exc.sse_event() + DONE_EVENT)
        except OSError:
            pass


async def relay_raw(send, resp: Answered, upstream: str) -> None:
    """Forward a body unchanged, chunk by chunk (passthrough paths)."""
    read = body_reader(resp)
    with mapped_errors(upstream):
        while (chunk := await read()) is not None:
            await send_body(send, chunk, True)

