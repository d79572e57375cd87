"""prefill_gate.proxy.fasthttp.FastTransport against raw loopback servers that write exact bytes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from conftest import compiled_core, make_state
from prefill_gate.proxy import fasthttp
from prefill_gate.proxy.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable
from prefill_gate.proxy.fasthttp import FastTransport
from prefill_gate.proxy.upstream import mapped_errors

HEAD_SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Server:
    """asyncio.start_server on a free port; `handler(reader, writer, server)` per connection."""

    def __init__(self, handler):
        self.handler = handler
        self.connections = 0
        self.closed = asyncio.Event()  # a connection saw EOF from the client
        self.events: dict[str, asyncio.Event] = {}

    def event(self, name: str) -> asyncio.Event:
        return self.events.setdefault(name, asyncio.Event())

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self):
        self.srv = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.srv.close()


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


async def drain(c: httpx.AsyncClient, url: str) -> None:
    """POST and read the streamed answer to its end."""
    async with c.stream("POST", url, content=b"{}") as resp:
        async for _ in resp.aiter_raw():
            pass


def client(**kw) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=2.0, read=kw.pop("read", 5.0), write=5.0, pool=kw.pop("pool", 2.0))
    return httpx.AsyncClient(transport=FastTransport(**kw), timeout=timeout, trust_env=False)


class _Sink:
    """A relay's sink as the connection sees it: takes a read's body bytes or refuses them
    (False: left queued), per ``answers`` in turn; with ``chunked`` (the compiled relay's
    method, here over ``chunk_payloads``) where ``framed``."""

    def __init__(self, core, answers: list[bool], out: list, framed: bool) -> None:
        self.core, self.answers, self.out, self.calls, self.whole = core, answers, out, 0, 0
        if framed:
            self.chunked = self._chunked

    def __call__(self, data: bytes) -> bool:
        self.calls += 1
        if not self.answers[self.calls % len(self.answers)]:
            return False
        self.out.append(data)
        return True

    def _chunked(self, data: bytes):
        payloads = self.core.chunk_payloads(data)
        if payloads is None:
            return None
        self.whole += 1
        return True if self(payloads) else payloads


async def test_chunks_arrive_as_they_are_written():
    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE + chunk(b"data: 1\n\n"))
        await srv.event("first_seen").wait()  # the second chunk only after the client has the first
        writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with Server(handler) as srv, client() as c:
        async with c.stream("POST", srv.url + "/v1/chat/completions", content=b"{}") as resp:
            assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
            got = []
            async for data in resp.aiter_raw():
                got.append(data)
                srv.event("first_seen").set()
        assert b"".join(got) == b"data: 1\n\ndata: 2\n\n" and got[0] == b"data: 1\n\n"


async def test_the_request_goes_out_whole():
    seen = []

    async def handler(reader, writer, srv):
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with Server(handler) as srv, client() as c:
        resp = await c.post(srv.url + "/v1/completions?x=1", content=b'{"a": 1}', headers={"x-k": "v"})
        assert resp.text == "ok"
    req = seen[0]
    assert req.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n") and req.endswith(b'\r\n\r\n{"a": 1}')
    assert b"x-k: v\r\n" in req.lower() and b"content-length: 8\r\n" in req.lower()


async def test_keep_alive_connections_are_reused():
    async def handler(reader, writer, srv):
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with Server(handler) as srv, client() as c:
        for _ in range(5):
            assert (await c.get(srv.url + "/v1/models")).text == "ok"
        assert srv.connections == 1


async def test_closing_a_stream_early_closes_the_connection():
    """How vLLM learns the client left: its connection closes."""
    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE + chunk(b"data: 1\n\n"))
        await writer.drain()
        assert await reader.read() == b""  # EOF: the proxy hung up
        srv.closed.set()

    async with Server(handler) as srv, client() as c:
        async with c.stream("POST", srv.url + "/v1/chat/completions", content=b"{}") as resp:
            async for _ in resp.aiter_raw():
                break
        await asyncio.wait_for(srv.closed.wait(), 2)


async def test_a_server_that_closed_an_idle_connection_costs_nothing():
    """uvicorn closes idle keep-alives after 5 s: the next request takes a fresh connection."""
    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # then close, as a keep-alive timeout would

    async with Server(handler) as srv, client() as c:
        assert (await c.get(srv.url + "/a")).text == "ok"
        await asyncio.sleep(0.05)  # the close reaches the pooled connection
        assert (await c.get(srv.url + "/b")).text == "ok"
        assert srv.connections == 2


async def test_a_stale_connection_is_retried_once_on_a_fresh_one(monkeypatch):
    """The race: the pooled connection dies between checkout and answer, nothing answered."""
    async def handler(reader, writer, srv):
        await read_request(reader)
        if srv.connections == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await read_request(reader)  # the second request on this connection: drop it unanswered
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh")
        await writer.drain()

    async with Server(handler) as srv, client() as c:
        assert (await c.get(srv.url + "/a")).text == "ok"
        assert (await c.get(srv.url + "/b")).text == "fresh"


async def test_read_timeout_between_chunks():
    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(5)

    async with Server(handler) as srv, client(read=0.2) as c:
        with pytest.raises(httpx.ReadTimeout):
            await drain(c, srv.url + "/v1/chat/completions")
        with pytest.raises(UpstreamTimeout), mapped_errors("u"):
            await drain(c, srv.url + "/x")


async def test_the_read_timeout_is_per_gap_not_per_stream():
    """Chunks every 0.1 s for 0.8 s under a 0.25 s read timeout: no timeout (each chunk
    moves the deadline), then silence: a timeout about 0.25 s after the last chunk."""
    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE)
        for i in range(8):
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)

    loop = asyncio.get_running_loop()
    async with Server(handler) as srv, client(read=0.25) as c:
        got, last = 0, None
        with pytest.raises(httpx.ReadTimeout):
            async with c.stream("POST", srv.url + "/v1/chat/completions", content=b"{}") as resp:
                async for data in resp.aiter_raw():
                    got += data.count(b"data:")
                    last = loop.time()
        assert got == 8
        assert 0.2 <= loop.time() - last < 0.6


async def test_silence_before_the_head_is_a_read_timeout():
    async def handler(reader, writer, srv):
        await read_request(reader)
        await asyncio.sleep(5)

    async with Server(handler) as srv, client(read=0.2) as c:
        with pytest.raises(UpstreamTimeout), mapped_errors("u"):
            await c.get(srv.url + "/x")


async def test_unreachable_and_garbage_upstreams_map_to_our_errors():
    async def garbage(reader, writer, srv):
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    async def cut(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE + chunk(b"data: 1\n\n"))
        await writer.drain()  # and close mid-stream

    async with client() as c:
        with pytest.raises(UpstreamUnavailable), mapped_errors("u"):
            await c.get("http://127.0.0.1:1/x")
        async with Server(garbage) as srv:
            with pytest.raises(UpstreamProtocolError), mapped_errors("u"):
                await c.get(srv.url + "/x")
        async with Server(cut) as srv:
            with pytest.raises(UpstreamProtocolError), mapped_errors("u"):
                await drain(c, srv.url + "/x")


async def test_bodies_without_chunking_and_without_bodies():
    async def handler(reader, writer, srv):
        req = await read_request(reader)
        if req.startswith(b"HEAD"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        elif b"/empty" in req:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:  # a body delimited by the connection's end
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with Server(handler) as srv, client() as c:
        assert (await c.get(srv.url + "/close")).text == "until the end"
        assert (await c.get(srv.url + "/empty")).status_code == 204
        head = await c.head(srv.url + "/h")
        assert head.status_code == 200 and head.content == b""


async def test_the_connection_limit_queues_then_times_out():
    release = asyncio.Event()

    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE)
        await writer.drain()
        await release.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Server(handler) as srv, client(max_connections=1, pool=0.2) as c:
        async with c.stream("POST", srv.url + "/x", content=b"{}"):
            with pytest.raises(httpx.PoolTimeout):
                await c.post(srv.url + "/y", content=b"{}")
        # the slot came back when the first response closed
        release.set()
        async with c.stream("POST", srv.url + "/z", content=b"{}") as resp:
            await resp.aread()


async def test_a_slow_reader_pauses_the_socket(monkeypatch):
    """Bounded buffering: the transport stops reading past HIGH_WATER unread bytes."""
    monkeypatch.setattr(fasthttp, "HIGH_WATER", 1 << 16)
    body = b"x" * (1 << 22)

    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        with contextlib.suppress(ConnectionError):
            writer.write(body)
            await writer.drain()

    async with Server(handler) as srv, client() as c:
        async with c.stream("GET", srv.url + "/big") as resp:
            stream = resp.stream._stream if hasattr(resp.stream, "_stream") else resp.stream
            await asyncio.sleep(0.3)  # the server writes as fast as it can; we do not read
            conn = stream._conn
            assert conn.paused and conn.buffered < len(body) // 4
            total = 0
            async for data in resp.aiter_raw():
                total += len(data)
        assert total == len(body)


async def test_body_reader_reads_the_connection_directly_or_through_httpx():
    """The relay's reader: this transport's responses hand it their connection's bytes;
    any other transport's go through aiter_raw. Both end with None and keep every byte."""
    parts = [b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"]

    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE)
        for p in parts:
            writer.write(chunk(p))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")

    async with Server(handler) as srv, client() as c:
        async with c.stream("POST", srv.url + "/v1/chat/completions", content=b"{}") as resp:
            assert fasthttp.BODY_READER in resp.extensions
            read, got = fasthttp.body_reader(resp), []
            while (data := await read()) is not None:
                got.append(data)
            assert b"".join(got) == b"".join(parts) and await read() is None

    class Parts(httpx.AsyncByteStream):
        async def __aiter__(self):
            for p in parts:
                yield p

    mock = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=Parts())))
    async with mock, mock.stream("GET", "http://upstream.test/") as resp:
        read, got = fasthttp.body_reader(resp), []
        while (data := await read()) is not None:
            got.append(data)
        assert b"".join(got) == b"".join(parts)


