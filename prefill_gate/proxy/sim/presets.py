"""Simulator presets, each calibrated from real measurements (sources inline).

A preset is a cost model plus the vLLM settings it was measured with. Flags of
``prefill-gate sim`` override single fields (``--max-num-batched-tokens 2048``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import CostModel, EngineConfig


@dataclass(frozen=True)
class Preset:
    name: str
    cost: CostModel
    engine: EngineConfig
    source: str


PRESETS: dict[str, Preset] = {}


def _add(p: Preset) -> None:
    PRESETS[p.name] = p


# H200, vLLM 0.26.0, Qwen3-8B shape with dummy weights, bf16, FA3, CUDA graphs, prefix
# caching on; fitted to the step times seen in bench/results/h200/ (B's gaps while A
# prefills): B alone decodes at 4.68 ms/token (p99 5.4); with 2048-token chunks A's 14
# steps rise linearly from ~48 to ~110 ms as its context grows (per token ~13 us: 1.3e-5,
# attention 1.4e-9 s per token and context position); the 8192-token chunks took
# ~165, 270, 350 and 205 ms; B keeps decoding for ~24 ms after A is sent (the front
# end's work on 28.6k characters), then A's arrival stalls the engine ~50 ms. Known gap: small mixed steps (--long-prefill-token-
# threshold 512) cost 25-55 ms on the GPU against ~23 ms here (the old docs/RESULTS.md, in git history). A prompt sent as
# token ids (a slice): its front end 6.8e-7 s and its engine stall 1.1e-7 s per id, fitted by
# bench/sim_fit.py --slice-floor from bench/results/slicing/slice-floor-h200.json (fully cached
# id prompts of 1k-28.6k ids while B streams; bench/results/sim/fit-h200.json). Checked on the
# sliced seed pairs held out of that fit (bench/sim_slice_check.py): sliced prompts take 1.8-2.3x
# longer here than on the H200 with these costs or the hand-set ones before them, so the per-id
# costs are not what that gap is made of (the old docs/RESULTS.md (in git history) section 2).
_add(Preset(
    name="h200-qwen3-8b",
    cost=CostModel(base=4.65e-3, mixed=2.0e-3, per_decode_row=2.0e-5, per_prefill_token=1.3e-5,
                   attention=1.4e-9, decode_kv=3.0e-8, jitter=0.04, frontend_per_token=0.85e-6,
                   arrival_per_token=1.7e-6, frontend_per_id=6.8e-7, arrival_per_id=1.1e-7),
    engine=EngineConfig(max_num_batched_tokens=8192, max_num_seqs=256, block_size=16),
    source="H200 vLLM 0.26.0 Qwen3-8B dummy weights; bench/results/h200/",
))

# The original report: 2x RTX 3090 (TP=2), a 27B hybrid model, vLLM nightly,
# --max-num-batched-tokens 8192. One stream decodes at ~48 tok/s alone (20.8 ms);
# while a 28,623-token tool result prefills it gets 0.2-0.4 tok/s with 8192-token
# chunks and ~0.9 tok/s with 2048-token chunks. Both overlap rates pin the same total
# prefill time (~15.5 s): 0.4 ms/token plus an attention term for the rest. KV blocks
# of the hybrid in prefix-caching align mode are 1568 tokens.
_add(Preset(
    name="rtx3090-27b-hybrid",
    cost=CostModel(base=20.8e-3, per_decode_row=2.0e-4, per_prefill_token=4.0e-4, attention=9.9e-9,
                   jitter=0.02),
    engine=EngineConfig(max_num_batched_tokens=8192, max_num_seqs=256, block_size=1568, align_chunks=True),
    source="2x RTX 3090 TP=2, 27B hybrid (the report in shared/ARCHITECTURE.md)",
))

# The report's model class on one H200: a 27B dense hybrid (Gated DeltaNet + attention,
# bench/gpu/hybrid_model.py) with an fp8 KV cache, prefix caching in align mode (blocks of
# 1568 tokens), --max-num-batched-tokens 2048 as in the report. Fitted by bench/sim_fit.py
# from the seed pair direct with and without prefix caching (1568- and 2047-token chunks) and
# checked on the paced runs held out of the fit: bench/results/sim/fit-h200-hybrid.json.
# mixed_floor: stock vLLM's short-prompt step (graphs up to 128 tokens, so it runs eagerly), from
# `bench short` on the H200 (bench/results/graphs/h200/hybrid/short-stock-2048.json: the stream
# gap over a 200-400-token prompt, 114.9 ms at the median) less a decode step and the arrival;
# checked by the same probe on this preset: bench/results/sim/short-h200-hybrid.json.
_add(Preset(
    name="h200-27b-hybrid",
    cost=CostModel(base=14.1e-3, mixed=60.4e-3, per_prefill_token=5.08e-5, attention=4.3e-10,
                   jitter=0.02, arrival_per_token=4.7e-6, mixed_floor=99e-3),
    engine=EngineConfig(max_num_batched_tokens=2048, max_num_seqs=64, block_size=1568, align_chunks=True),
    source="H200 vLLM 0.26.0, 27B dense hybrid dummy weights; bench/results/hybrid/h200/run-4031669/",
))

# The same model as the stack serves it: CUDA graphs to 512 tokens (the plugin's, for the paced
# scheduler) and PREFILL_GATE_GDN_RECURRENT=512 (a step of at most 512 prompt tokens runs the GDN
# layers as one recurrent launch each, walking the prompt token by token). A short prompt's step
# then cost the streams 43.5 ms at the median on the H200 (bench/results/gdn/h200/short-ours-gdn.json,
# 200-400 tokens beside 4 streams; p90 51.6, max 53.9) against 86.3 with the graphs alone and 114.9
# with neither, and the prompts' TTFT rose 0.11-0.12 ms a prompt token (vLLM's path: flat), the
# walk's ~1.8 us a token over 48 layers (0.086 ms) and some. So a step within the graphs costs
# 0.09 ms a prompt token and 1 ms fixed (43.5 ms for 300 tokens with the decode step and the
# prompt's arrival), and a step past 512 tokens what it costs stock vLLM (its fixed part, less
# that 1 ms, as ``eager``; the paced seed pair's whole-block steps, 157-184 ms, were the same with
# and without the patch, bench/results/gdn/h200/pair-paced-*.json). Checked by `bench short` on
# this preset: bench/results/sim/short-h200-hybrid-stack.json.
_add(Preset(
    name="h200-27b-hybrid-stack",
    cost=CostModel(base=14.1e-3, mixed=1.0e-3, per_prefill_token=5.08e-5, attention=4.3e-10, jitter=0.02,
                   arrival_per_token=4.7e-6, graph_tokens=512, eager=59.4e-3, graph_per_prefill_token=9.0e-5),
    engine=EngineConfig(max_num_batched_tokens=2048, max_num_seqs=64, block_size=1568, align_chunks=True),
    source="H200 vLLM 0.26.0, 27B dense hybrid dummy weights, graphs to 512 + the GDN recurrent path; "
           "bench/results/gdn/h200/",
))

DEFAULT_PRESET = "h200-qwen3-8b"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown simulator preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
