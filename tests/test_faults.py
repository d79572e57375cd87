"""Faults against real processes: the upstream dies mid-stream and comes back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from prefill_gate.proxy.bench.services import Service
from tests.conftest import CHAT, stream_events

pytestmark = pytest.mark.slow


async def test_upstream_killed_mid_stream_then_back_without_a_proxy_restart():
    sim = Service("sim", name="sim")
    port = sim.port
    try:
        with Service("serve", "--upstream", sim.url, "--health-interval", "0.2", "--log-level", "warning",
                     name="proxy") as proxy:
            started = asyncio.Event()
            task = asyncio.create_task(stream_events(proxy.url, 3000, started=started))
            await asyncio.wait_for(started.wait(), 10)
            sim.kill()  # SIGKILL: the connection drops mid-stream
            events = await asyncio.wait_for(task, 10)
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2][5:])["error"]
            assert error["type"] == "server_error" and error["code"] == "upstream_protocol_error"

            async with httpx.AsyncClient(timeout=10) as c:
                await asyncio.sleep(0.6)  # a health check or two fail
                health = (await c.get(proxy.url + "/health")).json()
                assert health["upstreams"][sim.url]["healthy"] is False
                assert (await c.get(proxy.url + "/ready")).status_code == 503  # load balancers: take me out
                down = await c.post(proxy.url + CHAT, json={"model": "sim", "messages": [
                    {"role": "user", "content": "anyone?"}], "max_tokens": 4})
                assert down.status_code == 502 and down.json()["error"]["code"] == "upstream_unavailable"

                sim = Service("sim", name="sim", port=port)  # the upstream returns on its address
                for _ in range(50):
                    if (await c.get(proxy.url + "/health")).json()["upstreams"][sim.url]["healthy"]:
                        break
                    await asyncio.sleep(0.1)
                events = await stream_events(proxy.url, 20)
                assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events)
                health = (await c.get(proxy.url + "/health")).json()
                up = health["upstreams"][sim.url]
                assert up["healthy"] and up["live_decodes"] == 0 and up["active"] == 0
                assert (await c.get(proxy.url + "/ready")).status_code == 200
                assert health["queue_depth"] == 0
    finally:
        sim.stop()


async def _maybe_abandon(c: httpx.AsyncClient, url: str, rng, stats: dict) -> None:
    large = rng.random() < 0.2
    content = ("x" * 12_000) if large else "hi " * rng.randint(1, 30)
    body = {"model": "sim", "stream": rng.random() < 0.8, "max_tokens": rng.randint(1, 200), "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}
    abandon_after = rng.choice([None, 0.0, 0.005, 0.02, 0.1, 0.3])  # None: read to the end
    async def read() -> None:
        async with c.stream("POST", url + CHAT, json=body) as r:
            async for _ in r.aiter_raw():
                pass
            stats[r.status_code] = stats.get(r.status_code, 0) + 1

    try:
        await asyncio.wait_for(read(), abandon_after)  # None: no deadline (asyncio.timeout is 3.11+)
    except asyncio.TimeoutError:
        stats["abandoned"] = stats.get("abandoned", 0) + 1  # the client went away mid-request


async def test_thousand_requests_with_random_disconnects_leak_nothing():
    import random

    rng = random.Random(4)
    stats: dict = {}
    with Service("sim", "--time-scale", "0.2", name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--large-prefill-tokens", "2000", "--max-queue-wait", "5",
                    "--log-level", "warning", name="proxy") as proxy:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=30, limits=limits) as c:
            sem = asyncio.Semaphore(48)

            async def one():
                async with sem:
                    await _maybe_abandon(c, proxy.url, rng, stats)

            await asyncio.gather(*(one() for _ in range(1000)))
            await asyncio.sleep(0.5)  # the last aborts reach the upstream
            health = (await c.get(proxy.url + "/health")).json()
            metrics = (await c.get(sim.url + "/metrics")).text
            proxy_metrics = (await c.get(proxy.url + "/metrics")).text
    up = health["upstreams"][sim.url]
    assert health["queue_depth"] == 0 and up["live_decodes"] == 0 and up["active"] == 0
    assert up["large_prefills_in_flight"] == 0
    running = [ln for ln in metrics.splitlines() if ln.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))]
    assert running and all(float(ln.split()[-1]) == 0 for ln in running)  # no orphaned upstream request
    assert stats.get("abandoned", 0) > 300 and stats.get(200, 0) > 100
    assert set(stats) <= {200, "abandoned"}, stats  # no 5xx from the proxy
    disconnects = sum(float(ln.split()[-1]) for ln in proxy_metrics.splitlines()
                      if ln.startswith("prefill_gate_requests_total{") and 'outcome="client_disconnect"' in ln)
    assert disconnects > 0


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def test_five_thousand_idle_connections_keep_memory_bounded():
    import socket

    with Service("sim", name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--log-level", "warning", name="proxy") as proxy:
        before = _rss_bytes(proxy.proc.pid)
        socks = []
        try:
            for _ in range(5000):
                s = socket.create_connection(("127.0.0.1", proxy.port))
                socks.append(s)
            await asyncio.sleep(1.0)  # the proxy accepts them all
            grown = _rss_bytes(proxy.proc.pid) - before
            async with httpx.AsyncClient(timeout=10) as c:  # and still serves
                r = await c.post(proxy.url + CHAT, json={"model": "sim", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200
        finally:
            for s in socks:
                s.close()
    assert grown < 200 * 1024 * 1024, f"{grown / 2**20:.0f} MiB for 5,000 idle connections"


async def test_a_client_that_stops_reading_does_not_stall_other_streams():
    import socket
    import time

    # A fast engine (steps 50x shorter): the stuck stream produces megabytes a second, far
    # past what the sockets buffer, so the proxy's relay of it must wait on flow control.
    with Service("sim", "--time-scale", "0.02", name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--log-level", "warning", name="proxy") as proxy:
        # A streaming request whose client never reads: tiny receive buffer, 20k tokens.
        body = json.dumps({"model": "sim", "stream": True, "max_tokens": 100_000, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", proxy.port))
        stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            await asyncio.sleep(2.0)  # its relay backs up against the socket
            before, made = _rss_bytes(proxy.proc.pid), _generated(sim.url)
            started = time.monotonic()
            events = await stream_events(proxy.url, 300)
            took = time.monotonic() - started
            chunk = min(len(e) for e in events if e.startswith(b"data: {"))
            deadline = time.monotonic() + 20
            while (_generated(sim.url) - made) * chunk < 4 * BOUND and time.monotonic() < deadline:
                await asyncio.sleep(0.5)  # a window long enough to tell
            grown = _rss_bytes(proxy.proc.pid) - before
            made = _generated(sim.url) - made
        finally:
            stuck.close()
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events)
    assert took < 5.0  # not held behind the stuck reader
    # What a relay that buffered without bound would have held over the window: every chunk
    # the engine made for the stuck stream meanwhile. The test can only pass by flow control
    # if that is far over the bound.
    unbounded = made * chunk
    assert unbounded >= 4 * BOUND, f"only {unbounded / 2**20:.1f} MiB made: the window tells nothing"
    assert grown < BOUND, f"{grown / 2**20:.1f} MiB grown while {unbounded / 2**20:.0f} MiB were made"


BOUND = 1024 * 1024  # the stuck stream's share of the proxy's memory (measured: ~50 KiB)


def _generated(url: str) -> float:
    """The simulator's vllm:generation_tokens (every token made, read or not)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no vllm:generation_tokens_total")


