"""How many chunks one relay process carries, and how prefill-gate goes past one core (issue 27).

    python3 bench/relay_scale.py --router /tmp/vr/bin/vllm-router --json F \\
        [--rates 5000,10000,15000,20000,25000,30000,40000,50000,60000] [--streams 200] [--seconds 3]
        [--load-procs 8] [--upstream-procs 4] [--scale 1,2,4] [--scale-rate 8000] [--rounds 2]

Made for a machine with many cores (the H200 host has 16): on the 2-core VM the load
generator, not the relay, is what runs out first.

**Ceiling.** prefill-gate, vllm-router (`--policy round_robin`, one worker) and
``bench/relay_floor.py`` (a bare TCP pipe in uvloop's callbacks) each on a core of their own,
the stamping upstream (``--upstream-procs`` processes on one socket) and the load generator
(``--load-procs`` processes) on the other cores. At each total chunk rate (``--streams``
streams, each at ``streams / rate`` seconds a chunk, long enough to run ``--seconds``), the
upstream direct and then each relay, in turn, ``--rounds`` times. A relay *keeps up* at a rate
when it delivers at least 95% of direct's chunks per second and, by delay, its per-chunk delay
p99 is within 1 ms of direct's in the same round; by gap (the issue's own wording), the p99 of
the gaps between a stream's chunks as its reader sees them is. Its ceiling, by each: the
highest rate it keeps up at below the first two rates in a row it does not (one miss between
two hits counts as noise; every miss is in the rows). After two misses in a row by both a
relay is not asked again in that round; the ramp ends where direct's best half second falls
10% short of the asked rate (the rig's own limit).

**Scale.** prefill-gate's admission state is per upstream (one vLLM server's queue and live
streams), so it scales as one proxy process per upstream: K proxies, each on a core of its
own in front of its own upstream, each at ``--scale-rate`` chunks/s, for K in ``--scale``;
direct at the same K upstreams and the same rate first. What one process per upstream cannot
do, and this does not measure, is carry one upstream past its ceiling.

Rows: TTFT p50/p99, the per-chunk delay (arrival minus the upstream's stamp) p50/p99/p99.9/
max, the gap p99, chunks/s, the relay's CPU per chunk and the fraction of its core it used (utime + stime of
its process from /proc over the turn), and for prefill-gate its cycle-collector pauses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from prefill_gate.proxy.bench.report import environment, table, write_json
from prefill_gate.proxy.bench.services import Service, free_port
from relay_router import measure_relay, router

ROUTER = "vllm-router"
GATE = "prefill-gate"
PIPE = "uvloop-pipe"


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def siblings(cpu: int) -> str | None:
    """The hardware threads sharing `cpu`'s core (a relay's neighbour on its core, if any)."""
    path = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return path.read_text().strip() if path.exists() else None


def shape(streams: int, rate: float, seconds: float) -> tuple[int, int, float]:
    """(streams, tokens, interval) of a turn: `streams` at `rate` chunks/s in all, each
    stream long enough to run `seconds`."""
    interval = streams / rate
    return streams, max(32, round(seconds / interval)), interval


def turn(url: str, pid: int | None, streams: int, rate: float, seconds: float, procs: int, gated: bool) -> dict:
    """One measurement: `streams` streams at `rate` chunks/s in all, through `url`."""
    streams, tokens, interval = shape(streams, rate, seconds)
    row = measure_relay(url, [pid] if pid else [], streams, tokens, interval, procs, gated)
    row.update(rate=rate, streams=streams, tokens=tokens)
    return row


class Ramp:
    """One relay's ramp in one round. Its ceiling: the highest rate it kept up at below the
    first two rates in a row it did not (a single miss between two hits is noise); after
    those two it is done."""

    def __init__(self) -> None:
        self.ceiling = 0.0
        self.misses = 0

    @property
    def done(self) -> bool:
        return self.misses >= 2

    def record(self, rate: float, kept_up: bool) -> None:
        if self.done:
            raise ValueError("the ramp is over: two misses in a row")
        if kept_up:
            self.ceiling, self.misses = rate, 0
        else:
            self.misses += 1


CRITERIA = {"delay": "chunk_ms_p99", "gap": "gap_ms_p99"}  # what a relay's p99 is held to, within 1 ms of direct's


def keeps_up(row: dict, direct: dict, by: str = "delay") -> bool:
    key = CRITERIA[by]
    return row[key] <= direct[key] + 1.0 and row["chunks_per_s"] >= 0.95 * direct["chunks_per_s"]


def ceiling(args, cpus: list[int]) -> tuple[list[dict], dict, dict]:
    relay_cpu = {GATE: cpus[-1], ROUTER: cpus[-2], PIPE: cpus[-3]}
    others = set(cpus[:-3])
    os.sched_setaffinity(0, others)
    rates = [float(r) for r in args.rates.split(",")]
    rows: list[dict] = []
    ceilings: dict[str, dict[str, list[float]]] = {by: {} for by in CRITERIA}
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(Service("bench-upstream", "--procs", str(args.upstream_procs), name="stamp",
                                         cpus=others))
        gate = stack.enter_context(Service("serve", "--upstream", up.url, "--log-level", "warning", name="proxy",
                                           cpus={relay_cpu[GATE]}))
        vr = stack.enter_context(router(args.router, up.url, {relay_cpu[ROUTER]}))
        port = free_port()
        pipe = stack.enter_context(Service(name=PIPE, port=port, cpus={relay_cpu[PIPE]}, argv=[
            sys.executable, str(pathlib.Path(__file__).with_name("relay_floor.py")), "--upstream", up.url,
            "--port", str(port)]))
        relays = {GATE: (gate.url, gate.proc.pid), ROUTER: (vr.url, vr.proc.pid), PIPE: (pipe.url, pipe.proc.pid)}
        for rnd in range(1, args.rounds + 1):
            ramps = {name: {by: Ramp() for by in CRITERIA} for name in relays}
            for rate in rates:
                live = {name: relays[name] for name, by in ramps.items() if not all(r.done for r in by.values())}
                if not live:
                    break
                print(f"[scale] ceiling round {rnd}: {rate:.0f} chunks/s, direct", file=sys.stderr)
                direct = turn(up.url, None, args.streams, rate, args.seconds, args.load_procs, False)
                direct.update(part="ceiling", round=rnd, target="direct", keeps_up=None)
                rows.append(direct)
                if direct["peak_chunks_per_s"] < 0.9 * rate:  # its best half second
                    print(f"[scale] the rig itself fell short at {rate:.0f} chunks/s: ramp ends", file=sys.stderr)
                    direct["rig_limit"] = True
                    break
                for name, (url, pid) in live.items():
                    print(f"[scale] ceiling round {rnd}: {rate:.0f} chunks/s, {name}", file=sys.stderr)
                    row = turn(url, pid, args.streams, rate, args.seconds, args.load_procs, name == GATE)
                    ok = {by: keeps_up(row, direct, by) for by in CRITERIA}
                    row.update(part="ceiling", round=rnd, target=name, cpu=relay_cpu[name], keeps_up=ok["delay"],
                               keeps_up_by_gap=ok["gap"])
                    rows.append(row)
                    for by, ramp in ramps[name].items():
                        if not ramp.done:
                            ramp.record(rate, ok[by])
            for name, by in ramps.items():
                for criterion, ramp in by.items():
                    ceilings[criterion].setdefault(name, []).append(ramp.ceiling)
    os.sched_setaffinity(0, set(cpus))
    return rows, ceilings["delay"], ceilings["gap"]


def scale(args, cpus: list[int]) -> list[dict]:
    rows: list[dict] = []
    for k in [int(x) for x in args.scale.split(",")]:
        if k + 2 > len(cpus):
            print(f"[scale] K={k}: needs {k} cores for proxies and 2 for the rig, have {len(cpus)}: skipped",
                  file=sys.stderr)
            continue
        proxy_cpus, others = cpus[-k:], set(cpus[:-k])
        os.sched_setaffinity(0, others)
        rate = args.scale_rate * k
        procs = -(-args.load_procs // k) * k  # a whole number of load processes per upstream
        with contextlib.ExitStack() as stack:
            ups = [stack.enter_context(Service("bench-upstream", "--procs", str(-(-args.upstream_procs // k)),
                                               name=f"stamp{i}", cpus=others)) for i in range(k)]
            gates = [stack.enter_context(Service("serve", "--upstream", u.url, "--log-level", "warning",
                                                 name=f"proxy{i}", cpus={c}))
                     for i, (u, c) in enumerate(zip(ups, proxy_cpus))]
            load = shape(args.streams * k, rate, args.seconds)
            for rnd in range(1, args.rounds + 1):
                print(f"[scale] K={k} round {rnd}: {rate:.0f} chunks/s direct", file=sys.stderr)
                d = measure_relay([u.url for u in ups], [], *load, procs)
                d.update(part="scale", k=k, round=rnd, target="direct", rate=rate)
                rows.append(d)
                print(f"[scale] K={k} round {rnd}: {rate:.0f} chunks/s through {k} proxies", file=sys.stderr)
                p = measure_relay([g.url for g in gates], [g.proc.pid for g in gates], *load, procs)
                p.update(part="scale", k=k, round=rnd, target=GATE, rate=rate, keeps_up=keeps_up(p, d),
                         keeps_up_by_gap=keeps_up(p, d, "gap"))
                rows.append(p)
    os.sched_setaffinity(0, set(cpus))
    return rows


CEILING_COLUMNS = [("round", "round"), ("rate", "asked chunks/s"), ("target", "target"),
                   ("chunks_per_s", "chunks/s"), ("peak_chunks_per_s", "peak chunks/s"),
                   ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"), ("chunk_ms_p50", "delay p50 ms"),
                   ("chunk_ms_p99", "delay p99 ms"), ("chunk_ms_p999", "delay p99.9 ms"), ("chunk_ms_max", "delay max ms"),
                   ("gap_ms_p99", "gap p99 ms"), ("cpu_us_per_chunk", "CPU us/chunk"), ("core_busy", "core busy"),
                   ("keeps_up", "keeps up (delay)"), ("keeps_up_by_gap", "keeps up (gap)")]
SCALE_COLUMNS = [("k", "proxies"), ("round", "round")] + CEILING_COLUMNS[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default=None, help="the vllm-router binary")
    ap.add_argument("--rates", default="5000,10000,15000,20000,25000,30000,40000,50000,60000")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=3.0, help="each stream's length at its rate")
    ap.add_argument("--load-procs", type=int, default=8)
    ap.add_argument("--upstream-procs", type=int, default=4)
    ap.add_argument("--scale", default="1,2,4", help="numbers of proxies (each with its own upstream)")
    ap.add_argument("--scale-rate", type=float, default=8000, help="chunks/s per proxy in the scale part")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-ceiling", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 5:
        raise SystemExit(f"relay_scale needs at least 5 CPUs (3 relays on their own, 2 for the rig); have {len(cpus)}")
    if not args.skip_ceiling and not (args.router and os.access(args.router, os.X_OK)):
        raise SystemExit("no vllm-router binary (pip install vllm-router==0.1.17 in a venv of its own; --router PATH)")
    record = {"bench": "relay_scale", "args": vars(args), "cpu_model": cpu_model(),
              "relay_cpu_siblings": {c: siblings(c) for c in cpus[-4:]}, **environment()}
    ceiling_rows, ceilings, by_gap, scale_rows = [], {}, {}, []
    if not args.skip_ceiling:
        ceiling_rows, ceilings, by_gap = ceiling(args, cpus)
        print(table(ceiling_rows, CEILING_COLUMNS))
        for what, c in (("delay p99", ceilings), ("gap p99", by_gap)):
            print(f"\nceiling by {what} (highest rate kept up at, per round): " + "; ".join(
                f"{name} {', '.join(f'{r:.0f}' for r in v)}" for name, v in c.items()))
        if args.json:  # the first part is kept even if the second fails
            write_json(args.json, {**record, "ceiling": ceiling_rows, "ceilings": ceilings, "ceilings_by_gap": by_gap,
                                   "scale": []})
    scale_rows = scale(args, cpus)
    if scale_rows:
        print("\nscale: K proxies, each with its own upstream and core")
        print(table(scale_rows, SCALE_COLUMNS))
    if args.json:
        write_json(args.json, {**record, "ceiling": ceiling_rows, "ceilings": ceilings, "ceilings_by_gap": by_gap,
                               "scale": scale_rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
