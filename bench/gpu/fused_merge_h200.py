"""The split-KV path with its merge fused into the launch, against the merge as a second launch.

    python3 bench/gpu/fused_merge_h200.py --json OUT.json      (on a GPU; needs torch and triton only)

Shapes: Qwen3-8B attention (32 query heads, 8 KV heads, head dim 128, bf16), page 16, 16
sequences, decode (1 query token) and verify (4), contexts 4k and 32k. Per shape and
variant: GPU time (``triton.testing.do_bench``), the host's cost per call (a loop of
launches without synchronizing, wall time / calls: what an eager vLLM step pays per
layer) and the largest difference from the two-launch output; on a small case, both
against the float32 reference; and that every arrival counter is zero after the runs.
Prints a table and writes JSON with the GPU and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gpu.kernel_h200 import gpu_case  # noqa: E402
from prefill_gate.kernels.paged_attention import Scratch, paged_attention  # noqa: E402
from prefill_gate.kernels.reference import paged_attention_ref  # noqa: E402
from tests.kernel_tests.cases import make_case  # noqa: E402

HQ, HKV, D, SPLITS = 32, 8, 128, 8
INPUTS = ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")


def host_us_per_call(fn, calls: int = 400) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / calls * 1e6


def accuracy(qlen: int) -> dict:
    """Both variants against the float32 reference on a small case (the reference runs on the CPU)."""
    case = make_case(16, [qlen] * 3, [3000, 700, 4100], HQ, HKV, D, torch.bfloat16, qlen)
    ref = paged_attention_ref(*(case[n] for n in INPUTS), scale=case["scale"])
    gpu = {n: case[n].cuda() for n in INPUTS}
    fused = Scratch.empty(gpu["q"].shape[0], HQ, SPLITS, D, "cuda", num_kv_heads=HKV)
    errs = {}
    for name, scratch in (("fused", fused), ("2 launch", Scratch(*fused[:3]))):
        out = paged_attention(**gpu, scale=case["scale"], max_query_len=qlen, split=True, num_kv_splits=SPLITS,
                              scratch=scratch)
        errs[name] = (out.float().cpu() - ref).abs().max().item()
    return {"qlen": qlen, "max_abs_err": errs, "counters_zero": fused.counter.count_nonzero().item() == 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    checks = [accuracy(qlen) for qlen in (1, 4)]
    for c in checks:
        print(f"accuracy q{c['qlen']}: max |err| vs float32 reference {c['max_abs_err']}, "
              f"counters zero {c['counters_zero']}")
    rows = []
    print(f"{'shape':<18} {'variant':<9} {'GPU us':>8} {'host us/call':>13} {'vs 2 launch':>12}")
    for qlen in (1, 4):
        for context in (4096, 32768):
            case = gpu_case(16, context, 16, qlen)
            inputs = {n: case[n] for n in INPUTS}
            tokens = case["q"].shape[0]
            fused = Scratch.empty(tokens, HQ, SPLITS, D, "cuda", num_kv_heads=HKV)
            outs = {}
            for name, scratch in (("2 launch", Scratch(*fused[:3])), ("fused", fused)):
                out = torch.empty_like(case["q"])

                def run(scratch=scratch, out=out):
                    paged_attention(**inputs, scale=case["scale"], max_query_len=qlen, out=out, split=True,
                                    num_kv_splits=SPLITS, scratch=scratch, validate=False)

                run()
                outs[name] = out
                gpu_us = do_bench(run, warmup=10, rep=100) * 1e3
                host_us = host_us_per_call(run)
                diff = (out.float() - outs["2 launch"].float()).abs().max().item()
                rows.append({"qlen": qlen, "context": context, "batch": 16, "variant": name, "gpu_us": gpu_us,
                             "host_us_per_call": host_us, "max_abs_diff_vs_2_launch": diff,
                             "counters_zero": fused.counter.count_nonzero().item() == 0})
                print(f"q{qlen} ctx{context // 1024}k b16{'':<6} {name:<9} {gpu_us:>8.1f} {host_us:>13.1f} "
                      f"{diff:>12.2e}")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "accuracy": checks, "rows": rows,
              "counters_zero_after_all": all(r["counters_zero"] for r in rows + checks)}
    print("counters zero after every launch:", record["counters_zero_after_all"])
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
