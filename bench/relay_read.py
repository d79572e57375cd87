"""The Python the relay runs per upstream read, in process, with the real objects (issue 27).

    python3 bench/relay_read.py [--streams 1,512] [--events 1,3] [--rounds 8] [--cores compiled,python]
                                [--baseline DIR] [--json F]

End to end, a relayed chunk's CPU is mostly the event loop and two syscalls, and it wanders
by 10-20% from turn to turn on a shared machine (bench/relay_router.py). This isolates the
rest: a response's upstream connection (``prefill_gate.proxy.fasthttp._Connection``) fed one read of
chunked SSE, through the callback ``GatedExchange._pump`` installs (ChunkWriter's checks, the
splitter and observer, the ITL histogram, the lease) to a transport that drops the bytes; the
exchanges, leases and gate are the app's own (``build_state``), only the sockets are gone.
``--streams K`` streams are fed in turn, so that at large K every read finds its objects
out of the CPU's caches, as the relay does with hundreds of streams. ``--events`` chunks per
read (more than one: reads that coalesced). Each (target, K, events) runs in a process of its
own, targets alternating, ``--rounds`` times; the table gives the median and the range.
``--cores``: the ``relay_core`` settings to run side by side (the compiled callback,
prefill_gate/proxy/_relaycore.c, and Python's). ``--baseline DIR``: another checkout's proxy (``git
worktree add DIR COMMIT``) beside this one.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EVENT = (b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1700000000,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,"finish_reason":null}]}\n\n')
COLUMNS = [("target", "target"), ("streams", "streams"), ("events", "chunks/read"), ("us_median", "us/read median"),
           ("us_min", "min"), ("us_max", "max"), ("us_per_chunk", "us/chunk median")]


def _wire(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


class _Transport:
    written = 0  # bytes, over every transport

    def write(self, data: bytes) -> None:
        _Transport.written += len(data)

    def pause_reading(self) -> None:
        pass


class _Flow:
    write_paused = False


class _Cycle:
    """What ChunkWriter reads of uvicorn's request cycle, for an answer under way."""

    def __init__(self) -> None:
        self.response_started, self.chunked_encoding = True, True
        self.response_complete = self.disconnected = False
        self.flow, self.transport, self.scope = _Flow(), _Transport(), {"method": "POST"}


def _direct(writer, observer, splitter, core: str):
    """The callback the relay installs on the upstream connection: the code's own for the
    ``relay_core`` setting ``core`` (from prefill_gate/proxy/relaycore.py on), or for an older checkout
    its ``direct_relay`` (46abd42 on: the observer owns its splitter), or what its ``_pump``
    wrote inline (2fab5de and older)."""
    import inspect
    import os

    import prefill_gate.proxy.exchange

    # (Asked of the checkout's own directory: an editable install of another checkout
    # answers an import of a module this one lacks from that one.)
    if os.path.exists(os.path.join(os.path.dirname(prefill_gate.proxy.exchange.__file__), "relaycore.py")):
        from prefill_gate.proxy.relaycore import relay_factory

        observer.splitter = splitter
        return relay_factory(core)[0](writer, observer)
    if hasattr(prefill_gate.proxy.exchange, "direct_relay"):
        if len(inspect.signature(prefill_gate.proxy.exchange.direct_relay).parameters) == 2:
            observer.splitter = splitter
            return prefill_gate.proxy.exchange.direct_relay(writer, observer)
        return prefill_gate.proxy.exchange.direct_relay(writer, observer, splitter)

    def direct(data: bytes) -> bool:
        if not writer.ready():
            return False
        out = observer.filter(splitter.feed(data))
        if out:
            writer.write(out)
        return True

    return direct


