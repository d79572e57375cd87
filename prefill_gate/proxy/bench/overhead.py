"""The proxy's own cost: added TTFT and added per-chunk delay, side by side.

An upstream process ("stamp server") streams chunks at a fixed pace, each carrying
the moment it was written (``time.monotonic()``, one clock for every process on the
machine). The client measures, per chunk, arrival minus that stamp, and per request
the time to the first chunk; once straight at the upstream, once through a
prefill-gate process in front of it. The difference is what the proxy adds.

    prefill-gate bench overhead [--streams 1,100,500] [--tokens 64] [--proxy-cpu N]
                                [--load-procs N] [--upstream-procs N] [--json FILE]

Levels: each concurrency at a modest per-stream rate (streams tick at their own
phases), then a ramp of the total chunk rate (100 streams) to find the highest rate
at which the added p99 per-chunk delay stays <= 5 ms, then the same concurrency with
every stream's chunk in one tick (as one vLLM step emits every stream's token): there
the p99 also holds the queueing of a whole burst. By default client, upstream and proxy
share the machine's cores: the rates are what one proxy process sustains *here*, with its
load generator beside it. With ``--proxy-cpu N`` the proxy gets CPU N to itself and the
upstream and client the other CPUs: what one proxy process sustains on one core. One
load process parses ~5,000 chunks/s and one upstream process writes about as many, so
finding a proxy's limit above that takes ``--load-procs`` and ``--upstream-procs`` > 1
(processes on one listening socket; the load split evenly).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence

from .. import collector
from .report import environment, percentile, table, write_json
from .services import Service

STAMP = b'"t":'
UNPARSED_BODY_BYTES = 64 * 1024


# ---------------------------------------------------------------- the upstream
_STREAMING = [0]  # streams in progress in this process


async def stamp_app(scope, receive, send) -> None:
    """A raw ASGI app: POST .../completions streams ``max_tokens`` chunks, one every
    ``interval`` seconds (body fields), each stamped with its write time. Its full
    collections wait for a moment with no stream, as the proxy's do (a pause between a
    stamp and its write would count as the relay's delay)."""
    if scope["type"] == "lifespan":
        stop_collector = collector.manage(lambda: _STREAMING[0] > 0)
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        stop_collector()
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] != "/v1/chat/completions":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    # A big prompt is answered without being read: parsing it would stall the stamps this
    # loop writes for every other stream (bench/big_bodies.py sends megabytes).
    body = json.loads(raw) if len(raw) <= UNPARSED_BODY_BYTES else {"max_tokens": 2, "interval": 0.001}
    _STREAMING[0] += 1
    try:
        await _stream(body, send)
    finally:
        _STREAMING[0] -= 1


async def _stream(body: dict, send) -> None:
    n, interval = body.get("max_tokens", 16), body.get("interval", 0.01)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    ticks = _Ticker.get(interval) if body.get("sync") else None
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    for _ in range(n):
        if ticks is not None:
            await ticks.next()
        else:
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))
        chunk = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"t":%.9f}\n\n' % time.monotonic()
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


