"""The paced server's mixed steps by the CUDA-graph size they were padded to: time against the
fitted line's prediction, from its step trace (PREFILL_GATE_PACING_TRACE_FILE).

    python3 bench/gpu/step_sizes.py OUT/paced-trace.jsonl.gz [--sync] [--json OUT/step-sizes.json]
    python3 bench/gpu/step_sizes.py OUT/paced-trace.jsonl.gz --during steady   # + host ms under steady load

The diagnosis that found the 27B hybrid's 320-token steps 9 ms dearer than the line on an H100
(bench/results/hybrid/h100/run-33e8a15/). A step's duration is the interval between schedule
calls: with vLLM's async scheduling (the default) step i runs from call i+1 to call i+2; with
``--sync`` (``--no-async-scheduling``) from call i to call i+1. Intervals past 200 ms are idle
time, not steps, and are left out. Traces written before the trace had ``graph_size`` take
the sizes from ``--sizes`` (comma-separated capture sizes). Where the trace has ``launched``
(traces since pacing stamps it), ``host ms`` is the median time the engine's host spent on a step
until its forward pass was launched (``launched - t``): where it reaches the step's measured
time, the host, not the GPU, sets the pace, and the interval after a call is that step's own.
``--during PART`` adds that host time's spread (p50 / p90 / p99 / max) over the mixed and the
decode-only steps traced while a part of ``bench defaults`` ran its load (``defaults.json``
beside the trace, ``--row``, default stack: the steady part's ``t0_unix`` and duration).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment, percentile  # noqa: E402

IDLE_S = 0.2


def read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def by_size(records: list[dict], *, lag: int = 1, sizes: list[int] | None = None) -> list[dict]:
    """One row per graph size (None: eager) of the mixed steps' measured and predicted times."""
    groups: dict[int | None, list[tuple[float, float | None, int, float | None]]] = {}
    for i, r in enumerate(records):
        if not (r.get("chunks") and r.get("decode_rows")) or i + 1 + lag >= len(records):
            continue
        seconds = records[i + 1 + lag]["t"] - records[i + lag]["t"]
        if not 0 < seconds < IDLE_S:
            continue
        tokens = r["decode_rows"] + sum(n for _, n in r["chunks"])
        if sizes:
            j = bisect.bisect_left(sizes, tokens)
            size = sizes[j] if j < len(sizes) else None
        else:
            size = r.get("graph_size")
        launched = r.get("launched")
        host = launched - r["t"] if launched is not None else None
        groups.setdefault(size, []).append((seconds, r.get("predicted_s"), i, host))
    rows = []
    for size in sorted(groups, key=lambda s: (s is None, s or 0)):
        steps = groups[size]
        measured = [s for s, _, _, _ in steps]
        predicted = [p for _, p, _, _ in steps if p is not None]
        host = [h for _, _, _, h in steps if h is not None]
        worst = max(steps, key=lambda step: step[0])
        rows.append({"graph_size": size, "steps": len(steps),
                     "median_ms": round(statistics.median(measured) * 1e3, 1),
                     "max_ms": round(max(measured) * 1e3, 1),
                     "predicted_median_ms": round(statistics.median(predicted) * 1e3, 1) if predicted else None,
                     "host_median_ms": round(statistics.median(host) * 1e3, 1) if host else None,
                     "worst_step_index": worst[2]})
    return rows


def host_during(records: list[dict], lo: float, hi: float) -> dict:
    """The host time (ms) of the mixed and the decode-only steps scheduled between the wall-clock
    times ``lo`` and ``hi``: p50 / p90 / p99 / max and how many (None where none had ``launched``)."""
    out = {}
    for kind, wanted in (("mixed", lambda r: bool(r.get("chunks"))), ("decode", lambda r: not r.get("chunks"))):
        ms = [(r["launched"] - r["t"]) * 1e3 for r in records
              if r.get("launched") is not None and r.get("decode_rows") and lo <= r.get("unix", -1.0) <= hi and wanted(r)]
        out[kind] = {"steps": len(ms), **({f"host_ms_{k}": round(percentile(ms, q), 1) for k, q in
                                           (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))} if ms else {})}
    return out


def part_window(defaults: dict, row: str, part: str) -> tuple[float, float]:
    """When ``part`` of ``row`` ran its load: the steady part's mixed phase, from its
    ``t0_unix`` for its duration."""
    result = defaults["rows"][row][part]
    return result["mixed"]["t0_unix"], result["mixed"]["t0_unix"] + result["shape"]["duration"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--sync", action="store_true", help="the server ran --no-async-scheduling")
    ap.add_argument("--sizes", help="capture sizes, for traces without graph_size")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--during", choices=("steady",), help="host time over the steps of this part's load")
    ap.add_argument("--row", default="stack", help="with --during: the row in defaults.json beside the trace")
    args = ap.parse_args(argv)
    try:
        records = read(args.trace)
    except (OSError, ValueError) as exc:
        print(f"{args.trace}: not a step trace ({exc})", file=sys.stderr)
        return 2
    sizes = sorted(int(s) for s in args.sizes.split(",")) if args.sizes else None
    if sizes is None and records and "graph_size" not in records[0]:
        print(f"{args.trace}: written before traces had graph_size: pass --sizes", file=sys.stderr)
        return 2
    rows = by_size(records, lag=0 if args.sync else 1, sizes=sizes)
    print(f"{'graph size':>10}  {'steps':>6}  {'median ms':>9}  {'max ms':>7}  {'line says ms':>12}  {'host ms':>7}")
    for r in rows:
        size = "eager" if r["graph_size"] is None else r["graph_size"]
        line = "-" if r["predicted_median_ms"] is None else r["predicted_median_ms"]
        host = "-" if r["host_median_ms"] is None else r["host_median_ms"]
        print(f"{size:>10}  {r['steps']:>6}  {r['median_ms']:>9}  {r['max_ms']:>7}  {line:>12}  {host:>7}")
    during = None
    if args.during:
        try:
            lo, hi = part_window(json.loads((args.trace.parent / "defaults.json").read_text()), args.row, args.during)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{args.trace.parent / 'defaults.json'}: no {args.row} {args.during} part with its "
                  f"t0_unix ({exc!r})", file=sys.stderr)
            return 2
        during = {"part": args.during, "row": args.row, "t0_unix": lo, "end_unix": hi, **host_during(records, lo, hi)}
        for kind in ("mixed", "decode"):
            h = during[kind]
            spread = " / ".join(str(h.get(f"host_ms_{k}", "-")) for k in ("p50", "p90", "p99", "max"))
            print(f"{args.row} {args.during}: {kind} steps {h['steps']}, host ms p50 / p90 / p99 / max {spread}")
    if args.json:
        args.json.write_text(json.dumps({"bench": "step_sizes", "trace": str(args.trace), **run_commit(args.trace),
                                         "rows": rows, **({"during": during} if during else {}), **environment()},
                                        indent=1))
    return 0


def run_commit(trace: Path) -> dict:
    """The commit the traced server ran (``defaults.json`` beside the trace, as the GPU scripts
    leave it), beside the analysing checkout's own ``git_commit``."""
    try:
        run = json.loads((trace.parent / "defaults.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"run_git_commit": run.get("git_commit"), "run_git_dirty": run.get("git_dirty")}


if __name__ == "__main__":
    sys.exit(main())
