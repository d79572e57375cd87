"""prefill-gate's relay against vllm-router (the Rust router for vLLM), side by side (issue 27).

    python3 bench/relay_router.py --router /tmp/vr/bin/vllm-router --json F \\
        [--levels 1x5,32x5,128x20,512x80] [--tokens 64] [--rounds 2] [--baseline DIR ...] [--floor]
        [--load-procs N] [--upstream-procs N]

One stamping upstream (`prefill_gate.proxy.bench.overhead`: vLLM-format SSE chunks, each stamped with its
write time), and three targets: the upstream direct, prefill-gate (defaults) and vllm-router
(`--policy round_robin`, the one worker). Level `NxMS`: N concurrent streams, one chunk every
MS ms each (so 512x80 is the same 6,400 chunks/s as 32x5). Every level runs the targets in
turn, `--rounds` times (direct, gate, router, direct, gate, router...), so drift falls on all
three alike. With two or more CPUs the relays get the last CPU to themselves and the load
generator and upstream the others (the issue's rig: one core each side).

Per target and level: TTFT p50/p99; the per-chunk delay (arrival minus the upstream's stamp)
p50/p99/p99.9/max; the gap between a stream's chunks as its reader sees them (the issue's
"gap": 80 ms and a little at 512x80) p99/p99.9/max; the relay's CPU seconds per relayed chunk
(its process's utime + stime, all threads, from /proc, over the level). Direct has no relay:
its delay and gaps are the floor. Then issue 27's goals, each relay's rounds that met each
(``GOALS``; every round's figure, the misses with the hits).

``--baseline DIR``: a fourth target, the prefill-gate of another checkout (e.g. ``git
worktree add /tmp/base <commit>``), named ``prefill-gate@<its commit>``, on the same CPU in
the same turns: a before/after in one run, where this VM's drift between runs (CPU per chunk
of the same code 20-40% apart on different days) would swamp it. Given more than once, one
target each (``--baseline-commit`` names them in the same order, where a DIR has no
``.git``). ``--floor``: also ``bench/relay_floor.py`` (``uvloop-pipe``), a TCP pipe in
uvloop's callbacks: the least CPU any relay in Python can spend per chunk. Each prefill-gate
turn also records the proxy's cycle-collector pauses (its ``prefill_gate_gc_pause_seconds``,
before and after the turn).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from prefill_gate.proxy.bench.overhead import measure
from prefill_gate.proxy.bench.report import environment, table, write_json
from prefill_gate.proxy.bench.services import Service, free_port

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, all its threads, in seconds: the scheduler's nanosecond count
    (``/proc/PID/task/*/schedstat``, summed) where the kernel keeps one, else utime + stime
    from ``/proc/PID/stat``, in clock ticks (10 ms: a short turn's few tens of ticks made
    the CPU ratios of 32 streams wander by 20%)."""
    if pathlib.Path(f"/proc/{pid}/schedstat").exists():
        total = 0
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def router_argv(binary: str, worker: str, port: int, metrics_port: int) -> list[str]:
    """vllm-router's command line: round robin over one worker. Its Prometheus exporter is
    on unless told otherwise and binds 29000 by default, where a router left over from an
    interrupted run (it renames itself ``vllm::router``) makes the next one panic; so each
    gets a free port of its own, on loopback."""
    return [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker,
            "--policy", "round_robin", "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


def router(binary: str, worker: str, cpus: set[int] | None) -> Service:
    """vllm-router in front of one worker, on its own port."""
    port = free_port()
    metrics_port = free_port()
    while metrics_port == port:
        metrics_port = free_port()
    return Service(name="vllm-router", port=port, cpus=cpus, timeout=60,
                   argv=router_argv(binary, worker, port, metrics_port))


def baselines_of(dirs: list[str], commits: list[str]) -> list[dict]:
    """``--baseline`` and ``--baseline-commit`` paired in order: each baseline's directory and
    name, a directory without a name named by its git HEAD."""
    if len(commits) > len(dirs):
        raise SystemExit("more --baseline-commit than --baseline")
    out = [{"dir": d, "commit": commits[i] if i < len(commits) else subprocess.run(
        ["git", "-C", d, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()}
        for i, d in enumerate(dirs)]
    if len({b["commit"] for b in out}) < len(out):
        raise SystemExit("two baselines with one name: give each its own --baseline-commit")
    return out


def level(text: str) -> tuple[int, float]:
    streams, ms = text.lower().split("x")
    return int(streams), float(ms) / 1000


def gc_pauses(url: str) -> dict[str, float] | None:
    """The proxy's cycle-collector pauses so far (its gc_pause_seconds): collections, full
    ones, pauses over 5 ms, seconds paused, and per generation (``g0``, ``g1``, ``g2``) its
    collections, seconds, collections under 1 ms and under each bucket's bound (``g0_le_0.0001``:
    see ``longest_pause``). None: a proxy that does not time them."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    family = next((f for f in text_string_to_metric_families(text) if f.name == "prefill_gate_gc_pause_seconds"),
                  None)
    if family is None:
        return None
    gens = ("g0", "g1", "g2")
    out = {f"{g}_{k}": 0.0 for g in gens for k in ("collections", "paused_s")}
    for s in family.samples:
        g = "g" + s.labels["generation"]
        if s.name.endswith("_count"):
            out[g + "_collections"] = s.value
        elif s.name.endswith("_sum"):
            out[g + "_paused_s"] = s.value
        elif s.labels["le"] != "+Inf":  # a bucket: the collections that took at most its bound
            out[f"{g}_le_{float(s.labels['le']):g}"] = s.value
    out["collections"] = sum(out[g + "_collections"] for g in gens)
    out["full"] = out["g2_collections"]
    out["paused_s"] = sum(out[g + "_paused_s"] for g in gens)
    out["over_5ms"] = out["collections"] - sum(out.get(g + "_le_0.005", 0.0) for g in gens)
    for g in gens:
        out[g + "_under_1ms"] = out.get(g + "_le_0.001", 0.0)
    return out


def longest_pause(gc: dict, generation: int) -> float | None:
    """The least bucket bound (seconds) that every collection of ``generation`` in ``gc`` (a
    turn's difference of two ``gc_pauses``) stayed under: its longest pause, to a bucket;
    None: none collected, or one past the last bound."""
    g = f"g{generation}"
    n = gc.get(g + "_collections", 0)
    bounds = sorted(float(k[len(g) + 4:]) for k in gc if k.startswith(g + "_le_"))
    return next((b for b in bounds if n and gc[f"{g}_le_{b:g}"] >= n), None)


def measure_relay(url: str | list[str], pids: list[int], streams: int, tokens: int, interval: float,
                  procs: int = 1, gated: bool = False, ttft_samples: int = 20) -> dict:
    """``measure`` through a relay, with the CPU of its processes ``pids`` over the turn (per
    chunk, and per process as the share of a core it kept busy) and, where ``gated`` (one
    prefill-gate at ``url``), the proxy's cycle-collector pauses in the turn."""
    gc0 = gc_pauses(url) if gated else None
    cpu0, t0 = sum(map(cpu_seconds, pids)), time.monotonic()
    row = measure(url, streams, tokens, interval, procs=procs, ttft_samples=ttft_samples)
    wall = time.monotonic() - t0
    cpu = sum(map(cpu_seconds, pids)) - cpu0 if pids else None
    gc1 = gc_pauses(url) if gc0 is not None else None
    row.update(cpu_s=cpu, cpu_us_per_chunk=None if cpu is None else cpu / row["chunks"] * 1e6,
               core_busy=None if cpu is None else cpu / wall / len(pids),
               gc=None if gc1 is None else {k: gc1[k] - gc0[k] for k in gc1})
    return row


# Issue 27's goals, each a bound on one of ``against_direct``'s figures: (name, the levels it
# is asked at, the figure, its bound).
GOALS = (
    ("CPU per chunk <= 1.5x vllm-router's", ("32x5", "512x80"), "cpu_over_router", 1.5),
    ("added TTFT p50 <= 1 ms", ("32x5",), "added_ttft_ms_p50", 1.0),
    ("added TTFT p99 <= 3 ms", ("32x5",), "added_ttft_ms_p99", 3.0),
    ("gap p99.9 <= 1.2x direct's", ("512x80",), "gap_p999_over_direct", 1.2),
    ("delay p99.9 <= 1.2x direct's", ("512x80",), "delay_p999_over_direct", 1.2),
)


def _over(row: dict, base: dict | None, key: str) -> float | None:
    """``row[key]`` over ``base[key]``; None where either lacks it."""
    a, b = row.get(key), (base or {}).get(key)
    return None if a is None or not b else a / b


def against_direct(rows: list[dict]) -> list[dict]:
    """Per level, round and relay: the figures issue 27 bounds, each against the same
    round's direct row (added TTFT; gap and delay p99.9 over direct's) and vllm-router's (CPU
    per chunk over its). A figure its rows cannot give (no vllm-router that round; rows of an
    older bench without gaps) is None."""
    turns: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        turns.setdefault((r["level"], r["round"]), {})[r["target"]] = r
    out = []
    for (lvl, rnd), by in turns.items():
        d, vr = by.get("direct"), by.get("vllm-router")
        for target, r in by.items():
            if target == "direct" or d is None:
                continue
            out.append({"level": lvl, "round": rnd, "target": target,
                        "cpu_over_router": None if target == "vllm-router" else _over(r, vr, "cpu_us_per_chunk"),
                        "added_ttft_ms_p50": r["ttft_ms_p50"] - d["ttft_ms_p50"],
                        "added_ttft_ms_p99": r["ttft_ms_p99"] - d["ttft_ms_p99"],
                        "gap_p999_over_direct": _over(r, d, "gap_ms_p999"),
                        "delay_p999_over_direct": _over(r, d, "chunk_ms_p999")})
    return out


def cpu_ratios(rows: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per level, over its rounds: every relay's CPU per chunk over vllm-router's in the same
    round (the same load, minutes apart at most)."""
    out: dict[str, dict[str, list[float]]] = {}
    for f in against_direct(rows):
        if f["cpu_over_router"] is not None:
            out.setdefault(f["level"], {}).setdefault(f["target"], []).append(round(f["cpu_over_router"], 2))
    return out


def cpu_over_run(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per level, the whole run's figure: every relay's CPU seconds over its chunks, summed
    over the rounds that measured vllm-router too, over vllm-router's (the goal's "measured
    in one run"; ``cpu_ratios`` gives each round's)."""
    sums: dict[tuple, list[float]] = {}
    rounds_with_router = {(r["level"], r["round"]) for r in rows
                          if r["target"] == "vllm-router" and r.get("cpu_s") is not None}
    for r in rows:
        if (r["level"], r["round"]) in rounds_with_router and r.get("cpu_s") is not None:
            total = sums.setdefault((r["level"], r["target"]), [0.0, 0])
            total[0] += r["cpu_s"]
            total[1] += r["chunks"]
    out: dict[str, dict[str, float]] = {}
    for (lvl, target), (cpu, chunks) in sums.items():
        router = sums.get((lvl, "vllm-router"))
        if target != "vllm-router" and router and router[0] and chunks:
            out.setdefault(lvl, {})[target] = round((cpu / chunks) / (router[0] / router[1]), 3)
    return out


def goals_met(figures: list[dict]) -> list[dict]:
    """Each of ``GOALS`` per relay: in how many of its rounds at the goal's levels it held,
    with the range of the figure (every round, the misses with the hits)."""
    out = []
    for name, levels, key, bound in GOALS:
        per: dict[str, list[float]] = {}
        for f in figures:
            if f["level"] in levels and f[key] is not None:
                per.setdefault(f["target"], []).append(f[key])
        for target, values in per.items():
            out.append({"goal": name, "target": target, "met": sum(v <= bound for v in values),
                        "rounds": len(values), "min": min(values), "max": max(values)})
    return out


def pause_summary(g: dict) -> str:
    """One turn's collector pauses (a difference of two ``gc_pauses``) in a line."""
    text = (f"{g['collections']:.0f} collections, {g['full']:.0f} full, {g['over_5ms']:.0f} over 5 ms, "
            f"{g['paused_s'] * 1e3:.1f} ms paused in all")
    for n, name in ((0, "young"), (1, "middle")):
        count = g.get(f"g{n}_collections")
        if count:
            longest = longest_pause(g, n)
            average_us = g[f"g{n}_paused_s"] / count * 1e6
            over = count - g.get(f"g{n}_le_0.00025", 0)
            text += (f"; {name} {count:.0f} (average {average_us:.0f} us, {over:.0f} over 0.25 ms, longest "
                     + (f"<= {longest * 1e3:g} ms)" if longest else "over the last bucket)"))
    return text


COLUMNS = [("level", "level"), ("target", "target"), ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"),
           ("chunk_ms_p50", "delay p50 ms"), ("chunk_ms_p99", "delay p99 ms"), ("chunk_ms_p999", "delay p99.9 ms"),
           ("chunk_ms_max", "delay max ms"), ("gap_ms_p99", "gap p99 ms"), ("gap_ms_p999", "gap p99.9 ms"),
           ("gap_ms_max", "gap max ms"), ("chunks_per_s", "chunks/s"), ("cpu_us_per_chunk", "relay CPU us/chunk")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default=shutil.which("vllm-router"), help="the vllm-router binary")
    ap.add_argument("--levels", default="1x5,32x5,128x20,512x80")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", action="append", default=[],
                    help="a checkout of another commit: its prefill-gate as one more target (repeatable)")
    ap.add_argument("--floor", action="store_true", help="also bench/relay_floor.py, a plain TCP pipe on uvloop")
    ap.add_argument("--python-core", action="store_true",
                    help="also this prefill-gate with relay_core python (beside the compiled core)")
    ap.add_argument("--baseline-commit", action="append", default=[],
                    help="a baseline's commit, where its DIR is a copy without .git (repeatable, in the "
                         "order of --baseline)")
    ap.add_argument("--load-procs", type=int, default=1, help="load generator processes (the streams split evenly)")
    ap.add_argument("--upstream-procs", type=int, default=1, help="stamping upstream processes on one socket")
    ap.add_argument("--ttft-samples", type=int, default=20,
                    help="run each level's streams again until this many have started (20: one run from 20 "
                         "streams up; a TTFT p99 of fewer samples is their maximum)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not args.router or not os.access(args.router, os.X_OK):
        raise SystemExit("no vllm-router binary (pip install vllm-router==0.1.17 in a venv of its own; --router PATH)")
    cpus = sorted(os.sched_getaffinity(0))
    relay_cpus = {cpus[-1]} if len(cpus) > 1 else None
    if relay_cpus:
        os.sched_setaffinity(0, set(cpus[:-1]))
    rows = []
    baselines = baselines_of(args.baseline, args.baseline_commit)
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(Service("bench-upstream", "--procs", str(args.upstream_procs), name="stamp"))
        gate = stack.enter_context(Service("serve", "--upstream", up.url, "--log-level", "warning", name="proxy",
                                           cpus=relay_cpus))
        vr = stack.enter_context(router(args.router, up.url, relay_cpus))
        targets = {"direct": (up.url, None), "prefill-gate": (gate.url, gate.proc.pid),
                   "vllm-router": (vr.url, vr.proc.pid)}
        if args.python_core:
            proxy = stack.enter_context(Service("serve", "--upstream", up.url, "--log-level", "warning",
                                                "--relay-core", "python", name="python-core", cpus=relay_cpus))
            targets["prefill-gate (python core)"] = (proxy.url, proxy.proc.pid)
        for b in baselines:
            proxy = stack.enter_context(Service("serve", "--upstream", up.url, "--log-level", "warning",
                                                name="baseline", cpus=relay_cpus, cwd=b["dir"]))
            targets[f"prefill-gate@{b['commit']}"] = (proxy.url, proxy.proc.pid)
        if args.floor:
            port = free_port()
            pipe = stack.enter_context(Service(name="uvloop-pipe", port=port, cpus=relay_cpus, argv=[
                sys.executable, str(pathlib.Path(__file__).with_name("relay_floor.py")), "--upstream", up.url,
                "--port", str(port)]))
            targets["uvloop-pipe"] = (pipe.url, pipe.proc.pid)
        for text in args.levels.split(","):
            streams, interval = level(text)
            for rnd in range(args.rounds):
                for name, (url, pid) in targets.items():
                    print(f"[relay] {text} round {rnd + 1}: {name}", file=sys.stderr)
                    row = measure_relay(url, [pid] if pid else [], streams, args.tokens, interval,
                                        args.load_procs, gated=name.startswith("prefill-gate"),
                                        ttft_samples=args.ttft_samples)
                    row.update(level=text, round=rnd + 1, target=name, streams=streams, interval_s=interval)
                    rows.append(row)
    print(table(rows, COLUMNS))
    ratios = cpu_ratios(rows)
    print("\nrelay CPU per chunk over vllm-router's, per round:")
    for lvl, per in ratios.items():
        print(f"  {lvl}: " + "; ".join(f"{t} {min(v):.2f}-{max(v):.2f}x ({', '.join(map(str, v))})" for t, v in per.items()))
    run = cpu_over_run(rows)
    if run:
        print("over the whole run (CPU seconds over chunks, summed over the rounds):")
        for lvl, per in run.items():
            print(f"  {lvl}: " + "; ".join(f"{t} {v:.2f}x" for t, v in per.items()))
    goals = goals_met(against_direct(rows))
    if goals:
        print("\nissue 27's goals, rounds met (every round's figure, min-max):")
        for g in goals:
            print(f"  {g['goal']}: {g['target']} {g['met']} of {g['rounds']} ({g['min']:.2f}-{g['max']:.2f})")
    timed = [r for r in rows if r.get("gc")]
    if timed:
        print("\nprefill-gate's cycle-collector pauses per turn (its gc_pause_seconds):")
        for r in timed:
            print(f"  {r['level']} round {r['round']} {r['target']}: {pause_summary(r['gc'])}")
    if args.json:
        write_json(args.json, {"bench": "relay_router", "levels": args.levels, "tokens": args.tokens,
                               "ttft_samples": args.ttft_samples, "rounds": args.rounds,
                               "relay_cpus": sorted(relay_cpus or []),
                               "load_procs": args.load_procs, "upstream_procs": args.upstream_procs,
                               "router": args.router, "floor": args.floor, "python_core": args.python_core,
                               "baselines": baselines, "baseline": baselines[0] if baselines else None,
                               "cpu_over_router": ratios, "cpu_over_router_run": run, "goals": goals, "rows": rows,
                               **environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
