"""The two kinds of proxied request: gated (chat/completions) and passthrough.

A gated request passes the stages in order: receive (size limit, JSON, types) ->
estimate -> classify -> admit or queue -> upstream -> relay -> account. The first
three run in the route handler and answer 4xx directly; the rest run inside the
``Exchange`` so that a disconnect in any of them is seen and cleaned up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from starlette.requests import ClientDisconnect

from .admission import RequestClass, Slicing, Ticket
from .assemble import Assembler
from .bodies import RequestBody
from .errors import BadRequest, BodyTooLarge, UpstreamProtocolError, UpstreamUnavailable
from .estimate import Estimate
from .fasthttp import body_reader, body_sink
from .listener import ChunkWriter, chunk_writer
from .labels import ErrorKind, OutcomeKind
from .relay import (
    DONE_EVENT,
    Exchange,
    Outcome,
    SSESplitter,
    StreamObserver,
    event_json,
    relay_raw,
    send_body,
)
from .slicer import BREAK_FACTOR, MAX_SLICE_ANSWER_BYTES, SliceRun, run_slices
from .upstream import Answered, UpstreamError, mapped_errors, read_limited, response_headers

if TYPE_CHECKING:
    from .gate import Lease
    from .predict import GapWindow, Predictor
    from .state import AppState

log = logging.getLogger("prefill_gate")

CLASS_HEADER = "x-prefill-gate-class"
PRIORITY_HEADER = "x-prefill-gate-priority"


# ----------------------------------------------------------------------- receive
def client_headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers from the ASGI scope as a dict: names as the server gives them
    (lower case), values latin-1 decoded (any byte passes), in the order sent; of a repeated
    header the first value (as starlette's ``Headers`` answer it)."""
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
    if len(out) < len(raw):  # a repeated name: the comprehension kept its last value
        for k, v in reversed(raw):
            out[k.decode("latin-1")] = v.decode("latin-1")
    return out


async def read_body(receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The request body from ASGI ``receive``, at most ``limit`` bytes (BodyTooLarge beyond,
    before reading it where Content-Length says so). A client that leaves before its body's
    end: ClientDisconnect."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body is {declared} bytes; the limit is {limit} (max_body_bytes)")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def classify(estimate: Estimate, threshold: int, override: str | None, allowed: str = "any") -> RequestClass:
    """The class from the estimate, or from the client's header where ``allowed`` lets it:
    ``any``, ``large`` (a client may hold itself, never skip the gate) or ``off``."""
    cls = RequestClass.LARGE if estimate.tokens >= threshold else RequestClass.INTERACTIVE
    if override is None or allowed == "off":
        return cls
    try:
        asked = RequestClass(override.strip().lower())
    except ValueError:
        raise BadRequest(f"header {CLASS_HEADER} must be 'interactive' or 'large'", param=CLASS_HEADER) from None
    return asked if allowed == "any" or asked is RequestClass.LARGE else cls


def priority_of(priority: int, header: str | None) -> int:
    """The header's priority where it is set, else the body's."""
    if header is None:
        return priority
    try:
        return int(header)
    except ValueError:
        raise BadRequest(f"header {PRIORITY_HEADER} must be an integer", param=PRIORITY_HEADER) from None


# ------------------------------------------------------------------------ gated
# vLLM caches whole blocks (16 tokens by default) and always computes the last prompt token:
# a credit this much over the reported cached_tokens means the upstream evicted the prefix.
CREDIT_SLACK_TOKENS = 256
# A /tokenize answer lists ids: at most this many bytes per byte of the request's body limit.
TOKEN_IDS_LIMIT_FACTOR = 4
# How long a request waits, on arrival, for its exact count (slicing auto) before it goes on
# with the estimate: as the estimator's own exact counts.
EXACT_COUNT_TIMEOUT_S = 5.0
# After a slice's answer, how long to wait for a protected stream's next chunk (the one
# that shows the slice's gap): a few decode steps.
WINDOW_END_WAIT_S = 0.05
# Upstream answers that mean "not now, not here": another upstream may take the request.
RETRY_STATUSES = frozenset({502, 503, 504})


