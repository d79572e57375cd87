"""The paged-attention kernel on a GPU, side by side with vLLM 0.26's Triton kernel.

    python3 bench/gpu/kernel_h200.py --json OUT.json      (on the device, after the recipe's setup)

    python3 bench/gpu/kernel_h200.py --sweep --json OUT.json   (also tune the decode launch)

Shapes (Qwen3-8B attention: 32 query heads, 8 KV heads, head dim 128, bf16): decode (1
query token per sequence), verify (4), a prefill chunk (512), page sizes 16 and 1568,
contexts 1k to 64k. Each shape: our kernel, vLLM's ``unified_attention`` (with its
3-D split path configured as vLLM's Triton backend does: 16 segments, threshold 128 / KV
heads) and vLLM's bundled FlashAttention 3 on the same inputs, timed with
``triton.testing.do_bench``; the achieved HBM
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
from prefill_gate.kernels.paged_attention import LaunchConfig, paged_attention  # noqa: E402
from prefill_gate.kernels.reference import paged_attention_ref  # noqa: E402
from tests.kernel_tests.cases import make_case  # noqa: E402

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


def fa3_runner(case: dict, out: torch.Tensor):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    max_k = int(case["seq_lens"].max())

    def run():
        flash_attn_varlen_func(case["q"], case["k_cache"], case["v_cache"], case["max_query_len"],
                               case["query_start_loc"], max_k, seqused_k=case["seq_lens"],
                               softmax_scale=case["scale"], causal=True, block_table=case["block_table"], out=out,
                               fa_version=3)
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
    for name, make in (("vllm", vllm_runner), ("fa3", fa3_runner)):
        try:
            theirs_out = torch.empty_like(case["q"])
            run = make(case, theirs_out)
            row[f"{name}_ms"] = do_bench(run, warmup=10, rep=100)
            row[f"{name}_over_ours"] = row[f"{name}_ms"] / ours
            row[f"max_abs_diff_vs_{name}"] = (ours_out.float() - theirs_out.float()).abs().max().item()
        except Exception as exc:  # vLLM missing or its kernel refusing the shape
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    kv_bytes = 2 * batch * context * HKV * D * 2
    row["ours_gbs"] = kv_bytes / (ours * 1e-3) / 1e9
    row["ours_fraction_of_copy"] = row["ours_gbs"] / copy_gbs
    if "fa3_ms" in row:
        row["fa3_fraction_of_copy"] = kv_bytes / (row["fa3_ms"] * 1e-3) / 1e9 / copy_gbs
    flops = 4 * batch * qlen * context * HQ * D  # QK^T and PV, causal halves ignored for decode
    if qlen > 8:
        flops = 4 * batch * HQ * D * sum(context - qlen + i + 1 for i in range(qlen))
    row["ours_tflops"] = flops / (ours * 1e-3) / 1e12
    return row


SWEEP_TILES = ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4))
SWEEP_GRID = [(splits, tile_n, warps, stages) for splits in (8, 16, 32) for tile_n, warps in SWEEP_TILES
              for stages in (1, 2, 3)]


def sweep(copy_gbs: float, configs, page: int, context: int, batch: int = 16, qlen: int = 1) -> list[dict]:
    """Time (splits, TILE_N, warps, stages) configurations on one split-KV shape."""
    case = gpu_case(page, context, batch, qlen)
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    out = torch.empty_like(case["q"])
    kv_bytes = 2 * batch * context * HKV * D * 2
    rows = []
    for splits, tile_n, warps, stages in configs:
        cfg = LaunchConfig(tile_n, warps, stages)
        row = {"page": page, "context": context, "batch": batch, "query_len": qlen, "splits": splits,
               "tile_n": tile_n, "num_warps": warps, "num_stages": stages}
        try:
            row["ms"] = do_bench(lambda cfg=cfg, splits=splits: paged_attention(
                **args, scale=case["scale"], max_query_len=qlen, out=out, num_kv_splits=splits, config=cfg),
                warmup=5, rep=40)
            row["fraction_of_copy"] = kv_bytes / (row["ms"] * 1e-3) / 1e9 / copy_gbs
        except Exception as exc:  # out of shared memory, registers
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    done = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    for r in done[:6]:
        print(f"sweep page={page} ctx={context} q={qlen} splits={r['splits']:<3} tile={r['tile_n']:<4} "
              f"warps={r['num_warps']} stages={r['num_stages']} {r['ms']:.3f} ms "
              f"({r['fraction_of_copy']:.0%} of copy)", flush=True)
    return rows


def best(rows: list[dict], n: int) -> list[tuple]:
    done = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    return [(r["splits"], r["tile_n"], r["num_warps"], r["num_stages"]) for r in done[:n]]


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
    p.add_argument("--sweep", action="store_true", help="also search the split-KV launch parameters")
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
              f"fa3={r.get('fa3_ms', float('nan')):.3f} ms fa3/ours={r.get('fa3_over_ours', float('nan')):.2f} "
              f"{r['ours_gbs']:.0f} GB/s ({r['ours_fraction_of_copy']:.0%} of copy) {r['ours_tflops']:.1f} TFLOP/s "
              f"{r.get('vllm_error', '')} {r.get('fa3_error', '')}", flush=True)
    sweeps = []
    if args.sweep:
        sweeps = sweep(copy_gbs, SWEEP_GRID, 1568, 65536)  # the shape: the full grid
        top = best(sweeps, 6) + [(8, 64, 4, None)]  # and today's default on the others
        for page, context, qlen in ((1568, 8192, 1), (16, 65536, 1), (1568, 65536, 4), (16, 8192, 4)):
            sweeps += sweep(copy_gbs, top, page, context, 16, qlen)
    record = {"bench": "kernel", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(), "copy_gbs": copy_gbs,
              "rows": rows, "sweep": sweeps, "relative_error": acc, "command": " ".join(sys.argv)}
    try:
        import vllm
        record["vllm"] = vllm.__version__
    except ImportError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
