"""What an attacker found (issue 26), each as a regression test that fails without its fix."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from conftest import CHAT, UPSTREAM, chat, hold_stream, make_state, proxy_client, serve
from prefill_gate.proxy.app import build_state, create_app
from prefill_gate.proxy.prefix_memory import PER_REQUEST, PrefixMemory, prefix_hashes
from prefill_gate.proxy.relay import SSESplitter
from prefill_gate.proxy.settings import SettingsError, load_settings
from test_fasthttp import HEAD_SSE, Server, chunk, read_request

from prefill_gate.proxy.errors import UpstreamProtocolError


# ------------------------------------------------- one request freezes the proxy
def tiny_messages(n: int) -> bytes:
    return b'{"model":"m","max_tokens":1,"messages":[' + b",".join([b"{}"] * n) + b"]}"


@pytest.mark.parametrize("body", [
    tiny_messages(1_000_000),  # 3 MB: 6.8 s of CPU and /health blocked 5.9 s before the fix
    tiny_messages(5_000),  # under the container bound, over max_messages
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":' + b"[" * 150_000 + b"]" * 150_000 + b"}",
])
async def test_bodies_built_to_be_slow_are_refused_in_bounded_time(fake, body):
    async with proxy_client(fake) as (c, _):
        cpu = time.process_time()
        r = await c.post(CHAT, content=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert time.process_time() - cpu < 0.5
        assert not fake.bodies  # nothing reached the upstream


async def test_a_hostile_body_does_not_stall_other_clients():
    """Real sockets: while the worst body that fits under max_body_bytes is answered, /health
    keeps answering within a bound (the parse of 16 MiB is the only work left on the loop).
    The cycle collector runs as `prefill-gate serve` runs it (``collector.manage``: the
    startup heap frozen, full collections deferred): here the heap is the whole test
    suite's (torch, vLLM; a full collection with vLLM imported alone took 0.25 s on the
    2-core VM), and one such collection during the poll (a fresh-clone CI run: /health
    waited 0.51 s) is a stall of this process that no serving proxy has."""
    import gc

    from prefill_gate.proxy import collector

    stop_collector = collector.manage(lambda: True)
    try:
        await _hostile_bodies_beside_health()
    finally:
        stop_collector()
        gc.unfreeze()


async def _hostile_bodies_beside_health():
    from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig
    from prefill_gate.proxy.sim.server import create_sim_app

    engine = Engine(EngineConfig(), CostModel(base=0.005))
    async with serve(create_sim_app(engine)) as sim_url:
        state = build_state(load_settings({"upstreams": [sim_url]}, environ={}), registry=CollectorRegistry())
        async with serve(create_app(state, health_checks=False)) as url, httpx.AsyncClient(timeout=30) as c:
            worst = [
                tiny_messages(5_400_000),  # 16.2 MB of empty messages
                json.dumps({"model": "sim", "messages": [{"role": "user", "content": "ab"}] * 4096}).encode(),
                json.dumps({"model": "sim", "messages": [{"role": "user", "content": "{" * 15_000_000}]}).encode(),
            ]
            for body in worst:
                gap = await _health_gap_during(c, url, [c.post(url + CHAT, content=body)], answers=(200, 400))
                assert gap < 0.5, (len(body), gap)


def many_parts(n: int) -> bytes:
    """A chat body of one message in ``n`` content parts: the most JSON containers a byte that a
    client can send under max_json_containers, the slowest body the proxy still reads."""
    parts = b",".join([b'{"type":"text","text":"a"}'] * n)
    return b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[' + parts + b"]}]}"


async def test_a_slow_body_is_read_off_the_event_loop():
    """The slowest accepted body (190,000 content parts, ~0.2 s to read here) is read in a body
    reader process, so /health answers beside it in a fraction of that. Measured against the
    body's own inline reading time on this machine, and checked both ways: with
    ``body_workers: 0`` (every body read on the loop) the same probe must see the stall, so a
    change that moves reading back onto the loop fails here. The upstream refuses connections:
    nothing else parses the body in this process."""
    import gc

    from prefill_gate.proxy import collector
    from prefill_gate.proxy.bodies import BodyOptions, read

    raw = many_parts(190_000)
    inline_s = min(_seconds(lambda: read(raw, BodyOptions("chat"))) for _ in range(2))
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    dead = f"http://127.0.0.1:{refused.getsockname()[1]}"
    worst = {}
    stop_collector = collector.manage(lambda: True)
    try:
        for workers in (2, 0):
            settings = load_settings({"upstreams": [dead], "body_workers": workers}, environ={})
            state = build_state(settings, registry=CollectorRegistry())
            async with serve(create_app(state, health_checks=False)) as url, httpx.AsyncClient(timeout=30) as c:
                await c.post(url + CHAT, content=raw)  # the readers start with the first big body
                worst[workers] = await _health_gap_during(c, url, [c.post(url + CHAT, content=raw) for _ in range(3)])
    finally:
        stop_collector()
        gc.unfreeze()
        refused.close()
    assert worst[0] >= 0.6 * inline_s, (worst, inline_s)  # the probe sees a read on the loop ...
    assert worst[2] < 0.5 * inline_s, (worst, inline_s)  # ... and there is none with readers


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def _health_gap_during(c, url, requests, answers=(502, 503)) -> float:
    """The longest time between two /health answers (asked every 5 ms) while ``requests`` run
    in turn. Between answers, not a request's round trip: a stall of the loop while the
    poller sleeps shows up too (timing round trips alone missed a 0.3 s stall in 1 of 5 runs)."""
    done, gaps = asyncio.Event(), []

    async def poll():
        last = time.monotonic()
        while not done.is_set():
            assert (await c.get(url + "/health")).status_code == 200
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            await asyncio.sleep(0.005)

    poller = asyncio.create_task(poll())
    for request in requests:
        r = await request
        assert r.status_code in answers, r.text
    done.set()
    await poller
    return max(gaps)


def test_prefix_memory_takes_only_a_requests_last_prefixes():
    mem = PrefixMemory(["u"], capacity=1000)
    mem.remember("u", prefix_hashes([{"i": 0}]), [10])
    many = [{"i": i} for i in range(5000)]
    mem.remember("u", prefix_hashes(many), list(range(5000)))
    assert len(mem) == 1 + PER_REQUEST  # one huge request cannot flush the others
    assert mem.longest(prefix_hashes([{"i": 0}, {"q": 1}])) is not None


# ---------------------------------------------- the gate bypassed by a path spelling
async def raw_request(app, method: str, raw_path: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request straight into the ASGI app with this exact path, as uvicorn would hand it
    over (``path`` percent-decoded, ``raw_path`` as sent): HTTP clients normalise dot
    segments before sending, an attacker's raw socket does not."""
    from urllib.parse import unquote

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": unquote(raw_path.decode("latin-1")), "raw_path": raw_path,
             "query_string": b"", "root_path": "", "server": ("proxy", 80), "client": ("1.2.3.4", 5),
             "headers": [(b"host", b"proxy"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent = [{"type": "http.request", "body": body, "more_body": False}]
    out = {"status": 0, "body": b""}
    done = asyncio.Event()

    async def receive():
        if sent:
            return sent.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")
            if not msg.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return out["status"], out["body"]


@pytest.mark.parametrize("path", [
    b"/v1/./chat/completions", b"/v1/%2e/chat/completions", b"/v1/%2E%2E/v1/chat/completions",
    b"/v1/../health", b"/v1/x/../../reset_prefix_cache", b"/v1//chat/completions", b"/v1/chat%2fcompletions",
    b"/v1/chat/completions/", b"/v1/completions/", b"/v1/chat%00/completions", b"/v1/a%5c..%5cmetrics",
])
async def test_no_spelling_of_a_path_reaches_around_the_gate(fake, path):
    async with proxy_client(fake) as (_, state):
        app = create_app(state, health_checks=False)
        status, body = await raw_request(app, "POST", path, json.dumps(chat("x" * 40_000, stream=True)).encode())
    assert status in (400, 404) and "error" in json.loads(body)
    assert not fake.requests


@pytest.mark.parametrize("char", [chr(c) for c in range(0x20)] + ["\x7f"])
def test_a_control_character_anywhere_in_the_path_is_refused(char):
    from prefill_gate.proxy.app import path_refusal

    for path in (f"/v1/chat/completions{char}", f"/v1/{char}chat/completions", f"{char}/health"):
        refused = path_refusal(path, path.encode())
        assert refused is not None and refused.status == 400, repr(path)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models/caf\u00e9", "/v1/a~b-c_d", "/\x80\xa0"])
def test_a_canonical_path_is_not_refused(path):
    from prefill_gate.proxy.app import path_refusal

    assert path_refusal(path, path.encode("utf-8")) is None


SEGMENTS = ["v1", "chat", "completions", "models", "tokenize", ".", "..", "%2e", "%2E", "%2f", "", "%00", "a"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=6), st.sampled_from(["GET", "POST", "DELETE"]))
async def test_any_path_is_gated_passed_canonically_or_refused(parts, method):
    from conftest import FakeVLLM

    fake = FakeVLLM()
    path = ("/" + "/".join(parts)).encode()
    async with proxy_client(fake) as (_, state):
        status, _ = await raw_request(create_app(state, health_checks=False), method, path,
                                      json.dumps(chat("hi")).encode())
    assert status < 500
    for req in fake.requests:
        sent = req.url.raw_path.split(b"?")[0]
        assert sent == path, (path, sent)  # exactly what the client asked for
        assert not any(seg in (b".", b"..") or b"%" in seg for seg in sent.split(b"/"))
        if sent in (b"/v1/chat/completions", b"/v1/completions"):
            assert method == "POST"  # through the gate


async def test_the_frameworks_own_errors_are_openai_shaped(fake):
    async with proxy_client(fake) as (c, _):
        r = await c.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# ------------------------------------------------- clients steering their class
async def test_a_client_cannot_declare_itself_interactive_by_default(fake):
    async with proxy_client(fake, large_prefill_tokens=1000) as (c, state):
        b = await hold_stream(c, fake)
        held = asyncio.create_task(c.post(CHAT, json=chat("x" * 40_000), headers={"x-prefill-gate-class": "interactive"}))
        await asyncio.sleep(0.1)
        assert state.policy.queue_depth == 1  # held, header or not
        fake.release.set()
        await asyncio.gather(b, held)
    fake.release.clear()
    async with proxy_client(fake, large_prefill_tokens=1000, class_header="any") as (c, state):
        b = await hold_stream(c, fake)
        r = await c.post(CHAT, json=chat("x" * 40_000), headers={"x-prefill-gate-class": "interactive"})
        assert r.status_code == 200 and state.policy.queue_depth == 0  # trusted clients may
        fake.release.set()
        await b


# ------------------------------------------------------------ 500s on bad bytes
@pytest.mark.parametrize("raw", [
    b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
    b'{"model":"m","messages":[{"role":"\\udfff","content":"x"}]}',
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":' + b"[" * 990 + b"]" * 990 + b"}",
    b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + b"[" * 5000 + b"]" * 5000 + b"}",
])
async def test_bad_bytes_are_a_400_not_a_500(fake, raw):
    async with proxy_client(fake) as (c, _):
        r = await c.post(CHAT, content=raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


def nested(depth: int) -> bytes:
    return b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":' + b"[" * depth + b"]" * depth + b"}"


