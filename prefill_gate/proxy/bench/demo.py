"""``prefill-gate demo``: the starvation and the fix, side by side, without a GPU.

Starts the engine simulator and prefill-gate in front of it (two processes), runs
the overlap benchmark directly and through the proxy, prints both rows, and writes
``demo.json`` and ``demo.png``. With ``--compare DIR`` it also sets the simulator's
vLLM row next to a real measurement of vLLM (``DIR/direct-8192.json``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from .overlap import run_overlap
from .report import OVERLAP_COLUMNS, environment, plot_overlap, table, write_json
from .services import Service

COMPARE_KEYS = ("solo_itl_ms_p50", "overlap_itl_ms_max", "overlap_b_tokens_per_s", "a_ttft_s", "a_total_s")


def compare(sim_rows: dict[str, dict], real_dir: Path) -> list[dict]:
    rows = []
    for real_name, sim_row in sim_rows.items():
        path = real_dir / f"{real_name}.json"
        if not path.exists():
            continue
        real = json.loads(path.read_text())
        for key in COMPARE_KEYS:
            rows.append({"config": real_name, "metric": key, "measured": real[key], "simulated": sim_row[key],
                         "sim/measured": sim_row[key] / real[key]})
    return rows


def main(args) -> int:
    out = Path(args.out)
    sim_args = ["sim", "--preset", args.preset, "--time-scale", str(args.time_scale)]
    print(f"[demo] simulator ({args.preset}) and prefill-gate in front of it; "
          f"{args.runs} run(s) of the seed shape each way", file=sys.stderr)
    with Service(*sim_args, name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--log-level", "warning", name="proxy") as gate:
        direct = asyncio.run(run_overlap(sim.url, runs=args.runs))
        proxied = asyncio.run(run_overlap(gate.url, runs=args.runs))
    direct["config"], proxied["config"] = "direct (vLLM-like engine)", "through prefill-gate"
    print(table([direct, proxied], OVERLAP_COLUMNS))
    stall = direct["overlap_itl_ms_max"] / proxied["overlap_itl_ms_max"]
    print(f"\nB's largest gap while A prefills: {direct['overlap_itl_ms_max']:.0f} ms direct, "
          f"{proxied['overlap_itl_ms_max']:.1f} ms through prefill-gate ({stall:.0f}x smaller; "
          f"B alone: {proxied['solo_itl_ms_p50']:.1f} ms). A's first token: {direct['a_ttft_s']:.2f} s direct, "
          f"{proxied['a_ttft_s']:.2f} s through the gate ({proxied['a_ttft_s'] / proxied['a_solo_ttft_s']:.1f}x "
          f"A alone: the gate sliced A into the engine's prefix cache, a short step at a time, or held it "
          f"where B was about to end).")
    record = {"preset": args.preset, "time_scale": args.time_scale, "direct": direct, "proxy": proxied,
              **environment()}
    if args.compare:
        rows = compare({"direct-8192": direct}, Path(args.compare))  # the simulator against vLLM itself
        record["compare"] = rows
        print("\n" + table(rows, [("config", "config"), ("metric", "metric"), ("measured", "measured"),
                                  ("simulated", "simulated"), ("sim/measured", "sim/measured")]))
    write_json(out / "demo.json", record)
    plot_overlap([direct, proxied], out / "demo.png", title=f"seed shape on the {args.preset} simulator")
    print(f"\nwrote {out / 'demo.json'} and {out / 'demo.png'}")
    return 0