async def _per_read(streams: int, events: int, reads: int, core: str = "auto") -> float:
    """Seconds of one read, the best of 7 passes over ``reads`` reads. Fails unless every
    chunk fed reached the client's transport and was counted by its stream."""
    from prometheus_client import CollectorRegistry

    from prefill_gate.proxy.admission import RequestClass, Ticket
    from prefill_gate.proxy.app import build_state
    from prefill_gate.proxy.estimate import Estimate
    from prefill_gate.proxy.exchange import GatedExchange, GatedRequest
    from prefill_gate.proxy import fasthttp
    from prefill_gate.proxy.gate import Lease
    from prefill_gate.proxy.listener import ChunkWriter
    from prefill_gate.proxy.relay import SSESplitter, StreamObserver
    from prefill_gate.proxy import settings as proxy_settings

    config = {"upstreams": ["http://upstream.invalid:8000"]}
    if "relay_core" in getattr(proxy_settings.Settings, "model_fields", {}):  # the app's hooks follow it
        config["relay_core"] = core
    state = build_state(proxy_settings.load_settings(config, environ={}), registry=CollectorRegistry())
    loop = asyncio.get_running_loop()
    conns, observers = [], []
    for _ in range(streams):
        ticket = Ticket(RequestClass.INTERACTIVE, 100)
        req = GatedRequest("chat", "/v1/chat/completions", {}, b"{}", "m", True, True,
                           Estimate(100, "calibrated", 400, 1), ticket, time.monotonic())
        exchange = GatedExchange(state, req)
        await state.gate._acquire(ticket)
        exchange.lease = Lease(state.gate, ticket)
        # The per-read token hook the app installs: the compiled tally where the core is
        # compiled (``_token_hook``, 2026-12-03 on), else the exchange's ``_tokens``.
        hook = exchange._token_hook() if hasattr(exchange, "_token_hook") else exchange._tokens
        observer = exchange.observer = StreamObserver(exchange._first_content, hook, drop_usage=True)
        splitter, writer = SSESplitter(), ChunkWriter(_Cycle())
        sink = _direct(writer, observer, splitter, core)
        # The connection the app opens for this sink: one that hands it whole chunks where
        # it takes them (the compiled core, 2026-12-03 on), else the parser's.
        framed = getattr(fasthttp, "FramedConnection", None) if hasattr(sink, "chunked") else None
        conn = (framed or fasthttp._Connection)(("http", "upstream.invalid", 8000))
        conn.connection_made(_Transport())
        conn._loop, conn._wait_timeout = loop, 600.0
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        conn.waiter = loop.create_future()
        conn._timer = loop.call_at(loop.time() + 600, lambda: None)
        conn.sink, conn.sink_chunked = sink, getattr(sink, "chunked", None)
        conn.data_received(_wire(EVENT))  # the first content: the stream is under way
        conns.append(conn)
        observers.append(observer)
    read = _wire(EVENT * events)
    passes = max(1, reads // streams)
    best = float("inf")
    _Transport.written = 0
    gc.collect()
    gc.disable()
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(passes):
            for conn in conns:
                conn.data_received(read)
        best = min(best, (time.perf_counter() - t0) / (passes * streams))
    gc.enable()
    fed = 7 * passes * streams
    counted = sum(o.tokens for o in observers) - streams  # (less each first content)
    if _Transport.written != fed * len(read) or counted != fed * events:
        raise SystemExit(f"the relay did not pass what it was fed: {_Transport.written} bytes written, "
                         f"{counted} chunks counted, for {fed} reads of {events} chunks")
    return best


def _worker(argv: list[str]) -> None:
    code, core, streams, events, reads = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    sys.path.insert(0, code)
    print(json.dumps({"s": asyncio.run(_per_read(streams, events, reads, core))}))


def _run(code: str, core: str, streams: int, events: int, reads: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--worker", code, core, str(streams), str(events), str(reads)],
                         capture_output=True, text=True, cwd=code, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["s"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1:])
        return 0
    sys.path.insert(0, str(ROOT))
    from prefill_gate.proxy.bench.report import environment, table, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,512", help="streams fed in turn")
    ap.add_argument("--events", default="1,3", help="chunks per upstream read")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reads", type=int, default=100_000, help="reads per pass")
    ap.add_argument("--baseline", help="another checkout: its proxy beside this one")
    ap.add_argument("--baseline-commit", help="the baseline's commit, where DIR is a copy without .git")
    ap.add_argument("--cores", default="compiled,python",
                    help="this checkout's relay_core settings to run (compiled, python, auto)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    targets = {("prefill-gate" if core == "compiled" else f"prefill-gate ({core} core)"): (str(ROOT), core)
               for core in args.cores.split(",")}
    base_commit = None
    if args.baseline:
        base_commit = args.baseline_commit or subprocess.run(
            ["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
            text=True).stdout.strip()
        targets[f"prefill-gate@{base_commit}"] = (str(pathlib.Path(args.baseline).resolve()), "auto")
    cases = [(k, e) for k in map(int, args.streams.split(",")) for e in map(int, args.events.split(","))]
    samples: dict[tuple, list[float]] = {}
    for rnd in range(args.rounds):
        for k, e in cases:
            for name, (code, core) in targets.items():  # targets alternate within a round
                print(f"[relay_read] round {rnd + 1}: {name}, {k} streams, {e} chunks/read", file=sys.stderr)
                samples.setdefault((name, k, e), []).append(_run(code, core, k, e, args.reads) * 1e6)
    rows = [{"target": name, "streams": k, "events": e, "us_median": statistics.median(v), "us_min": min(v),
             "us_max": max(v), "us_per_chunk": statistics.median(v) / e, "samples_us": v}
            for (name, k, e), v in samples.items()]
    print(table(rows, COLUMNS))
    if args.json:
        write_json(args.json, {"bench": "relay_read", "streams": args.streams, "events": args.events,
                               "rounds": args.rounds, "reads": args.reads, "cores": args.cores,
                               "baseline": args.baseline and {"dir": args.baseline, "commit": base_commit},
                               "rows": rows, **environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
