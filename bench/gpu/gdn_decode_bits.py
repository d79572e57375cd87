"""Are a step's decode rows the same bits whatever launch shape our GDN kernel runs with?

    python3 bench/gpu/gdn_decode_bits.py [--json OUT.json]

The chunk-16 launch (16 value rows, 8 warps) gave decodes that differ from vLLM's recurrent
kernel in the last bits on an H100 where the chunk-32 launch of the same rows and warps and the
token walk did not (bench/results/gdn/h100/run-b953a47/). Compiled for sm_90 on a CPU, the token
loop of both is the same IR, PTX and floating-point SASS. This runs one 27B-sized step (8 decodes
and a 300-token prompt) through each launch shape and compares the decodes' outputs and states
bit for bit with the token walk's (32 rows, 4 warps), and the prompt's within rounding.
Since then, with chunks the decodes run in a launch of their own (the walk's decode launch), so
every row here should come out equal; a chunk row that does not says that fix did not hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"walk 32x4": {}, "walk 16x8": {"block_v": 16, "num_warps": 8},
          "chunk 16 (16x8)": {"chunk": 16}, "chunk 32 (16x8)": {"chunk": 32}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny heads and prompt: a smoke run under TRITON_INTERPRET=1")
    args = p.parse_args()
    import torch

    from prefill_gate.kernels.gated_delta import gated_delta_recurrent
    from prefill_gate.proxy.bench.report import environment
    from tests.engine.gdn_gpu import SIZES  # the 27B hybrid's layer; imports no vLLM
    from tests.kernel_tests.test_gated_delta import make_step

    decodes, lens = 8, [1] * 8 + [40 if args.small else 300]
    sizes = dict(H=2, HV=4, K=32, V=32) if args.small else SIZES
    step = make_step(lens, **sizes, slots=16, dtype=torch.bfloat16, seed=5, device=args.device)
    indices = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=args.device)
    has_initial = torch.ones(len(lens), dtype=torch.bool, device=args.device)
    runs = {}
    for name, launch in SHAPES.items():
        state = step["state"].clone()
        out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial, **launch)
        runs[name] = (out, state)
    base_out, base_state = runs["walk 32x4"]
    rows = []
    for name, (out, state) in runs.items():
        rows.append({"shape": name,
                     "decode_out_equal": bool(torch.equal(out[:decodes], base_out[:decodes])),
                     "decode_state_equal": bool(torch.equal(state[1:decodes + 1], base_state[1:decodes + 1])),
                     "decode_out_max_diff": float((out[:decodes].float() - base_out[:decodes].float()).abs().max()),
                     "prompt_out_rel": float((out[decodes:].float() - base_out[decodes:].float()).abs().max()
                                             / base_out[decodes:].float().abs().max())})
        print(rows[-1], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "gdn_decode_bits", "rows": rows, **environment()},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
