"""Where a mixed step's time goes: vLLM's torch profiler over a few steps, summarised per step.

    python3 bench/gpu/profile_steps.py collect URL --dir PROFILER_DIR --json OUT.json
    python3 bench/gpu/profile_steps.py summarize TRACE.json[.gz] [--json OUT.json]

Issue 50 asks, before any patch to the hybrid's eager GDN path, for one step's host time inside
the GDN cores against the GPU's busy time and the wall, and the kernels launched. On the H100
the 27B hybrid's mixed steps took ~38 ms at any prefill, ~36 of it the host launching them
(bench/results/hybrid/h100/run-1a80097/); this says which operations that host time is.

`collect` needs a server started with vLLM's profiler (`--profiler-config '{"profiler": "torch",
"torch_profiler_dir": DIR, ...}'`; `PROFILE=1 bench/gpu/defaults_h200.sh` starts the paced one
so): it opens 4 streams, asks the server to start profiling, sends short prompts (300 tokens,
one output token) one after another beside them, stops it, and summarises the newest trace in
DIR. `summarize` reads a trace vLLM wrote (Chrome trace JSON, gzipped or not).

Per step (vLLM annotates each `execute_model` as `execute_context_N(TOKENS)_generation_M(TOKENS)`):
its host time (the annotated span on the CPU: the engine launching the step), the kernels and
CUDA graphs launched in it and the launch calls' own time, the GPU's busy time in the step's
GPU-side annotation (the union of its kernels' intervals), and the host time inside operations
whose name says GDN (`gdn`, `gated_delta`, `fla`, `chunk_`: the eager core and its kernels'
Python). Then, over the mixed steps, the CPU operations that took most of their host time.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment  # noqa: E402

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
GDN = re.compile(r"gdn|gated_delta|fla|chunk_", re.IGNORECASE)
LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx)")
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")
TOP_OPS = 25
KINDS = ("decode", "mixed", "prefill")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict]) -> dict:
    """Per-step records and the top host operations of the mixed steps (times in ms)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    cpu_steps = [e for e in complete if e.get("cat") == "user_annotation" and STEP.match(e.get("name", ""))]
    gpu_steps = defaultdict(list)
    for e in complete:
        if e.get("cat") == "gpu_user_annotation" and STEP.match(e.get("name", "")):
            gpu_steps[e["name"]].append(e)
    kernels = sorted(((e["ts"], e["ts"] + e["dur"]) for e in complete if e.get("cat") == "kernel"))
    by_thread = defaultdict(list)
    for e in complete:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    steps = []
    ops = {kind: defaultdict(lambda: [0.0, 0]) for kind in KINDS}
    used_gpu: dict[str, int] = defaultdict(int)
    for step in sorted(cpu_steps, key=lambda e: e["ts"]):
        ctx, ctx_tokens, gen, gen_tokens = (int(g) for g in STEP.match(step["name"]).groups())
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in by_thread[(step.get("pid"), step.get("tid"))]
                  if e is not step and start <= e["ts"] and e["ts"] + e["dur"] <= end]
        launches = [e for e in inside if LAUNCH.match(e.get("name", ""))]
        graphs = [e for e in inside if GRAPH_LAUNCH.match(e.get("name", ""))]
        cpu_ops = [e for e in inside if e.get("cat") == "cpu_op"]
        gdn = [e for e in cpu_ops if GDN.search(e.get("name", ""))]
        # the step's GPU span: its GPU-side annotation (the n-th of that name for the n-th step)
        spans = gpu_steps.get(step["name"], [])
        gpu_busy = None
        if used_gpu[step["name"]] < len(spans):
            span = sorted(spans, key=lambda e: e["ts"])[used_gpu[step["name"]]]
            used_gpu[step["name"]] += 1
            a, b = span["ts"], span["ts"] + span["dur"]
            gpu_busy = _union([(max(k0, a), min(k1, b)) for k0, k1 in kernels if k1 > a and k0 < b]) / 1e3
        kind = "decode" if not ctx_tokens else "mixed" if gen else "prefill"
        steps.append({
            "kind": kind, "prefill_requests": ctx, "prefill_tokens": ctx_tokens, "decode_requests": gen,
            "host_ms": step["dur"] / 1e3, "kernel_launches": len(launches), "graph_launches": len(graphs),
            "launch_call_ms": sum(e["dur"] for e in launches + graphs) / 1e3,
            "gdn_host_ms": _union([(e["ts"], e["ts"] + e["dur"]) for e in gdn]) / 1e3,
            # the host's time in no torch operation at all: Python between them (graph replays'
            # wrappers, metadata building, the scheduler's output handling)
            "outside_ops_ms": (step["dur"] - _union([(e["ts"], e["ts"] + e["dur"]) for e in cpu_ops])) / 1e3,
            "gpu_busy_ms": gpu_busy,
        })
        for e in inside:
            if e.get("cat") in ("cpu_op", "user_annotation"):
                # vLLM's own annotations (preprocess, forward, sample, ...) beside the operations
                name = e["name"] if e["cat"] == "cpu_op" else f"[{e['name']}]"
                agg = ops[kind][name]
                agg[0] += e["dur"] / 1e3
                agg[1] += 1
    return {
        "steps": steps,
        "by_kind": {kind: _medians([s for s in steps if s["kind"] == kind]) for kind in KINDS},
        **{f"{kind}_top_ops": _top(ops[kind], sum(s["kind"] == kind for s in steps)) for kind in ("mixed", "decode")},
    }


