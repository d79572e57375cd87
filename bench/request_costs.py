"""What each request's code costs on the running proxy's loop (issue 27).

    python3 bench/request_costs.py [--streams 32] [--tokens 64] [--interval-ms 5] [--requests 640]
                                   [--json F]

A request's setup costs the proxy far more on its loop, between other streams' reads, than
the same calls cost in a loop of their own: the CPU's caches hold other work each time
(the old docs/RESULTS.md (in git history) 3m). A profiler's overhead hides that; this times it where it happens. The
proxy (this checkout, defaults) runs alone on the last CPU in front of the stamping upstream,
with the synchronous per-request functions in ``TIMED`` (the proxy's, its HTTP protocol's included) each
wrapped in a timer; streams go through it as in bench/relay_router.py (a new connection a
request, starts spread over the level), first a warm-up, then ``--requests`` counted. Per
function: calls a request, the median and p90 of a call, and its time a request; beside them
the proxy process's CPU a request over the same window (all of it: the reads, the event loop,
the kernel). The timers nest where the functions do (the protocol's ``data_received`` holds its
``on_headers_complete``), and each adds its own call and two clock reads to what it times.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pathlib
import signal
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (module, attribute path): synchronous code that runs once or twice a request.
TIMED = (
    ("prefill_gate.proxy.http1", "Connection.__init__"),
    ("prefill_gate.proxy.http1", "Connection.connection_made"),
    ("prefill_gate.proxy.http1", "Connection.data_received"),
    ("prefill_gate.proxy.http1", "Connection.on_headers_complete"),
    ("prefill_gate.proxy.http1", "Connection.answered"),
    ("prefill_gate.proxy.http1", "Connection.connection_lost"),
    ("prefill_gate.proxy.app", "path_refusal"),
    ("prefill_gate.proxy.bodies", "_read"),
    ("prefill_gate.proxy.bodies", "parse_body"),
    ("prefill_gate.proxy.bodies", "prefix_hashes"),
    ("prefill_gate.proxy.exchange", "GatedExchange.__init__"),
    ("prefill_gate.proxy.exchange", "GatedExchange._first_content"),
    ("prefill_gate.proxy.exchange", "GatedExchange.finished"),
    ("prefill_gate.proxy.relay", "StreamObserver.filter"),
    ("prefill_gate.proxy.relay", "event_json"),
    ("prefill_gate.proxy.admission", "AdmissionPolicy.submit"),
    ("prefill_gate.proxy.admission", "AdmissionPolicy.finish"),
    ("prefill_gate.proxy.predict", "Predictor.stream_started"),
    ("prefill_gate.proxy.predict", "Predictor.stream_ended"),
    ("prefill_gate.proxy.prefix_memory", "PrefixMemory.remember"),
)
COLUMNS = [("function", "function"), ("calls_per_request", "calls/request"), ("us_median", "us a call median"),
           ("us_p90", "p90"), ("us_per_request", "us a request")]


def timed(owner, name: str, samples: list[int]) -> bool:
    """Wrap ``owner.name`` (a plain function or method) so that each call's wall time, in
    ns, goes to ``samples``. False, nothing changed: it is missing or a coroutine function
    (whose time would hold its awaits)."""
    fn = getattr(owner, name, None)
    if fn is None or inspect.iscoroutinefunction(fn) or not callable(fn):
        return False
    clock = time.perf_counter_ns

    def wrapper(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append(clock() - t0)

    wrapper.__wrapped__ = fn
    setattr(owner, name, wrapper)
    return True


def install(targets=TIMED) -> dict[str, list[int]]:
    """Wrap every target that this checkout has; {label: samples}."""
    stats: dict[str, list[int]] = {}
    for module, path in targets:
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p, None)
        samples: list[int] = []
        if owner is not None and timed(owner, name, samples):
            stats[f"{module.rsplit('.', 1)[-1]}:{path}"] = samples
    return stats


def _serve(out: str, argv: list[str]) -> int:
    """The proxy, timed: SIGUSR1 starts the count afresh (after the warm-up); at its end the
    samples go to ``out`` as JSON."""
    sys.path.insert(0, os.getcwd())
    stats = install()
    signal.signal(signal.SIGUSR1, lambda *_: [s.clear() for s in stats.values()])
    from prefill_gate.proxy import cli

    try:
        return cli.main(argv)
    finally:
        pathlib.Path(out).write_text(json.dumps(stats))


def summarize(stats: dict[str, list[int]], requests: int) -> list[dict]:
    rows = []
    for label, ns in stats.items():
        if not ns:
            continue
        ns = sorted(ns)
        rows.append({"function": label, "calls_per_request": len(ns) / requests,
                     "us_median": ns[len(ns) // 2] / 1e3, "us_p90": ns[int(len(ns) * 0.9)] / 1e3,
                     "us_per_request": sum(ns) / 1e3 / requests})
    return sorted(rows, key=lambda r: -r["us_per_request"])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve(argv[1], argv[2:])
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from relay_router import cpu_seconds

    from prefill_gate.proxy.bench.overhead import measure, rounds_for
    from prefill_gate.proxy.bench.report import environment, table, write_json
    from prefill_gate.proxy.bench.services import Service, free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="chunks a stream")
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=640, help="requests counted (whole rounds of --streams)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    mine, others = ({cpus[-1]}, set(cpus[:-1])) if len(cpus) > 1 else (None, None)
    interval = args.interval_ms / 1000
    out = pathlib.Path(f"/tmp/request-costs-{os.getpid()}.json")
    with Service("bench-upstream", name="stamp", cpus=others) as up:
        port = free_port()
        proxy = Service(name="prefill-gate", port=port, cpus=mine, cwd=str(ROOT),
                        argv=[sys.executable, __file__, "--serve", str(out), "serve", "--upstream", up.url,
                              "--log-level", "warning", "--port", str(port)])
        try:
            measure(proxy.url, args.streams, args.tokens, interval, ttft_samples=args.streams)  # warm-up
            proxy.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            cpu0 = cpu_seconds(proxy.proc.pid)
            row = measure(proxy.url, args.streams, args.tokens, interval, ttft_samples=args.requests)
            cpu = cpu_seconds(proxy.proc.pid) - cpu0
        finally:
            proxy.stop()
    # (each load process first warms the path with one request of its own: one process here)
    requests = args.streams * rounds_for(args.streams, args.requests) + 1
    stats = json.loads(out.read_text())
    out.unlink()
    rows = summarize(stats, requests)
    print(table(rows, COLUMNS))
    print(f"\n{requests} requests of {args.tokens} chunks, {args.streams} at a time, {args.interval_ms:g} ms apart: "
          f"the proxy's CPU {cpu / requests * 1e6:.0f} us a request ({cpu / row['chunks'] * 1e6:.1f} us a chunk); "
          f"the functions above (nested ones counted in their callers too) "
          f"{statistics.fsum(r['us_per_request'] for r in rows):.0f} us")
    if args.json:
        write_json(args.json, {"benchmark": "request_costs", "args": vars(args), "requests": requests,
                               "chunks": row["chunks"], "proxy_cpu_us_per_request": cpu / requests * 1e6,
                               "rows": rows, "environment": environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