async def test_the_gated_path_sends_the_same_head_as_httpx():
    """UpstreamClient sends POSTs to plain paths straight to the transport (no httpx
    client): the upstream must see the same request line, headers and body as through
    httpx (a query string takes httpx's path), and no header of httpx's own."""
    from prefill_gate.proxy.upstream import UpstreamClient, read_limited

    heads = []

    async def handler(reader, writer, srv):
        while True:
            heads.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    def parsed(raw: bytes) -> tuple:
        head, body = raw.split(b"\r\n\r\n", 1)
        line, *fields = head.split(b"\r\n")
        return line.replace(b"?a=1", b""), sorted(f.lower() for f in fields), body

    async with Server(handler) as srv:
        up = UpstreamClient([srv.url], api_key="k")
        headers = {"content-type": "application/json", "user-agent": "openai/1", "x-custom": "caf\u00e9",
                   "authorization": "Bearer client", "x-prefill-gate-class": "large", "connection": "keep-alive"}
        for query in ("", "a=1"):
            async with up.stream(srv.url, "POST", "/v1/chat/completions", headers, b'{"x":1}', query) as resp:
                assert resp.status_code == 200 and await read_limited(resp, srv.url, 100) == b"ok"
        await up.aclose()
    fast, slow = parsed(heads[0]), parsed(heads[1])
    assert heads[1].startswith(b"POST /v1/chat/completions?a=1 ")
    assert fast == slow
    assert fast[0] == b"POST /v1/chat/completions HTTP/1.1" and fast[2] == b'{"x":1}'
    names = [f.split(b":")[0] for f in fast[1]]
    assert b"user-agent: openai/1" in fast[1] and b"authorization: bearer k" in fast[1]
    assert b"x-custom: caf\xe9" in fast[1] and b"accept-encoding: identity" in fast[1]
    assert b"accept" not in names and b"connection" not in names and b"x-prefill-gate-class" not in names