async def test_json_depth_is_a_setting(fake):
    async with proxy_client(fake) as (c, _):
        assert (await c.post(CHAT, content=nested(100))).status_code == 200
        r = await c.post(CHAT, content=nested(200))
        assert r.status_code == 400 and "max_json_depth" in r.json()["error"]["message"]
    async with proxy_client(fake, max_json_depth=300) as (c, _):
        assert (await c.post(CHAT, content=nested(200))).status_code == 200


async def test_a_header_byte_over_0x7f_passes_through(fake):
    async with proxy_client(fake) as (c, _):
        r = await c.post(CHAT, json=chat("hi"), headers={"x-note": "caf\xe9".encode("latin-1")})
        assert r.status_code == 200
        assert fake.requests[-1].headers.raw[-1] == (b"x-note", b"caf\xe9") or \
            (b"x-note", b"caf\xe9") in fake.requests[-1].headers.raw


# ---------------------------------------------------------- a hostile upstream
def test_an_event_that_never_ends_is_bounded_and_linear():
    s = SSESplitter(limit=4 * 1024 * 1024)
    t = time.process_time()
    with pytest.raises(UpstreamProtocolError):
        for _ in range(100_000):  # 1 KiB at a time, never a blank line: quadratic took minutes
            s.feed(b"data: " + b"x" * 1018)
    assert time.process_time() - t < 2.0
    s = SSESplitter()
    for _ in range(2000):
        assert s.feed(b"x" * 1000) == []
    assert s.feed(b"\n\n")[0].endswith(b"x\n\n")