async def _tcp_server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_garbage_or_silent_upstream_process_gives_502_and_504():
    async def garbage(reader, writer):
        await reader.read(65536)
        writer.write(b"\x00\x01 this is not HTTP at all\r\n\r\n")
        await writer.drain()
        writer.close()

    done = asyncio.Event()

    async def silent(reader, writer):
        await reader.read(65536)
        await done.wait()  # accepts, reads, never answers
        writer.close()

    garbage_server, garbage_url = await _tcp_server(garbage)
    silent_server, silent_url = await _tcp_server(silent)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with Service("serve", "--upstream", garbage_url, "--log-level", "warning", name="p1") as p1, \
                Service("serve", "--upstream", silent_url, "--read-timeout", "0.5", "--log-level", "warning",
                        name="p2") as p2:
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(p1.url + CHAT, json=body)
                assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_protocol_error"
                r = await c.post(p2.url + CHAT, json=body)
                assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
                for p in (p1, p2):  # nothing held afterwards
                    health = (await c.get(p.url + "/health")).json()
                    assert health["queue_depth"] == 0
                    assert all(u["active"] == 0 for u in health["upstreams"].values())
    finally:
        done.set()
        garbage_server.close()
        silent_server.close()
        await asyncio.sleep(0.05)


def _blackhole():
    """A listener that never accepts, its one-slot backlog already taken: a connect to it
    hangs (the kernel drops the SYNs), as to an upstream host that is down or overloaded."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    fillers = []
    for _ in range(3):  # take the backlog (the kernel admits backlog + 1)
        f = socket.socket()
        f.setblocking(False)
        try:
            f.connect(sock.getsockname())
        except BlockingIOError:
            pass
        fillers.append(f)
    return sock, fillers, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_an_upstream_slow_to_connect_gives_502_in_time_or_the_next_upstream():
    sock, fillers, hole = _blackhole()
    sim = Service("sim", name="sim")
    body = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with Service("serve", "--upstream", hole, "--connect-timeout", "0.3", "--health-interval", "60",
                     "--log-level", "warning", name="p1") as p1, \
                Service("serve", "--upstream", hole, "--upstream", sim.url, "--connect-timeout", "0.3",
                        "--health-interval", "60", "--log-level", "warning", name="p2") as p2:
            async with httpx.AsyncClient(timeout=10) as c:
                t0 = asyncio.get_running_loop().time()
                r = await c.post(p1.url + CHAT, json=body)
                waited = asyncio.get_running_loop().time() - t0
                assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
                assert 0.25 < waited < 3.0, waited  # the connect timeout, not the read timeout
                for _ in range(4):  # whichever upstream a request picks, it is answered
                    r = await c.post(p2.url + CHAT, json=body)
                    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
                for p in (p1, p2):
                    health = (await c.get(p.url + "/health")).json()
                    assert health["queue_depth"] == 0
                    assert all(u["active"] == 0 for u in health["upstreams"].values())
    finally:
        sim.stop()
        for f in fillers:
            f.close()
        sock.close()
