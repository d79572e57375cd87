"""Check the simulator's per-id costs (what a slice costs beyond its prefill) on runs held out
of their fit: the H200 seed pair sliced at fixed sizes (`bench/results/mixed/h200/pairs/
pair-slice-{256,512,1024}.json`), replayed on the simulator with the per-id costs set by hand before
(issue 18's measurements) and with those `bench/sim_fit.py --slice-floor` fitted from
`slice-floor-h200.json` (the preset's now).

    python3 bench/sim_slice_check.py --fit bench/results/sim/fit-h200.json --json F

For each cost set: a simulator (`h200-qwen3-8b`, the per-id costs overridden), then for each
size a prefill-gate `--slicing on --min-slice-tokens N --max-slice-tokens N` in front of it,
and `bench overlap` (one run) through it. Printed and written: A's TTFT and B's largest gap
per size, the H200's beside them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from prefill_gate.proxy.bench.report import environment, table, write_json
from prefill_gate.proxy.bench.services import Service
SIZES = (256, 512, 1024)
HAND_SET = (1.0e-7, 3.1e-7)  # frontend_per_id, arrival_per_id before the fit (issue 18's hand numbers)
H200 = ROOT / "bench/results/mixed/h200/pairs"


def overlap(url: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "prefill_gate.proxy", "bench", "overlap", "--base-url", url, "--model", "sim",
                        "--runs", "1", "--json", out.name], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd=ROOT)
        return json.loads(pathlib.Path(out.name).read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", type=pathlib.Path, required=True, help="sim_fit.py JSON with per-id costs")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    fitted = json.loads(args.fit.read_text())["fitted"]
    costs = {"hand-set": HAND_SET, "fitted": (fitted["frontend_per_id"], fitted["arrival_per_id"])}
    rows = []
    for size in SIZES:
        h200 = json.loads((H200 / f"pair-slice-{size}.json").read_text())
        rows.append({"size": size, "costs": "H200 (measured)", "a_ttft_s": h200["a_ttft_s"],
                     "a_solo_ttft_s": h200["a_solo_ttft_s"], "b_max_ms": h200["overlap_itl_ms_max"]})
    for name, (frontend, arrival) in costs.items():
        with Service("sim", "--cost-frontend-per-id", repr(frontend), "--cost-arrival-per-id", repr(arrival),
                     name="sim") as sim:
            for size in SIZES:
                print(f"[slice-check] {name} costs, slices of {size}", file=sys.stderr)
                with Service("serve", "--upstream", sim.url, "--slicing", "on", "--min-slice-tokens", str(size),
                             "--max-slice-tokens", str(size), "--log-level", "warning", name="proxy") as gate:
                    r = overlap(gate.url)
                rows.append({"size": size, "costs": f"simulator, {name}", "frontend_per_id": frontend,
                             "arrival_per_id": arrival, "a_ttft_s": r["a_ttft_s"], "a_solo_ttft_s": r["a_solo_ttft_s"],
                             "b_max_ms": r["overlap_itl_ms_max"]})
    rows.sort(key=lambda r: (r["size"], r["costs"]))
    print(table(rows, [("size", "slice tokens"), ("costs", "costs"), ("a_ttft_s", "A TTFT s"),
                       ("a_solo_ttft_s", "A alone s"), ("b_max_ms", "B max ms")]))
    if args.json:
        write_json(args.json, {"bench": "sim_slice_check", "fit": str(args.fit), "rows": rows, **environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
