"""The proxy's HTTP/1.1 protocol (prefill_gate.proxy.http1), over real sockets: the same bytes as
uvicorn's httptools protocol on the same requests, and the bounds it adds."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re

import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import make_state, serve
from prefill_gate.proxy import http1

SETTINGS = make_state().settings


def _send_parts(mode: str, body: bytes):
    if mode.startswith("/chunked/"):
        n = int(mode.rsplit("/", 1)[1])
        return None, [body[i::n] for i in range(n)]
    return str(len(body)).encode(), [body]


async def echo(scope, receive, send):
    """Answers with what it was asked: the scope's request fields and the body's size and
    hash, framed by the path (``/len``: content-length; ``/chunked/N``: N parts, no length;
    ``/close``: asks to close; ``/204``: no body; ``/fail``: raises before answering;
    ``/late``: raises mid-answer)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request", message
        body += message["body"]
        if not message["more_body"]:
            break
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("the app failed")
    seen = {k: scope[k] for k in ("type", "http_version", "scheme", "method", "root_path", "path", "query_string")}
    seen.update(raw_path=scope["raw_path"].decode("latin-1"), query_string=scope["query_string"].decode("latin-1"),
                headers=[[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
                asgi=scope["asgi"], state=scope.get("state"), body=len(body),
                sha=hashlib.sha256(body).hexdigest()[:16], client=type(scope["client"]).__name__,
                server=scope["server"][0])
    out = json.dumps(seen).encode()
    if path == "/204":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    length, parts = _send_parts(path, out)
    headers = [(b"content-type", b"application/json"), (b"X-Echo", b"yes")]
    if length is not None and path != "/nolength":
        headers.append((b"content-length", length))
    if path == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200 if scope["method"] != "PUT" else 201,
                "headers": headers})
    for i, part in enumerate(parts):
        if path == "/late" and i == 0:
            await send({"type": "http.response.body", "body": part[:5], "more_body": True})
            raise RuntimeError("the app failed mid-answer")
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


