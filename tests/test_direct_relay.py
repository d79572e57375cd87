"""The relay's direct path: body bytes written to the client from the upstream's read
callback (``prefill_gate.proxy.listener.ChunkWriter``, ``prefill_gate.proxy.fasthttp.body_sink``; the callback of
either relay core, ``prefill_gate.proxy.relaycore``), with real sockets on both sides (the proxy's
listener, the proxy's own transport)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import types

import pytest

from conftest import RELAY_CORES, compiled_core, make_state, serve
from prefill_gate.proxy import app as app_module
from prefill_gate.proxy import listener, relaycore
from prefill_gate.proxy.app import create_app
from prefill_gate.proxy.listener import chunk_writer

HEAD_SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def sse(i: int, pad: int = 0) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": f"t{i}" + "x" * pad}}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (head included in ``raw``)."""
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head.lower()
    out = bytearray()
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size:size + 2] == b"\r\n"
        rest = rest[size + 2:]


async def post_raw(url: str, path: str, body: bytes, *, pause_s: float = 0.0) -> bytes:
    """POST over a raw socket and read the answer to its end (after ``pause_s`` seconds
    of not reading: the proxy's writes back up)."""
    host, port = url.split("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                 b"connection: close\r\n\r\n%s" % (path.encode(), len(body), body))
    await writer.drain()
    if pause_s:
        await asyncio.sleep(pause_s)
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return raw


async def test_the_chunk_writer_writes_what_send_writes():
    """Byte for byte, a body part through ChunkWriter and through send frame alike; for a
    GET (and for any send that is not the proxy's listener's) there is no writer."""
    seen = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen[scope["method"]] = writer = chunk_writer(send)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if writer is not None:
            assert writer.write_through(bytes, b"hello")
            assert writer.write_through(bytes.upper, b"hi")
            assert writer.write_through(lambda data: b"", b"held back")  # taken, nothing to write
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if writer is not None:
            assert not writer.write_through(_never, b"late")  # complete: only send may end it

    async with serve(app, make_state().settings) as url:
        raw = await post_raw(url, "/", b"{}")
    assert raw.endswith(b"\r\n\r\n5\r\nhello\r\n2\r\nHI\r\n5\r\nhello\r\n0\r\n\r\n")
    assert isinstance(seen["POST"], listener.ChunkWriter)

    async def no_writer(message):
        pass

    assert chunk_writer(no_writer) is None


def _never(data):
    raise AssertionError("take called while the writer was not ready")


@pytest.mark.parametrize("fields", list(itertools.product([False, True], [False, True, "maybe"], [False, True],
                                                           [False, True], [False, True])))
def test_write_through_writes_exactly_when_send_has_nothing_more_to_do(fields):
    """Over every state of the cycle's fields ``write_through`` takes and writes only while the
    answer is started, chunked, not complete, its client there and reading; otherwise it
    returns False without calling ``take``."""
    started, chunked, complete, disconnected, paused = fields
    written = []
    cycle = types.SimpleNamespace(response_started=started, chunked_encoding=chunked, response_complete=complete,
                                  disconnected=disconnected, flow=types.SimpleNamespace(write_paused=paused),
                                  transport=types.SimpleNamespace(write=written.append))
    writer = listener.ChunkWriter(cycle)
    ready = started and chunked is True and not complete and not disconnected and not paused
    assert writer.write_through(bytes.upper if ready else _never, b"abc") is ready
    assert written == ([b"3\r\nABC\r\n"] if ready else [])


@pytest.fixture(params=RELAY_CORES)
def writes(request, monkeypatch):
    """Runs the test under each relay core (``relay_core``) and counts the reads the relay
    wrote from the read callback (the callback took them)."""
    if request.param == "compiled":
        compiled_core()
    count = {"n": 0}

    def factory(choice):
        make, name = relaycore.relay_factory(request.param)
        assert name == request.param

        def counting(writer, observer):
            callback = make(writer, observer)

            def counted(data):
                taken = callback(data)
                count["n"] += taken
                return taken

            return counted

        return counting, name

    monkeypatch.setattr(app_module, "relay_factory", factory)
    return count


async def sse_upstream(events: list[bytes], cuts: random.Random, gap_s: float = 0.0):
    """A raw upstream: answers every request with ``events`` as SSE, the bytes cut at
    random places into chunks of the chunked encoding. Yields (url, the bytes it sent)."""
    stream = b"".join(events)
    closed = asyncio.Event()

    async def handle(reader, writer):
        try:
            while True:  # every request on the connection (the proxy keeps it alive)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(HEAD_SSE)
                pos = 0
                while pos < len(stream):
                    n = cuts.randint(1, 400)
                    writer.write(b"%x\r\n%s\r\n" % (len(stream[pos:pos + n]), stream[pos:pos + n]))
                    pos += n
                    await writer.drain()
                    if gap_s:
                        await asyncio.sleep(gap_s)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            closed.set()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", stream, closed


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                   "stream_options": {"include_usage": True}}).encode()