def _top(ops: dict, n: int) -> list[dict]:
    """The operations that took most of these steps' host time (inclusive), per step."""
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]
    return [{"op": name, "host_ms_per_step": total / n, "calls_per_step": calls / n}
            for name, (total, calls) in top] if n else []


def _medians(steps: list[dict]) -> dict | None:
    if not steps:
        return None
    out = {"steps": len(steps)}
    for key in ("prefill_tokens", "host_ms", "kernel_launches", "graph_launches", "launch_call_ms", "gdn_host_ms",
                "outside_ops_ms", "gpu_busy_ms"):
        values = [s[key] for s in steps if s[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def table(summary: dict) -> str:
    def cell(v) -> str:
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    cols = ("steps", "prefill_tokens", "host_ms", "gdn_host_ms", "outside_ops_ms", "gpu_busy_ms", "kernel_launches",
            "graph_launches", "launch_call_ms")
    lines = ["step (medians)  " + "  ".join(f"{c:>15}" for c in cols)]
    for kind, row in summary["by_kind"].items():
        if row:
            lines.append(f"{kind:<15}  " + "  ".join(f"{cell(row[c]):>15}" for c in cols))
    for kind in ("mixed", "decode"):
        if summary[f"{kind}_top_ops"]:
            lines.append("")
            lines.append(f"{kind} steps' host time by operation (inclusive, per step; [vLLM's annotations])")
            for op in summary[f"{kind}_top_ops"]:
                lines.append(f"  {op['host_ms_per_step']:8.2f} ms  {op['calls_per_step']:7.1f} calls  {op['op'][:90]}")
    return "\n".join(lines)


def newest_trace(directory: Path) -> Path | None:
    traces = [p for p in directory.rglob("*.json*") if ".pt.trace." in p.name or p.name.endswith(".trace.json.gz")]
    return max(traces, key=lambda p: p.stat().st_mtime, default=None)


async def collect(url: str, prompts: int, seed: int) -> None:
    import httpx  # the device's environment has it (vLLM's); the summary needs nothing

    rng = random.Random(seed)

    async def stream(c: httpx.AsyncClient) -> None:
        body = {"model": "m", "prompt": [rng.randrange(10, 200) for _ in range(40)], "max_tokens": 2000,
                "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
        except (httpx.HTTPError, asyncio.CancelledError):
            pass

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as c:
        streams = [asyncio.create_task(stream(c)) for _ in range(4)]
        await asyncio.sleep(3.0)  # every stream decoding
        (await c.post(url + "/start_profile")).raise_for_status()
        try:
            for _ in range(prompts):
                body = {"model": "m", "prompt": [rng.randrange(10, 200) for _ in range(300)], "max_tokens": 1,
                        "temperature": 0}
                (await c.post(url + "/v1/completions", json=body)).raise_for_status()
                await asyncio.sleep(0.3)
        finally:
            (await c.post(url + "/stop_profile", timeout=600.0)).raise_for_status()
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="profile short prompts beside streams on a running server, then summarise")
    c.add_argument("url")
    c.add_argument("--dir", type=Path, required=True, help="the server's torch_profiler_dir")
    c.add_argument("--prompts", type=int, default=4)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", type=Path)
    s = sub.add_parser("summarize", help="summarise a trace vLLM's profiler wrote")
    s.add_argument("trace", type=Path)
    s.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "collect":
        began = time.time()
        asyncio.run(collect(args.url.rstrip("/"), args.prompts, args.seed))
        trace = newest_trace(args.dir)
        if trace is None or trace.stat().st_mtime < began:
            print(f"profile_steps: no trace written in {args.dir} (was the server started with --profiler-config?)",
                  file=sys.stderr)
            return 1
    else:
        trace = args.trace
    summary = summarize(load(trace))
    if not summary["steps"]:
        print(f"profile_steps: no annotated steps in {trace}", file=sys.stderr)
        return 1
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps({"bench": "profile_steps", "trace": str(trace), **summary, **environment()},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
