"""A server's first step at a new request count: what each eager per-request op pays the first time.

    python3 bench/gpu/first_use.py [--json OUT.json] [--max-reqs 64] [--hidden 5120] [--vocab 256,248320]
                                   [--fill 0.9]

On the 27B hybrid every server traced ran its first step with 9 requests ~70 ms longer on the
host than any later step (bench/results/hybrid/h100/run-ed51eec/README.md): one-time work keyed
on the request count, which neither vLLM's JIT monitor (Triton compiles) nor the scheduler
shows. What vLLM 0.26 runs eagerly every step on one row per request, outside the CUDA graphs:
the gather of each request's last hidden state, the output layer (a GEMM whose kernel cuBLAS
picks by the row count, loaded at its first launch under CUDA's lazy module loading), the
greedy pick, and the copy of the picks to the host (non-blocking, into a pinned block that
PyTorch's caching host allocator sizes in powers of two: a new size is a new `cudaHostAlloc`).
vLLM runs the output layer and its sampler once at start, at its largest count only
(`_dummy_sampler_run`, sampling rather than the greedy pick), and the copy not at all.

This replays that order in a fresh process (once at the largest count, then each count from 1
up, a repeat after each), per vocabulary size, and does it twice: with CUDA_MODULE_LOADING=LAZY
(CUDA's default) and EAGER, each in a child process of its own. A first call tens of ms over its
repeat at 9 rows, and none at 2-8, says the ~70 ms step is this, and which op; if EAGER has
none, loading eagerly (or warming that op at every count) removes it.

Run on an H100 (bench/results/hybrid/h100/run-b088fbb/first-use.json): no count from 2 to 64
ran more than 5 ms over its repeat, lazy or eager. Replayed alone these ops pay nothing at a new
count; warming vLLM's own ``compute_logits`` at every count (engine_patches.warmup) removed the
step all the same, so the one-time work lies in vLLM's output path around them, or in what the
replay lacked then and has since: the logits' float32 copy the sampler makes (``to_float32``)
and a card mostly taken (``--fill 0.9``: a server's KV cache leaves a few GiB, so each new size
may be a new ``cudaMalloc``, or the caching allocator freeing what it holds to make room).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = ("LAZY", "EAGER")
TOKENS = 512  # a step's hidden states, of which each request's last row is gathered


def child(args) -> dict:
    """Time the ops in this process, as a fresh server meets them."""
    import torch
    import torch.nn.functional as F

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy_out(ids):
        """The sampled ids to the host as vLLM's async output does: int32 [n, 1], non-blocking on
        a stream of its own (a pinned host block from PyTorch's caching host allocator)."""
        ids = ids.to(torch.int32).unsqueeze(-1)
        if side is None:
            return ids.to("cpu")
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = ids.to("cpu", non_blocking=True)
        side.synchronize()
        return host

    def step(hidden, weight, n: int) -> dict[str, float]:
        """One step's per-request ops, each timed to its end on the device: ms by op and in all."""
        times, t = {}, time.perf_counter()
        ops = (("gather", lambda x: x.index_select(0, torch.arange(TOKENS - n, TOKENS, device=device))),
               ("output_layer", lambda x: F.linear(x, weight)), ("to_float32", lambda x: x.to(torch.float32)),
               ("argmax", lambda x: x.argmax(dim=-1)), ("copy_out", copy_out))
        x = hidden
        for name, op in ops:
            x = op(x)
            sync()
            now = time.perf_counter()
            times[name], t = round((now - t) * 1e3, 3), now
        return {"ms": round(sum(times.values()), 3), **times}

    held = hold(device, args.fill)  # noqa: F841 (held for the whole replay, as vLLM's KV cache is)
    out = {}
    for vocab in args.vocab:
        gen = torch.Generator(device=device).manual_seed(vocab)
        hidden = torch.randn(TOKENS, args.hidden, generator=gen, device=device, dtype=dtype)
        weight = torch.randn(vocab, args.hidden, generator=gen, device=device, dtype=dtype) * 0.02
        largest = step(hidden, weight, args.max_reqs)  # vLLM's own warm-up: the largest count only
        rows = []
        for n in range(1, args.max_reqs + 1):
            first = step(hidden, weight, n)
            rows.append({"reqs": n, "first_ms": first.pop("ms"), "again_ms": step(hidden, weight, n)["ms"],
                         "first_by_op_ms": first})
        out[str(vocab)] = {"largest_first_ms": largest["ms"], "rows": rows}
    return out


def hold(device, fill: float):
    """A tensor holding the card's memory up to ``fill`` of it (0: none), as a server's KV cache
    holds all but a few GiB: each new size the replay allocates then comes from what is left."""
    import torch

    if fill <= 0 or device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    take = int(total * fill) - (total - free)
    return torch.empty(max(take, 0), dtype=torch.uint8, device=device)


def run_mode(mode: str, argv: list[str]) -> dict:
    env = {**os.environ, "CUDA_MODULE_LOADING": mode}
    done = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"CUDA_MODULE_LOADING={mode}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spikes(rows: list[dict], over_ms: float) -> list[int]:
    """The counts whose first call took ``over_ms`` more than its repeat."""
    return [r["reqs"] for r in rows if r["first_ms"] - r["again_ms"] > over_ms]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-reqs", type=int, default=64)
    p.add_argument("--hidden", type=int, default=5120)  # the 27B hybrid's (bench/gpu/hybrid_model.py)
    p.add_argument("--vocab", type=lambda s: [int(x) for x in s.split(",")], default=[256, 248320],
                   help="the dummy folder's, and Qwen3.5's")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--over-ms", type=float, default=5.0, help="a first call this much over its repeat is a spike")
    p.add_argument("--fill", type=float, default=0.0,
                   help="hold this share of the card's memory first, as a server's KV cache does (0 to 0.98)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if not 0 <= args.fill <= 0.98:
        p.error(f"--fill: {args.fill} (a share of the card's memory, 0 to 0.98)")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: {bad} (known: {', '.join(MODES)})")
    child_argv = ["--device", args.device, "--max-reqs", str(args.max_reqs), "--hidden", str(args.hidden),
                  "--vocab", ",".join(map(str, args.vocab)), "--fill", str(args.fill)]
    modes = {m: run_mode(m, child_argv) for m in args.modes}
    from prefill_gate.proxy.bench.report import environment

    print(f"{'loading':8} {'vocab':>7} {'largest first ms':>16}  "
          f"counts whose first call ran > {args.over_ms} ms over its repeat")
    for mode, per_vocab in modes.items():
        for vocab, res in per_vocab.items():
            found = spikes(res["rows"], args.over_ms)
            detail = ", ".join(f"{r['reqs']}: {r['first_ms']:.1f} (again {r['again_ms']:.2f}; "
                               + " ".join(f"{k} {v:.1f}" for k, v in r["first_by_op_ms"].items()) + ")"
                               for r in res["rows"] if r["reqs"] in found)
            print(f"{mode:8} {vocab:>7} {res['largest_first_ms']:>16.1f}  {detail or 'none'}")
            res["spikes"] = found
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "first_use", "tokens": TOKENS, "hidden": args.hidden,
                                               "max_reqs": args.max_reqs, "over_ms": args.over_ms, "fill": args.fill,
                                               "modes": modes,
                                               **environment()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