@pytest.mark.parametrize("kind", ["endless_event", "huge_json", "many_headers", "drip"])
async def test_a_hostile_upstream_gets_a_bounded_answer(kind):
    async def handler(reader, writer, srv):
        await read_request(reader)
        if kind == "endless_event":
            writer.write(HEAD_SSE)
            while True:
                writer.write(chunk(b"x" * 65536))
                await writer.drain()
        elif kind == "huge_json":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            while True:
                writer.write(chunk(b" " * 65536))
                await writer.drain()
        elif kind == "many_headers":
            writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(100_000)) + b"\r\n")
            await writer.drain()
        else:  # one byte of a never-ending event every 0.2 s: never silent past read_timeout
            writer.write(HEAD_SSE)
            while True:
                writer.write(chunk(b"x"))
                await writer.drain()
                await asyncio.sleep(0.2)

    async with Server(handler) as srv:
        settings_ = {"upstreams": [srv.url], "max_upstream_event_bytes": 1 << 20,
                     "max_upstream_body_bytes": 4 << 20, "max_request_seconds": 2.0}
        state = build_state(load_settings(settings_, environ={}), registry=CollectorRegistry())
        app = create_app(state, health_checks=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p", timeout=30) as c:
            t = time.monotonic()
            r = await c.post(CHAT, json=chat("hi", stream=kind != "huge_json"))
            took = time.monotonic() - t
        assert took < 5.0
        if r.status_code == 200:  # the stream started: it ends with an error event
            assert b'"error"' in r.content and r.content.endswith(b"data: [DONE]\n\n")
        else:
            assert r.status_code in (502, 504) and "error" in r.json()


async def test_upstream_head_bounds_are_settings():
    async def handler(reader, writer, srv):
        await read_request(reader)
        body = b'{"choices":[]}'
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(40))
                     + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async with Server(handler) as srv:
        for limit, status in ((None, 200), (16, 502)):
            extra = {} if limit is None else {"max_upstream_headers": limit}
            state = build_state(load_settings({"upstreams": [srv.url], **extra}, environ={}),
                                registry=CollectorRegistry())
            app = create_app(state, health_checks=False)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
                r = await c.post(CHAT, json=chat("hi", stream=False))
            assert r.status_code == status, (limit, r.text)
            await state.client.aclose()


