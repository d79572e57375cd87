"""One Gated DeltaNet layer's core, vLLM 0.26's path against engine_patches.gdn's, per prompt length.

    python3 bench/gpu/gdn_sweep.py --json OUT.json [--lens 16,64,128,256,512,1024] [--decodes 4]
        [--shapes 32x1,16x1,32x2,16x1x16x8]

A layer the size of the 27B hybrid's (tests/engine/gdn_gpu.py) runs one mixed step, `--decodes`
streams and one prompt of each length, both ways from the same states; per length: each path's
time per call until the calls returned (the host launching) and until the GPU finished (eager,
as a mixed step's GDN cores run), and how far ours is from vLLM's (relative max error of the
outputs and the states; whether the decodes' outputs and the conv states are identical). A
step runs 48 such cores: where ``ours_wall_ms`` stays under ``stock_wall_ms`` the patch pays,
and that crossover is what PREFILL_GATE_GDN_RECURRENT's limit should be. ``--shapes``: our
kernel's launch shapes to compare, BLOCK_VxSTAGES[xCHUNK[xWARPS]] (value rows per program x the
token loop's pipeline depth x the chunk a prompt walks in, 0 token by token, x warps a program;
PREFILL_GATE_GDN_CHUNK picks the chunk, the other numbers are the kernel's defaults), or wRxW:
the decodes at the kernel's default launch and the prompts, token by token, in a launch of their
own of R value rows and W warps a program (PREFILL_GATE_GDN_WALK=RxW).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment, table  # noqa: E402

COLUMNS = [("prompt", "prompt tokens"), ("shape", "ours: BVxSTAGESxCHUNKxWARPS"), ("stock_wall_ms", "vLLM ms"), ("ours_wall_ms", "ours ms"),
           ("stock_host_ms", "vLLM host ms"), ("ours_host_ms", "ours host ms"), ("out_rel", "out rel err"),
           ("state_rel", "state rel err"), ("decode_out_equal", "decodes identical")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="16,64,128,256,384,512,1024,1568,2048,4096")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--runs", type=int, default=30, help="timed calls per path and length")
    p.add_argument("--shapes", default="32x1", help="our kernel's launch shapes, BLOCK_VxSTAGES[xCHUNK[xWARPS]] or "
                   "wROWSxWARPS (the prompts' own launch), comma-separated")
    p.add_argument("--json", required=True, help="where the sweep goes (with --choice: a sweep to read)")
    p.add_argument("--choice", action="store_true",
                   help="print the sweep's choice in --json as 'CHUNK LIMIT WALK' (off for none) and run nothing")
    args = p.parse_args()
    if args.choice:
        c = json.loads(Path(args.json).read_text()).get("choice") or {}
        print(c.get("chunk") or "off", c.get("limit") or "off", c.get("walk") or "off")
        return 0
    from tests.engine.gdn_gpu import compare_paths

    shapes = [launch_shape(shape) for shape in args.shapes.split(",")]
    check_shapes(shapes, "cuda")  # a shape the kernel refuses stops here, not after the rows before it
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        for name, launch in shapes:
            r = compare_paths(prompt_lens=[n], decodes=args.decodes, timing_runs=args.runs, launch=launch)
            rows.append({"prompt": n, "shape": name, **r})
            print(f"[gdn] {n} {name}: {r}", file=sys.stderr, flush=True)
    print(table(rows, COLUMNS))
    choice = choose(rows)
    print(f"choice: {choice}")
    Path(args.json).write_text(json.dumps({"bench": "gdn_sweep", "decodes": args.decodes, "rows": rows,
                                           "choice": choice, **environment()}, indent=1, default=float) + "\n")
    return 0


MAX_OUT_REL = 0.02  # a prompt's outputs within 2% of vLLM's path (rounding, not a bug)


def deployable(shape: str) -> dict | None:
    """The settings under which the engine patch runs a shape: PREFILL_GATE_GDN_CHUNK (the
    kernel's own launch defaults for that chunk) and PREFILL_GATE_GDN_WALK ("RxW" for a wRxW
    shape, else None); None for a shape only a code change would deploy."""
    from prefill_gate.kernels.gated_delta import BLOCK_V, CHUNK_BLOCK_V, CHUNK_WARPS

    launch = launch_shape(shape)[1]
    if "walk" in launch:
        return {"chunk": 0, "walk": "x".join(map(str, launch["walk"]))}
    chunk = launch.get("chunk", 0)
    want = {"block_v": CHUNK_BLOCK_V if chunk else BLOCK_V, "stages": 1, "chunk": chunk,
            "num_warps": CHUNK_WARPS if chunk else 4}
    return {"chunk": chunk, "walk": None} if {**want, **launch} == want else None


def choose(rows: list[dict]) -> dict | None:
    """PREFILL_GATE_GDN_CHUNK, _WALK and _RECURRENT for the stack from a sweep: per deployable shape
    the limit is the last prompt length up to which, at every length swept, ours is faster than
    vLLM's path (GPU time), its outputs within MAX_OUT_REL and the decodes' outputs identical; the
    shape with the largest limit wins (a tie: the faster at the length nearest 300 tokens, a
    short agent turn). None: no shape pays at the shortest length."""
    best = None
    for shape in dict.fromkeys(r["shape"] for r in rows):
        settings = deployable(shape)
        if settings is None:
            continue
        mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["prompt"])
        limit = 0
        for r in mine:
            if not (r["ours_wall_ms"] < r["stock_wall_ms"] and r["out_rel"] <= MAX_OUT_REL and r["decode_out_equal"]):
                break
            limit = r["prompt"]
        if not limit:
            continue
        near = min(mine, key=lambda r: abs(r["prompt"] - 300))
        key = (limit, -near["ours_wall_ms"])
        if best is None or key > best[0]:
            best = (key, {**settings, "limit": limit, "shape": shape, "ms_near_300": near["ours_wall_ms"],
                          "stock_ms_near_300": near["stock_wall_ms"]})
    return best[1] if best else None


def check_shapes(shapes: list[tuple[str, dict]], device: str) -> None:
    """Launch our kernel once per shape on a tiny step (two decodes, a 40-token prompt); a shape
    it refuses (a chunk it no longer offers, a walk of three warps) exits with its reason."""
    import torch

    from prefill_gate.kernels.gated_delta import gated_delta_recurrent
    from tests.kernel_tests.test_gated_delta import make_step

    step = make_step([1, 1, 40], H=2, HV=4, K=32, V=32, device=device)
    indices = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    for name, launch in shapes:
        try:
            gated_delta_recurrent(**step, state_indices=indices, **launch)
        except ValueError as e:
            raise SystemExit(f"--shapes: {name}: {e}") from None


def launch_shape(text: str) -> tuple[str, dict]:
    """BLOCK_VxSTAGES[xCHUNK[xWARPS]] or wROWSxWARPS -> (the shape as given, the kernel's launch
    arguments)."""
    if text.startswith("w"):
        numbers = [int(x) for x in text[1:].split("x")]
        if len(numbers) != 2:
            raise SystemExit(f"--shapes: {text!r} is not wROWSxWARPS")
        return text, {"walk": tuple(numbers)}
    numbers = [int(x) for x in text.split("x")]
    if not 2 <= len(numbers) <= 4:
        raise SystemExit(f"--shapes: {text!r} is not BLOCK_VxSTAGES[xCHUNK[xWARPS]]")
    launch = dict(zip(("block_v", "stages", "chunk", "num_warps"), numbers))
    return text, launch


if __name__ == "__main__":
    raise SystemExit(main())
