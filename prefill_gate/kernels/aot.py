"""Compile the kernels ahead of time for a GPU that is not here, and read their resources.

    python -m prefill_gate.kernels.aot [--arch 70 80 90] [--dtype fp16] [--head-dim 128]

Triton's own compiler builds PTX and a cubin for the target (``GPUTarget("cuda", arch,
32)``) on a CPU-only machine; ``ptxas -v`` (shipped with Triton) then reports registers
and spill traffic per kernel. CI runs this for sm_70, sm_80 and sm_90 and requires no
spills at head_dim 128 on sm_70 (V100). The Gated DeltaNet recurrence
(``gated_delta._gated_delta_kernel``) is built too, at the 27B hybrid's sizes, token by token
and (sm_80 and up) with prompts in chunks of 16, and the GDN layers' convolution
(``causal_conv._causal_conv_kernel``): the compiler refuses what Triton's interpreter, where
their numerics are tested, lets through.

``walk_report`` counts (bench/gdn_walks_aot.py runs it), in the PTX of each launch shape of the prompts' token walk (PREFILL_GATE_GDN_WALK: value
rows and warps a program), what one token costs a program: instructions, warp shuffles and
barriers in the loop, which the walk repeats once a token in dependent order; and registers. A
token's update is two reductions over the key dimension per value row of the state tile, so the
shape decides how much of it is shuffles and barriers. Counts, not times: a GPU run decides
(bench/gpu/gdn_kernel_time.py --walks, gdn_sweep.py's wRxW shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from prefill_gate.kernels.gated_delta import (BLOCK_V, CHUNK_BLOCK_V, CHUNK_WARPS, ROWS_ALL, ROWS_PROMPTS, SUB_BLOCK,
                                             _gated_delta_kernel)
from prefill_gate.kernels.paged_attention import MERGE_ROWS, ROWS, _merge_splits, _tile_attention, launch_config

PTR_ARGS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}
F32_PTR_ARGS = {"part_m_ptr", "part_l_ptr", "part_acc_ptr"}
I32_PTR_ARGS = {"block_table_ptr", "seq_lens_ptr", "query_start_ptr", "counter_ptr"}
F32_ARGS = {"scale", "softcap"}


@dataclass
class Report:
    kernel: str
    num_warps: int
    arch: int
    dtype: str
    head_dim: int
    split: bool
    registers: int
    spill_stores_bytes: int
    spill_loads_bytes: int
    shared_bytes: int
    chunk: int = 0


def _signature(fn, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in PTR_ARGS:
            sig[name] = f"*{dtype}"
        elif name in F32_PTR_ARGS:
            sig[name] = "*fp32"
        elif name in I32_PTR_ARGS:
            sig[name] = "*i32"
        elif name in F32_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _ptxas(ptx: str, arch: int) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE)  # sm_90 kernels target sm_90a
    try:
        run = subprocess.run([ptxas, "-v", f"--gpu-name={target.group(1) if target else f'sm_{arch}'}", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{arch}: {run.stderr.strip()[-2000:]}")
    out = run.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    smem = re.search(r"(\d+) bytes smem", out)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores_bytes": int(spills.group(1)) if spills else 0,
            "spill_loads_bytes": int(spills.group(2)) if spills else 0,
            "shared_bytes": int(smem.group(1)) if smem else 0}


def compile_report(arch: int, dtype: str = "fp16", head_dim: int = 128, group: int = 8,
                   split: bool = True) -> list[Report]:
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    target = GPUTarget("cuda", arch, 32)
    tile_n, num_warps, num_stages = launch_config((arch // 10, arch % 10), split)
    reports = []
    tile = {"GROUP": group, "GROUP_PAD": group_pad, "BLOCK_Q": max(1, ROWS // group_pad), "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim_pad, "TILE_N": tile_n, "NUM_SPLITS": 8 if split else 1, "SPLIT": split,
            "FUSE_MERGE": split, "MERGE_ROWS": MERGE_ROWS, "USE_SOFTCAP": False, "USE_WINDOW": False,
            "IEEE": dtype == "fp32"}
    merge = {"NUM_SPLITS": 8, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad}
    kernels = [(_tile_attention, tile)] + ([(_merge_splits, merge)] if split else [])
    for fn, constexprs in kernels:
        src = ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs)
        warps = num_warps if fn is _tile_attention else 4
        options = {"num_warps": warps}
        if fn is _tile_attention and num_stages is not None:
            options["num_stages"] = num_stages
        compiled = triton.compile(src, target=target, options=options)
        res = _ptxas(compiled.asm["ptx"], arch)
        reports.append(Report(fn.__name__, warps, arch, dtype, head_dim, split, **res))
    return reports


def gated_delta_report(arch: int, dtype: str = "bf16", head_dim: int = 128, stages: int = 1,
                       chunk: int = 0, num_warps: int = 4, block_v: int = BLOCK_V) -> Report:
    """The recurrence at the 27B hybrid's head sizes (16 key and 48 value heads), float32 state;
    ``stages`` > 1: its token loop software-pipelined (reported as ``split``); ``chunk``: prompts
    in chunks (tf32 matrix products where the target has them; Triton falls back to float32 FMAs
    on sm_70), in the prompts' launch as ``gated_delta_recurrent`` makes it (its decodes run in
    the token walk's)."""
    ptx = _gated_delta_ptx(arch, dtype, num_warps, {
        "H": 16, "HV": 48, "K": head_dim, "V": head_dim, "BK": triton.next_power_of_2(head_dim),
        "BV": min(triton.next_power_of_2(head_dim), block_v), "MASK_INITIAL": True, "STAGES": stages, "CHUNK": chunk,
        "SUB": min(chunk, SUB_BLOCK) if chunk else 1, "PRECISION": "tf32",
        "ROWS": (ROWS_PROMPTS if chunk else ROWS_ALL).value})
    return Report(_gated_delta_kernel.__name__, num_warps, arch, dtype, head_dim, stages > 1, **_ptxas(ptx, arch),
                  chunk=chunk)


