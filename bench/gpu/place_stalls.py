"""Set a run's worst stream gaps beside what the servers logged at that moment.

    python3 bench/gpu/place_stalls.py OUT/defaults.json [--gc gc-pauses.log, from OUT/defaults-logs.tar.gz]
        [--trace OUT/paced-trace.jsonl.gz] [--probe WORK/host-probe.jsonl] [--row stack] [--part steady|pair]

For each stall of the steady phase's ``worst_gaps`` (gaps that began within 5 ms of each other
are one stall: the same engine moment), its wall-clock window (the phase's ``t0_unix`` plus
the gap's times), the cycle-collector pauses (``gc-pauses.log``, the plugin's and the
proxy's lines) that overlap it, and the paced engine's steps (``PREFILL_GATE_PACING_TRACE_FILE``)
that began in it, each with how long it lasted until the next step began. A stall with a
long collection inside names itself; one whose steps all stayed short was made after the
engine (its output path, the proxy, the client). ``--probe``: the host's own speed then
(``host_probe.py``'s samples, each against their median): a stall whose steps ran long while the
probe's work ran slow too was the machine's, not the engine's.

``--part pair``: the seed pair's runs instead (each run's worst gap of B; runs measured since
``t0_unix`` was recorded with them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_probe  # noqa: E402  (bench/gpu/host_probe.py)

SAME_STALL_S = 0.005
PROBE_MARGIN_S = 0.1  # probe samples this close to a stall count as its
_GC = re.compile(r"held .*? ([\d.]+) ms.*?ending at ([\d.]+) \(unix s\)")


def stalls(worst: list[list[float]], t0_unix: float) -> list[dict]:
    """``worst_gaps`` rows ``[ended s, gap ms, user]`` grouped into stalls, by start."""
    gaps = sorted((t0_unix + end - gap / 1e3, t0_unix + end, gap, user) for end, gap, user in worst)
    out: list[dict] = []
    for start, end, gap, user in gaps:
        if out and start - out[-1]["start"] <= SAME_STALL_S:
            s = out[-1]
            s["end"], s["gap_ms"] = max(s["end"], end), max(s["gap_ms"], gap)
            s["users"].append(user)
        else:
            out.append({"start": start, "end": end, "gap_ms": gap, "users": [user]})
    return out


def pair_stalls(raw: list[dict]) -> list[dict]:
    """Each pair run's worst gap of B, on the wall clock (runs without ``t0_unix``: skipped)."""
    out = []
    for run in raw:
        tokens = (run.get("b") or {}).get("tokens") or []
        if "t0_unix" not in run or len(tokens) < 2:
            continue
        gap, i = max((b - a, i) for i, (a, b) in enumerate(zip(tokens, tokens[1:])))
        start = run["t0_unix"] + tokens[i]
        out.append({"start": start, "end": start + gap, "gap_ms": gap * 1e3, "users": [f"B, run {run['run']}"]})
    return out