async def test_an_unsolicited_answer_on_a_pooled_connection_reaches_nobody():
    async def handler(reader, writer, srv):
        n = 0
        while True:
            await read_request(reader)
            n += 1
            body = b'{"n":%d}' % n
            answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            writer.write(answer)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{"n":666}')  # nobody asked
            await writer.drain()

    from prefill_gate.proxy.fasthttp import FastTransport

    async with Server(handler) as srv:
        async with httpx.AsyncClient(transport=FastTransport(), timeout=5) as c:
            first = await c.post(srv.url, content=b"{}")
            await asyncio.sleep(0.2)
            second = await c.post(srv.url, content=b"{}")
        assert first.json() == {"n": 1} and second.json() == {"n": 1}  # a fresh connection
        assert srv.connections == 2


# ------------------------------------------------------------------ the rest
def test_upstream_urls_with_credentials_are_refused():
    with pytest.raises(SettingsError, match="credentials"):
        load_settings({"upstreams": ["http://user:secret@vllm:8000"]}, environ={})


async def test_queued_bodies_are_bounded_in_bytes(fake):
    async with proxy_client(fake, large_prefill_tokens=1000, max_queued_bytes=100_000) as (c, state):
        b = await hold_stream(c, fake)
        first = asyncio.create_task(c.post(CHAT, json=chat("x" * 60_000)))
        await asyncio.sleep(0.1)
        r = await c.post(CHAT, json=chat("y" * 60_000))
        assert r.status_code == 429 and "max_queued_bytes" in r.json()["error"]["message"]
        fake.release.set()
        await asyncio.gather(b, first)


async def test_an_upstream_redirect_does_not_leak_its_address(fake):
    from conftest import response

    async def redirecting(request):
        if request.url.path == "/v1/models":
            return response(307, {"moved": True}, headers={"location": UPSTREAM + "/v1/models/"})
        return await fake(request)

    async with proxy_client(redirecting) as (c, _):
        r = await c.get("/v1/models")
        assert r.status_code == 307 and r.headers["location"] == "/v1/models/"