class _Ticker:
    """One clock per interval: every stream on it gets its chunk in the same tick, as
    every decoding request gets its token in the same vLLM step."""

    _all: dict[float, "_Ticker"] = {}

    def __init__(self, interval: float):
        self.interval = interval
        self._fut: asyncio.Future | None = None

    @classmethod
    def get(cls, interval: float) -> "_Ticker":
        if interval not in cls._all:
            cls._all[interval] = cls(interval)
        return cls._all[interval]

    def next(self) -> asyncio.Future:
        if self._fut is None or self._fut.done():
            loop = asyncio.get_running_loop()
            self._fut = loop.create_future()
            loop.call_later(self.interval, self._fire, self._fut)
        return self._fut

    @staticmethod
    def _fire(fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_result(None)


# ------------------------------------------------------------------ the client
async def _one_stream(url: str, tokens: int, interval: float, ttfts: list, delays: list, sync: bool = False,
                      arrivals: list | None = None, gaps: list | None = None) -> None:
    """One streaming request over a raw socket. Stamps are found by a byte search, so
    that the load generator costs far less than the proxy it measures. Per chunk: its delay
    (arrival minus stamp) into ``delays``, its arrival into ``arrivals``, and the time since
    this stream's previous chunk arrived (the gap a reader of the stream sees: 0 for a chunk
    that came in the same read as the one before) into ``gaps``."""
    host, port = url.split("//", 1)[1].split(":")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "interval": interval, "stream": True, "sync": sync}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    sent = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    buf = b""
    first = True
    last = None  # this stream's previous chunk's arrival
    try:
        while b"[DONE]" not in buf:
            data = await reader.read(262144)
            if not data:
                break
            now = time.monotonic()
            buf += data
            pos = 0
            while (j := buf.find(STAMP, pos)) >= 0 and (k := buf.find(b"}", j)) >= 0:
                if first:
                    ttfts.append(now - sent)
                    first = False
                delays.append(now - float(buf[j + len(STAMP):k]))
                if arrivals is not None:
                    arrivals.append(now)
                if gaps is not None and last is not None:
                    gaps.append(now - last)
                last = now
                pos = k + 1
            buf = buf[pos:]
    finally:
        writer.close()


