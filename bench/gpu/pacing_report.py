"""Summarise a pacing sweep: a table, the adaptive targets, and B's p99 against A's TTFT.

    python3 bench/gpu/pacing_report.py DIR [DIR ...] --out OUTDIR

Reads the `bench overlap` JSON files that bench/gpu/pacing_h200.sh wrote (one per
configuration) and writes OUTDIR/pacing-summary.md, pacing.json (the rows) and
pacing.png (one curve per method: the trade each method offers).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import markdown_table

COLUMNS = [
    ("batch", "batch"),
    ("config", "config"),
    ("method", "method"),
    ("size", "size"),
    ("solo_itl_ms_p50", "B solo p50 ms"),
    ("overlap_itl_ms_p50", "B overlap p50 ms"),
    ("overlap_itl_ms_p99", "B overlap p99 ms"),
    ("overlap_itl_ms_max", "B overlap max ms"),
    ("overlap_b_tokens_per_s", "B tok/s in overlap"),
    ("a_ttft_s", "A TTFT s"),
    ("a_solo_ttft_s", "A alone TTFT s"),
]
METHODS = {
    "stock": "vLLM unpatched, 8192",
    "mnbt": "vLLM --max-num-batched-tokens",
    "mnbt-full": "vLLM --max-num-batched-tokens, full CUDA graphs",
    "lpt": "vLLM --long-prefill-token-threshold",
    "paced-off": "paced server, pacing off",
    "paced-cap": "pacing cap",
    "paced-cap-noalign": "pacing cap, steps not lowered to a graph size (GRAPH_ALIGN=0)",
    "paced-cadence": "pacing cadence",
    "paced-adaptive": "pacing adaptive (target ms; batch 1: the model alone, no feedback)",
    "paced-adaptive-q128": "pacing adaptive, STEP_QUANTUM 128 (target ms)",
    "paced-fb-adaptive": "pacing adaptive (target ms)",
    "paced-full-off": "paced server, full graphs, pacing off",
    "paced-full-cap": "pacing cap, full CUDA graphs",
    "paced-full-adaptive": "pacing adaptive, full CUDA graphs (target ms)",
    "paced-cold-adaptive": "pacing adaptive, its server's first setting: an empty fit (target ms)",
    "paced-fullcr-off": "paced server, full graphs + small-step compile, pacing off",
    "paced-fullcr-cap": "pacing cap, full graphs + small-step compile",
    "paced-fullcr-adaptive": "pacing adaptive, full graphs + small-step compile (target ms)",
}


def classify(config: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(stock|mnbt|lpt)-(\d+)(-full)?", config)
    if m:
        return m.group(1) + (m.group(3) or ""), int(m.group(2))
    m = re.fullmatch(r"(paced(?:-full|-fullcr|-fb|-cold)?)-(off|cap|cadence|adaptive)(?:-(\d+))?(?:-(noalign|q128))?",
                     config)
    if m:
        method = f"{m.group(1)}-{m.group(2)}" + (f"-{m.group(4)}" if m.group(4) else "")
        return method, int(m.group(3)) if m.group(3) else None
    return config, None


def load(dirs: list[pathlib.Path]) -> list[dict]:
    rows = []
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            data = json.loads(path.read_text())
            if data.get("bench") != "overlap":
                continue
            method, size = classify(data.get("config") or path.stem)
            row = {k: data.get(k) for k, _ in COLUMNS if k in data}
            row.update(batch=d.name, config=data.get("config") or path.stem, method=method, size=size,
                       overlap_itl_ms_p99_spread=data.get("spread", {}).get("overlap_itl_ms_p99"))
            rows.append(row)
    order = list(METHODS)
    rows.sort(key=lambda r: (r["batch"], order.index(r["method"]) if r["method"] in order else 99,
                             -(r["size"] or 0)))
    return rows


def adaptive_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["method"].endswith("adaptive") and r["size"]:
            p99 = r["overlap_itl_ms_p99"]
            out.append({"config": r["config"], "target_ms": r["size"], "p99_ms": p99,
                        "p99_over_target": p99 / r["size"],
                        "target_over_solo_p50": r["size"] / r["solo_itl_ms_p50"]})
    return out


# What the plot shows (the table has every row): vLLM's knobs, and pacing as shipped.
PLOTTED = {
    "stock": ("vLLM unpatched (8192)", "black", "X"),
    "mnbt": ("vLLM --max-num-batched-tokens", "tab:orange", "s"),
    "mnbt-full": ("vLLM --max-num-batched-tokens, full CUDA graphs", "tab:brown", "s"),
    "lpt": ("vLLM --long-prefill-token-threshold", "tab:red", "D"),
    "paced-cap": ("pacing cap", "tab:blue", "o"),
    "paced-fb-adaptive": ("pacing adaptive (target ms)", "tab:green", "^"),
    "paced-adaptive": ("pacing adaptive (target ms)", "tab:green", "^"),
    "paced-cold-adaptive": ("pacing adaptive from an empty fit (target ms)", "tab:green", "v"),
    "paced-full-cap": ("pacing cap, full CUDA graphs", "tab:cyan", "o"),
    "paced-full-adaptive": ("pacing adaptive, full CUDA graphs (target ms)", "tab:olive", "^"),
}


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    for method, (label, color, marker) in PLOTTED.items():
        pts = sorted((r["a_ttft_s"], r["overlap_itl_ms_p99"], r["size"], r["a_solo_ttft_s"])
                     for r in rows if r["method"] == method)
        if not pts:
            continue
        xs, ys, _, solo = zip(*pts)
        ax.plot(xs, ys, marker=marker, color=color, label=label)
        ax2.scatter(solo, ys, marker=marker, color=color, label=label)
        for x, y, size, _ in pts:
            if size and method != "stock":
                ax.annotate(str(size), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for a in (ax, ax2):
        a.set_ylabel("B's p99 inter-token gap while A prefills (ms)")
        a.set_yscale("log")
        a.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("A's time to first token next to B (s)")
    ax.set_title("The trade during the overlap (lower-left is better)")
    ax.legend(fontsize=7)
    ax2.set_xlabel("A's time to first token alone on the same server (s)")
    ax2.set_title("What A pays when nothing else runs")
    fig.suptitle("Seed shape on an H200, vLLM 0.26.0, Qwen3-8B shape (dummy weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirs", nargs="+", type=pathlib.Path)
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args()
    rows = load(args.dirs)
    if not rows:
        raise SystemExit(f"no overlap results in {', '.join(map(str, args.dirs))}")
    args.out.mkdir(parents=True, exist_ok=True)
    adaptive = adaptive_rows(rows)
    md = markdown_table(rows, COLUMNS)
    if adaptive:
        md += "\n\n" + markdown_table(adaptive, [
            ("config", "config"), ("target_ms", "target ms"), ("p99_ms", "B overlap p99 ms"),
            ("p99_over_target", "p99 / target"), ("target_over_solo_p50", "target / solo p50")])
    (args.out / "pacing-summary.md").write_text(md + "\n")
    (args.out / "pacing.json").write_text(json.dumps({"rows": rows, "adaptive": adaptive},
                                                     indent=1) + "\n")
    try:
        plot(rows, args.out / "pacing.png")
    except ImportError:
        print("matplotlib missing: no plot")
    print(md)


if __name__ == "__main__":
    main()
