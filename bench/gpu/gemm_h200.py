"""What a step of N tokens costs in the dense GEMMs of a Qwen3-8B-shaped model, per N.

    python3 bench/gpu/gemm_h200.py --json OUT.json [--tokens 64:576:8]

A mixed step of ~256 tokens is compute-bound on an H200, and cuBLAS computes M (= step
tokens) in tiles: a step one tile row past a boundary (257 tokens, or 272 after vLLM pads
it to a CUDA-graph size) may cost much more than 256. This times the four projections of
one decoder layer (qkv, o, gate_up, down; bf16, torch.nn.functional.linear as vLLM calls
it) for every N in the range and reports the 36-layer total, so step-size choices
(pacing's caps, `--max-num-batched-tokens`) can be read against the GEMM cost curve.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4096, 12288, 32, 8, 128, 36
PROJECTIONS = {  # name: (in_features, out_features)
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o": (HEADS * HEAD_DIM, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64:577:8", help="start:stop:step of step sizes N")
    p.add_argument("--json")
    args = p.parse_args()
    import torch
    from triton.testing import do_bench

    start, stop, step = (int(v) for v in args.tokens.split(":"))
    weights = {k: torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * i ** -0.5
               for k, (i, o) in PROJECTIONS.items()}
    rows = []
    print(f"{'N':>5} {'qkv':>7} {'o':>7} {'gate_up':>8} {'down':>7} {'36 layers ms':>13} {'us/token':>9}")
    for n in range(start, stop, step):
        ms = {}
        for k, w in weights.items():
            x = torch.randn(n, w.shape[1], device="cuda", dtype=torch.bfloat16)
            ms[k] = do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w), warmup=3, rep=20,
                             return_mode="median")
        total = LAYERS * sum(ms.values())
        rows.append({"tokens": n, **{f"{k}_ms": v for k, v in ms.items()}, "layers_ms": total})
        print(f"{n:>5} {ms['qkv']:>7.3f} {ms['o']:>7.3f} {ms['gate_up']:>8.3f} {ms['down']:>7.3f} "
              f"{total:>13.2f} {1000 * total / n:>9.2f}")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(),
              "command": " ".join(sys.argv), "layers": LAYERS, "projections": PROJECTIONS, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