def rounds_for(total: int, ttft_samples: int = 20) -> int:
    """How many times a level's ``total`` streams run one after another, for at least
    ``ttft_samples`` first tokens (each stream gives one)."""
    return max(1, -(-ttft_samples // total))


async def _measure_part(url: str, streams: int, tokens: int, interval: float, sync: bool, index: int,
                        procs: int, total: int, ttft_samples: int = 20) -> tuple[list, list, float, list, list]:
    """Process `index` of `procs`: its `streams` of the level's `total`, each started in its
    slot of the spread (slots interleave across processes), `rounds_for(total, ttft_samples)`
    times. Returns (TTFTs, chunk delays, wall seconds, chunk arrival times, chunk gaps)."""
    ttfts: list[float] = []
    delays: list[float] = []
    arrivals: list[float] = []
    gaps: list[float] = []
    await _one_stream(url, 2, 0.001, [], [])  # warm the path (the proxy's upstream pool)
    t0 = time.monotonic()
    # spread the starts over up to a second: concurrency, not a burst of simultaneous arrivals
    spread = min(1.0, tokens * interval / 2)

    async def staggered(k: int) -> None:
        await asyncio.sleep(spread * (index + k * procs) / total)
        await _one_stream(url, tokens, interval, ttfts, delays, sync, arrivals, gaps)

    for _ in range(rounds_for(total, ttft_samples)):
        await asyncio.gather(*(staggered(k) for k in range(streams)))
    return ttfts, delays, time.monotonic() - t0, arrivals, gaps


def peak_rate(arrivals: list[float], window: float = 0.5) -> float:
    """The most chunks that arrived within any `window` seconds, per second: the rate
    while every stream runs (the average over the whole level also holds the staggered
    starts and the tail)."""
    times = sorted(arrivals)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window


def _part(args: tuple) -> tuple[list, list, float, list, list]:
    """One load process's share of a level, with its own cycle collector off: a full
    collection in the load generator stalls its reads, and the stall was counted as the
    relay's delay (60 ms p99.9 in the second 512-stream turn, through any relay or direct)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return asyncio.run(_measure_part(*args))
    finally:
        if enabled:
            gc.enable()


def load_plan(urls: Sequence[str], streams: int, procs: int) -> list[tuple[str, int]]:
    """(url, streams) for each load process: the streams split as evenly as they go, process
    i sending to ``urls[i % len(urls)]``, at least one process for each url."""
    if not urls:
        raise ValueError("no url to load")
    procs = max(1, len(urls), min(procs, streams))
    return [(urls[i % len(urls)], streams // procs + (i < streams % procs)) for i in range(procs)]


def measure(url: str | Sequence[str], streams: int, tokens: int, interval: float, sync: bool = False,
            procs: int = 1, ttft_samples: int = 20) -> dict:
    """Every stream's TTFT, per-chunk delay and gap between its chunks (as its reader sees
    them, ``gap_ms_*``; the issue-27 table's "gap"); the streams spread over `procs` load
    processes (one asyncio process tops out near 5,000 chunks/s of its own parsing), run
    again until at least `ttft_samples` streams started (a TTFT p99 of 32 first tokens is
    their maximum). Several URLs: load process i sends to ``url[i % len(url)]`` (at least
    one process each)."""
    plan = load_plan([url] if isinstance(url, str) else list(url), streams, procs)
    parts = [(u, n, tokens, interval, sync, i, len(plan), streams, ttft_samples) for i, (u, n) in enumerate(plan)]
    if len(parts) == 1:
        results = [_part(parts[0])]
    else:
        with multiprocessing.get_context("fork").Pool(len(parts)) as pool:
            results = pool.map(_part, parts)
    ttfts = [t for r in results for t in r[0]]
    delays = [d for r in results for d in r[1]]
    gaps = [g for r in results for g in r[4]]  # (none where every stream had one chunk: NaN)
    wall = max(r[2] for r in results)
    return {"ttft_ms_p50": percentile(ttfts, 50) * 1e3, "ttft_ms_p99": percentile(ttfts, 99) * 1e3,
            "chunk_ms_p50": percentile(delays, 50) * 1e3, "chunk_ms_p99": percentile(delays, 99) * 1e3,
            "chunk_ms_p999": percentile(delays, 99.9) * 1e3, "chunk_ms_max": max(delays) * 1e3,
            "gap_ms_p50": percentile(gaps, 50) * 1e3, "gap_ms_p99": percentile(gaps, 99) * 1e3,
            "gap_ms_p999": percentile(gaps, 99.9) * 1e3, "gap_ms_max": max(gaps, default=math.nan) * 1e3,
            "chunks": len(delays), "chunks_per_s": len(delays) / wall,
            "peak_chunks_per_s": peak_rate([a for r in results for a in r[3]])}


def compare(direct: str, proxied: str, streams: int, tokens: int, interval: float, sync: bool = False,
            procs: int = 1) -> dict:
    d = measure(direct, streams, tokens, interval, sync, procs)
    p = measure(proxied, streams, tokens, interval, sync, procs)
    return {"streams": streams, "target_chunks_per_s": streams / interval, "direct": d, "proxy": p,
            "added_ttft_ms_p50": p["ttft_ms_p50"] - d["ttft_ms_p50"],
            "added_ttft_ms_p99": p["ttft_ms_p99"] - d["ttft_ms_p99"],
            "added_chunk_ms_p50": p["chunk_ms_p50"] - d["chunk_ms_p50"],
            "added_chunk_ms_p99": p["chunk_ms_p99"] - d["chunk_ms_p99"],
            "direct_chunks_per_s": d["chunks_per_s"], "relayed_chunks_per_s": p["chunks_per_s"],
            "direct_peak_chunks_per_s": d["peak_chunks_per_s"], "relayed_peak_chunks_per_s": p["peak_chunks_per_s"]}


RAMP = "2000,4000,6000,8000,10000,12000,15000,20000,25000,30000"
COLUMNS = [("streams", "streams"), ("target_chunks_per_s", "target chunks/s"), ("direct_chunks_per_s", "direct chunks/s"),
           ("relayed_chunks_per_s", "relayed chunks/s"), ("relayed_peak_chunks_per_s", "relayed peak chunks/s"),
           ("added_ttft_ms_p50", "added TTFT p50 ms"),
           ("added_ttft_ms_p99", "added TTFT p99 ms"), ("added_chunk_ms_p50", "added chunk p50 ms"),
           ("added_chunk_ms_p99", "added chunk p99 ms")]


def _sustained(row: dict) -> bool:
    """The proxy kept up: added p99 per-chunk delay <= 5 ms and (nearly) the direct rate."""
    return row["added_chunk_ms_p99"] <= 5.0 and row["relayed_chunks_per_s"] >= 0.95 * row["direct"]["chunks_per_s"]


def main(args) -> int:
    levels = [int(s) for s in str(args.streams).split(",") if s.strip()]
    rows, ramp, synced = [], [], []
    proxy_cpus = others = None
    if getattr(args, "proxy_cpu", None) is not None:
        available = os.sched_getaffinity(0)
        if args.proxy_cpu not in available or len(available) < 2:
            raise SystemExit(f"--proxy-cpu {args.proxy_cpu}: not one of this process's CPUs "
                             f"{sorted(available)}, or no CPU left for the others")
        proxy_cpus, others = {args.proxy_cpu}, available - {args.proxy_cpu}
        os.sched_setaffinity(0, others)
    load_procs = max(1, getattr(args, "load_procs", 1) or 1)
    upstream_procs = max(1, getattr(args, "upstream_procs", 1) or 1)
    with Service("bench-upstream", "--procs", str(upstream_procs), name="stamp", cpus=others) as up, \
            Service("serve", "--upstream", up.url, "--log-level", "warning", name="proxy",
                    cpus=proxy_cpus) as gate:
        for streams in levels:
            interval = max(0.01, streams / 5000)  # at most ~5k chunks/s for the concurrency levels
            print(f"[overhead] {streams} streams at {1 / interval:.0f} chunks/s each", file=sys.stderr)
            rows.append(compare(up.url, gate.url, streams, args.tokens, interval, procs=load_procs))
        ramp_rates = RAMP if getattr(args, "ramp", None) is None else args.ramp
        for rate in [int(r) for r in ramp_rates.split(",") if r.strip()]:
            print(f"[overhead] ramp: 100 streams, {rate} chunks/s in total", file=sys.stderr)
            row = compare(up.url, gate.url, 100, max(args.tokens, rate // 50), 100 / rate, procs=load_procs)
            ramp.append(row)
            if not _sustained(row):
                break
        for streams in levels[1:]:
            print(f"[overhead] {streams} streams in synchronized steps", file=sys.stderr)
            synced.append(compare(up.url, gate.url, streams, args.tokens, max(0.01, streams / 5000), sync=True,
                                  procs=load_procs))
    ok = [r for r in rows + ramp if _sustained(r)]
    best = max((r["relayed_peak_chunks_per_s"] for r in ok), default=0.0)
    print(table(rows, COLUMNS))
    print("\nramp (100 streams):")
    print(table(ramp, COLUMNS))
    print("\nsynchronized steps (every stream's chunk in the same tick, as in one vLLM step):")
    print(table(synced, COLUMNS))
    print(f"\nhighest relayed rate (peak 0.5 s window) with added p99 per-chunk delay <= 5 ms: {best:.0f} chunks/s")
    if args.json:
        write_json(args.json, {"bench": "overhead", "levels": rows, "ramp": ramp, "synchronized": synced, "max_chunks_per_s": best,
                               "proxy_cpu": getattr(args, "proxy_cpu", None), "load_procs": load_procs,
                               "upstream_procs": upstream_procs, **environment()})
    return 0


def _die_with(parent: int) -> None:
    """In a forked child: SIGTERM when `parent` dies, however it dies (a SIGKILLed parent
    runs no cleanup, and its children would serve on, holding the port)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)


def serve_stamp(port: int, procs: int = 1) -> None:
    """The stamping upstream; `procs` processes accept on one listening socket."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    children = []
    parent = os.getpid()
    for _ in range(procs - 1):
        pid = os.fork()
        if pid == 0:
            children = []
            _die_with(parent)
            break
        children.append(pid)
    try:
        uvicorn.Server(uvicorn.Config(stamp_app, log_level="warning", lifespan="on")).run(sockets=[sock])
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
