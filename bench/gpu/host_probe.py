"""The host's own speed during a GPU run, sampled: was a slow step the engine's, or the machine's?

    python3 bench/gpu/host_probe.py OUT.jsonl [--every 0.2] [--seconds S]   # sample until killed or S
    python3 bench/gpu/host_probe.py --summary OUT.jsonl                     # what the samples say

A mixed step of the 27B hybrid is the host's work (bench/results/hybrid/h100/run-667ef4c/: the
same 255-token step took 20, 28-30, 35-38 or 43-52 ms of host time, for 0.3-2 s at a time, and
a bench with no server at all moved the same way). So beside the servers this times a fixed
piece of pure-Python work every ``--every`` seconds, on one core like the engine's loop, and
reads ``/proc/stat`` between samples: the share of all cores' time that was busy, and the share
the hypervisor took from this VM (``steal``). One JSON line a sample, appended:

    {"unix": 1796573527.61, "work_us": 842.1, "busy": 0.21, "steal": 0.0}

``work_us`` is comparable within a machine, not across machines. ``place_stalls.py --probe``
sets the samples beside each worst gap; ``--summary`` gives their spread and the slow stretches.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import statistics
import sys
import time
from pathlib import Path

WORK_LOOPS = 20_000  # ~1 ms of CPython on a server core: long enough to time, short beside --every
SLOW = 1.5  # a sample this many times the median is slow


def work() -> float:
    """Seconds one fixed piece of interpreter work takes (integer arithmetic in a loop: what
    the engine's host work is made of, without touching memory the engine uses)."""
    t = time.perf_counter()
    x = 0
    for i in range(WORK_LOOPS):
        x += i * i & 7
    return time.perf_counter() - t


def cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int, int] | None:
    """(total, idle + iowait, steal) jiffies over all cores, or None where there is no /proc/stat."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    values += [0] * (8 - len(values))
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    return sum(values[:8]), values[3] + values[4], values[7]


def sample(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None, work_s: float) -> dict:
    row = {"unix": round(time.time(), 4), "work_us": round(work_s * 1e6, 1), "busy": None, "steal": None}
    if before is not None and after is not None and after[0] > before[0]:
        total = after[0] - before[0]
        row["busy"] = round(1 - (after[1] - before[1]) / total, 3)
        row["steal"] = round((after[2] - before[2]) / total, 3)
    return row


def run(out: Path, every: float, seconds: float | None) -> int:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    end = None if seconds is None else time.monotonic() + seconds
    before = cpu_times()
    with out.open("a", encoding="utf-8") as f:
        while not stop and (end is None or time.monotonic() < end):
            tick = time.monotonic()
            took = work()
            after = cpu_times()
            f.write(json.dumps(sample(before, after, took)) + "\n")
            f.flush()
            before = after
            time.sleep(max(0.0, tick + every - time.monotonic()))
    return 0


def read(path: Path, value: str = "work_us") -> list[dict]:
    """The samples of a probe file (``.gz`` too), by time: lines with a numeric ``unix`` and
    ``value``; a line cut short by the kill is skipped (gpu_probe.py's files too: ``sm_mhz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("unix"), (int, float)) and isinstance(row.get(value), (int, float)):
            rows.append(row)
    return sorted(rows, key=lambda r: r["unix"])


def stretches(rows: list[dict], median: float, slow: float = SLOW) -> list[tuple[float, float, float]]:
    """Runs of consecutive slow samples: (first unix, last unix, their median x the run's)."""
    out, current = [], []
    for r in rows + [None]:
        if r is not None and r["work_us"] >= slow * median:
            current.append(r)
            continue
        if current:
            out.append((current[0]["unix"], current[-1]["unix"],
                        statistics.median(c["work_us"] for c in current) / median))
            current = []
    return out


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {"samples": 0}
    us = sorted(r["work_us"] for r in rows)
    median = statistics.median(us)
    steal = [r["steal"] for r in rows if r.get("steal") is not None]
    busy = [r["busy"] for r in rows if r.get("busy") is not None]
    slow = stretches(rows, median)
    return {
        "samples": len(rows), "seconds": round(rows[-1]["unix"] - rows[0]["unix"], 1),
        "work_us_p50": round(median, 1), "work_us_p90": us[int(0.9 * (len(us) - 1))], "work_us_max": us[-1],
        "slow_share": round(sum(1 for u in us if u >= SLOW * median) / len(us), 3),
        "slow_stretches": [{"from_unix": a, "to_unix": b, "x_median": round(x, 2)} for a, b, x in slow],
        "steal_max": max(steal) if steal else None, "busy_p50": statistics.median(busy) if busy else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the samples' JSON lines (appended)")
    p.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--seconds", type=float, help="stop after this long (default: until SIGTERM)")
    p.add_argument("--summary", action="store_true", help="read OUT and print what the samples say")
    args = p.parse_args(argv)
    if args.summary:
        if not args.out.is_file():
            print(f"{args.out}: no such file", file=sys.stderr)
            return 2
        s = summary(read(args.out))
        print(json.dumps(s, indent=1))
        return 0 if s["samples"] else 2
    if not args.every > 0:
        p.error("--every must be above 0")
    return run(args.out, args.every, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
