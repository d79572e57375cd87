"""The relay benches' own rules: how a level's load is spread, and where a ramp's ceiling is."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import RELAY_CORES, compiled_core
from prefill_gate.proxy.bench.overhead import load_plan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _relay_scale():
    return _bench("relay_scale")


def test_load_plan_splits_streams_evenly_and_gives_every_url_a_process():
    assert load_plan(["a"], 10, 1) == [("a", 10)]
    assert load_plan(["a"], 10, 3) == [("a", 4), ("a", 3), ("a", 3)]
    assert load_plan(["a"], 2, 8) == [("a", 1), ("a", 1)]  # no process without a stream
    plan = load_plan(["a", "b"], 200, 4)
    assert [u for u, _ in plan] == ["a", "b", "a", "b"] and sum(n for _, n in plan) == 200
    assert {u for u, _ in load_plan(["a", "b", "c"], 30, 1)} == {"a", "b", "c"}  # one each at least
    with pytest.raises(ValueError):
        load_plan([], 1, 1)


def test_a_ramps_ceiling_is_below_its_first_two_misses_in_a_row():
    Ramp = _relay_scale().Ramp

    def ceiling(outcomes):
        ramp = Ramp()
        for rate, ok in outcomes:
            ramp.record(rate, ok)
        return ramp.ceiling, ramp.done

    assert ceiling([(5, True), (10, True), (15, False), (20, False)]) == (10, True)
    assert ceiling([(5, True), (10, False), (15, True), (20, True)]) == (20, False)  # one miss: noise
    assert ceiling([(5, False), (10, False)]) == (0.0, True)
    assert ceiling([(5, True), (10, False), (15, True), (20, False), (25, False)]) == (15, True)
    ramp = Ramp()
    ramp.record(5, False)
    ramp.record(10, False)
    with pytest.raises(ValueError):
        ramp.record(15, True)  # a relay that is done is not asked again


def test_a_load_process_measures_with_its_cycle_collector_off(monkeypatch):
    """The load generator's own full collections stalled its reads, and were counted as the
    relay's delay: its collector is off while it measures, and back on after."""
    import gc

    from prefill_gate.proxy.bench import overhead

    async def part(*args):
        return gc.isenabled()

    monkeypatch.setattr(overhead, "_measure_part", part)
    assert gc.isenabled()
    assert overhead._part(("u", 1, 1, 0.01, False, 0, 1, 1)) is False
    assert gc.isenabled()


@pytest.mark.parametrize("core", RELAY_CORES)
def test_relay_read_times_reads_that_went_all_the_way_through(core):
    """bench/relay_read.py: the reads it times reach the client's transport and are counted
    by their streams, or it fails (a writer that is not ready leaves them queued); with
    either relay core."""
    import asyncio

    if core == "compiled":
        compiled_core()
    bench = _bench("relay_read")
    assert asyncio.run(bench._per_read(3, 2, 30, core)) > 0
    bench._Flow.write_paused = True
    try:
        with pytest.raises(SystemExit, match="did not pass what it was fed"):
            asyncio.run(bench._per_read(2, 1, 10, core))
    finally:
        bench._Flow.write_paused = False


def test_relay_read_records_every_case_against_a_baseline(tmp_path):
    out = tmp_path / "read.json"
    _bench("relay_read").main(["--streams", "1,2", "--events", "1,3", "--rounds", "2", "--reads", "20",
                               "--cores", "python", "--baseline", str(ROOT), "--baseline-commit", "same",
                               "--json", str(out)])
    record = json.loads(out.read_text())
    cases = {(r["target"], r["streams"], r["events"]) for r in record["rows"]}
    assert {t for t, _, _ in cases} == {"prefill-gate (python core)", "prefill-gate@same"}
    assert len(cases) == 8 and all(len(r["samples_us"]) == 2 and r["us_min"] > 0 for r in record["rows"])
    assert record["baseline"]["commit"] == "same" and "git_commit" in record