def test_logs_keep_no_query_strings_and_no_tracebacks_for_bad_http():
    import logging

    from prefill_gate.proxy.cli import _one_line_for_bad_http, _strip_query

    rec = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                            ("1.2.3.4:5", "GET", "/v1/models?api_key=secret", "1.1", 200), None)
    assert _strip_query(rec) and "secret" not in rec.getMessage() and "/v1/models?..." in rec.getMessage()
    try:
        raise ValueError("bad chunk size")
    except ValueError:
        import sys

        rec = logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, "Invalid HTTP request received.", (),
                                sys.exc_info())
    assert _one_line_for_bad_http(rec) and rec.exc_info is None


# ------------------------------------------------------- slow clients on the listener
async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)  # until the server closes


async def test_slow_or_silent_request_heads_get_408_and_are_closed(fake):
    """A client that connects and sends nothing, or its headers a byte at a time, held a
    socket forever (uvicorn has no deadline for a request head)."""
    state = make_state(httpx.MockTransport(fake), client_header_timeout=0.3, client_idle_timeout=5.0)
    async with serve(create_app(state, health_checks=False), state.settings) as url:
        port = int(url.rsplit(":", 1)[1])
        silent = await asyncio.open_connection("127.0.0.1", port)
        slow = await asyncio.open_connection("127.0.0.1", port)
        head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * 40
        start = time.monotonic()
        for i in range(0, 32, 4):  # a few bytes every 20 ms, then a pause: never a complete head
            slow[1].write(head[i:i + 4])
            await asyncio.sleep(0.02)
        for reader, _ in (silent, slow):
            answer = await _read_all(reader, 2.0)
            assert answer.startswith(b"HTTP/1.1 408") and b"client_header_timeout" in answer
        assert time.monotonic() - start < 1.5
        for _, writer in (silent, slow):
            writer.close()


async def test_the_head_deadline_spares_slow_bodies_and_rearms_per_request(fake):
    state = make_state(httpx.MockTransport(fake), client_header_timeout=0.3, client_idle_timeout=5.0)
    async with serve(create_app(state, health_checks=False), state.settings) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        body = json.dumps({"model": "m", "messages": "not a list"}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 8):  # the body over ~0.6 s: past the head deadline
            await asyncio.sleep(0.1)
            writer.write(body[i:i + 8])
        answer = await asyncio.wait_for(reader.readuntil(b"}}"), 2.0)
        assert answer.startswith(b"HTTP/1.1 400")  # answered, not cut off with 408
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # the next request's head, never finished
        assert (await _read_all(reader, 2.0)).startswith(b"HTTP/1.1 408")
        writer.close()


async def test_chunked_trailers_are_not_forwarded_as_headers(fake):
    state = make_state(httpx.MockTransport(fake))
    async with serve(create_app(state, health_checks=False), state.settings) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        body = json.dumps(chat("hi", stream=False)).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\ntrailer: x-smuggled\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\nx-smuggled: yes\r\n\r\n" % (len(body), body))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
    assert head.startswith(b"HTTP/1.1 200")
    sent = fake.requests[-1].headers
    assert "x-smuggled" not in sent, dict(sent)


async def test_a_client_that_leaves_mid_body_costs_nothing_upstream(fake):
    """The body's first part, then the client is gone: no answer to send, nothing sent
    upstream, no exception out of the app (uvicorn would log a traceback per such client),
    counted as a client disconnect; a repeated header's first value is the one read."""
    async with proxy_client(fake) as (_, state):
        app = create_app(state, health_checks=False)
        body = json.dumps(chat("x" * 100, stream=True)).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "",
                 "server": ("proxy", 80), "client": ("1.2.3.4", 5),
                 "headers": [(b"host", b"proxy"), (b"content-length", str(len(body)).encode())]}
        messages = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
        sent = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
    assert not sent and not fake.requests
    assert state.metrics.registry.get_sample_value(
        "prefill_gate_requests_total", {"class": "interactive", "outcome": "client_disconnect"}) == 1


def test_client_headers_keep_order_and_a_repeated_headers_first_value():
    from prefill_gate.proxy.exchange import client_headers

    raw = [(b"a", b"1"), (b"b", b"\xe9"), (b"a", b"2"), (b"c", b"3")]
    assert list(client_headers(raw).items()) == [("a", "1"), ("b", "\xe9"), ("c", "3")]
    assert client_headers([]) == {}


