"""The paced server's mixed steps by the CUDA-graph size they were padded to: time against the
fitted line's prediction, from its step trace (PREFILL_GATE_PACING_TRACE_FILE).

    python3 bench/gpu/step_sizes.py OUT/paced-trace.jsonl.gz [--sync] [--json OUT/step-sizes.json]

The diagnosis that found the 27B hybrid's 320-token steps 9 ms dearer than the line on an H100
(bench/results/hybrid/h100/run-33e8a15/). A step's duration is the interval between schedule
calls: with vLLM's async scheduling (the default) step i runs from call i+1 to call i+2; with
``--sync`` (``--no-async-scheduling``) from call i to call i+1. Intervals past 200 ms are idle
time, not steps, and are left out. Traces written before the trace had ``graph_size`` take
the sizes from ``--sizes`` (comma-separated capture sizes). Where the trace has ``launched``
(traces since pacing stamps it), ``host ms`` is the median time the engine's host spent on a step
until its forward pass was launched (``launched - t``): where it reaches the step's measured
time, the host, not the GPU, sets the pace, and the interval after a call is that step's own.
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
from prefill_gate.proxy.bench.report import environment  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--sync", action="store_true", help="the server ran --no-async-scheduling")
    ap.add_argument("--sizes", help="capture sizes, for traces without graph_size")
    ap.add_argument("--json", type=Path)
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
    if args.json:
        args.json.write_text(json.dumps({"bench": "step_sizes", "trace": str(args.trace), **run_commit(args.trace),
                                         "rows": rows, **environment()}, indent=1))
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