def test_gc_pauses_reads_each_generation_from_the_proxys_metrics(monkeypatch):
    """relay_router's collector summary, from the histogram the proxy exports (its real
    exposition), per generation: collections, seconds, collections under 1 ms."""
    from prometheus_client import CollectorRegistry, generate_latest

    from prefill_gate.proxy.metrics import Metrics

    relay_router = _bench("relay_router")
    metrics = Metrics(CollectorRegistry(), [])
    for generation, seconds in [(0, 0.0002), (0, 0.0003), (1, 0.0004), (1, 0.003), (2, 0.02)]:
        metrics.gc_pause.labels(str(generation)).observe(seconds)
    page = generate_latest(metrics.registry).decode()

    class Answer:
        text = page

    monkeypatch.setattr(relay_router.httpx, "get", lambda url, timeout: Answer())
    out = relay_router.gc_pauses("http://proxy")
    assert (out["collections"], out["full"], out["over_5ms"]) == (5, 1, 1)
    assert (out["g0_collections"], out["g0_under_1ms"]) == (2, 2)
    assert (out["g1_collections"], out["g1_under_1ms"], out["g2_collections"]) == (2, 1, 1)
    assert out["g1_paused_s"] == pytest.approx(0.0034) and out["paused_s"] == pytest.approx(0.0239)
    assert relay_router.longest_pause(out, 0) == 0.0005  # 0.3 ms: above the 0.25 ms bound
    assert relay_router.longest_pause(out, 1) == 0.005 and relay_router.longest_pause(out, 2) == 0.025
    assert relay_router.longest_pause({**out, "g1_collections": 0.0}, 1) is None
    beyond = {k: 0.0 if k.startswith("g2_le_") else v for k, v in out.items()}  # longer than the last bound
    assert relay_router.longest_pause(beyond, 2) is None


def test_a_level_runs_again_until_enough_first_tokens():
    """A TTFT p99 of one run of 32 streams is their slowest first token: levels run again
    until at least ``ttft_samples`` streams started (20 by default: one run from 20 streams)."""
    from prefill_gate.proxy.bench.overhead import rounds_for

    assert [rounds_for(n) for n in (1, 3, 20, 32, 512)] == [20, 7, 1, 1, 1]
    assert [rounds_for(n, 200) for n in (1, 32, 128, 512)] == [200, 7, 2, 1]
    assert all(rounds_for(n, k) * n >= k for n in range(1, 600, 7) for k in (1, 20, 200))


FAKE_ROUTER = """\
import argparse, http.server, json, socket, sys
ap = argparse.ArgumentParser()
for flag in ("--host", "--worker-urls", "--policy", "--log-level", "--prometheus-host"):
    ap.add_argument(flag)
ap.add_argument("--port", type=int)
ap.add_argument("--prometheus-port", type=int, default=29000)  # vllm-router's default
args = ap.parse_args()
metrics = socket.create_server((args.prometheus_host or "0.0.0.0", args.prometheus_port))  # as vllm-router: panics if taken
with open(sys.argv[0] + ".argv", "w") as f:
    json.dump(sys.argv[1:], f)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""


def test_relay_router_gives_vllm_router_a_metrics_port_of_its_own(tmp_path):
    """vllm-router binds its Prometheus exporter to 29000 unless told otherwise, and a router
    left over from an interrupted run (renamed ``vllm::router``, so ``pkill -f vllm-router``
    misses it) made the next run's router panic. Each router now gets a free loopback port:
    two at once start, each with its own, and neither on 29000."""
    relay_router = _bench("relay_router")
    argv = relay_router.router_argv("vr", "http://w", 8001, 8002)
    assert argv[argv.index("--prometheus-port") + 1] == "8002"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8001" and argv[argv.index("--worker-urls") + 1] == "http://w"
    fakes = []
    for i in range(2):
        fake = tmp_path / f"router{i}"
        fake.write_text(f"#!{sys.executable}\n" + FAKE_ROUTER)
        fake.chmod(0o755)
        fakes.append(fake)
    with relay_router.router(str(fakes[0]), "http://w", None) as one, \
            relay_router.router(str(fakes[1]), "http://w", None) as two:
        got = [json.loads(pathlib.Path(f"{fake}.argv").read_text()) for fake in fakes]
        ports = [int(a[a.index("--prometheus-port") + 1]) for a in got]
        assert len(set(ports)) == 2 and 29000 not in ports
        assert {one.port, two.port}.isdisjoint(ports)


def test_relay_router_pairs_each_baseline_with_its_name():
    relay_router = _bench("relay_router")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert relay_router.baselines_of(["/a", str(ROOT)], ["abc1234"]) == [
        {"dir": "/a", "commit": "abc1234"}, {"dir": str(ROOT), "commit": head}]
    assert relay_router.baselines_of([], []) == []
    with pytest.raises(SystemExit, match="more --baseline-commit"):
        relay_router.baselines_of(["/a"], ["x", "y"])
    with pytest.raises(SystemExit, match="one name"):
        relay_router.baselines_of(["/a", "/b"], ["x", "x"])


def test_a_streams_gaps_are_between_its_own_chunks_as_its_reader_sees_them():
    """The issue's "gap": the time from one chunk of a stream to its next, as the client read
    them; chunks that come in one read have a gap of 0, and a stream's first has none."""
    import asyncio
    import time

    from prefill_gate.proxy.bench.overhead import _one_stream

    def chunk(stamp: float) -> bytes:
        event = b'data: {"choices":[{"delta":{"content":"x"}}],"t":%.9f}\n\n' % stamp
        return b"%x\r\n%s\r\n" % (len(event), event)

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        now = time.monotonic()
        writer.write(chunk(now) + chunk(now))  # two chunks, one write
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(chunk(time.monotonic()))
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ttfts, delays, arrivals, gaps = [], [], [], []
        async with server:
            await _one_stream(f"http://127.0.0.1:{port}", 3, 0.01, ttfts, delays, False, arrivals, gaps)
        return ttfts, delays, arrivals, gaps

    ttfts, delays, arrivals, gaps = asyncio.run(main())
    assert len(ttfts) == 1 and len(delays) == len(arrivals) == 3
    assert len(gaps) == 2 and gaps[0] == 0.0 and 0.19 < gaps[1] < 1.0
    assert gaps == [b - a for a, b in zip(arrivals, arrivals[1:])]


