"""The host's time to launch one GDN layer's recurrence, with and without fast launches.

    python3 bench/gpu/gdn_launch_time.py --json OUT.json [--calls 200] [--repeats 7]

A mixed step on the 27B hybrid runs the GDN patch's glue and two launches of our kernel 48
times, on the host, while the streams wait (bench/results/hybrid/h100/run-0261253/: ~36 ms of
a mixed step's host time was the 48 GDN cores'). This times that host work alone: one layer the
size of the 27B's (16 key heads, 48 value heads of 128, bf16, float32 states), 4 decodes and a
300-token prompt, the prompts' walk at 8x1 as the stack runs it, ``--calls`` calls of the patch's
``_recurrence`` back to back without waiting for the GPU (the GPU's ~0.3 ms a call keeps it
behind, so the loop's wall time is the host's), the fastest of ``--repeats`` loops, with
PREFILL_GATE_FAST_LAUNCH on and off, alternating. Then the GPU's time a call (CUDA events) and
whether both ways gave the same bits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_timing import time_ways  # noqa: E402
from prefill_gate.proxy.bench.report import environment, table  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--json", required=True)
    args = p.parse_args()

    import torch

    from prefill_gate.engine_patches import gdn
    from prefill_gate.kernels import gated_delta
    from prefill_gate.kernels.launch import Launcher

    H, HV, D = 16, 48, 128
    lens = [1] * args.decodes + [args.prompt]
    tokens, seqs = sum(lens), len(lens)
    g = torch.Generator().manual_seed(0)
    layer = SimpleNamespace(head_k_dim=D, head_v_dim=D, key_dim=H * D, tp_size=1,
                            A_log=(torch.randn(HV, generator=g) * 0.5).cuda(),
                            dt_bias=(torch.randn(HV, generator=g) * 0.5).cuda())
    conv = torch.randn(tokens, (2 * H + HV) * D, generator=g).to(torch.bfloat16).cuda()
    a = torch.randn(tokens, HV, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(tokens, HV, generator=g).to(torch.bfloat16).cuda()
    state0 = (torch.randn(seqs + 1, HV, D, D, generator=g) * 0.1).cuda()
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    slots = torch.arange(1, seqs + 1, dtype=torch.int32).cuda()
    has_initial = torch.tensor([True] * args.decodes + [False]).cuda()
    out = torch.empty(tokens, HV, D, dtype=torch.bfloat16).cuda()
    launchers = {"fast launch": Launcher(gated_delta._gated_delta_kernel, enabled=True),
                 "Triton's launch": Launcher(gated_delta._gated_delta_kernel, enabled=False)}

    def way(launcher):
        def call(state):
            gated_delta._launch = launcher
            gdn._recurrence(layer, conv, a, b, state, out, starts, slots, has_initial, walk=(8, 1))
            return out
        return call

    ways = {name: way(launcher) for name, launcher in launchers.items()}
    host, bits, gpu_us = time_ways(ways, state0, args.calls, args.repeats, torch.cuda.synchronize, cuda=True)
    rows = [{"launch": name, "host_us": round(min(host[name]), 1), "host_us_max": round(max(host[name]), 1),
             "gpu_us": gpu_us[name]} for name in ways]
    (fo, fs), (so, ss) = bits["fast launch"], bits["Triton's launch"]
    same = bool(torch.equal(fo, so) and torch.equal(fs, ss))
    for row in rows:
        row["x_triton"] = round(row["host_us"] / rows[1]["host_us"], 3)
        row["a_step_ms"] = round(row["host_us"] * 48 / 1e3, 2)
    columns = [("launch", "launch"), ("host_us", "host us a call (min)"), ("host_us_max", "max"),
               ("x_triton", "x Triton's"), ("a_step_ms", "x 48 layers, ms"), ("gpu_us", "GPU us a call")]
    print(table(rows, columns))
    print(f"same bits both ways: {same}")
    Path(args.json).write_text(json.dumps({"bench": "gdn_launch_time", "rows": rows, "same_bits": same,
                                           "calls": args.calls, "repeats": args.repeats, "prompt": args.prompt,
                                           "decodes": args.decodes, "host_us_all": host,
                                           "command": " ".join(sys.argv), **environment()}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