@dataclass
class GatedRequest:
    endpoint: str  # "chat" | "completions"
    path: str
    headers: dict[str, str]
    content: bytes
    model: str
    streaming: bool
    drop_usage: bool  # we asked for include_usage on the client's behalf
    estimate: Estimate
    ticket: Ticket
    received_at: float
    assemble: bool = False  # the client wants JSON; we stream upstream to see the phase
    prefixes: list[bytes] | None = None  # chat: hashes of the message-list prefixes
    prefix_tokens: list[int] | None = None  # and their cumulative estimated tokens
    max_tokens: int | None = None
    slice_payload: dict | bytes | None = None  # the /tokenize request for its ids (sliceable requests)
    cache_salt: str | None = None
    token_ids: Sequence[int] | None = None  # slicing auto: counted exactly on arrival, reused by the slicer


async def prepare(state: "AppState", scope: dict, receive, endpoint: str) -> GatedRequest:
    """Receive, read (``bodies``: a big body in a worker process), estimate, classify:
    a GatedRequest, a BadRequest, or ClientDisconnect."""
    received_at = time.monotonic()
    headers = client_headers(scope["headers"])
    raw = await read_body(receive, headers, state.settings.max_body_bytes)
    body = await state.bodies.read(raw, endpoint)
    return await _prepare(state, scope["path"], headers, endpoint, body, received_at)


async def _prepare(state: "AppState", path: str, headers: dict[str, str], endpoint: str, body: RequestBody,
                   received_at: float) -> GatedRequest:
    settings = state.settings
    model, prefixes = body.model, body.prefixes
    hit = state.prefix_memory.longest(prefixes) if prefixes else None
    estimate = await state.estimator.estimate(body.shape, model, cached=hit.tokens if hit else 0)
    cls = classify(estimate, settings.large_prefill_tokens, headers.get(CLASS_HEADER), settings.class_header)
    slice_payload = token_ids = None
    if cls is RequestClass.LARGE and settings.slicing != Slicing.OFF:
        slice_payload = body.tokenize
    if slice_payload is not None and not any(u.can_slice for u in state.policy.upstreams.values()):
        slice_payload = None  # nowhere to slice it (a paced engine, or none that can): no /tokenize either
    if slice_payload is not None and settings.slicing == Slicing.AUTO:
        # Auto weighs holding against slicing by the prompt's tokens: count them exactly
        # (slicing needs the ids anyway), so that a tokenizer far from the calibrated
        # bytes-per-token cannot make it misjudge (an estimate of 7,153 for a 28,600-token
        # prompt chose slicing on the H200); the count calibrates later estimates too.
        token_ids = await fetch_token_ids(state, slice_payload, state.pick_upstream(), timeout=EXACT_COUNT_TIMEOUT_S)
        if token_ids is not None and estimate.method != "token_ids":
            state.estimator.observe(model, estimate, len(token_ids))
            cached = min(estimate.cached, len(token_ids))
            estimate = Estimate(len(token_ids) - cached, "exact", estimate.n_bytes, estimate.n_messages, cached)
            cls = classify(estimate, settings.large_prefill_tokens, headers.get(CLASS_HEADER),
                           settings.class_header)
            if cls is not RequestClass.LARGE:  # smaller than estimated: nothing to hold or slice
                slice_payload = token_ids = None
    ticket = Ticket(
        cls=cls,
        tokens=estimate.tokens,
        protected=body.streaming or body.assemble,  # a phase the proxy cannot see cannot be protected
        priority=priority_of(body.priority, headers.get(PRIORITY_HEADER)),
        prefer=hit.upstream if hit else None,  # keep a conversation where its prefix is cached
        sliceable=slice_payload is not None,
        bytes=len(body.content),
    )
    state.metrics.estimated_tokens.labels(cls.value).observe(estimate.tokens)
    state.metrics.cached_tokens.observe(estimate.cached)
    prefix_tokens = state.estimator.prefix_tokens(body.message_bytes, model) if body.message_bytes is not None else None
    return GatedRequest(endpoint, path, headers, body.content, model, body.streaming,
                        body.drop_usage, estimate, ticket, received_at, body.assemble, prefixes, prefix_tokens,
                        body.max_tokens, slice_payload, body.salt, token_ids)


