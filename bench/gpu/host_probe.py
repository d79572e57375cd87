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
sets the samples beside each worst gap; ``--summary`` gives their spread and the slow stretches;
``--parts OUT.jsonl defaults.json`` says, part by part of a ``bench defaults`` run, whether the
host was quiet enough to judge tens of milliseconds by (``QUIET_SPIKES``).
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
# A part of a run ran on a quiet host when at most QUIET_SPIKES of its samples took SPIKE times
# their own median or more: on the H100 host of bench/results/defaults/h100/run-9f76ea6/ every
# part had 0-0.2% such samples (and the 27B runs of bench/results/hybrid/h100/run-943f4b9/ none);
# on the one of run-f5b6617/, where every row missed its bounds, 1.4-9.7%.
SPIKE = 3.0
QUIET_SPIKES = 0.005


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


def part_windows(defaults: dict) -> list[tuple[str, str, float, float]]:
    """(row, part, start, end) on the wall clock of each part of a ``bench defaults`` JSON: a
    seed pair from its first run's start to its last run's end, sparse and steady load over
    their mixed phase (parts without the times: skipped)."""
    out = []
    for row, parts in (defaults.get("rows") or {}).items():
        for part, result in (parts or {}).items():
            if part == "pair":
                runs = [r for r in (result.get("raw") or []) if isinstance(r.get("t0_unix"), (int, float))]
                ends = [r["t0_unix"] + max((p.get("end") or 0) for p in r.values() if isinstance(p, dict))
                        for r in runs]
                if runs:
                    out.append((row, part, runs[0]["t0_unix"], max(ends)))
                continue
            mixed, shape = result.get("mixed") or {}, result.get("shape") or {}
            if isinstance(mixed.get("t0_unix"), (int, float)) and shape.get("duration"):
                out.append((row, part, mixed["t0_unix"], mixed["t0_unix"] + shape["duration"]))
    return out


def quiet(rows: list[dict], start: float, end: float, median: float) -> dict:
    """The samples from ``start`` to ``end``: their median against the run's ``median`` (a host
    slower all along), their slow share (against the run's), their p99 and max as multiples of
    their own median, and the share of spikes (``SPIKE`` times it): the host's moments a step
    meets, which say whether the host was quiet (``QUIET_SPIKES``)."""
    us = sorted(r["work_us"] for r in rows if start <= r["unix"] <= end)
    if not us:
        return {"samples": 0}
    own = statistics.median(us)
    spikes = sum(1 for u in us if u >= SPIKE * own) / len(us)
    return {"samples": len(us), "median_x_run": round(own / median, 2),
            "slow_share": round(sum(1 for u in us if u >= SLOW * median) / len(us), 3),
            "p99_x_median": round(us[int(0.99 * (len(us) - 1))] / own, 2), "max_x_median": round(us[-1] / own, 2),
            "spike_share": round(spikes, 4), "quiet": spikes <= QUIET_SPIKES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the samples' JSON lines (appended)")
    p.add_argument("defaults", type=Path, nargs="?", help="with --parts: bench defaults' JSON")
    p.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--seconds", type=float, help="stop after this long (default: until SIGTERM)")
    p.add_argument("--summary", action="store_true", help="read OUT and print what the samples say")
    p.add_argument("--parts", action="store_true", help="read OUT: was the host quiet during each part of DEFAULTS?")
    args = p.parse_args(argv)
    if args.parts:
        if args.defaults is None:
            p.error("--parts needs the defaults JSON")
        rows = read(args.out) if args.out.is_file() else []
        if not rows:
            print(f"{args.out}: no samples", file=sys.stderr)
            return 2
        median = statistics.median(r["work_us"] for r in rows)
        for row, part, start, end in part_windows(json.loads(args.defaults.read_text())):
            q = quiet(rows, start, end, median)
            verdict = "no samples" if not q["samples"] else ("quiet" if q["quiet"] else
                                                             f"NOISY (over {QUIET_SPIKES:.1%} of samples {SPIKE:g}x "
                                                             "their median)")
            print(f"host {row} {part}: {verdict} {json.dumps(q)}")
        return 0
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
