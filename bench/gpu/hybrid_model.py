#!/usr/bin/env python3
"""A weight-less hybrid model folder of the starvation report's class, for vLLM's
``--load-format dummy``: Qwen3.5/3.6-27B's text shape (Gated DeltaNet linear-attention
layers, every fourth layer full attention), served text-only (``--language-model-only``).

    python3 bench/gpu/hybrid_model.py TOKENIZER_DIR OUT_DIR [--check]

TOKENIZER_DIR: a folder of ``../shared/gpu/make_model.py`` (the character-level tokenizer,
vocab 256); its tokenizer files are copied. ``--check`` prints the KV block size vLLM
derives for this model (its own arithmetic, ``Platform._align_hybrid_block_size``) for the
report's setting and for one H200, from the installed vLLM, on the CPU.

Where each field comes from:
- 64 layers, hidden 5120, FFN 17408, 24 query heads, 4 KV heads of 256, partial rotary
  0.25, rope base 1e7, output-gated attention: the Megatron arguments of the public
  Qwen3.5-27B training recipe (THUDM/slime, ``scripts/models/qwen3.5-27B.sh``).
- Linear attention (16 key heads, 48 value heads, head dims 128, conv kernel 4) and
  ``mamba_ssm_dtype: float32``: chosen so that vLLM's align-mode block comes out at the
  report's 1,568 tokens under the report's setting (TP 2 with an 8-bit KV cache, or its
  equivalent on one GPU: an fp8 KV cache); 32 value heads would give 1,056 and a bf16
  state 800 (and one H200's bf16 KV cache 784). ``--check`` prints it. The GDN defaults of vLLM's ``Qwen3_5TextConfig`` (16 key
  heads, 128 dims, kernel 4) agree; the value-head count is this inference, not a copied
  config.
- Vocabulary 256 (the test tokenizer's), not 248,320: random weights sample any id, and
  every id must decode. The real vocabulary's lm_head would add ~2.5 GB of reads per step
  (~0.5 ms on an H200); gaps measured here are that much lower than the real model's.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

LAYERS = 64
TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 256,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)],
    "full_attention_interval": 4,
    "mamba_ssm_dtype": "float32",
    "bos_token_id": 253,
    "eos_token_id": 255,
    "pad_token_id": 253,
    "torch_dtype": "bfloat16",
}
# The vision tower is never built (--language-model-only); its config must still parse.
VISION_CONFIG = {"depth": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                 "out_hidden_size": 5120}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def write(tokenizer_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def align_block(*, tp: int, kv_cache_dtype: str, kernel_block: int = 16) -> int:
    """The attention block (tokens) vLLM 0.26 chooses in prefix caching's align mode:
    its own state-shape and page-size code, and the rule of
    ``Platform._align_hybrid_block_size`` (the smallest multiple of the kernel block whose
    attention page holds one layer's recurrent state). The server logs the block it chose
    ("Setting attention block size to N tokens"); the H200 run keeps that log."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator, MambaStateShapeCalculator)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    t = TEXT_CONFIG
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
        t["linear_value_head_dim"], t["linear_conv_kernel_dim"], 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", t["mamba_ssm_dtype"])
    state = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
    per_token = FullAttentionSpec(block_size=1, num_kv_heads=t["num_key_value_heads"] // tp,
                                  head_size=t["head_dim"], dtype=kv_dtype).page_size_bytes
    return kernel_block * -(-state // (kernel_block * per_token))


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    out = Path(args[1])
    write(Path(args[0]), out)
    print(f"wrote {out}")
    if "--check" in argv:
        for tp, dtype in ((2, "fp8"), (1, "fp8"), (1, "auto")):
            print(f"align-mode block, TP {tp}, KV cache {dtype}: {align_block(tp=tp, kv_cache_dtype=dtype)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