@contextlib.asynccontextmanager
async def two_servers(app=echo):
    """The same app behind uvicorn's httptools protocol and behind the proxy's."""
    async with serve(app, plain=True) as theirs, serve(app, SETTINGS) as ours:
        yield theirs, ours


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def exchange(url: str, pieces: list[bytes], *, pause: float = 0.0, timeout: float = 5.0) -> bytes:
    """Write ``pieces`` on one connection (``pause`` seconds apart) and read until the
    server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
        return await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()


_DATE = re.compile(rb"\r\ndate: [^\r]*\r\n")


def normal(raw: bytes) -> bytes:
    return _DATE.sub(b"\r\ndate: -\r\n", raw)


# ------------------------------------------------------------------ requests, generated
_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1,
                 max_size=12)
_value = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 ;=,./:-_", max_size=20).map(str.strip)


@st.composite
def requests(draw, last: bool):
    method = draw(st.sampled_from(["GET", "POST", "HEAD", "PUT"]))
    path = draw(st.sampled_from(["/len", "/chunked/1", "/chunked/3", "/nolength", "/204", "/a%20b/c", "/x/./y",
                                 "/%2e%2e/z", "/fail"]))
    query = draw(st.sampled_from(["", "?a=1", "?q=%20&x=y", "?"]))
    version = draw(st.sampled_from(["1.1", "1.1", "1.1", "1.0"]))
    headers = [(b"host", b"example")] + [(k.encode(), v.encode()) for k, v in
                                        draw(st.lists(st.tuples(_token, _value), max_size=4))]
    body = draw(st.binary(max_size=3000)) if method in ("POST", "PUT") else b""
    framing = draw(st.sampled_from(["length", "chunked"])) if body or method == "POST" else "none"
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
    if body and draw(st.booleans()):
        headers.append((b"Expect", b"100-continue"))
    closes = last or version == "1.0"
    if closes and version == "1.1":
        headers.append((b"Connection", b"close"))
    elif version == "1.0" and draw(st.booleans()):
        headers.append((b"Connection", b"keep-alive"))  # (an HTTP/1.0 answer closes all the same)
    head = b"%s %s HTTP/%s\r\n" % (method.encode(), (path + query).encode(), version.encode())
    head += b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n"
    if framing == "chunked":
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body))), max_size=3))) | {len(body)})
        parts, start = [], 0
        for cut in cuts:
            if cut > start and body[start:cut]:  # (an empty chunk would be the body's end: "0\r\n\r\n")
                parts.append(body[start:cut])
                start = cut
        wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    else:
        wire = body
    return head + wire, closes, path == "/fail"


@st.composite
def conversations(draw):
    """A few requests on one connection, the last asking to close it (or HTTP/1.0), the
    wire cut anywhere into pieces."""
    wire = b""
    n = draw(st.integers(1, 4))
    for i in range(n):
        raw, closes, fails = draw(requests(last=i == n - 1))
        wire += raw
        if closes or fails:
            break
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=3))))
    points = [0] + cuts + [len(wire)]
    return [wire[a:b] for a, b in zip(points, points[1:]) if b > a]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(conversations(), st.booleans())
async def test_the_same_bytes_as_uvicorns_protocol(pieces, paced):
    """Requests (GET, POST, HEAD, PUT; bodies by length or chunked; Expect: 100-continue;
    HTTP/1.0; percent-encoded paths; queries), one after another on a connection or
    pipelined, cut anywhere: the app sees the same scope and body, the client gets the same
    bytes (the Date header aside) from both protocols."""
    async with two_servers() as (theirs, ours):
        expected = normal(await exchange(theirs, pieces, pause=0.02 if paced else 0.0))
        got = normal(await exchange(ours, pieces, pause=0.02 if paced else 0.0))
    assert got == expected


async def test_pipelined_requests_are_answered_in_order_with_their_bodies():
    wire = b"".join(b"POST /len?i=%d HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (i, i * 100, b"b" * i * 100)
                    for i in range(1, 6)) + b"GET /close HTTP/1.1\r\nhost: x\r\n\r\n"
    async with two_servers() as (theirs, ours):
        got = await exchange(ours, [wire])
        assert normal(got) == normal(await exchange(theirs, [wire]))
    answers = got.split(b"HTTP/1.1 200 OK")[1:]
    assert [json.loads(a[a.index(b"{"):a.rindex(b"}") + 1])["body"] for a in answers] == [100, 200, 300, 400, 500, 0]


# ------------------------------------------------------------------ what it adds: bounds
async def test_a_head_over_max_header_bytes_gets_431_and_at_the_bound_passes():
    limit = SETTINGS.max_header_bytes
    async with serve(echo, SETTINGS) as url:
        base = len(b"host") + len(b"x") + len(b"connection") + len(b"close") + len(b"x-fill")
        at = b"GET /len HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-fill: %s\r\n\r\n" % (b"a" * (limit - base))
        assert (await exchange(url, [at])).startswith(b"HTTP/1.1 200")
        over = at.replace(b"x-fill: a", b"x-fill: aa")
        answer = await exchange(url, [over])
        assert answer.startswith(b"HTTP/1.1 431") and b"max_header_bytes" in answer
        many = b"GET /len HTTP/1.1\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(http1.MAX_HEADERS + 1)) + b"\r\n"
        assert (await exchange(url, [many])).startswith(b"HTTP/1.1 431")
        long_target = b"GET /len?%s HTTP/1.1\r\nhost: x\r\n\r\n" % (b"q" * http1.MAX_TARGET_BYTES)
        assert (await exchange(url, [long_target])).startswith(b"HTTP/1.1 414")


async def test_an_endless_header_is_refused_while_it_arrives():
    """One header value without end, sent in pieces: answered 431 and closed long before
    it ends (uvicorn buffers a head whole, however large)."""
    async with serve(echo, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"GET /len HTTP/1.1\r\nhost: x\r\nx-endless: ")
        sent = 0
        with pytest.raises((ConnectionError, AssertionError)):
            while True:
                writer.write(b"a" * 16384)
                await writer.drain()
                sent += 16384
                assert sent < 50 * SETTINGS.max_header_bytes
                await asyncio.sleep(0)
                if reader.at_eof() or reader._buffer:  # answered
                    break
            raise AssertionError("answered")
        answer = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 431")
    assert sent < 4 * SETTINGS.max_header_bytes + 4 * 262144


async def test_an_endless_trailer_field_is_refused_while_it_arrives():
    """A chunked body's trailer field without end: the parser would hold it whole."""
    async with serve(echo, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST /len HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nx-t: ")
        sent = 0
        with contextlib.suppress(ConnectionError):
            while not (reader.at_eof() or reader._buffer) and sent < 50 * SETTINGS.max_header_bytes:
                writer.write(b"a" * 16384)
                await writer.drain()
                sent += 16384
                await asyncio.sleep(0)
        answer = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400")
    assert sent < 4 * SETTINGS.max_header_bytes + 4 * 262144


async def test_a_body_cut_by_bad_bytes_tells_the_app_its_client_is_gone(monkeypatch):
    """A chunked body whose next chunk size is garbage: the app, reading it, hears
    http.disconnect at once (it would otherwise wait for the rest forever) and the client
    gets 400. (The lingering close is stretched past the test's waits, so that the
    connection's end cannot be what tells the app.)"""
    monkeypatch.setattr(http1, "LINGER_S", 60.0)
    heard = asyncio.Queue()

    async def reads(scope, receive, send):
        if scope["type"] != "http":
            return
        while True:
            message = await receive()
            await heard.put(message)
            if message["type"] == "http.disconnect" or not message["more_body"]:
                return

    async with serve(reads, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        assert (await asyncio.wait_for(heard.get(), 5))["body"] == b"hi"
        writer.write(b"zz\r\n")
        assert (await asyncio.wait_for(heard.get(), 5)) == {"type": "http.disconnect"}
        answer = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400")


async def test_a_body_cut_after_the_answer_began_cuts_the_answer_without_a_400_inside():
    """The app answers while it reads a chunked body; bad bytes cut the body: the app hears
    http.disconnect, and the client sees its answer end with the connection, no 400 written
    into the middle of it."""
    heard = asyncio.Queue()

    async def answers_early(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"begun", "more_body": True})
        while (message := await receive())["type"] != "http.disconnect":
            pass
        await heard.put(message)

    async with serve(answers_early, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await asyncio.wait_for(reader.readuntil(b"begun\r\n"), 5)
        writer.write(b"zz\r\n")
        assert (await asyncio.wait_for(heard.get(), 5)) == {"type": "http.disconnect"}
        rest = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
    assert rest == b""  # the answer cut where it was: no chunk, no last chunk, no 400


async def test_garbage_behind_a_request_under_way_does_not_land_in_its_answer():
    """The answer under way ends whole, then the connection closes; uvicorn writes its 400
    into the middle of the stream."""
    release = asyncio.Event()

    async def slow(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"second", "more_body": False})

    async with serve(slow, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"first\r\n"), 5)
        writer.write(b"\x00\x01 not http\r\n\r\n")
        await asyncio.sleep(0.05)
        flood = asyncio.create_task(_send_until_refused(writer, 8 << 20))  # more garbage
        await asyncio.sleep(0.2)
        assert not flood.done()  # not read: the connection stopped reading at the garbage
        release.set()
        rest = await asyncio.wait_for(reader.read(-1), 5)
        await asyncio.wait_for(flood, 5)
        writer.close()
    # whole, though unread bytes waited: closing on them would have reset the answer's tail
    assert rest == b"6\r\nsecond\r\n0\r\n\r\n"