@pytest.mark.parametrize("path", ["fast", "httpx"])
async def test_an_upstream_header_over_0x7f_passes_byte_exact(fake, path):
    """An answer's header bytes reach the client as sent: a UTF-8 value (here a euro sign,
    outside latin-1) was decoded by httpx's guess and re-encoded as latin-1, which raised
    (the request failed) or changed the bytes."""
    value = "price \u20ac5 caf\xe9".encode()
    if path == "fast":  # the gated POST over FastTransport: a real socket upstream
        async def handler(reader, writer, srv):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-note: " + value
                         + b"\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b'data: {"choices":[]}\n\n')
                         + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

        async with Server(handler) as srv:
            state = build_state(load_settings({"upstreams": [srv.url]}, environ={}), registry=CollectorRegistry())
            app = create_app(state, health_checks=False)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
                r = await c.post(CHAT, json=chat("hi", stream=True))
        state.bodies.close()
    else:  # a passthrough GET over httpx's client
        from conftest import response

        async def noted(request):
            if request.url.path == "/v1/models":
                return response(200, {"data": []}, headers={"x-note": value})
            return await fake(request)

        async with proxy_client(noted) as (c, _):
            r = await c.get("/v1/models")
    assert r.status_code == 200 and (b"x-note", value) in r.headers.raw


# ------------------------------------------------------------------ hostile upstream wires, end to end
async def _through_proxy(answer: bytes, method: str, path: str, body: dict | None = None):
    """The proxy (its own listener, compiled relay where built) in front of a raw upstream
    that answers every request with ``answer`` and closes; one client request through it.
    Returns (status or the client's error, headers, body)."""

    async def handler(reader, writer, srv):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with Server(handler) as srv:
        state = build_state(load_settings({"upstreams": [srv.url]}, environ={}), registry=CollectorRegistry())
        async with serve(create_app(state, health_checks=False)) as url, httpx.AsyncClient(timeout=10) as c:
            try:
                r = await c.request(method, url + path, json=body)
            except httpx.HTTPError as exc:
                return exc, None, None
            return r.status_code, r.headers, r.content


async def test_a_passthrough_answer_cut_short_reaches_the_client_broken_not_complete():
    """The upstream promises 1000 bytes, sends 10 and closes: the client must see a broken
    answer (here: a chunked body without its end), never a complete 200."""
    status, _, _ = await _through_proxy(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                        b"content-length: 1000\r\n\r\n" + b"0123456789", "GET", "/v1/models")
    assert isinstance(status, httpx.RemoteProtocolError), status
    # Read whole before the answer begins (a gated non-streaming request): an error answer.
    status, _, body = await _through_proxy(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                           b"content-length: 1000\r\n\r\n" + b"0123456789", "POST", CHAT, chat())
    assert status == 502 and json.loads(body)["error"]["type"]


async def test_upstream_trailer_fields_never_become_the_clients_headers():
    wire = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunk(b'{"id": "x", "choices": []}') + b"0\r\nset-cookie: session=evil\r\nlocation: /evil\r\n\r\n")
    for method, path, body in (("POST", CHAT, chat()), ("GET", "/v1/models", None)):
        status, headers, got = await _through_proxy(wire, method, path, body)
        assert status == 200 and json.loads(got)["id"] == "x"
        assert "set-cookie" not in headers and "location" not in headers, (path, headers)


@pytest.mark.parametrize("status", [b"000", b"999"])
async def test_an_upstream_status_outside_100_599_is_a_502(status, caplog):
    wire = b"HTTP/1.1 " + status + b" Odd\r\ncontent-length: 2\r\n\r\n{}"
    for method, path, body in (("POST", CHAT, chat()), ("GET", "/v1/models", None)):
        got, _, answer = await _through_proxy(wire, method, path, body)
        assert got == 502 and "broke the connection" in json.loads(answer)["error"]["message"], (path, answer)
    assert "Exception in ASGI application" not in caplog.text


async def test_headers_the_client_names_in_connection_stay_on_its_hop(fake):
    """RFC 9110 7.6.1: what Connection lists is hop-by-hop; so are HTTP2-Settings and Expect
    (the listener answers 100-continue itself)."""
    async with proxy_client(fake) as (c, _):
        r = await c.post(CHAT, json=chat(), headers={"connection": "keep-alive, X-Secret, x-other",
                                                     "x-secret": "s", "X-Other": "o", "x-kept": "k",
                                                     "http2-settings": "AAMAAABkAAQAoAAAAAIAAAAA",
                                                     "expect": "100-continue"})
        assert r.status_code == 200
    sent = {k.lower() for k in fake.requests[-1].headers}
    assert "x-kept" in sent
    assert not sent & {"x-secret", "x-other", "http2-settings", "expect", "connection"}
