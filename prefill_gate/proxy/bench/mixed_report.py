"""`bench mixed`'s command line, tables, plot and merge (the workload is `mixed.py`)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

from .mixed import HIST_EDGES_MS, SLO, STALL_MS, MixedShape, normalize_base_url, run_mixed
from .report import environment, table, write_json

MIXED_COLUMNS = [
    ("label", "endpoint"),
    ("seed", "seed"),
    ("itl_ms_p50", "ITL p50 ms"),
    ("itl_ms_p99", "ITL p99 ms"),
    ("itl_ms_max", "ITL max ms"),
    ("gaps_over_50ms_pct", "gaps>50ms %"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "TTFT p99 ms"),
    ("long_ttft_s_p50", "long TTFT p50 s"),
    ("long_ttft_s_p90", "p90 s"),
    ("long_ttft_s_max", "max s"),
    ("long_x_p50", "long x alone p50"),
    ("goodput_rps", "goodput rps"),
    ("strict_pct", "strict %"),
    ("done_failed", "done/failed"),
]
BASELINE_COLUMNS = [
    ("label", "endpoint"),
    ("seed", "seed"),
    ("itl_ms_p50", "alone ITL p50 ms"),
    ("itl_ms_p99", "ITL p99 ms"),
    ("itl_ms_max", "ITL max ms"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "TTFT p99 ms"),
    ("long_alone", "long alone TTFT s"),
    ("itl_p99_x", "steady ITL p99 / alone"),
    ("no_stream_pct", "no stream live %"),
]


def rows(result: dict) -> tuple[list[dict], list[dict]]:
    mixed_rows, base_rows = [], []
    for ep in result["endpoints"]:
        for run in ep["runs"]:
            m, b = run["mixed"], run["baseline"]
            mixed_rows.append({**m, "label": ep["label"], "seed": run["seed"],
                               "gaps_over_50ms_pct": 100 * m["gaps_over_50ms_share"],
                               "strict_pct": 100 * m["strict_share"],
                               "done_failed": f"{m['interactive_completed'] + m.get('long_completed', 0)}/"
                                              f"{m['interactive_failed'] + m.get('long_failed', 0)}"})
            base_rows.append({**b, "label": ep["label"], "seed": run["seed"],
                              "long_alone": run["long_alone_ttft_s_p50"],
                              "itl_p99_x": m["itl_p99_x_baseline"], "no_stream_pct": 100 * m["no_stream_share"]})
    return mixed_rows, base_rows


def _ccdf_from_hist(counts: list[int]) -> tuple[list[float], list[float]]:
    """(x, share of gaps longer than x) at each histogram edge that has gaps above it."""
    total = sum(counts)
    xs, ys, above = [], [], total
    for edge, n in zip(HIST_EDGES_MS, counts):
        above -= n
        if above <= 0:
            break
        xs.append(edge)
        ys.append(above / total)
    return xs, ys


def plot_mixed(result: dict, path: str) -> None:
    """Per endpoint (its first seed): interactive gaps (share longer than x, from the gap
    histogram), interactive TTFTs and long TTFTs (CDFs), on shared axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gap, ax_ttft, ax_long) = plt.subplots(1, 3, figsize=(15, 4.4))
    for ep in result["endpoints"]:
        m = ep["runs"][0]["mixed"]
        xs, ys = _ccdf_from_hist(m["gap_hist"])
        if xs:
            ax_gap.step(xs, ys, where="post", label=ep["label"])
        for ax, vals in ((ax_ttft, m["ttft_ms_all"]), (ax_long, m.get("long_ttft_s_all") or [])):
            if vals:
                ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=ep["label"])
    ax_gap.set(xscale="log", yscale="log", xlabel="gap between two tokens of a streaming answer (ms)",
               ylabel="share of gaps longer than x", title="Live streams: how often they stall")
    ax_ttft.set(xscale="log", xlabel="time to first token (ms)", ylabel="share of requests",
                title="New interactive requests: first token")
    ax_long.set(xscale="log", xlabel="time to first token (s)", ylabel="share of long prompts",
                title="Long prompts: time to first token")
    for ax in (ax_gap, ax_ttft, ax_long):
        ax.grid(True, which="both", alpha=0.3)
    ax_gap.axvline(STALL_MS, color="grey", lw=0.8, ls=":")
    ax_long.legend(fontsize=8, loc="lower right")
    s = result["shape"]
    fig.suptitle(f"{s['users']} interactive users (think ~{s['think']:g} s, {s['interactive_prompt']}-token "
                 f"prompts) + a {s['long_prompt']:,}-token prompt every ~{s['long_every']:g} s, "
                 f"{s['duration']:g} s per endpoint", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(results: list[dict]) -> dict:
    """Several runs of the bench (one endpoint each, say, with a server retuned between
    them) as one result; they must share the shape and the seeds."""
    first = results[0]
    for r in results[1:]:
        if r["shape"] != first["shape"] or r["seeds"] != first["seeds"] or r["slo"] != first["slo"]:
            raise ValueError("the results differ in shape, seeds or SLOs: they are not one comparison")
    return {**first, "endpoints": [ep for r in results for ep in r["endpoints"]],
            "parts": [{k: r.get(k) for k in ("command", "git_commit", "git_dirty")} for r in results]}


def report(result: dict) -> str:
    mixed_rows, base_rows = rows(result)
    return ("steady load (interactive users + long prompts):\n" + table(mixed_rows, MIXED_COLUMNS)
            + "\n\nsame-run baselines (the users alone; the long prompt alone):\n" + table(base_rows, BASELINE_COLUMNS))


def main(args) -> int:
    labels = args.label or []
    if labels and len(labels) != len(args.base_url):
        print("prefill-gate bench mixed: give one --label per --base-url (or none)", file=sys.stderr)
        return 2
    labels = labels or [normalize_base_url(u) for u in args.base_url]
    shape = MixedShape(users=args.users, think=args.think, interactive_prompt=args.interactive_prompt,
                       interactive_tokens=args.interactive_tokens, long_prompt=args.long_prompt,
                       long_tokens=args.long_tokens, long_every=args.long_every, duration=args.duration,
                       baseline_duration=args.baseline_duration, long_alone_runs=args.long_alone_runs)
    slo = SLO(ttft_ms=args.slo_ttft_ms or None, tpot_ms=args.slo_tpot_ms or None, e2el_ms=args.slo_e2el_ms or None,
              max_gap_ms=args.slo_max_gap_ms, long_x=args.slo_long_x)
    seeds = [args.seed + k for k in range(args.seeds)]
    try:
        shape.validate()
        if args.seeds < 1:
            raise ValueError("seeds must be at least 1")
        result = asyncio.run(run_mixed(args.base_url, labels, shape, slo, seeds, args.model, args.time_scale))
    except ValueError as exc:
        print(f"prefill-gate bench mixed: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, httpx.HTTPError, OSError) as exc:
        print(f"prefill-gate bench mixed: {exc}", file=sys.stderr)
        return 1
    print(report(result))
    record = {**result, **environment()}
    if args.json:
        write_json(args.json, record)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot_mixed(record, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main_report(args) -> int:
    """``bench mixed-report F.json ...``: the tables of saved results, merged and plotted."""
    try:
        result = merge([json.loads(Path(f).read_text()) for f in args.files])
    except (OSError, ValueError, KeyError) as exc:
        print(f"prefill-gate bench mixed-report: {exc}", file=sys.stderr)
        return 2
    print(report(result))
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot_mixed(result, args.plot)
    return 0


def add_arguments(p) -> None:
    d, s = MixedShape(), SLO()
    p.add_argument("--base-url", action="append", required=True, metavar="URL",
                   help="an OpenAI-compatible endpoint (repeat: each is measured in turn)")
    p.add_argument("--label", action="append", metavar="NAME", help="a name per --base-url, in order")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--users", type=int, default=d.users, help="interactive users (default: %(default)s)")
    p.add_argument("--think", type=float, default=d.think, metavar="S",
                   help="mean think time between a user's requests, exponential (default: %(default)s)")
    p.add_argument("--interactive-prompt", type=int, default=d.interactive_prompt, metavar="T",
                   help="interactive prompt tokens (default: %(default)s)")
    p.add_argument("--interactive-tokens", type=int, default=d.interactive_tokens, metavar="T",
                   help="mean streamed tokens per interactive answer, drawn 0.5x-1.5x (default: %(default)s)")
    p.add_argument("--long-prompt", type=int, default=d.long_prompt, metavar="T",
                   help="long prompt tokens (default: %(default)s)")
    p.add_argument("--long-tokens", type=int, default=d.long_tokens, metavar="T",
                   help="streamed tokens of a long prompt's answer (default: %(default)s)")
    p.add_argument("--long-every", type=float, default=d.long_every, metavar="S",
                   help="mean seconds between long prompts, Poisson (default: %(default)s)")
    p.add_argument("--duration", type=float, default=d.duration, metavar="S",
                   help="seconds of steady load per endpoint (default: %(default)s)")
    p.add_argument("--baseline-duration", type=float, default=d.baseline_duration, metavar="S",
                   help="seconds of the users alone per endpoint (default: %(default)s)")
    p.add_argument("--long-alone-runs", type=int, default=d.long_alone_runs, metavar="N",
                   help="runs of the long prompt alone per endpoint (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=1, metavar="K",
                   help="repeat with seeds SEED..SEED+K-1 and report the range (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="the endpoint runs X times slower than real (a simulator with --time-scale X): "
                        "stretch the schedule by X and report times divided by X (default: %(default)s)")
    p.add_argument("--slo-ttft-ms", type=float, default=s.ttft_ms,
                   help="goodput and strict share: interactive TTFT bound, 0 none (default: %(default)s)")
    p.add_argument("--slo-tpot-ms", type=float, default=s.tpot_ms,
                   help="goodput: mean time per output token bound, 0 none (default: %(default)s)")
    p.add_argument("--slo-e2el-ms", type=float, default=0.0,
                   help="goodput: end-to-end latency bound, 0 none (default: %(default)s)")
    p.add_argument("--slo-max-gap-ms", type=float, default=s.max_gap_ms,
                   help="strict share: every gap within this (default: %(default)s)")
    p.add_argument("--slo-long-x", type=float, default=s.long_x,
                   help="long prompts: TTFT within this multiple of alone (default: %(default)s)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--plot", help="write CDFs per endpoint here (PNG)")