def test_issue_27s_goals_are_counted_per_round_against_the_same_rounds_rows():
    rr = _bench("relay_router")

    def row(level, rnd, target, cpu, ttft50, ttft99, gap, delay):
        return {"level": level, "round": rnd, "target": target, "cpu_us_per_chunk": cpu, "ttft_ms_p50": ttft50,
                "ttft_ms_p99": ttft99, "gap_ms_p999": gap, "chunk_ms_p999": delay}

    rows = [row("32x5", 1, "direct", None, 5.0, 6.0, 6.0, 0.5),
            row("32x5", 1, "vllm-router", 30.0, 5.5, 9.5, 6.0, 0.6),
            row("32x5", 1, "prefill-gate", 44.0, 5.9, 8.9, 6.1, 0.7),   # CPU 1.47x, TTFT +0.9/+2.9: met
            row("32x5", 2, "direct", None, 5.0, 6.0, 6.0, 0.5),
            row("32x5", 2, "vllm-router", 20.0, 5.5, 9.5, 6.0, 0.6),
            row("32x5", 2, "prefill-gate", 31.0, 6.1, 9.1, 6.1, 0.7),   # 1.55x, +1.1, +3.1: missed
            row("512x80", 1, "direct", None, 80.0, 81.0, 81.0, 0.5),
            row("512x80", 1, "vllm-router", 30.0, 80.0, 81.0, 81.0, 0.61),
            row("512x80", 1, "prefill-gate", 40.0, 80.0, 81.0, 98.0, 0.59)]  # gap 1.21x missed, delay 1.18x met
    figures = rr.against_direct(rows)
    assert {(f["level"], f["round"], f["target"]) for f in figures} == {
        (lvl, rnd, t) for lvl, rnd in (("32x5", 1), ("32x5", 2), ("512x80", 1)) for t in ("vllm-router", "prefill-gate")}
    goals = {(g["goal"].split(" <=")[0], g["target"]): (g["met"], g["rounds"]) for g in rr.goals_met(figures)}
    assert goals[("CPU per chunk", "prefill-gate")] == (2, 3)  # 1.47, 1.55, 1.33
    assert rr.cpu_ratios(rows) == {"32x5": {"prefill-gate": [1.47, 1.55]}, "512x80": {"prefill-gate": [1.33]}}
    assert ("CPU per chunk", "vllm-router") not in goals  # not against itself
    assert goals[("added TTFT p50", "prefill-gate")] == (1, 2)
    assert goals[("added TTFT p99", "prefill-gate")] == (1, 2)
    assert goals[("added TTFT p50", "vllm-router")] == (2, 2)
    assert goals[("gap p99.9", "prefill-gate")] == (0, 1)
    assert goals[("delay p99.9", "prefill-gate")] == (1, 1)
    assert goals[("delay p99.9", "vllm-router")] == (0, 1)
    # an older file's rows, without gaps: that goal is not counted, not counted as met
    old = [{k: v for k, v in r.items() if k != "gap_ms_p999"} for r in rows]
    assert not [g for g in rr.goals_met(rr.against_direct(old)) if g["goal"].startswith("gap")]


def test_the_runs_cpu_figure_sums_the_rounds_that_measured_the_router():
    """relay_router's whole-run CPU figure: CPU seconds over chunks summed over the rounds,
    over vllm-router's summed alike; a round without vllm-router (or without CPU) counts for
    no one."""
    rr = _bench("relay_router")

    def row(rnd, target, cpu_s, chunks=1000):
        return {"level": "32x5", "round": rnd, "target": target, "cpu_s": cpu_s, "chunks": chunks}

    rows = [row(1, "direct", None), row(1, "vllm-router", 0.030), row(1, "prefill-gate", 0.045),  # 1.5x
            row(2, "direct", None), row(2, "vllm-router", 0.020, 2000), row(2, "prefill-gate", 0.025, 2000),
            row(3, "prefill-gate", 9.0)]  # no router in round 3: left out
    # prefill-gate: 0.070 s / 3000 chunks; vllm-router: 0.050 s / 3000 chunks
    assert rr.cpu_over_run(rows) == {"32x5": {"prefill-gate": 1.4}}
    assert rr.cpu_over_run([r for r in rows if r["target"] != "vllm-router"]) == {}


