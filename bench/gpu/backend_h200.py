"""`--attention-backend CUSTOM` (prefill_gate.engine_patches.attention) against vLLM's TRITON_ATTN, on real vLLM.

    python3 bench/gpu/backend_h200.py worker --backend CUSTOM --spec ngram --out DIR --lock FILE
    python3 bench/gpu/backend_h200.py compare DIR --json OUT.json

With `--dtype float32` (and TRITON_F32_DEFAULT=ieee, so TRITON_ATTN's dots are exact too)
the comparison measures the kernels rather than bf16 rounding: in bf16 two vLLM setups
with the same kernel already disagree on a third of greedy tokens (a near-tie flips and
the texts diverge), which hides whether a backend computes the same attention.

One worker per (backend, speculative decoding) runs an offline `vllm.LLM` in its own process
(engine in-process, so the plugin's `register()` applies without installing the package),
with CUDA graphs on (vLLM's default FULL_AND_PIECEWISE). Weights: `--load-format dummy`, then
re-drawn from a seed per parameter name (vLLM's dummy weights are U(-1e-3, 1e-3), norms
included, which makes every logit nearly equal and greedy decoding a coin toss between
kernels): unit norms, N(0, 1/fan_in) matrices, the residual projections (o_proj,
down_proj) scaled by 1/sqrt(2 x layers) as GPT-2 initializes them (run 1 without that
scaling was chaotic: TRITON_ATTN agreed with itself on 46% of greedy tokens across two
vLLM setups), so logits are peaked as in a trained model. Every worker sees the same
weights and prompts.

The worker records (1) the logprob of every prompt token (prefill rows), (2) greedy
continuations with the logprob of each chosen token (decode rows; verify rows under
n-gram speculation), with the LM head scaled x4 first (sharper logits, see
`scale_lm_head`), (3) decode throughput: the same 16 x 4096-token batch generating 1 and
256 tokens, twice, decode tok/s = 16 x 255 / (best 256 - best 1). Workers start and check
accuracy in parallel, wait for each other, then time their decodes one at a time (a file
lock). `compare` pairs CUSTOM with TRITON_ATTN per speculation setting (vLLM 0.26 runs
Qwen3 on its model runner V2 without speculation and on V1 with it), and TRITON_ATTN with
itself across the two as the floor: what changes between two vLLM setups with the same
attention kernel.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 253  # the character tokenizer's ids below its special tokens
GREEDY_LOGIT_SCALE = 4.0
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def reinit_weights(worker) -> dict:
    """Runs inside vLLM's worker: redraw every parameter from a seed per name."""
    import torch

    model = worker.model_runner.get_model()
    layers = model.config.num_hidden_layers
    counts = {"norm": 0, "matrix": 0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                counts["norm"] += 1
                continue
            g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
            if "embed_tokens" in name:
                std = 1.0
            elif "lm_head" in name:
                std = 4.0 / p.shape[1] ** 0.5
            elif "o_proj" in name or "down_proj" in name:  # GPT-2's scaled residual init
                std = (p.shape[1] * 2 * layers) ** -0.5
            else:
                std = p.shape[1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(std))
            counts["matrix"] += 1
    return counts


def scale_lm_head(worker, factor: float) -> None:
    """Sharpen the logits: greedy decoding then has a trained model's margins between
    the top tokens, instead of near-ties any rounding difference flips."""
    import torch

    with torch.no_grad():
        worker.model_runner.get_model().lm_head.weight.mul_(factor)


def impl_names(worker) -> list[str]:
    model = worker.model_runner.get_model()
    return sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})