@pytest.mark.parametrize("framed", [False, True])
async def test_bytes_taken_by_a_sink_move_the_read_deadline(framed):
    """With a sink taking the bytes in the read callback, the reader stays parked: each
    delivery still counts as progress (a stream that flows longer than the read timeout
    lives), and silence past it is still a ReadTimeout at read(). Alike where whole chunks
    go past the parser (``framed``: a FramedConnection, a sink with ``chunked``)."""
    core = compiled_core() if framed else None

    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(HEAD_SSE)
        for i in range(10):  # 1 s of chunks every 0.1 s, under a 0.3 s read timeout
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        await srv.event("done").wait()  # then silence

    async with Server(handler) as srv, client(read=0.3, framed=framed) as c:
        async with c.stream("POST", srv.url + "/", content=b"{}") as resp:
            taken = []
            sink = _Sink(core, [True], taken, framed)
            assert fasthttp.body_sink(resp, sink)
            read = fasthttp.body_reader(resp)
            with pytest.raises(httpx.ReadTimeout):
                got = []
                while (data := await read()) is not None:
                    got.append(data)
            assert b"".join(got + taken) == b"".join(b"data: %d\n\n" % i for i in range(10))
            assert len(taken) >= 8  # all but what arrived before the reader first parked
            if framed:
                assert sink.whole >= 7  # (the first chunk complete before the reader parked: the parser's)
        srv.event("done").set()