def _gated_delta_ptx(arch: int, dtype: str, num_warps: int, constexprs: dict) -> str:
    """The recurrence's PTX for ``arch``: q, k, v, a, b and the output in ``dtype``, the state
    in float32."""
    fn = _gated_delta_kernel
    types = {"q": dtype, "k": dtype, "v": dtype, "a": dtype, "b": dtype, "o": dtype, "A_log": "fp32",
             "dt_bias": "fp32", "state": "fp32", "cu_seqlens": "i32", "state_indices": "i32", "has_initial": "i1"}
    sig = {n: "constexpr" if n in constexprs else f"*{types[n]}" if n in types else "fp32" if n == "scale" else "i32"
           for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return compiled.asm["ptx"]


def causal_conv_report(arch: int, dtype: str = "bf16") -> Report:
    """The GDN layers' convolution (``causal_conv._causal_conv_kernel``) as ``causal_conv``
    launches it: inputs, weights, state and output in ``dtype``, the sequences' bounds int32."""
    from prefill_gate.kernels import causal_conv

    fn = causal_conv._causal_conv_kernel
    constexprs = {"NULL": causal_conv.NULL_SLOT, "HAS_BIAS": True, "SILU": True, "SEQS": causal_conv.MIN_SEQS,
                  "BLOCK_M": causal_conv.BLOCK_M, "BLOCK_N": causal_conv.BLOCK_N}
    types = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "state_ptr": f"*{dtype}",
             "out_ptr": f"*{dtype}", "slots_ptr": "*i32", "starts_ptr": "*i32", "has_initial_ptr": "*i1"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    return Report(fn.__name__, 4, arch, dtype, causal_conv.WIDTH, False, **_ptxas(compiled.asm["ptx"], arch))


# The prompts' own launch shapes offered to the sweep, (value rows, warps) a program. Not 32 x 4,
# the one launch's shape: with the walk's prefetched inputs and its one round of sums, its state
# tile no longer fits sm_90's 255 registers (24 bytes spilled a thread).
WALKS = ((32, 1), (16, 1), (8, 1), (4, 1), (16, 2), (8, 2), (4, 2))
HYBRID_27B = {"H": 16, "HV": 48, "K": 128, "V": 128}  # a GDN layer of the 27B hybrid (bench/gpu/hybrid_model.py)


def token_loop(ptx: str) -> dict:
    """The longest loop of a kernel's PTX (a block that a later branch jumps back to): its
    instructions, warp shuffles, barriers and shared-memory loads and stores, executed once an
    iteration by every warp of a program."""
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        start = labels.get(m.group(1)) if m else None
        if start is None or start >= i:
            continue
        body = [x.strip() for x in lines[start:i + 1]]
        code = [x for x in body if x and not x.startswith(("$", "//", "{", "}", "."))]
        if best is None or len(code) > best["instructions"]:
            best = {"instructions": len(code), "shuffles": sum("shfl.sync" in x for x in code),
                    "barriers": sum("bar.sync" in x or "barrier.sync" in x for x in code),
                    "shared_loads": sum(x.startswith(("ld.shared", "@")) and "ld.shared" in x for x in code),
                    "shared_stores": sum("st.shared" in x for x in code)}
    if best is None:
        raise ValueError("no loop in this PTX")
    return best


def walk_report(arch: int, rows: int = BLOCK_V, warps: int = 4, dtype: str = "bf16", walk: bool = True) -> dict:
    """The prompts' token walk at one launch shape (``rows`` value rows, ``warps`` warps a
    program) on ``arch`` (``walk`` False: the one launch for decodes and prompts, as without
    PREFILL_GATE_GDN_WALK): ptxas' registers and spills and the token loop's counts
    (``token_loop``); ``warp_instructions_a_token``: programs x warps x loop instructions for one
    prompt of the 27B's layer (48 value heads of 128), the issue work a token asks of the GPU."""
    sizes = HYBRID_27B
    ptx = _gated_delta_ptx(arch, dtype, warps, {
        **sizes, "BK": triton.next_power_of_2(sizes["K"]), "BV": rows, "MASK_INITIAL": True, "STAGES": 1, "CHUNK": 0,
        "SUB": 1, "PRECISION": "tf32", "ROWS": (ROWS_PROMPTS if walk else ROWS_ALL).value})
    loop = token_loop(ptx)
    programs = triton.cdiv(sizes["V"], rows) * sizes["HV"]
    return {"arch": arch, "dtype": dtype, "launch": "prompts' walk" if walk else "one launch", "rows": rows,
            "warps": warps, **_ptxas(ptx, arch), **loop,
            "programs": programs, "warp_instructions_a_token": programs * warps * loop["instructions"]}


def all_reports(arches: list[int], dtype: str | None = None, head_dim: int = 128) -> list[dict]:
    """Every kernel, split and not, for each target (dtype: fp16 on sm_70, bf16 elsewhere)."""
    rows = []
    for arch in arches:
        dt = dtype or ("fp16" if arch < 80 else "bf16")
        for split in (True, False):
            rows += [asdict(r) for r in compile_report(arch, dt, head_dim, split=split)]
        rows += [asdict(gated_delta_report(arch, dt, head_dim, stages)) for stages in (1, 2)]
        if arch >= 80:  # the chunked form wants tf32 tensor cores; on sm_70 its products are FMAs and spill
            rows.append(asdict(gated_delta_report(arch, dt, head_dim, 1, 16, CHUNK_WARPS, CHUNK_BLOCK_V)))
        rows.append(asdict(causal_conv_report(arch, dt)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[70, 80, 90])
    p.add_argument("--dtype", default=None, help="fp16 or bf16 (default: fp16 on sm_70, bf16 elsewhere)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args()
    rows = all_reports(args.arch, args.dtype, args.head_dim)
    for r in rows:
        print(f"sm_{r['arch']} {r['dtype']} d={r['head_dim']} {r['kernel']:<16} split={r['split']!s:<5} "
              f"chunk={r['chunk']:<2} regs={r['registers']:<4} spill st/ld={r['spill_stores_bytes']}/{r['spill_loads_bytes']} B "
              f"smem={r['shared_bytes']} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "reports": rows}, f, indent=1)


if __name__ == "__main__":
    main()
