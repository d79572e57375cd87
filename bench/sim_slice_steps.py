"""Does the simulator price a slice's engine step as the real engine ran it?

    python3 bench/sim_slice_steps.py PROXY_LOG... [--preset h200-qwen3-8b] [--json F]

The proxy logs every sliced prompt: each slice's new tokens and the largest gap a protected
stream saw while it ran (``sliced request #N ...; slice tokens [...]; largest gaps ms [...]``),
which is that slice's engine step as the streams felt it. This prices each such slice with the
preset's step model (its prefix, the slices before it, as cached context; ``--decodes`` streams
beside it) and prints observed / predicted by slice size and by context, then fits the per-token
and attention terms to the observed steps with the preset's fixed part kept: what the slices say
those terms are. Slices under ``--min-tokens`` and gaps not seen (None) are left out.

Why: on the simulator sliced prompts take ~2x longer than on the H200 (docs/results/simulator.md),
and the slicer sizes its slices to the step it sees, so a step model that overprices slices
makes the simulator slice smaller and more often than the engine it models.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from prefill_gate.proxy.bench.report import environment, table, write_json  # noqa: E402
from prefill_gate.proxy.sim.presets import PRESETS  # noqa: E402

_SLICED = re.compile(r"sliced request #(\d+) .*?slice tokens \[([^\]]*)\]; largest gaps ms \[([^\]]*)\]")


def slices(lines) -> list[tuple[int, int, float]]:
    """(new tokens, cached prefix, observed gap s) for every slice the logs saw the gap of."""
    out = []
    for line in lines:
        m = _SLICED.search(line)
        if not m:
            continue
        sizes = [int(x) for x in m.group(2).split(",") if x.strip()]
        gaps = [None if g.strip() == "None" else float(g) / 1e3 for g in m.group(3).split(",") if g.strip()]
        prefix = 0
        for n, gap in zip(sizes, gaps):
            if gap is not None:
                out.append((n, prefix, gap))
            prefix += n
    return out


def fit_terms(obs: list[tuple[int, int, float]], fixed: float) -> tuple[float, float] | None:
    """Least squares for (per token, attention) in gap - fixed = a n + b n (p + n/2)."""
    sxx = sxy = syy = sx = sy = 0.0
    for n, p, g in obs:
        x, y, t = n, n * (p + n / 2), g - fixed
        sxx, sxy, syy, sx, sy = sxx + x * x, sxy + x * y, syy + y * y, sx + x * t, sy + y * t
    det = sxx * syy - sxy * sxy
    if len(obs) < 3 or det <= 0:
        return None
    return (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det


def _bins(rows, key, edges):
    out = []
    for lo, hi in zip(edges, edges[1:]):
        r = [x["ratio"] for x in rows if lo <= x[key] < hi]
        if r:
            out.append({key: f"{lo}-{hi}", "slices": len(r), "obs/pred p50": round(statistics.median(r), 2),
                        "p10": round(sorted(r)[len(r) // 10], 2), "p90": round(sorted(r)[9 * len(r) // 10], 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="the proxy's logs (proxy-*.log)")
    p.add_argument("--preset", default="h200-qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--decodes", type=int, default=3, help="streams decoding beside each slice")
    p.add_argument("--decode-context", type=int, default=1000, help="their context, tokens")
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--json")
    args = p.parse_args(argv)
    cost = PRESETS[args.preset].cost
    obs = [o for path in args.logs for o in slices(path.read_text(encoding="utf-8", errors="replace").splitlines())
           if o[0] >= args.min_tokens]
    if not obs:
        print("no sliced prompt with a seen gap in those logs", file=sys.stderr)
        return 2
    decodes = [args.decode_context] * args.decodes
    rows = []
    for n, prefix, gap in obs:
        pred = cost.step_seconds(decodes, [(n, prefix)])
        rows.append({"tokens": n, "context": prefix, "gap_ms": round(gap * 1e3, 1),
                     "predicted_ms": round(pred * 1e3, 1), "ratio": gap / pred})
    ratios = sorted(r["ratio"] for r in rows)
    fixed = cost.step_seconds(decodes, [(0, 0)])  # the step's fixed part with a prompt chunk in it
    fitted = fit_terms(obs, fixed)
    result = {
        "bench": "sim_slice_steps", "preset": args.preset, "logs": [str(x) for x in args.logs],
        "slices": len(rows), "obs_over_pred_p50": round(statistics.median(ratios), 3),
        "obs_over_pred_p10": round(ratios[len(ratios) // 10], 3), "obs_over_pred_p90": round(ratios[9 * len(ratios) // 10], 3),
        "by_tokens": _bins(rows, "tokens", [0, 512, 1024, 1536, 2048, 4096, 1 << 20]),
        "by_context": _bins(rows, "context", [0, 5000, 10000, 15000, 20000, 30000, 1 << 20]),
        "preset_terms": {"per_prefill_token_s": cost.per_prefill_token, "attention_s": cost.attention, "fixed_s": fixed},
        "fitted_terms": None if fitted is None else {"per_prefill_token_s": fitted[0], "attention_s": fitted[1]},
        "command": " ".join(["sim_slice_steps.py"] + (argv if argv is not None else sys.argv[1:])),
        **environment(),
    }
    print(f"{len(rows)} slices: observed / the {args.preset} preset's step, p50 {result['obs_over_pred_p50']} "
          f"(p10 {result['obs_over_pred_p10']}, p90 {result['obs_over_pred_p90']})")
    stats = [("slices", "slices"), ("obs/pred p50", "observed / predicted p50"), ("p10", "p10"), ("p90", "p90")]
    print(table(result["by_tokens"], [("tokens", "slice tokens")] + stats))
    print(table(result["by_context"], [("context", "cached context")] + stats))
    if fitted is not None:
        print(f"fitted to the slices (fixed part {fixed * 1e3:.2f} ms kept): {fitted[0] * 1e6:.2f} us a token, "
              f"attention {fitted[1] * 1e9:.3f} ns a token x context (the preset: {cost.per_prefill_token * 1e6:.2f} us, "
              f"{cost.attention * 1e9:.3f} ns)")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