@pytest.mark.parametrize("ending", ["reset_mid_body", "malformed_body", "reset_before_head", "left_unread", "read_whole"])
async def test_upstream_connections_that_end_leave_no_reference_cycles(ending):
    """A connection closed by an error, an abort (a body left unread: how vLLM learns the
    client left) or the upstream goes by reference counting: its parser held its callbacks
    (a cycle per closed connection), and a raised error kept on it held frames that hold it.
    What survives two young collections waits for a full one (prefill_gate/proxy/collector.py)."""
    import gc

    from prefill_gate.proxy.errors import UpstreamError
    from prefill_gate.proxy.upstream import UpstreamClient, read_limited

    async def handler(reader, writer, srv):
        while True:
            await read_request(reader)
            if ending == "reset_before_head":
                writer.transport.abort()
                return
            writer.write(HEAD_SSE + chunk(b"data: 1\n\n"))
            await writer.drain()
            if ending == "reset_mid_body":
                writer.transport.abort()
                return
            if ending == "malformed_body":
                writer.write(b"zz\r\nnot chunked\r\n")
                await writer.drain()
                return
            if ending == "left_unread":
                await asyncio.sleep(5)
            writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await writer.drain()
            if ending == "read_whole":
                writer.transport.close()  # the upstream ends the keep-alive
                return

    def ours(o) -> bool:
        return type(o).__module__ == "prefill_gate.proxy.fasthttp"

    async with Server(handler) as srv:
        up = UpstreamClient([srv.url])

        async def one() -> None:
            with contextlib.suppress(UpstreamError):
                async with up.stream(srv.url, "POST", "/v1/completions", {}, b"{}") as resp:
                    if ending != "left_unread":
                        await read_limited(resp, srv.url, 1 << 20)
            await asyncio.sleep(0.05)  # the closed connections' connection_lost

        await one()  # warm
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                await one()
            gc.collect()
            cyclic = sorted({type(o).__name__ for o in gc.garbage if ours(o)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            await up.aclose()
    assert cyclic == []


# ------------------------------------------------- whole chunks past the parser (FramedConnection)
class _Socket:
    def __init__(self) -> None:
        self.paused = self.closed = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True


def _between_chunks(loop, first: bytes):
    """A framed connection whose answer is under way, its first chunk taken: the next read
    starts at a chunk (where the compiled read step offers whole chunks to the sink)."""
    conn = fasthttp.FramedConnection(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn._loop, conn._wait_timeout = loop, 600.0
    conn.data_received(HEAD_SSE + chunk(first))
    conn.take()
    return conn


def _relay_through(cls, core, reads: list[bytes], answers: list[bool], framed: bool):
    """Feed ``reads`` to a connection of class ``cls`` whose answer is under way, a sink
    installed as the relay installs it; between reads, a woken reader takes what is queued
    and parks again. Returns (the body bytes in the order they left, the connection, how many
    reads the sink's ``chunked`` took)."""
    loop = asyncio.get_running_loop()
    out: list[bytes] = []
    conn = cls(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn._loop, conn._wait_timeout = loop, 600.0
    conn.data_received(HEAD_SSE)
    sink = _Sink(core, answers, out, framed)
    conn.sink, conn.sink_chunked = sink, getattr(sink, "chunked", None)
    whole = 0
    for data in reads:
        if conn.waiter is None or conn.waiter.done():
            if conn.chunks:
                out.append(conn.take())
            conn.waiter = loop.create_future()  # the reader parks again
        calls = sink.calls
        boundary = conn.at_boundary
        conn.data_received(data)
        whole += boundary and core.chunk_payloads(data) is not None and sink.calls > calls
    if conn.chunks:
        out.append(conn.take())
    return out, conn, whole


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=12),
       st.lists(st.integers(0, 2000), max_size=12), st.lists(st.booleans(), min_size=1, max_size=5),
       st.booleans())
async def test_whole_chunks_reach_the_sink_past_the_parser_alike(frames, cuts, answers, whole_reads):
    """A chunked answer read whole chunk by chunk, or cut anywhere, to a sink that takes or
    refuses each read: a ``FramedConnection`` with a sink that takes whole chunks hands on the
    same body, in the same order, and ends the answer where a plain connection does (the
    parser's); and whole-chunk reads from between two chunks go past the parser."""
    core = compiled_core()
    wire_frames = [chunk(f) for f in frames] + [b"0\r\n\r\n"]
    if whole_reads:
        reads = wire_frames
    else:
        wire = b"".join(wire_frames)
        points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
        reads = [wire[a:b] for a, b in zip(points, points[1:]) if b > a]
    plain, plain_conn, _ = _relay_through(fasthttp._Connection, core, reads, answers, framed=False)
    framed, framed_conn, past = _relay_through(fasthttp.FramedConnection, core, reads, answers, framed=True)
    assert b"".join(plain) == b"".join(framed) == b"".join(frames)
    for conn in (plain_conn, framed_conn):
        assert conn.complete and conn.error is None and conn.reusable() and not conn.at_boundary
    if whole_reads and len(frames) > 1:
        assert past >= 1  # every chunk after the first is whole, read from between two chunks


async def test_a_framed_connection_still_refuses_what_the_parser_refuses():
    """Past the parser only whole chunks go; anything else still meets the parser: a
    malformed chunk after whole ones fails the answer, and an answer's end (the last chunk)
    still completes it, after which bytes close the connection as on any other."""
    core = compiled_core()
    out, conn, past = _relay_through(fasthttp.FramedConnection, core,
                                     [chunk(b"a"), chunk(b"b"), b"zz\r\nboom\r\n"], [True], framed=True)
    assert out == [b"a", b"b"] and past == 1
    assert isinstance(conn.error, httpx.RemoteProtocolError) and conn.transport.closed and not conn.at_boundary
    out, conn, _ = _relay_through(fasthttp.FramedConnection, core,
                                  [chunk(b"a"), chunk(b"b") + b"0\r\n\r\n", chunk(b"late")], [True], framed=True)
    assert out == [b"a", b"b"] and conn.complete and not conn.keep_alive and conn.transport.closed


async def test_inside_a_chunk_bytes_that_look_like_chunks_are_its_payload():
    """A read that starts inside a chunk is never offered as whole chunks, however it looks:
    a chunk whose payload is itself chunk-shaped, its head read apart from its payload."""
    core = compiled_core()
    inner = chunk(b"x") + chunk(b"y")  # 1\r\nx\r\n1\r\ny\r\n, as a payload
    reads = [chunk(b"a"), b"%x\r\n" % len(inner), inner, b"\r\n", b"0\r\n\r\n"]
    out, conn, past = _relay_through(fasthttp.FramedConnection, core, reads, [True], framed=True)
    assert b"".join(out) == b"a" + inner and past == 0 and conn.complete


async def test_a_sink_that_raises_on_whole_chunks_fails_the_answer():
    core = compiled_core()

    class Failing(_Sink):
        def _chunked(self, data):
            raise OSError("client socket gone")

    loop = asyncio.get_running_loop()
    conn = fasthttp.FramedConnection(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn._loop = loop
    conn.data_received(HEAD_SSE + chunk(b"first"))
    sink = Failing(core, [True], [], framed=True)
    conn.sink, conn.sink_chunked = sink, sink.chunked
    conn.take()
    conn.waiter = waiter = loop.create_future()
    conn.data_received(chunk(b"second"))
    assert waiter.done() and isinstance(conn.error, OSError) and conn.sink is None and conn.sink_chunked is None
    assert conn.transport.closed and not conn.chunks


@pytest.mark.parametrize("reader", ["busy", "woken"])
async def test_whole_chunks_wait_in_the_queue_for_a_reader_not_parked(reader):
    """Only a parked reader's sink may take a read in the callback: a reader busy with bytes
    it took (sending them on: no waiter) or woken and not yet run (its waiter done) must
    find the next read queued behind them, whole chunks or not, or the client would get
    the later bytes first."""
    core = compiled_core()
    loop = asyncio.get_running_loop()
    conn = fasthttp.FramedConnection(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn._loop = loop
    conn.data_received(HEAD_SSE + chunk(b"first"))
    out = []
    sink = _Sink(core, [True], out, framed=True)
    conn.sink, conn.sink_chunked = sink, sink.chunked
    assert conn.take() == b"first"
    if reader == "busy":
        conn.waiter = None
    else:
        conn.waiter = loop.create_future()
        conn.waiter.set_result(None)
    conn.data_received(chunk(b"second"))
    assert sink.calls == 0 and out == [] and conn.take() == b"second"
    conn.waiter = loop.create_future()  # parked again: whole chunks go past the parser
    conn.data_received(chunk(b"third"))
    assert out == [b"third"] and sink.whole == 1 and not conn.chunks


async def test_a_framed_connection_lets_what_is_not_an_exception_go_up():
    """As the Python path's ``except Exception``: a sink raising anything else (a
    KeyboardInterrupt, a SystemExit) is not the answer's failure; it goes up as raised."""
    core = compiled_core()

    class Interrupted(BaseException):
        pass

    loop = asyncio.get_running_loop()
    conn = fasthttp.FramedConnection(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn._loop = loop
    conn.data_received(HEAD_SSE + chunk(b"first"))
    conn.take()

    def interrupted(data):
        raise Interrupted

    conn.sink, conn.sink_chunked = _Sink(core, [True], [], framed=False), interrupted
    conn.waiter = waiter = loop.create_future()
    with pytest.raises(Interrupted):
        conn.data_received(chunk(b"second"))
    assert not waiter.done() and conn.error is None and not conn.transport.closed


async def test_a_framed_connection_keeps_no_references_and_goes_at_a_collection():
    """Its compiled read step counts its references right (a hundred thousand reads taken,
    handed back as payloads, and left to the parser change no object's count and grow no
    memory), and a FramedConnection in a reference cycle through the state kept in C goes at
    a collection (the C type tells the collector what it holds)."""
    import collections
    import gc
    import sys
    import tracemalloc
    import weakref

    core = compiled_core()
    loop = asyncio.get_running_loop()
    conn = _between_chunks(loop, b"first")
    conn._timer = timer = loop.call_at(loop.time() + 600, lambda: None)
    conn.waiter = waiter = loop.create_future()
    payload = b"x" * 40
    whole, back = chunk(payload), b"back"
    conn.sink_chunked = taking = lambda data: True
    giving = lambda data: back  # noqa: E731  (whole chunks not taken: their payloads queued)
    leaving = lambda data: None  # noqa: E731  (not whole chunks: the parser's)
    watched = (whole, back, timer, loop, taking)
    before = [sys.getrefcount(o) for o in watched]

    def rounds(k):
        nonlocal waiter
        for _ in range(k):
            conn.sink_chunked = taking
            conn.data_received(whole)
            conn.sink_chunked = giving
            conn.data_received(whole)  # queued: the reader is woken; it takes and parks again
            assert conn.buffered == len(back) and waiter.done() and conn.take() == back and conn.buffered == 0
            conn.waiter = loop.create_future()
            conn.sink_chunked = leaving
            conn.data_received(whole)  # the parser's: queued for the reader, woken
            assert conn.take() == payload and conn.waiter.done()
            conn.waiter = waiter = loop.create_future()

    rounds(1000)
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        rounds(20_000)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    conn.sink_chunked = taking
    assert [sys.getrefcount(o) for o in watched] == before
    assert grown < 64 * 1024
    timer.cancel()
    del conn
    looped = fasthttp.FramedConnection(("http", "upstream.invalid", 80))
    looped.chunks = collections.deque([looped])  # a cycle through a field the C type keeps
    looped.waiter = looped
    gone = weakref.ref(looped)
    del looped
    gc.collect()
    assert gone() is None


def test_framed_connections_without_the_compiled_core_are_refused(monkeypatch):
    monkeypatch.setattr(fasthttp, "FramedConnection", None)
    with pytest.raises(RuntimeError, match="compiled core"):
        FastTransport(framed=True)
    assert FastTransport()._connection is fasthttp._Connection


async def test_only_the_compiled_core_gets_framed_connections():
    """The app opens FramedConnections where its relay's sink takes whole chunks (the
    compiled core), plain ones for Python's (whose callbacks would cost it two calls a
    chunk)."""
    compiled_core()
    assert make_state().client._fast._connection is fasthttp.FramedConnection
    assert make_state(relay_core="python").client._fast._connection is fasthttp._Connection


async def test_a_read_that_ends_inside_a_chunk_size_line_is_not_taken_for_whole_chunks():
    """The parser holds a chunk size's first digit ("1" of "1a") when a read ends there; the
    next read, "a\\r\\n" and 26 bytes, must not be read as whole chunks from its start, even
    where its bytes happen to frame as such: the same bytes give the same body with the
    compiled core's reads and with the parser's."""
    core = compiled_core()
    payload = b"0123456789" + b"\r\n" + b"b\r\n" + b"ABCDEFGHIJK"  # 26 bytes that also frame as a 10 and an 11
    assert core.chunk_payloads(b"a\r\n" + payload + b"\r\n") == b"0123456789ABCDEFGHIJK"  # the lie to avoid
    reads = [chunk(b"abc") + b"1", b"a\r\n" + payload + b"\r\n", b"0\r\n\r\n"]
    plain, plain_conn, _ = _relay_through(fasthttp._Connection, core, reads, [True], framed=False)
    framed, framed_conn, _ = _relay_through(fasthttp.FramedConnection, core, reads, [True], framed=True)
    assert b"".join(plain) == b"".join(framed) == b"abc" + payload
    assert plain_conn.complete and framed_conn.complete


@st.composite
def lying_payloads(draw) -> bytes:
    """A chunk payload of 16X + Y bytes (size "XY" in hex) built so that, read from the size's
    second digit on ("Y\r\n" + payload + "\r\n"), the bytes also frame as whole chunks: Y
    bytes, then a chunk of k bytes (k + its hex digits + 4 = 16X)."""
    x = draw(st.integers(1, 2))
    y = draw(st.integers(1, 15))
    k = next(k for k in range(16 * x) if k + len(b"%x" % k) + 4 == 16 * x)
    return draw(st.binary(min_size=y, max_size=y)) + b"\r\n" + chunk(draw(st.binary(min_size=k, max_size=k)))[:-2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(lying_payloads(), st.binary(min_size=1, max_size=40)), min_size=1, max_size=6),
       st.lists(st.booleans(), min_size=1, max_size=5), st.data())
async def test_chunks_whose_payloads_frame_as_chunks_reach_the_sink_alike(frames, answers, data):
    """The differential fuzz, aimed where the fast path can be fooled: payloads that also
    frame as chunks from their size's second digit, reads cut right after a size's first
    digit and at other offsets. The compiled core's reads and the parser's give the same body."""
    core = compiled_core()
    wire = b"".join(chunk(f) for f in frames) + b"0\r\n\r\n"
    size_digits, at = [], 0
    for f in frames:
        size_digits.append(at + 1)  # just after the first digit of this chunk's size
        at += len(chunk(f))
    cuts = data.draw(st.lists(st.sampled_from(size_digits), max_size=3)) + \
        data.draw(st.lists(st.integers(1, len(wire) - 1), max_size=3))
    points = sorted(set(cuts) | {0, len(wire)})
    reads = [wire[a:b] for a, b in zip(points, points[1:]) if b > a]
    plain, plain_conn, _ = _relay_through(fasthttp._Connection, core, reads, answers, framed=False)
    framed, framed_conn, _ = _relay_through(fasthttp.FramedConnection, core, reads, answers, framed=True)
    assert b"".join(plain) == b"".join(framed) == b"".join(frames)
    assert plain_conn.complete and framed_conn.complete


@pytest.mark.parametrize("cls", ["_Connection", "FramedConnection"])
async def test_trailer_fields_never_become_the_answers_headers(cls):
    """A chunked answer's trailer fields are bounded and dropped: the answer's header list
    (which a non-streaming relay reads after the body) holds the head's fields alone."""
    if cls == "FramedConnection":
        compiled_core()
    conn = getattr(fasthttp, cls)(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
                       b"trailer: set-cookie\r\n\r\n" + chunk(b"{}") + b"0\r\nset-cookie: session=evil\r\n"
                       b"location: http://evil.test/\r\n\r\n")
    assert conn.complete and conn.error is None
    assert [name for name, _ in conn.headers] == [b"content-type", b"transfer-encoding", b"trailer"]
    many = fasthttp._Connection(("http", "upstream.invalid", 80), max_headers=8)
    many.connection_made(_Socket())
    many.data_received(HEAD_SSE + b"0\r\n" + b"".join(b"t%d: v\r\n" % i for i in range(20)) + b"\r\n")
    assert isinstance(many.error, httpx.RemoteProtocolError)  # trailers count against the bound


@pytest.mark.parametrize("status", [b"000", b"099", b"600", b"999"])
async def test_a_status_that_is_not_http_is_a_protocol_error(status):
    conn = fasthttp._Connection(("http", "upstream.invalid", 80))
    conn.connection_made(_Socket())
    conn.data_received(b"HTTP/1.1 " + status + b" Weird\r\ncontent-length: 0\r\n\r\n")
    assert isinstance(conn.error, httpx.RemoteProtocolError) and not conn.head_done


async def test_a_sink_that_drops_the_connections_hold_on_it_mid_call_is_safe():
    """The compiled read step calls the sink's ``chunked`` while the connection holds the
    only references to it, its queue and its reader's future; a sink whose work ends the
    relay (the connection drops all three, as its answer's close does) must not leave the
    step using what was freed (tests/test_relaycore_asan.py runs this under AddressSanitizer)."""
    core = compiled_core()
    loop = asyncio.get_running_loop()

    class Dropping:
        def __init__(self, conn, answer):
            self.conn, self.answer, self.calls = conn, answer, 0

        def chunked(self, data):
            self.calls += 1
            conn = self.conn
            conn.sink = conn.sink_chunked = None  # the last references to this sink's bound method
            conn.chunks = collections.deque()
            conn.waiter = None
            self.conn = None
            return self.answer

    for answer in (True, b"left for the reader", None):
        conn = _between_chunks(loop, b"first")
        sink = Dropping(conn, answer)
        conn.sink, conn.sink_chunked = (lambda data: True), sink.chunked
        del sink
        conn.waiter = loop.create_future()
        assert conn.at_boundary
        conn.data_received(chunk(b"second"))  # whole: offered to the sink, which lets go of everything
        gc.collect()
        assert conn.sink_chunked is None and conn.error is None
        conn.data_received(b"0\r\n\r\n")
        assert conn.complete


async def test_a_relay_whose_own_callback_drops_it_mid_read_is_not_freed_under_it():
    """The compiled relay's ``chunked`` as a framed connection's sink, the connection holding
    the only reference to it: a token callback inside it that ends the relay (the stream's end
    drops the sink) must not free the relay while its C code still runs (a use after free,
    seen with the borrowed reference under AddressSanitizer: tests/test_relaycore_asan.py)."""
    import types

    core = compiled_core()
    loop = asyncio.get_running_loop()
    conn = _between_chunks(loop, b"data: {}\n\n")
    written = []
    flow = types.SimpleNamespace(write_paused=False)
    cycle = types.SimpleNamespace(flow=flow, transport=types.SimpleNamespace(write=written.append),
                                  response_started=True, chunked_encoding=True, response_complete=False,
                                  disconnected=False)

    def on_tokens(gap, n):
        conn.sink = conn.sink_chunked = None  # the stream ended: its relay goes

    observer = types.SimpleNamespace(first_at=1.0, splitter=types.SimpleNamespace(held=False), clock=lambda: 2.0,
                                     tokens=0, on_tokens=on_tokens, last_at=1.0)
    relay = core.DirectRelay(cycle, observer)
    conn.sink, conn.sink_chunked = relay, relay.chunked
    del relay
    conn.waiter = loop.create_future()
    conn.data_received(chunk(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'))
    gc.collect()
    assert conn.sink_chunked is None and written and observer.tokens == 1