async def fetch_token_ids(state: "AppState", payload: dict | bytes, upstream: str,
                          timeout: float | None = None) -> Sequence[int] | None:
    """The prompt's exact token ids from the upstream's ``/tokenize`` (``payload`` from
    ``slicer.tokenize_payload``), as a compact array; None when it cannot say (in
    ``timeout`` seconds, default ``read_timeout``)."""
    if isinstance(payload, dict) and "ids" in payload:
        return payload["ids"]
    try:
        status, body = await state.client.request_bytes(
            upstream, "POST", "/tokenize", payload if isinstance(payload, bytes) else json.dumps(payload).encode(),
            limit=TOKEN_IDS_LIMIT_FACTOR * state.settings.max_body_bytes,
            timeout=state.settings.read_timeout if timeout is None else timeout)
        if status != 200:
            raise ValueError(f"status {status}: {body[:200]!r}")
        return await state.bodies.token_ids(body)
    except (UpstreamError, ValueError, OverflowError) as exc:
        log.info("/tokenize on %s: %s", upstream, getattr(exc, "message", exc))
        return None


async def slice_window_end(predictor: "Predictor", upstream: str, window: "GapWindow",
                           wait_s: float = WINDOW_END_WAIT_S) -> float | None:
    """Close a slice's gap window: its answer and the streams' chunk from the same engine
    step race to the proxy, so wait (briefly) for a protected stream's next gap first, or
    the window would miss the very gap the slice caused."""
    seen, give_up = predictor.gaps_seen(upstream), time.monotonic() + wait_s
    while predictor.gaps_seen(upstream) == seen and predictor.live(upstream) and time.monotonic() < give_up:
        await asyncio.sleep(0.001)
    return predictor.window_max(upstream, window)