@pytest.mark.parametrize("pause_s", [0.0, 0.5])
async def test_the_direct_relay_is_byte_exact_with_and_without_backpressure(writes, pause_s):
    """Events cut anywhere by the upstream reach the client as sent, in order: written from
    the read callback while the client keeps up, through send (and its flow control) when
    it stops reading (0.5 s of ~3 MB backs up the socket) and back again."""
    events = [sse(i, pad=random.Random(i).randint(0, 300)) for i in range(12_000 if pause_s else 2_000)]
    events.append(b"data: [DONE]\n\n")
    server, url, stream, _ = await sse_upstream(events, random.Random(5))
    state = make_state(upstreams=[url])
    async with server, serve(create_app(state, health_checks=False)) as proxy:
        raw = await post_raw(proxy, "/v1/chat/completions", CHAT, pause_s=pause_s)
    assert raw.startswith(b"HTTP/1.1 200")
    assert dechunk(raw) == stream
    assert writes["n"] > 0  # the direct path carried bytes


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_on_the_direct_path(writes):
    """vLLM learns that the client left (its connection closes) while bytes flow through
    the read callback, with no task reading."""
    events = [sse(i) for i in range(100_000)] + [b"data: [DONE]\n\n"]
    server, url, _, closed = await sse_upstream(events, random.Random(1), gap_s=0.002)
    state = make_state(upstreams=[url])
    async with server, serve(create_app(state, health_checks=False)) as proxy:
        host, port = proxy.split("//", 1)[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT))
        got = b""
        while got.count(b"data:") < 50:
            got += await asyncio.wait_for(reader.read(65536), 10)
        assert writes["n"] > 0
        writer.close()
        await asyncio.wait_for(closed.wait(), 10)


@pytest.mark.parametrize("core", RELAY_CORES)
async def test_each_reads_gaps_reach_the_histogram_the_closed_loop_and_the_predictor(core):
    """With the closed loop and slicing on, every gap after a stream's first content chunk
    feeds all three, read by read, with either relay core (the compiled one hands them to
    its compiled twin of the exchange's per-read hook, relaycore.gap_tally_type)."""
    if core == "compiled":
        compiled_core()
    events = [sse(i) for i in range(300)] + [b"data: [DONE]\n\n"]
    server, url, stream, _ = await sse_upstream(events, random.Random(4))
    state = make_state(upstreams=[url], relay_core=core, itl_slo_ms=50, slicing="on")
    assert (state.gap_tally is not None) == (core == "compiled")
    fed = []
    observe = state.policy.observe_itl

    def feeding(upstream, seconds, n=1):
        fed.append(n)
        return observe(upstream, seconds, n)

    state.policy.observe_itl = feeding
    async with server, serve(create_app(state, health_checks=False)) as proxy:
        assert dechunk(await post_raw(proxy, "/v1/chat/completions", CHAT)) == stream
    count = state.metrics.registry.get_sample_value(
        "prefill_gate_itl_seconds_count", {"class": "interactive", "large_prefill_in_flight": "false"})
    assert count == 299
    assert sum(fed) == 299 and len(fed) > 1  # (one call a read)
    assert state.predictor.gaps_seen(url) == 299


@pytest.mark.parametrize("core", RELAY_CORES)
async def test_the_direct_path_leaves_no_reference_cycles(core):
    """As through send (tests/test_relay.py): a request's objects go by reference counting
    when it ends, the read callback included (its connection, pooled, lets go of it), with
    either relay core."""
    import gc

    if core == "compiled":
        compiled_core()

    from prefill_gate.proxy.disconnect import DisconnectWatch
    from prefill_gate.proxy.exchange import GatedExchange
    from prefill_gate.proxy.fasthttp import _ResponseStream
    from prefill_gate.proxy.relay import StreamObserver

    events = [sse(i) for i in range(50)] + [b"data: [DONE]\n\n"]
    server, url, stream, _ = await sse_upstream(events, random.Random(2))
    state = make_state(upstreams=[url], relay_core=core)
    kinds = (GatedExchange, DisconnectWatch, StreamObserver, _ResponseStream, listener.ChunkWriter)
    if core == "compiled":
        kinds += (compiled_core().DirectRelay,)
    async with server, serve(create_app(state, health_checks=False)) as proxy:
        assert dechunk(await post_raw(proxy, "/v1/chat/completions", CHAT)) == stream  # warm
        await asyncio.sleep(0.05)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                assert dechunk(await post_raw(proxy, "/v1/chat/completions", CHAT)) == stream
            await asyncio.sleep(0.05)
            gc.collect()
            cyclic = sorted({type(o).__name__ for o in gc.garbage if isinstance(o, kinds)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert cyclic == []


@pytest.mark.parametrize("level, logged", [("debug", True), ("info", True), ("warning", False), ("error", False)])
def test_the_access_log_and_forwarded_addresses_are_made_only_where_they_print(level, logged):
    """Below info nothing prints uvicorn's access log, so it is off (uvicorn formats each
    response's line whenever it is on), and with it X-Forwarded-For, which only that line
    reads. Asked for explicitly, either stays as asked."""
    settings = make_state().settings
    config = listener.server_config(None, settings, log_level=level)
    assert (config.access_log, config.proxy_headers) == (logged, logged)
    config = listener.server_config(None, settings, log_level=level, access_log=True, proxy_headers=True)
    assert (config.access_log, config.proxy_headers) == (True, True)
    assert listener.server_config(None, settings.model_copy(update={"log_level": level})).access_log is logged
