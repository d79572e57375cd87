"""Our Gated DeltaNet kernel alone, token by token against chunks, per prompt length (no vLLM).

    python3 bench/gpu/gdn_kernel_time.py --json OUT.json [--lens 64,300,512,1024] [--chunks 16,32]
        [--walks 8x1,4x1]

One layer the size of the 27B hybrid's (16 key heads, 48 value heads of 128, bf16 inputs,
float32 states), one step of `--decodes` streams and one prompt: per length and path, the time
per call until the GPU finished (CUDA events around `--runs` calls after a warm-up), and how far
the chunked path's outputs and states are from the token walk's (relative max error). What it
answers without shipping vLLM: from which prompt length each chunk beats the token walk, and by
how much (vLLM's own path, ~1 ms a layer call on the H200 at any length, is `gdn_sweep.py`'s).
`--walks`: the same token walk with the prompt in a launch of its own, R value rows and W warps a
program (PREFILL_GATE_GDN_WALK; the decodes keep the default launch): the walk's time is its
per-token latency, which the launch shape sets (`python3 bench/gdn_walks_aot.py` counts each
shape's instructions a token). A step runs 48 such calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment, table  # noqa: E402

COLUMNS = [("prompt", "prompt tokens"), ("path", "path"), ("ms", "ms a call"), ("x_token", "x token walk"),
           ("out_rel", "out rel err"), ("state_rel", "state rel err"), ("decodes_equal", "decodes identical")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="16,64,128,256,300,384,512,1024,1568,2048,4096")
    p.add_argument("--chunks", default="16,32")
    p.add_argument("--walks", default="", help="the prompts' own launch shapes, ROWSxWARPS, comma-separated")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (tests)")
    p.add_argument("--sizes", default=None, help="H,HV,K,V instead of the 27B's (smoke runs)")
    args = p.parse_args()
    import torch

    from prefill_gate.kernels.gated_delta import gated_delta_recurrent
    from tests.engine.gdn_gpu import SIZES, rel  # the 27B hybrid's layer; imports no vLLM
    from tests.kernel_tests.test_gated_delta import make_step

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)")
    sizes = dict(zip(SIZES, map(int, args.sizes.split(",")))) if args.sizes else SIZES
    dev = args.device
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        lens = [1] * args.decodes + [n]
        step = make_step(lens, **sizes, slots=len(lens) + 1, dtype=torch.bfloat16, seed=n, device=dev)
        step["state"] *= 0.1
        indices = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=dev)
        has_initial = torch.tensor([True] * args.decodes + [False], device=dev)
        ref = None
        chunks = [{"chunk": int(c)} for c in args.chunks.split(",") if c]
        walks = [{"walk": tuple(int(x) for x in w.split("x"))} for w in args.walks.split(",") if w]
        for launch in [{}, *chunks, *walks]:
            state = step["state"].clone()
            out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial,
                                        **launch)
            sync(dev)
            if ref is None:
                ref, errors = (out.float(), state.clone()), {"out_rel": 0.0, "state_rel": 0.0}
            else:
                errors = {"out_rel": rel(out.float(), ref[0]), "state_rel": rel(state, ref[1]),
                          "decodes_equal": bool(torch.equal(out[:args.decodes].float(), ref[0][:args.decodes]))}
            ms = timed(lambda: gated_delta_recurrent(**{**step, "state": state}, state_indices=indices,
                                                     has_initial=has_initial, **launch), args.runs, dev)
            chunk = launch.get("chunk", 0)
            path = (f"chunk {chunk}" if chunk else "walk {}x{}".format(*launch["walk"]) if "walk" in launch
                    else "token walk")
            row = {"prompt": n, "path": path, "chunk": chunk, "ms": ms, **errors}
            rows.append(row)
            print(f"[gdn-kernel] {row}", file=sys.stderr, flush=True)
    walk = {r["prompt"]: r["ms"] for r in rows if r["path"] == "token walk"}
    for r in rows:
        r["x_token"] = r["ms"] / walk[r["prompt"]]
    print(table(rows, COLUMNS))
    Path(args.json).write_text(json.dumps({"bench": "gdn_kernel_time", "sizes": sizes, "device": dev, "decodes": args.decodes,
                                           "runs": args.runs, "rows": rows, **environment()}, indent=1) + "\n")
    return 0


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(call, runs: int, device: str) -> float:
    """Milliseconds a call, GPU time included (CUDA events over ``runs`` calls, after 3)."""
    import time

    import torch

    for _ in range(3):
        call()
    if device != "cuda":
        t = time.perf_counter()
        for _ in range(runs):
            call()
        return (time.perf_counter() - t) * 1e3 / runs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runs


if __name__ == "__main__":
    raise SystemExit(main())