def probe_near(stall: dict, probe: list[dict]) -> list[dict]:
    """The host probe's samples during ``stall`` (within PROBE_MARGIN_S), each as x the median."""
    if not probe:
        return []
    median = sorted(r["work_us"] for r in probe)[len(probe) // 2]
    lo, hi = stall["start"] - PROBE_MARGIN_S, stall["end"] + PROBE_MARGIN_S
    return [{"at_ms": round((r["unix"] - stall["start"]) * 1e3, 1), "work_us": r["work_us"],
             "x_median": round(r["work_us"] / median, 2), "steal": r.get("steal")}
            for r in probe if lo <= r["unix"] <= hi]


def collections(lines: list[str]) -> list[tuple[float, float, str]]:
    """``(start, end, line)`` of each logged collection."""
    out = []
    for line in lines:
        m = _GC.search(line)
        if m:
            ms, end = float(m.group(1)), float(m.group(2))
            out.append((end - ms / 1e3, end, line.strip()))
    return out


def steps(records: list[dict]) -> list[dict]:
    """Trace lines with ``lasted_s`` (until the next line began; the last: unknown),
    ``requests`` (decode rows and prompts' chunks) and ``most_requests_yet`` (more requests than
    any step before it of the same server: a server's first step past 8 has run ~70 ms more host
    time where nothing else differed, bench/results/hybrid/h100/run-ed51eec/README.md; a trace
    holds every server that wrote to it, each from its step 1)."""
    records = sorted((r for r in records if "unix" in r), key=lambda r: r["unix"])
    most, last_step = 0, None
    for r, nxt in zip(records, records[1:] + [None]):
        r["lasted_s"] = None if nxt is None else nxt["unix"] - r["unix"]
        r["requests"] = (r.get("decode_rows") or 0) + len(r.get("chunks") or [])
        step = r.get("step")
        if step is not None and last_step is not None and step <= last_step:
            most = 0  # the step count began again: another server
        last_step = step if step is not None else last_step
        r["most_requests_yet"], most = r["requests"] > most, max(most, r["requests"])
    return records


def place(stall: dict, gcs: list[tuple[float, float, str]], trace: list[dict]) -> dict:
    """The collections overlapping ``stall`` and the steps in it, from the one it began in
    (negative ``at_ms``: that step may be what held it)."""
    lo, hi = stall["start"], stall["end"]
    first = max((i for i, r in enumerate(trace) if r["unix"] <= lo), default=0)
    return {
        **stall,
        "collections": [line for a, b, line in gcs if a < hi and b > lo],
        "steps": [{"at_ms": round((r["unix"] - lo) * 1e3, 1),
                   "lasted_ms": None if r["lasted_s"] is None else round(r["lasted_s"] * 1e3, 1),
                   "decode_rows": r.get("decode_rows"), "prefill_tokens": sum(n for _, n in r.get("chunks") or []),
                   "requests": r["requests"], "most_requests_yet": r["most_requests_yet"],
                   "predicted_ms": None if r.get("predicted_s") is None else round(r["predicted_s"] * 1e3, 1),
                   "host_ms": _host_ms(r)}
                  for r in trace[first:] if r["unix"] < hi],
    }


def _host_ms(record: dict) -> float | None:
    """The engine's host time for a step: from its schedule (``t``) to its launch, on the
    engine's clock; None in traces from before ``launched`` was recorded."""
    t, launched = record.get("t"), record.get("launched")
    return None if t is None or launched is None else round((launched - t) * 1e3, 1)


def _read(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("defaults", type=Path, help="defaults.json (bench defaults)")
    p.add_argument("--gc", type=Path, help="gc-pauses.log (in defaults-logs.tar.gz in runs after ed51eec)")
    p.add_argument("--trace", type=Path, help="the paced server's step trace (.jsonl or .jsonl.gz)")
    p.add_argument("--probe", type=Path, help="host_probe.py's samples (host-probe.jsonl)")
    p.add_argument("--row", default="stack")
    p.add_argument("--part", default="steady", choices=("steady", "sparse", "pair"))
    args = p.parse_args(argv)
    try:
        part = json.loads(args.defaults.read_text())["rows"].get(args.row, {}).get(args.part)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"{args.defaults}: not a bench defaults result ({exc!r})", file=sys.stderr)
        return 2
    if not isinstance(part, dict) or (args.part != "pair" and not isinstance(part.get("mixed"), dict)):
        print(f"{args.defaults}: no {args.row} {args.part} part", file=sys.stderr)
        return 2
    if args.part == "pair":
        raw = part.get("raw") or []
        timed, found = any("t0_unix" in r for r in raw), pair_stalls(raw)
    else:
        timed = "t0_unix" in part["mixed"]
        found = stalls(part["mixed"]["worst_gaps"], part["mixed"]["t0_unix"]) if timed else []
    if not timed:
        print(f"{args.defaults}: the {args.row} {args.part} part has no t0_unix (measured before it was "
              "recorded): its gaps cannot be placed on the wall clock", file=sys.stderr)
        return 2
    gcs = collections(_read(args.gc)) if args.gc else []
    trace = steps([json.loads(x) for x in _read(args.trace) if x.strip()]) if args.trace else []
    probe = host_probe.read(args.probe) if args.probe else []
    for s in found:
        s = place(s, gcs, trace)
        print(f"stall at {s['start']:.3f}: {s['gap_ms']:.1f} ms, {len(s['users'])} stream(s) "
              f"{sorted(s['users'])}, ended by {s['end'] - s['start']:.3f} s")
        for line in s["collections"]:
            print(f"  collection: {line}")
        for st in s["steps"]:
            lasted = "to the trace's end" if st["lasted_ms"] is None else f"lasting {st['lasted_ms']} ms"
            print(f"  step at {st['at_ms']:+.1f} ms {lasted}: {st['decode_rows']} decode rows, "
                  f"{st['prefill_tokens']} prefill tokens, predicted {st['predicted_ms']} ms"
                  + ("" if st["host_ms"] is None else f", host {st['host_ms']} ms")
                  + (f"; {st['requests']} requests, this server's first step with that many"
                     if st["most_requests_yet"] else ""))
        for pr in probe_near(s, probe):
            print(f"  host probe at {pr['at_ms']:+.1f} ms: {pr['work_us']:.0f} us, {pr['x_median']:.2f}x its median"
                  + (f", {pr['steal']:.0%} stolen" if pr.get("steal") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
