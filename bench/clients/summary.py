"""The table of bench/clients/run.sh: per target, what `vllm bench serve` (or AIPerf, for the
interactive client with CLIENT=aiperf) reported.

    python3 bench/clients/summary.py RES_DIR --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment, git_state, percentile, table  # noqa: E402

KEYS = ("completed", "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
        "p99.9_itl_ms", "median_tpot_ms", "p99_tpot_ms")


def aiperf_row(run: pathlib.Path) -> dict:
    """AIPerf's per-request records in vLLM's keys: TTFT, and its inter-chunk latencies (every
    gap between streamed chunks, what vLLM's client calls ITL); goodput from its summary."""
    ttfts, gaps, done = [], [], 0
    for line in (run / "profile_export.jsonl").read_text().splitlines():
        metrics = json.loads(line).get("metrics", {})
        if "time_to_first_token" not in metrics:
            continue  # a failed request: no first token
        done += 1
        ttfts.append(metrics["time_to_first_token"]["value"])
        gaps += metrics.get("inter_chunk_latency", {}).get("value", [])
    summary = json.loads((run / "profile_export_aiperf.json").read_text())

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    return {"completed": done, "request_goodput": summary.get("goodput", {}).get("avg"),
            "median_ttft_ms": pct(ttfts, 50), "p99_ttft_ms": pct(ttfts, 99), "median_itl_ms": pct(gaps, 50),
            "p99_itl_ms": pct(gaps, 99), "p99.9_itl_ms": pct(gaps, 99.9), "max_itl_ms": max(gaps, default=None),
            "client": f"aiperf {summary.get('aiperf_version')}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("res", type=pathlib.Path)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    stamp = git_state()  # vllm bench serve records no commit: the files say which code they measured
    for path in [*args.res.glob("*.json"), *args.res.glob("aiperf-*/profile_export_aiperf.json")]:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "git_commit" not in data:
            path.write_text(json.dumps({**stamp, **data}))
    rows = []
    for label in ("direct", "hold", "auto"):
        row = {"target": label}
        if (args.res / f"aiperf-{label}").is_dir():
            row["interactive"] = aiperf_row(args.res / f"aiperf-{label}")
        for kind in ("interactive", "long"):
            path = args.res / f"{kind}-{label}.json"
            if not path.exists():
                continue
            data = json.loads(path.read_text())
            row[kind] = {k: data.get(k) for k in KEYS if k in data}
            row[kind]["max_itl_ms"] = max((max(x) for x in data.get("itls", []) if x), default=None)
            if row[kind]["max_itl_ms"] is not None:
                row[kind]["max_itl_ms"] *= 1000.0
        rows.append(row)
    flat = [{"target": r["target"], **{f"{k}_{m}": v for k in ("interactive", "long") for m, v in r.get(k, {}).items()}}
            for r in rows]
    cols = [("target", "target"), ("interactive_completed", "inter. done"), ("interactive_request_goodput", "goodput/s"),
            ("interactive_median_ttft_ms", "TTFT p50 ms"), ("interactive_p99_ttft_ms", "TTFT p99 ms"),
            ("interactive_median_itl_ms", "ITL p50 ms"), ("interactive_p99_itl_ms", "ITL p99 ms"),
            ("interactive_p99.9_itl_ms", "ITL p99.9 ms"), ("interactive_max_itl_ms", "ITL max ms"),
            ("long_completed", "long done"), ("long_median_ttft_ms", "long TTFT p50 ms"),
            ("long_p99_ttft_ms", "long TTFT p99 ms")]
    print(table(flat, cols))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv),
                                                       **environment()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
