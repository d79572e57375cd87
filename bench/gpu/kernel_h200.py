"""The paged-attention kernel on a GPU, side by side with vLLM 0.26's Triton kernel.

    python3 bench/gpu/kernel_h200.py --json OUT.json      (on the device, after the recipe's setup)

Shapes (Qwen3-8B attention: 32 query heads, 8 KV heads, head dim 128, bf16): decode (1
query token per sequence), verify (4), a prefill chunk (512), page sizes 16 and 1568,
contexts 1k to 64k. Each shape: our kernel and vLLM's ``unified_attention`` (with its
3-D split path configured as vLLM's Triton backend does: 16 segments, threshold 128 / KV
heads) on the same inputs, timed with ``triton.testing.do_bench``; the achieved HBM
bandwidth for decode (KV bytes read / time) against a device-to-device copy measured in
the same run; TFLOP/s for the prefill chunk; and our error against the float32 reference
on a small case. Prints a table and writes JSON with the GPU and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.reference import paged_attention_ref  # noqa: E402
from tests.kernels.cases import make_case  # noqa: E402

HQ, HKV, D = 32, 8, 128


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # read + write, GB/s


def vllm_runner(case: dict, out: torch.Tensor):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    segments, threshold = 16, 128 // HKV
    seg_out = torch.empty(threshold, HQ, segments, triton.next_power_of_2(D), dtype=torch.float32, device="cuda")
    seg_max = torch.empty(threshold, HQ, segments, dtype=torch.float32, device="cuda")
    seg_sum = torch.empty_like(seg_max)
    max_k = int(case["seq_lens"].max())

    def run():
        unified_attention(q, k, v, out, case["query_start_loc"], case["max_query_len"], case["seq_lens"], max_k,
                          case["scale"], True, (-1, -1), case["block_table"], 0, None, None, None,
                          seq_threshold_3D=threshold, num_par_softmax_segments=segments,
                          softmax_segm_output=seg_out, softmax_segm_max=seg_max, softmax_segm_expsum=seg_sum)
    return run


def gpu_case(page: int, context: int, batch: int, qlen: int) -> dict:
    """Random inputs made on the GPU (64k-token contexts are GBs), pages shuffled."""
    pages = -(-context // page)
    blocks = batch * pages + 1
    k = torch.randn(blocks, page, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks - 1, device="cuda")[: batch * pages].view(batch, pages).to(torch.int32)
    return {"q": torch.randn(batch * qlen, HQ, D, device="cuda", dtype=torch.bfloat16), "k_cache": k, "v_cache": v,
            "block_table": table, "seq_lens": torch.full((batch,), context, dtype=torch.int32, device="cuda"),
            "query_start_loc": torch.arange(0, batch * qlen + 1, qlen, dtype=torch.int32, device="cuda"),
            "scale": D ** -0.5, "max_query_len": qlen}


def bench_shape(kind: str, page: int, context: int, batch: int, qlen: int, copy_gbs: float) -> dict:
    case = gpu_case(page, context, batch, qlen)
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    ours_out = torch.empty_like(case["q"])
    ours = do_bench(lambda: paged_attention(**args, scale=case["scale"], max_query_len=qlen, out=ours_out),
                    warmup=10, rep=100)
    row = {"kind": kind, "page": page, "context": context, "batch": batch, "query_len": qlen, "ours_ms": ours}
    try:
        theirs_out = torch.empty_like(case["q"])
        run = vllm_runner(case, theirs_out)
        row["vllm_ms"] = do_bench(run, warmup=10, rep=100)
        row["vllm_over_ours"] = row["vllm_ms"] / ours
        row["max_abs_diff_vs_vllm"] = (ours_out.float() - theirs_out.float()).abs().max().item()
    except Exception as exc:  # vLLM missing or its kernel refusing the shape
        row["vllm_error"] = f"{type(exc).__name__}: {exc}"[:300]
    kv_bytes = 2 * batch * context * HKV * D * 2
    row["ours_gbs"] = kv_bytes / (ours * 1e-3) / 1e9
    row["ours_fraction_of_copy"] = row["ours_gbs"] / copy_gbs
    flops = 4 * batch * qlen * context * HQ * D  # QK^T and PV, causal halves ignored for decode
    if qlen > 8:
        flops = 4 * batch * HQ * D * sum(context - qlen + i + 1 for i in range(qlen))
    row["ours_tflops"] = flops / (ours * 1e-3) / 1e12
    return row


def accuracy() -> dict:
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        case = make_case(1568, [1, 4, 300], [3000, 2000, 500], HQ, HKV, D, dtype, seed=5, device="cuda")
        args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
        got = paged_attention(**args, scale=case["scale"], max_query_len=case["max_query_len"]).float().cpu()
        ref = paged_attention_ref(**{k: v.cpu() for k, v in args.items()}, scale=case["scale"])
        out[str(dtype)] = ((got - ref).abs().max() / ref.abs().max()).item()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="fewer contexts")
    args = p.parse_args()
    copy_gbs = copy_bandwidth()
    rows = []
    contexts = (1024, 8192, 65536) if not args.quick else (8192, 65536)
    shapes = [(kind, page, context, 16, qlen) for page in (16, 1568) for context in contexts
              for kind, qlen in (("decode", 1), ("verify", 4))]
    shapes += [("prefill", page, 8192, 1, 512) for page in (16, 1568)]
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    acc = accuracy()
    print(f"relative error vs float32 reference: {acc}", flush=True)
    for shape in shapes:
        rows.append(r := bench_shape(*shape, copy_gbs))
        print(f"{r['kind']:<8} page={r['page']:<5} ctx={r['context']:<6} b={r['batch']:<3} q={r['query_len']:<4} "
              f"ours={r['ours_ms']:.3f} ms vllm={r.get('vllm_ms', float('nan')):.3f} ms "
              f"vllm/ours={r.get('vllm_over_ours', float('nan')):.2f} "
              f"{r['ours_gbs']:.0f} GB/s ({r['ours_fraction_of_copy']:.0%} of copy) {r['ours_tflops']:.1f} TFLOP/s "
              f"{r.get('vllm_error', '')}", flush=True)
    record = {"bench": "kernel", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(), "copy_gbs": copy_gbs,
              "rows": rows, "relative_error": acc, "command": " ".join(sys.argv)}
    try:
        import vllm
        record["vllm"] = vllm.__version__
    except ImportError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