def repeated(rng, length: int, period: int) -> list[int]:
    """A random segment repeated: text n-gram speculation finds drafts in."""
    seg = rng.integers(0, VOCAB, size=period).tolist()
    return (seg * (length // period + 1))[:length]


def worker(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(ROOT))
    from prefill_gate import engine_patches

    engine_patches.register()  # not pip-installed on the device: register in-process
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(model=args.model, load_format="dummy", seed=0, skip_tokenizer_init=True, dtype=args.dtype,
              attention_backend=args.backend, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192,
              gpu_memory_utilization=args.util, kv_cache_memory_bytes=args.kv_bytes, enable_prefix_caching=False,
              speculative_config=SPEC if args.spec == "ngram" else None)
    record = {"backend": args.backend, "spec": args.spec, "dtype": args.dtype, "startup_s": time.monotonic() - t0,
              "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
              "vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "python": platform.python_version(), "command": " ".join(sys.argv),
              "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
              "weights": llm.collective_rpc(reinit_weights)[0], "impls": llm.collective_rpc(impl_names)[0]}
    print(f"[{args.backend}/{args.spec}] up in {record['startup_s']:.0f} s, impls {record['impls']}, "
          f"graphs {record['cudagraph_mode']}", flush=True)
    rng = np.random.default_rng(0)

    # (1) prompt logprobs: prefill rows
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(200, 1500, size=8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False))
    record["prompt_logprobs"] = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                                 for o, p in zip(outs, prompts)]

    # (2) greedy continuations: decode rows (verify rows with n-gram speculation), logits x4
    llm.collective_rpc(scale_lm_head, args=(GREEDY_LOGIT_SCALE,))
    prompts = [repeated(rng, int(n), int(per)) if i % 2 else rng.integers(0, VOCAB, size=int(n)).tolist()
               for i, (n, per) in enumerate(zip(rng.integers(100, 2000, size=16), rng.integers(8, 64, size=16)))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=128, temperature=0, logprobs=0, ignore_eos=True, detokenize=False))
    record["greedy"] = [{"tokens": list(o.outputs[0].token_ids),
                         "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                        for o in outs]

    # (3) decode throughput, one worker at a time, once every worker is done with (1), (2)
    if args.no_throughput:
        Path(args.out, f"{args.backend}-{args.spec}.json").write_text(json.dumps(record))
        return
    batch = [{"prompt_token_ids": repeated(rng, 4096, 48)} for _ in range(16)]
    Path(args.out, f"ready-{args.backend}-{args.spec}").touch()
    deadline = time.monotonic() + 300
    while len(list(Path(args.out).glob("ready-*"))) < args.expect and time.monotonic() < deadline:
        time.sleep(1)
    with open(args.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        times = {}
        for n in (1, 256, 1, 256):
            t = time.monotonic()
            llm.generate(batch, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False),
                         use_tqdm=False)
            times.setdefault(n, []).append(time.monotonic() - t)
        fcntl.flock(lock, fcntl.LOCK_UN)
    decode_s = min(times[256]) - min(times[1])
    record["throughput"] = {"batch": 16, "prompt_tokens": 4096, "new_tokens": 256, "times_s": times,
                            "decode_s": decode_s, "decode_tok_s": 16 * 255 / decode_s}
    print(f"[{args.backend}/{args.spec}] decode {record['throughput']['decode_tok_s']:.0f} tok/s", flush=True)
    Path(args.out, f"{args.backend}-{args.spec}.json").write_text(json.dumps(record))


def agreement(a: list[dict], b: list[dict]) -> dict:
    """Token agreement of greedy continuations and the logprob gap while they agree."""
    same = total = 0
    first_div, lp_gap = [], 0.0
    for x, y in zip(a, b):
        tx, ty = x["tokens"], y["tokens"]
        eq = [p == q for p, q in zip(tx, ty)]
        same += sum(eq)
        total += len(eq)
        k = eq.index(False) if False in eq else len(eq)
        first_div.append(k)
        if k:
            lp_gap = max(lp_gap, float(np.max(np.abs(np.subtract(x["logprobs"][:k], y["logprobs"][:k])))))
    return {"token_agreement": same / total, "first_divergence": first_div,
            "decode_logprob_max_abs_diff_while_agreeing": lp_gap}


def compare(args) -> None:
    runs = {p.stem: json.loads(p.read_text()) for p in Path(args.dir).glob("*-*.json")
            if p.stem.split("-")[0] in ("CUSTOM", "TRITON_ATTN")}
    result = {"runs": {k: {f: v.get(f) for f in ("dtype", "startup_s", "cudagraph_mode", "impls", "throughput",
                                                 "weights")}
                       for k, v in runs.items()}, "pairs": {}}
    for spec in ("none", "ngram"):
        ours, theirs = runs.get(f"CUSTOM-{spec}"), runs.get(f"TRITON_ATTN-{spec}")
        if not ours or not theirs:
            result["pairs"][spec] = {"missing": [k for k, v in ((f"CUSTOM-{spec}", ours),
                                                                (f"TRITON_ATTN-{spec}", theirs)) if not v]}
            continue
        gaps = [float(np.max(np.abs(np.subtract(x, y)))) for x, y in
                zip(ours["prompt_logprobs"], theirs["prompt_logprobs"])]
        pair = {"prompt_logprob_max_abs_diff": max(gaps), **agreement(ours["greedy"], theirs["greedy"])}
        speed = ""
        if "throughput" in ours and "throughput" in theirs:
            pair["decode_tok_s"] = {"CUSTOM": ours["throughput"]["decode_tok_s"],
                                    "TRITON_ATTN": theirs["throughput"]["decode_tok_s"]}
            pair["throughput_ratio"] = pair["decode_tok_s"]["CUSTOM"] / pair["decode_tok_s"]["TRITON_ATTN"]
            speed = (f"  decode tok/s CUSTOM {pair['decode_tok_s']['CUSTOM']:.0f} vs TRITON_ATTN "
                     f"{pair['decode_tok_s']['TRITON_ATTN']:.0f} ({pair['throughput_ratio']:.2f}x)")
        result["pairs"][spec] = pair
        print(f"spec={spec:<6} prompt logprob max |diff| {pair['prompt_logprob_max_abs_diff']:.4f}  "
              f"greedy agreement {pair['token_agreement']:.1%}  decode logprob max |diff| "
              f"{pair['decode_logprob_max_abs_diff_while_agreeing']:.4f}{speed}")
    base, spec = runs.get("TRITON_ATTN-none"), runs.get("TRITON_ATTN-ngram")
    if base and spec:  # same kernel, other runner and speculation: the floor for the pairs above
        result["floor_TRITON_ATTN_none_vs_ngram"] = {
            "prompt_logprob_max_abs_diff": max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in
                                               zip(base["prompt_logprobs"], spec["prompt_logprobs"])),
            **agreement(base["greedy"], spec["greedy"])}
        f = result["floor_TRITON_ATTN_none_vs_ngram"]
        print(f"floor (TRITON_ATTN none vs ngram): prompt logprob max |diff| {f['prompt_logprob_max_abs_diff']:.4f}"
              f"  greedy agreement {f['token_agreement']:.1%}")
    if "CUSTOM-none" in runs and "CUSTOM-ngram" in runs:
        result["spec_vs_plain_CUSTOM"] = agreement(runs["CUSTOM-none"]["greedy"], runs["CUSTOM-ngram"]["greedy"])
    result["command"] = " ".join(sys.argv)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--backend", required=True, choices=("CUSTOM", "TRITON_ATTN"))
    w.add_argument("--spec", default="none", choices=("none", "ngram"))
    w.add_argument("--model", default=str(ROOT / ".gpu/model-qwen3-8b"))
    w.add_argument("--out", required=True)
    w.add_argument("--lock", required=True)
    w.add_argument("--expect", type=int, default=1, help="workers to wait for before timing decode")
    w.add_argument("--util", type=float, default=0.2)
    w.add_argument("--kv-bytes", type=int, default=11 << 30)
    w.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    w.add_argument("--no-throughput", action="store_true", help="accuracy only (e.g. float32 runs)")
    c = sub.add_parser("compare")
    c.add_argument("dir")
    c.add_argument("--json")
    args = p.parse_args()
    worker(args) if args.cmd == "worker" else compare(args)


if __name__ == "__main__":
    main()