async def _send_until_refused(writer: asyncio.StreamWriter, size: int) -> None:
    with contextlib.suppress(ConnectionError):
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()


async def test_an_upgrade_request_is_served_as_http_and_the_connection_closed():
    async with serve(echo, SETTINGS) as url:
        answer = await exchange(url, [b"GET /len HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
                                      b"\r\nGET /len HTTP/1.1\r\nhost: x\r\n\r\n"])
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
    assert b"connection: close" in answer.lower()


async def test_a_malformed_request_gets_400_and_a_closed_connection():
    async with two_servers() as (theirs, ours):
        for wire in (b"GET / HTTP/1.1\r\nhost x\r\n\r\n", b"\x16\x03\x01 tls hello", b"GET /\xff HTTP/1.1\r\n\r\n"):
            got = await exchange(ours, [wire])
            assert got.startswith(b"HTTP/1.1 400") and got.endswith(b"Invalid HTTP request received."), got


# ------------------------------------------------------------------ the app's side
async def test_the_apps_failures_are_answered_as_uvicorn_answers_them():
    async with two_servers() as (theirs, ours):
        for path in (b"/fail", b"/late"):
            wire = [b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path]
            assert normal(await exchange(ours, wire)) == normal(await exchange(theirs, wire))


async def test_an_app_that_ignores_backpressure_waits_and_loses_nothing():
    """A client that stops reading: ``send`` waits for the socket to drain (write_paused),
    and every byte arrives once the client reads again."""
    part = bytes(range(256)) * 256  # 64 KiB

    async def big(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % (64 * len(part)))]})
        for _ in range(64):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with serve(big, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        await asyncio.sleep(0.3)  # 4 MiB backs up in the sockets
        raw = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
    assert raw.split(b"\r\n\r\n", 1)[1] == part * 64


async def test_a_large_body_pauses_reading_until_the_app_asks():
    """Past HIGH_WATER unread body bytes the connection stops reading; the app's receive
    resumes it, and the whole body arrives in order."""
    seen = {}
    go = asyncio.Event()

    async def lazy(scope, receive, send):
        if scope["type"] != "http":
            return
        await go.wait()
        body = b""
        while True:
            m = await receive()
            body += m["body"]
            if not m["more_body"]:
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    body = bytes(range(256)) * 4096  # 1 MiB
    async with serve(lazy, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
        writer.write(body)
        await asyncio.sleep(0.2)
        conns = [c for c in _connections() if isinstance(c, http1.Connection)]
        assert conns and all(c.read_state == "paused" for c in conns)
        assert conns[0].cycle.buffered < http1.HIGH_WATER + 262144
        go.set()
        await writer.drain()
        assert (await asyncio.wait_for(reader.read(-1), 10)).endswith(b"ok")
        writer.close()
    assert seen["body"] == body


def _connections():
    import gc

    return [o for o in gc.get_objects() if isinstance(o, http1.Connection) and o.parser is not None]


async def test_receive_reports_the_clients_loss_and_the_loss_callbacks_run():
    from prefill_gate.proxy.disconnect import ON_LOST

    got = {}
    answered = asyncio.Event()

    async def waits(scope, receive, send):
        if scope["type"] != "http":
            return
        cycle = send.__self__
        getattr(cycle, ON_LOST).append(lambda: got.setdefault("callback", True))
        got["first"] = await receive()
        answered.set()
        got["then"] = await receive()  # blocks until the client is gone

    async with serve(waits, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        await asyncio.wait_for(answered.wait(), 5)
        writer.close()
        for _ in range(100):
            if "then" in got:
                break
            await asyncio.sleep(0.02)
    assert got["first"] == {"type": "http.request", "body": b"hi", "more_body": False}
    assert got["then"] == {"type": "http.disconnect"} and got["callback"]


async def _leaves(app_reads_body: bool, wire: bytes, tail: bytes = b"") -> dict:
    """A request the app answers never (it waits, its loss callback armed); the client
    sends ``wire``, then ``tail``, then leaves. Returns when the callback ran (or not)."""
    from prefill_gate.proxy.disconnect import ON_LOST

    got = {}
    ready = asyncio.Event()

    async def waits(scope, receive, send):
        if scope["type"] != "http":
            return
        lost = asyncio.Event()
        getattr(send.__self__, ON_LOST).append(lost.set)
        if app_reads_body:
            await asyncio.sleep(0.1)  # the whole body has arrived: its last read is over HIGH_WATER
            size = 0
            while True:
                m = await receive()
                size += len(m["body"])
                if not m["more_body"]:
                    break
            got["body"] = size
        ready.set()
        await asyncio.wait_for(lost.wait(), 3)  # gated work the app does not cut short by itself
        got["lost"] = True

    async with serve(waits, SETTINGS) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(wire)
        await asyncio.wait_for(ready.wait(), 5)
        if tail:
            writer.write(tail)
            await writer.drain()
            await asyncio.sleep(0.05)
        t0 = asyncio.get_running_loop().time()
        writer.close()
        for _ in range(150):
            if "lost" in got:
                break
            await asyncio.sleep(0.01)
        got["seen_after_s"] = asyncio.get_running_loop().time() - t0
    return got


async def test_a_client_that_leaves_after_a_large_body_is_seen_at_once():
    """An agent's long tool result (a body over HIGH_WATER, its last read too) queued at the
    gate: the client leaving must reach the app at once. The read that paused at HIGH_WATER
    was never resumed once the app had the whole body, so the leaving went unseen until the
    answer was written, and the queued prompt later reached the upstream."""
    body = b"x" * (HIGH := http1.HIGH_WATER * 3)
    got = await _leaves(True, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (HIGH, body))
    assert got["body"] == HIGH and got.get("lost") and got["seen_after_s"] < 0.5, got


async def test_a_client_that_leaves_behind_a_pipelined_request_or_a_stray_byte_is_seen():
    head = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
    for tail in (b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n", b"G"):
        got = await _leaves(False, head, tail)
        assert got.get("lost") and got["seen_after_s"] < 0.5, (tail, got)


async def test_pipelined_requests_past_the_bound_are_not_held():
    """One read of many pipelined requests: those within MAX_PIPELINED behind the first are
    answered in turn, the rest are never parsed into request state, and the connection
    closes after the last answer."""
    n = http1.MAX_PIPELINED + 40
    wire = b"".join(b"GET /len?i=%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(n))
    async with serve(echo, SETTINGS) as url:
        got = await exchange(url, [wire])
    answers = got.count(b"HTTP/1.1 200 OK")
    assert answers == 1 + http1.MAX_PIPELINED
    assert got.rstrip().endswith(b"}") and b"connection: close" in got.split(b"HTTP/1.1 200 OK")[-1]


async def test_a_bare_crlf_after_an_answer_gets_the_head_deadline():
    """llhttp skips CRLF between messages without beginning one, and the keep-alive timer
    stopped at any byte: a connection kept to one answer, then a bare CRLF, had no deadline
    left. Now any byte after an answer starts the head's deadline."""
    from prefill_gate.proxy.settings import load_settings

    quick = load_settings({"upstreams": ["http://u.test"], "client_header_timeout": 0.5,
                           "client_idle_timeout": 0.3}, environ={})
    async with serve(echo, quick) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"GET /len HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(re.search(rb"content-length: (\d+)", head).group(1))
        await reader.readexactly(length)  # the whole first answer
        writer.write(b"\r\n")
        t0 = asyncio.get_running_loop().time()
        rest = await asyncio.wait_for(reader.read(-1), 5)
        waited = asyncio.get_running_loop().time() - t0
        writer.close()
    assert rest.startswith(b"HTTP/1.1 408") and b"client_header_timeout" in rest
    assert 0.4 < waited < 2.0


async def test_a_body_that_trickles_gets_408_and_one_that_flows_does_not():
    """A head, then its body a byte at a time: 408 once client_body_timeout passes (the app
    hears its client is gone; nothing of the body reaches it whole). A large body arriving
    steadily moves the deadline on (a second per 64 KiB) and is read whole."""
    from prefill_gate.proxy.settings import load_settings

    heard = []

    async def reads(scope, receive, send):
        if scope["type"] != "http":
            return
        size = 0
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                heard.append("disconnect")
                return
            size += len(m["body"])
            if not m["more_body"]:
                break
        heard.append(size)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    quick = load_settings({"upstreams": ["http://u.test"], "client_body_timeout": 0.5}, environ={})
    async with serve(reads, quick) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        t0 = asyncio.get_running_loop().time()
        with contextlib.suppress(ConnectionError):
            for _ in range(40):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.05)
                if reader.at_eof() or reader._buffer:
                    break
        answer = await asyncio.wait_for(reader.read(-1), 5)
        waited = asyncio.get_running_loop().time() - t0
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"client_body_timeout" in answer
        assert 0.4 < waited < 1.5 and heard == ["disconnect"]
        heard.clear()
        body = b"y" * (1 << 20)  # 1 MiB over ~1.6 s: past 0.5 s, but each 64 KiB adds a second
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 1 << 16):
            writer.write(body[i:i + (1 << 16)])
            await writer.drain()
            await asyncio.sleep(0.1)
        answer = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and heard == [len(body)]


async def test_an_answer_status_that_is_not_http_gets_a_500_not_a_dropped_connection():
    async def odd(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 1000, "headers": []})

    async with serve(odd, SETTINGS) as url:
        got = await exchange(url, [b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"])
    assert got.startswith(b"HTTP/1.1 500")


async def test_idle_connections_close_and_the_limit_answers_503():
    state = make_state(client_idle_timeout=0.2, max_client_connections=16)
    async with serve(echo, state.settings) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        writer.write(b"GET /len HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(-1), 2)  # answered, then closed when idle
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200")
        held = [await asyncio.open_connection("127.0.0.1", _port(url)) for _ in range(16)]
        answer = await exchange(url, [b"GET /len HTTP/1.1\r\nhost: x\r\n\r\n"])
        assert answer.startswith(b"HTTP/1.1 503")
        for _, w in held:
            w.close()


async def test_shutdown_closes_idle_connections_and_ends_the_answer_under_way():
    release = asyncio.Event()

    async def slow(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await release.wait()
        await send({"type": "http.response.body", "body": b"done", "more_body": False})

    from prefill_gate.proxy.listener import server_config

    config = server_config(slow, SETTINGS, log_level="warning", host="127.0.0.1", port=0)
    server = uvicorn.Server(config)
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    idle = await asyncio.open_connection("127.0.0.1", port)
    busy = await asyncio.open_connection("127.0.0.1", port)
    busy[1].write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(busy[0].readuntil(b"\r\n\r\n"), 5)
    server.should_exit = True
    assert await asyncio.wait_for(idle[0].read(-1), 2) == b""  # closed, unanswered
    release.set()
    rest = await asyncio.wait_for(busy[0].read(-1), 5)
    assert rest == b"4\r\ndone\r\n0\r\n\r\n"  # the answer whole, then the connection closed
    await asyncio.wait_for(task, 5)
    sock.close()
    for _, w in (idle, busy):
        w.close()


# ------------------------------------------------------------------ connection lifetime, against uvicorn's
async def _lifetime(url: str, pieces: list[bytes], close_after_s: float | None, wait_s: float) -> tuple[bytes, str]:
    """Send ``pieces``; then close our side after ``close_after_s`` (None: never), and read for
    ``wait_s``. Returns (what came back, how the connection ended: "server" closed it, or
    "open" when it was still open when we stopped reading)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    for piece in pieces:
        writer.write(piece)
    await writer.drain()
    got, ended = b"", "open"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    closed_ours = close_after_s is None
    close_at = loop.time() + (close_after_s or 0)
    try:
        while loop.time() < deadline:
            if not closed_ours and loop.time() >= close_at:
                writer.close()
                closed_ours = True
                break
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.05)
            except asyncio.TimeoutError:
                continue
            if not data:
                ended = "server"
                break
            got += data
    finally:
        writer.close()
    return normal(got), ended


async def test_connection_lifetime_matches_uvicorns_where_it_should():
    """Beyond the bytes (the differential test above), when a connection ends: kept alive and
    then closed when idle, closed after an answer that asks for it, and a client's leaving
    mid-answer told to the app, alike in both protocols."""
    lost = {"theirs": asyncio.Event(), "ours": asyncio.Event()}

    def streams(side: str):
        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            if scope["path"] != "/stream":
                return await echo(scope, receive, send)
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            if (await receive())["type"] == "http.disconnect":  # until the client leaves
                lost[side].set()

        return app

    # Both keep an idle connection 5 s: uvicorn's default and client_idle_timeout's.
    assert SETTINGS.client_idle_timeout == uvicorn.Config(app=None).timeout_keep_alive == 5
    get = b"GET /len HTTP/1.1\r\nhost: x\r\n\r\n"
    async with serve(streams("theirs"), plain=True) as theirs, serve(streams("ours"), SETTINGS) as ours:
        for pieces, close_after, wait in [
            ([get], None, 6.0),  # kept alive, then closed when idle
            ([b"GET /close HTTP/1.1\r\nhost: x\r\n\r\n"], None, 2.0),  # the answer says close
            ([get.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")], None, 2.0),  # the request says close
            ([b"GET /len HTTP/1.0\r\nhost: x\r\n\r\n"], None, 2.0),  # HTTP/1.0
            ([b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n"], 0.3, 1.0),  # the client leaves mid-answer
        ]:
            results = {}
            for side, url in (("theirs", theirs), ("ours", ours)):
                results[side] = await _lifetime(url, pieces, close_after, wait)
            assert results["ours"] == results["theirs"], (pieces, results)
        for event in lost.values():  # both apps heard the client leave
            await asyncio.wait_for(event.wait(), 2)
