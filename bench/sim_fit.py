"""Fit the simulator's H200 step costs from committed H200 runs, and check them on a run
held out of the fit.

    python3 bench/sim_fit.py --fit bench/results/h200/run1 --check bench/results/h200 \\
        --json bench/results/sim/fit-h200.json
    python3 bench/sim_fit.py --fit D --check D --preset h200-27b-hybrid --step-ms 40 \\
        --chunks direct-2048=1568,direct-2048-nocache=2047 \\
        --check-chunks paced-cap-1568=1568,paced-adaptive-60=1568 --json F   (D: the hybrid run)
    python3 bench/sim_fit.py ... --slice-floor bench/results/slicing/slice-floor-h200.json

Data: the seed pair direct on vLLM 0.26.0 (`bench overlap` JSON, every token's time). While
A (28,600 tokens) prefills, B decodes one token per engine step, so B's gaps are the step
times: the first is a decode step plus A's arrival work, then one step per chunk of A
(`direct-2048`: 14 chunks of 2,048 tokens; `direct-8192`: 8,192 x 3 and 4,024). The model is
the simulator's (`prefill_gate/proxy/sim/engine.py`, ``CostModel.step_seconds``): a step with a chunk of
n tokens after s cached ones costs ``C + per_prefill_token x n + attention x n x (s + n/2)``,
C being a decode step plus ``mixed``. Least squares over every chunk step of every run in
``--fit``; ``base`` from B's solo median gap; A's arrival stall from the first gap. Then the
same model predicts every chunk step of ``--check`` (another run, not used in the fit).

With ``--slice-floor`` (``bench/gpu/slice_floor.py``'s JSON: fully cached token-id prompts
of growing length sent while B streams), also the two per-id costs of a token-id prompt
(what a slice costs that is not prefill compute): ``arrival_per_id``, the engine stall per
id, is the slope of B's largest gap during those requests over the prompt's length;
``frontend_per_id``, the delay before the engine sees it, is the slope of their round trip
less that stall. Both by least squares with an intercept over every row.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from prefill_gate.proxy.bench.report import environment  # noqa: E402
from prefill_gate.proxy.sim.presets import get_preset  # noqa: E402

CHUNKS = {"direct-2048": 2048, "direct-8192": 8192}
STEP_MS = 15.0  # a gap over this while A prefills is a chunk step (B decodes in ~4.7 ms)


def chunk_map(text: str) -> dict[str, int]:
    """``name=tokens,...``: the bench files to read and the chunk each one's steps carry."""
    return {name: int(tokens) for name, tokens in (item.split("=") for item in text.split(","))}


def steps(run_dir: pathlib.Path, chunks: dict[str, int] = CHUNKS, step_ms: float = STEP_MS,
          ) -> tuple[list[tuple[int, int, float]], list[float], list[float]]:
    """(chunk tokens, cached tokens before it, seconds) of every chunk step; the first gaps
    (arrival); B's solo gaps."""
    rows, firsts, solo = [], [], []
    for config, chunk in chunks.items():
        data = json.loads((run_dir / f"{config}.json").read_text())
        for run in data["raw"]:
            b, a = run["b"]["tokens"], run["a"]
            total = run["a_prompt_tokens"]
            big = [t1 - t0 for t0, t1 in zip(b, b[1:]) if a["sent"] < t1 and t0 < a["tokens"][0]
                   and (t1 - t0) * 1e3 > step_ms]
            firsts.append(big[0])
            for i, seconds in enumerate(big[1:]):
                start = i * chunk
                if start >= total:
                    break  # A's first token came with the last chunk; later gaps are not A's
                rows.append((min(chunk, total - start), start, seconds))
            s = run["b_solo"]["tokens"]
            solo += [t1 - t0 for t0, t1 in zip(s, s[1:])]
    return rows, firsts, solo


def design(rows):
    return np.array([[1.0, n, n * (s + n / 2)] for n, s, _ in rows]), np.array([t for *_, t in rows])