class GatedExchange(Exchange):
    def __init__(self, state: "AppState", req: GatedRequest):
        super().__init__(state.exchanges, state.settings.max_request_seconds)
        self.state = state
        self.req = req
        self.lease: Lease | None = None
        self.usage: dict | None = None
        self.prefilled = False  # the upstream computed (and so caches) the prompt
        self.observer: StreamObserver | None = None
        self.slice_run: SliceRun | None = None
        # Gaps of a protected stream size slices and feed auto's prediction; without slicing
        # the per-chunk path does not pay for them.
        self._feed_predictor = req.ticket.protected and state.settings.slicing != Slicing.OFF
        cls = req.ticket.cls.value
        self._ttft = state.metrics.ttft.labels(cls)
        self._itl = {True: state.metrics.itl.labels(cls, "true"), False: state.metrics.itl.labels(cls, "false")}

    async def run(self, send) -> None:
        st, req = self.state, self.req
        admitted = asyncio.Event()
        keepalive = None
        if req.streaming and st.settings.sse_keepalive > 0 and req.ticket.cls is RequestClass.LARGE:
            keepalive = asyncio.create_task(self._keepalive(send, admitted, st.settings.sse_keepalive))
        try:
            async with st.gate.admission(req.ticket) as lease:
                self.lease = lease
                if keepalive is not None:
                    admitted.set()
                    await keepalive  # ends after at most the comment it is writing
                if lease.slicing:
                    await self._slice(lease)
                await self._send_upstream(send, lease)
        finally:
            if keepalive is not None and not keepalive.done():
                keepalive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keepalive

    async def _send_upstream(self, send, lease: Lease) -> None:
        """Relay from the lease's upstream; when it fails before answering (cannot connect,
        or 502/503/504) and another healthy upstream is left, go there instead: nothing of
        this request reached the client or the engine yet."""
        st, req = self.state, self.req
        tried: set[str] = set()
        while True:
            upstream = lease.upstream
            tried.add(upstream)
            try:
                async with st.client.stream(upstream, "POST", req.path, req.headers, req.content) as resp:
                    if resp.status_code in RETRY_STATUSES and lease.reroute(tried):
                        st.metrics.retries.labels(upstream).inc()
                        continue
                    if resp.status_code == 200 and req.assemble:
                        await self._relay_assembled(send, resp, upstream)
                    elif resp.status_code == 200 and req.streaming:
                        await self._relay_stream(send, resp, upstream)
                    elif self.started:  # keep-alives went out: the status line is spent
                        await self._relay_error_event(send, resp, upstream)
                    else:
                        await self._relay_whole(send, resp, upstream)
                return
            except UpstreamUnavailable:
                st.mark_health(upstream, False)  # until its health check passes
                if not lease.reroute(tried):
                    raise
                st.metrics.retries.labels(upstream).inc()

    async def _slice(self, lease: Lease) -> None:
        """Warm the lease's upstream with slices of the prompt, then let the request go
        (only its tail left to prefill). No token ids (``/tokenize`` failed, or the upstream
        lost its capabilities): back to the queue, held like any large prefill."""
        st, req = self.state, self.req
        upstream = lease.upstream
        caps = st.caps.get(upstream)
        ids = await self._token_ids(upstream) if caps is not None and caps.can_slice else None
        if ids is None:
            await lease.hold()
            return
        predictor = st.predictor

        async def send(body: bytes) -> bool:
            try:
                status, _ = await st.client.request_bytes(upstream, "POST", "/v1/completions", body,
                                                          limit=MAX_SLICE_ANSWER_BYTES, timeout=st.settings.read_timeout)
            except UpstreamError as exc:
                log.warning("slice of request #%d on %s failed: %s", req.ticket.id, upstream, exc.message)
                return False
            return status == 200

        run = await run_slices(ids, caps.block_size, predictor.sizer(upstream), send, model=req.model or None,
                               cache_salt=req.cache_salt, deadline=req.ticket.deadline,
                               window=lambda: predictor.window_start(upstream),
                               window_end=lambda w: slice_window_end(predictor, upstream, w),
                               settle=lambda: st.gate.prefills_settled(upstream, st.settings.slice_settle_ms / 1000),
                               inflight=st.settings.slice_inflight, encode=st.bodies.id_prefixes,
                               capped_inflight=st.settings.slice_inflight_capped)
        self.slice_run = run
        m = st.metrics
        m.slices.labels(upstream).inc(run.slices)
        m.slice_tokens.labels(upstream).inc(run.tokens)
        m.slicing_seconds.observe(run.seconds)
        m.slice_settle_seconds.labels(upstream).inc(run.settling_s)
        gaps = m.slice_gap.labels(upstream)
        for g in run.gaps:
            if g is not None:
                gaps.observe(g)
        predictor.slice_done(upstream, run.tokens, run.seconds)
        sizer = predictor.sizer(upstream)
        ceiling = sizer.ceiling()
        m.slice_ceiling.labels(upstream).set(ceiling or 0)
        if log.isEnabledFor(logging.INFO):
            fit = sizer.model()
            log.info("sliced request #%d on %s: %d slices, %d tokens in %.3f s; slice tokens %s; largest gaps ms %s; "
                     "round trips ms %s; cost model %s%s", req.ticket.id, upstream, run.slices, run.tokens, run.seconds,
                     run.sizes, [None if g is None else round(g * 1000, 1) for g in run.gaps],
                     [round(t * 1000, 1) for t in run.round_trips],
                     "none yet" if fit is None else
                     f"a={fit.a * 1000:.2f} ms b={fit.b * 1e6:.3f} us c={fit.c * 1e9:.4f} ns margin={fit.margin * 1000:.1f} ms"
                     + (f", a step at {fit.step_at} tokens ({fit.step_gap * 1000:.1f} ms at most below it)"
                        if fit.step_at else ""),
                     "" if ceiling is None else f"; slices of at most {ceiling} tokens (larger ones stalled streams "
                     f"past {BREAK_FACTOR:g}x max_gap_ms), "
                     f"{max(st.settings.slice_inflight, st.settings.slice_inflight_capped)} in flight")
        if run.stopped:
            log.warning("slicing of request #%d on %s stopped at %d of %d tokens: %s", req.ticket.id, upstream,
                        run.tokens, len(ids), run.stopped)
        lease.sliced(max(1, len(ids) - run.tokens))

    async def _token_ids(self, upstream: str) -> Sequence[int] | None:
        if self.req.token_ids is not None:  # counted exactly when it arrived (slicing: auto)
            return self.req.token_ids
        ids = await fetch_token_ids(self.state, self.req.slice_payload, upstream)
        if ids is None:
            log.warning("cannot slice request #%d: no token ids from /tokenize on %s; holding it instead",
                        self.req.ticket.id, upstream)
        return ids

    async def _keepalive(self, send, admitted: asyncio.Event, every: float) -> None:
        """While held: the 200 and an SSE comment at once, then one every ``every`` seconds,
        with the queue position and the time left until the wait bound (comments are
        ignored by SSE clients). This task first runs after the ticket's submission (it is
        created just before it, and submission does not suspend)."""
        gate, ticket = self.state.gate, self.req.ticket
        first = True
        while True:
            if not first:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(admitted.wait(), every)
            first = False
            waiting = gate.waiting(ticket)
            if admitted.is_set() or waiting is None:
                return
            if not self.started:
                await self.start(send, 200, [(b"content-type", b"text/event-stream"),
                                             (b"cache-control", b"no-cache")])
            position, left = waiting
            await send_body(send, b": prefill-gate queued position=%d max_wait_s=%.1f\n\n"
                            % (position + 1, left), True)

    async def _relay_error_event(self, send, resp: Answered, upstream: str) -> None:
        """An upstream error answer after keep-alives spent the status line: its JSON body
        unchanged as one SSE event (a non-JSON body wrapped in an OpenAI error)."""
        body = await read_limited(resp, upstream, self.state.settings.max_upstream_body_bytes)
        self.outcome.kind = OutcomeKind.UPSTREAM_HTTP_ERROR
        self.outcome.http_kind = ErrorKind.of_status(resp.status_code)
        if await self.state.bodies.is_json(body):
            # One line (an SSE data field cannot hold newlines; in JSON they are only whitespace).
            data = body.strip().replace(b"\r", b" ").replace(b"\n", b" ")
        else:
            message = body[:8000].decode(errors="replace")[:2000]
            data = json.dumps({"error": {"message": message, "type": "upstream_error", "param": None,
                                         "code": resp.status_code}}).encode()
        await self.end(send, b"data: " + data + b"\n\n" + DONE_EVENT)

    async def _relay_whole(self, send, resp: Answered, upstream: str) -> None:
        body = await read_limited(resp, upstream, self.state.settings.max_upstream_body_bytes)
        if resp.status_code == 200:
            self.prefilled = True
            if b'"usage"' in body:
                self.usage = await self.state.bodies.usage(body)
        else:
            self.outcome.kind = OutcomeKind.UPSTREAM_HTTP_ERROR
            self.outcome.http_kind = ErrorKind.of_status(resp.status_code)
        await self.start(send, resp.status_code, response_headers(resp, upstream))
        await self.end(send, body)

    async def _pump(self, resp: Answered, upstream: str, observer: StreamObserver, handle,
                    writer: ChunkWriter | None = None, *, events: bool = False) -> None:
        """Every read of the upstream's body through ``observer``, to ``await handle(out)``
        (out: the bytes the client gets), or with ``events`` to ``await handle(events)`` (the
        read cut into complete SSE events); then the checks of a clean end.

        The per-chunk path: with a ``writer`` (the client's socket, when nothing stands in
        the way of writing to it), bytes that arrive while this task waits are relayed in
        the upstream connection's read callback, the task never woken; otherwise (the client
        stopped reading, or no writer) one await of the upstream per read, then ``handle``.
        The callback is ``relay_core``'s (``prefill_gate.proxy.relaycore``: compiled, or Python's)."""
        splitter = observer.splitter
        read = body_reader(resp)
        if writer is not None:
            body_sink(resp, self.state.direct_relay(writer, observer))
        with mapped_errors(upstream):
            while (raw := await read()) is not None:
                if events:
                    cut = splitter.feed(raw)
                    observer.filter(cut)
                    await handle(cut)
                else:
                    await handle(observer.take(raw))
        rest = splitter.flush()
        if rest:
            out = observer.filter([rest])
            await handle([rest] if events else out)
        self.usage = observer.usage
        if not observer.done:
            raise UpstreamProtocolError(f"upstream {upstream} ended the stream before [DONE]")

    async def _relay_stream(self, send, resp: Answered, upstream: str) -> None:
        observer = self.observer = StreamObserver(self._first_content, self._token_hook(), drop_usage=self.req.drop_usage,
                                                  splitter=self._splitter())
        await self.start(send, 200, response_headers(resp, upstream))

        async def forward(out: bytes) -> None:
            if out:
                await send_body(send, out, True)

        await self._pump(resp, upstream, observer, forward, chunk_writer(send))
        if observer.saw_error:  # relayed as sent, but not a completed answer (nor a length to learn)
            self.outcome.kind = OutcomeKind.UPSTREAM_ERROR
        await self.end(send)

    async def _relay_assembled(self, send, resp: Answered, upstream: str) -> None:
        """Stream from upstream (to see the phase), answer the client with one JSON body."""
        observer = self.observer = StreamObserver(self._first_content, self._token_hook(), splitter=self._splitter())
        assembler = Assembler(self.req.endpoint)
        limit, seen = self.state.settings.max_upstream_body_bytes, 0

        async def assemble(events: list[bytes]) -> None:
            nonlocal seen
            for ev in events:
                seen += len(ev)
                if seen > limit:
                    raise UpstreamProtocolError(f"upstream {upstream} streamed over {limit} bytes for one "
                                                "answer the proxy assembles (max_upstream_body_bytes)")
                if ev != DONE_EVENT:
                    obj = event_json(ev)
                    if isinstance(obj, dict) and "error" in obj:
                        raise UpstreamProtocolError(f"upstream {upstream} failed mid-generation: {obj['error']}")
                    assembler.add(obj)

        await self._pump(resp, upstream, observer, assemble, events=True)
        body = await self.state.bodies.encode(assembler.response(), seen)
        await self.start(send, 200, [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())])
        await self.end(send, body)

    def _first_content(self) -> None:
        self.prefilled = True
        lease, ticket, req = self.lease, self.req.ticket, self.req
        predictor = self.state.predictor
        now = time.monotonic()
        if ticket.cls is RequestClass.LARGE and not (ticket.sliced or ticket.expired or lease.upstream_state.paced) \
                and self.state.policy.limits.itl_slo is None and ticket.admitted_at is not None:
            predictor.prefill_done(lease.upstream, ticket.tokens, now - ticket.admitted_at)  # held until alone
        lease.decoding()
        if ticket.protected:
            observer = self.observer
            predictor.stream_started(lease.upstream, id(self), req.max_tokens, req.model,
                                     lambda: observer.tokens)
        self._ttft.observe(now - req.received_at)

    def _splitter(self) -> SSESplitter:
        return SSESplitter(self.state.settings.max_upstream_event_bytes)

    def _token_hook(self) -> Callable[[float, int], Any]:
        """The stream observer's per-read callback: ``_tokens``, or where the relay's core is
        compiled its compiled twin (``relaycore.gap_tally_type``), which the compiled relay
        calls without a Python frame; ``_more_tokens`` only where there is more to feed."""
        tally = self.state.gap_tally
        if tally is None:
            return self._tokens
        lease = self.lease
        more = self._more_tokens if lease.closed_loop or self._feed_predictor else None
        return tally(self._itl[False], self._itl[True], lease.upstream_state, more)

    def _tokens(self, gap: float, n: int) -> None:
        """``n`` content chunks in one read, the first ``gap`` seconds after the previous."""
        lease = self.lease
        self._itl[lease.upstream_state.large_in_flight > 0].observe_run(gap, n)
        if lease.closed_loop or self._feed_predictor:
            self._more_tokens(gap, n)

    def _more_tokens(self, gap: float, n: int) -> None:
        """What a read's gap feeds past the histogram: the closed loop, the predictor."""
        lease = self.lease
        if lease.closed_loop:
            lease.token_gap(gap, n)
        if self._feed_predictor:
            self.state.predictor.gap(lease.upstream, gap, n)

    def finished(self, outcome: Outcome) -> None:
        st, req = self.state, self.req
        m = st.metrics
        m.requests.labels(req.ticket.cls.value, outcome.kind).inc()
        upstream = self.lease.upstream if self.lease else None
        # The observer holds bound methods of this exchange: dropping it here leaves no
        # reference cycle, so the request's objects go when it ends, not at a full collection.
        observer, self.observer = self.observer, None
        if upstream is not None and observer is not None and observer.first_at is not None:
            st.predictor.stream_ended(upstream, id(self), observer.tokens, outcome.kind is OutcomeKind.COMPLETED)
        if upstream is not None:
            kind = outcome.http_kind or getattr(outcome.error, "kind", None)
            if kind is not None:
                m.upstream_errors.labels(upstream, kind).inc()
            if kind is ErrorKind.CONNECT:
                st.mark_health(upstream, False)
        usage = self.usage or {}
        prompt_tokens = usage.get("prompt_tokens")
        if self.prefilled and upstream is not None and req.prefixes:
            cumulative = req.prefix_tokens
            if isinstance(prompt_tokens, int) and cumulative and cumulative[-1] > 0:
                # The upstream counted the whole message list exactly: scale our per-message
                # estimates to it, so the next turn's cached credit is exact at this prefix.
                scale = prompt_tokens / cumulative[-1]
                cumulative = [round(t * scale) for t in cumulative]
            st.prefix_memory.remember(upstream, req.prefixes, cumulative)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int) and req.estimate.cached - cached > CREDIT_SLACK_TOKENS:
            m.cache_credit_misses.inc()  # we credited a prefix the upstream no longer held
        if isinstance(cached, int) and self.slice_run is not None and upstream is not None:
            m.slice_misses.labels(upstream).inc(max(0, self.slice_run.tokens - cached))
        if isinstance(prompt_tokens, int):
            err = st.estimator.observe(req.model, req.estimate, prompt_tokens)
            if err is not None:
                m.estimate_error.observe(err)
            m.bytes_per_token.set(st.estimator.calibrator.ratio(req.model))


# ------------------------------------------------------------------ passthrough
class PassthroughExchange(Exchange):
    """Any other allowed path: method, headers, body and status pass unchanged (a body the
    upstream breaks off is cut, not ended)."""

    cut_on_error = True

    def __init__(self, state: "AppState", upstream: str, method: str, path: str, query: str, headers: Any, body: bytes):
        super().__init__(state.exchanges, state.settings.max_request_seconds)
        self.state = state
        self.args = (upstream, method, path, headers, body, query)

    async def run(self, send) -> None:
        upstream = self.args[0]
        async with self.state.client.stream(*self.args) as resp:
            await self.start(send, resp.status_code, response_headers(resp, upstream))
            await relay_raw(send, resp, upstream)
            await self.end(send)

    def finished(self, outcome: Outcome) -> None:
        kind = getattr(outcome.error, "kind", None)
        if kind is not None:
            self.state.metrics.upstream_errors.labels(self.args[0], kind).inc()