def test_a_ramp_keeps_going_while_either_criterion_is_live_and_gives_a_ceiling_by_each(monkeypatch):
    """relay_scale's ceiling by delay p99 and by gap p99 (the issue's wording), from one ramp:
    a relay is asked again while either has not missed twice in a row."""
    import types

    scale = _relay_scale()

    class Fake:
        def __init__(self, *args, name="x", **kwargs):
            self.url, self.proc = f"http://{name}", types.SimpleNamespace(pid=1)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    # (target, rate) -> (delay p99, gap p99); direct is 0.5 / 8.0 at every rate
    seen: list[tuple[str, float]] = []

    def turn(url, pid, streams, rate, seconds, procs, gated):
        name = url.split("//")[1]
        seen.append((name, rate))
        delay, gap = {"stamp": (0.5, 8.0)}.get(name, (0.5 if rate <= 10 else 3.0, 8.0 if rate <= 20 else 10.0))
        return {"chunk_ms_p99": delay, "gap_ms_p99": gap, "chunks_per_s": rate, "peak_chunks_per_s": rate, "rate": rate}

    monkeypatch.setattr(scale, "Service", Fake)
    monkeypatch.setattr(scale, "router", lambda binary, worker, cpus: Fake(name="vllm-router"))
    monkeypatch.setattr(scale, "turn", turn)
    monkeypatch.setattr(scale.os, "sched_setaffinity", lambda pid, cpus: None)
    args = types.SimpleNamespace(rates="10,20,30,40,50", rounds=1, upstream_procs=1, router="r", streams=10,
                                 seconds=1.0, load_procs=1)
    rows, by_delay, by_gap = scale.ceiling(args, list(range(8)))
    assert by_delay == {"prefill-gate": [10.0], "vllm-router": [10.0], "uvloop-pipe": [10.0]}
    assert by_gap == {"prefill-gate": [20.0], "vllm-router": [20.0], "uvloop-pipe": [20.0]}
    # misses by delay at 20 and 30; by gap at 30 and 40: asked up to 40, not at 50
    assert sorted({rate for name, rate in seen if name == "vllm-router"}) == [10, 20, 30, 40]
    row = next(r for r in rows if r["target"] == "prefill-gate" and r["rate"] == 20)
    assert row["keeps_up"] is False and row["keeps_up_by_gap"] is True


def test_request_costs_times_plain_functions_and_leaves_the_rest():
    """bench/request_costs.py's timer: a plain function or method is wrapped and its calls
    recorded (its answer and errors unchanged); a coroutine function or a missing name is
    left alone; the summary is per request, the costliest first."""
    costs = _bench("request_costs")

    class Owner:
        def work(self, x):
            if x < 0:
                raise ValueError("negative")
            return x * 2

        async def waits(self):
            return None

    samples: list[int] = []
    assert costs.timed(Owner, "work", samples)
    assert not costs.timed(Owner, "waits", []) and not costs.timed(Owner, "missing", [])
    assert Owner().work(3) == 6 and len(samples) == 1 and samples[0] >= 0
    with pytest.raises(ValueError, match="negative"):
        Owner().work(-1)
    assert len(samples) == 2 and Owner.work.__wrapped__(Owner(), 1) == 2
    rows = costs.summarize({"a": [1000, 3000, 2000], "b": [10_000], "c": []}, requests=2)
    assert [r["function"] for r in rows] == ["b", "a"]
    assert rows[1] == {"function": "a", "calls_per_request": 1.5, "us_median": 2.0, "us_p90": 3.0,
                       "us_per_request": 3.0}


def test_first_prompt_times_a_new_proxys_first_big_request_and_the_same_again(tmp_path):
    """bench/first_prompt.py, one round: the upstream direct, then a fresh `prefill-gate serve`'s
    first and second requests; the JSON keeps every round's times and the commit."""
    out = tmp_path / "first.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "first_prompt.py"), "--rounds", "1", "--settle", "0.5",
                    "--kind", "tool:70000", "--json", str(out)], check=True, cwd=ROOT, capture_output=True,
                   timeout=120)
    data = json.loads(out.read_text())
    assert data["body_bytes"] >= 64 * 1024  # big enough for the body readers (offload_body_bytes)
    assert [(r["target"], r["request"]) for r in data["rows"]] == [
        ("upstream direct", "any"), ("prefill-gate", "first"), ("prefill-gate", "second")]
    (run,) = data["runs"]["prefill-gate"]
    assert run["first"] > 0 and run["second"] > 0 and len(data["direct_ms"]) == 1
    assert "git_commit" in data and "git_dirty" in data