def per_id_costs(floor: dict) -> dict:
    """(frontend_per_id, arrival_per_id) in seconds per id, from slice_floor.py's rows."""
    n = np.array([r["tokens"] for r in floor["rows"]], dtype=float)
    stall = np.array([(r["b_max_gap_ms_during_cached_ids"] - r["b_gap_ms_solo"]) / 1e3 for r in floor["rows"]])
    rtt = np.array([r["cached_ids_rtt_ms"] / 1e3 for r in floor["rows"]])
    ones = np.ones_like(n)
    (_, arrival), *_ = np.linalg.lstsq(np.column_stack([ones, n]), stall, rcond=None)
    (_, total), *_ = np.linalg.lstsq(np.column_stack([ones, n]), rtt, rcond=None)
    return {"frontend_per_id": float(total - arrival), "arrival_per_id": float(arrival)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", type=pathlib.Path, required=True)
    ap.add_argument("--check", type=pathlib.Path, required=True)
    ap.add_argument("--chunks", type=chunk_map, default=CHUNKS, help="fit files: name=chunk tokens,...")
    ap.add_argument("--check-chunks", type=chunk_map, default=None, help="held-out files (default: --chunks)")
    ap.add_argument("--step-ms", type=float, default=STEP_MS, help="a gap over this while A prefills is a chunk step")
    ap.add_argument("--preset", default="h200-qwen3-8b", help="the preset to compare; none: no comparison")
    ap.add_argument("--slice-floor", type=pathlib.Path, help="slice_floor.py JSON: fit the per-id costs too")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows, firsts, solo = steps(args.fit, args.chunks, args.step_ms)
    x, y = design(rows)
    (c, per_token, attention), *_ = np.linalg.lstsq(x, y, rcond=None)
    base = statistics.median(solo)
    fitted = {"base": base, "mixed": c - base, "per_prefill_token": per_token, "attention": attention,
              "arrival_stall_s": statistics.median(firsts) - base}
    current = None
    if args.preset != "none":
        preset = get_preset(args.preset).cost
        current = {"base": preset.base, "mixed": preset.mixed, "per_prefill_token": preset.per_prefill_token,
                   "attention": preset.attention, "arrival_stall_s": preset.arrival_per_token * 28600}

    def errors(model, data):
        xx, yy = design(data)
        pred = xx @ np.array([model["base"] + model["mixed"], model["per_prefill_token"], model["attention"]])
        rel = np.abs(pred - yy) / yy
        return {"steps": len(data), "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max())}

    if args.slice_floor is not None:
        fitted |= per_id_costs(json.loads(args.slice_floor.read_text()))
        if current:
            preset = get_preset(args.preset).cost
            current |= {"frontend_per_id": preset.frontend_per_id, "arrival_per_id": preset.arrival_per_id}
    check_chunks = args.check_chunks or args.chunks
    held, _, _ = steps(args.check, check_chunks, args.step_ms)
    models = {"fitted": fitted} | ({"preset": current} if current else {})
    result = {
        "fit_data": str(args.fit), "check_data": str(args.check), "fit_files": args.chunks,
        "check_files": check_chunks, "step_ms": args.step_ms, "preset_name": args.preset,
        "fitted": fitted, "preset": current,
        "fit_errors": {k: errors(m, rows) for k, m in models.items()},
        "held_out_errors": {k: errors(m, held) for k, m in models.items()},
        **environment(),
    }
    print(f"{len(rows)} chunk steps fitted ({args.fit}); {len(held)} held out ({args.check})")
    print(f"{'':22s} {'fitted':>12s} {'preset':>12s}")
    for k in fitted:
        print(f"{k:22s} {fitted[k]:12.4g} {current[k] if current else float('nan'):12.4g}")
    for name in ("fit_errors", "held_out_errors"):
        for which in models:
            e = result[name][which]
            print(f"{name:16s} {which:7s} median {100 * e['median_rel_error']:5.1f}%  max {100 * e['max_rel_error']:5.1f}%"
                  f"  over {e['steps']} steps")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
