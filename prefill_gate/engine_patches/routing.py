"""Which attention launch each row of a batch takes (sm_70 decode-row routing).

vLLM 0.26's Triton backend picks its split-KV (decode) launch per batch, and only when
every row has one query token; speculative-verification rows (1 + k tokens) and every mixed
batch take the 2-D launch, the slow one on sm_70. Here the choice is per row:

    decode   one query token, not prefilling               -> split-KV launch
    verify   not prefilling, 1 < query length <= 1 + k     -> split-KV launch (mode auto)
    prefill  everything else                                -> 2-D launch

``PREFILL_GATE_SPEC_AS_DECODE`` picks the mode: ``auto`` (the rule above, the default),
``0`` (multi-token rows stay on the 2-D launch), ``1`` (every row of at most
``SPLIT_MAX_QUERY`` tokens takes the split-KV launch, prefilling or not). Verify rows are
at most ``SPLIT_MAX_QUERY`` tokens in every mode (longer ones, e.g. k > 7, stay 2-D). Pure: the
metadata builder calls it with CPU-side query lengths and prefill flags, no device sync.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from prefill_gate.kernels.tiles import SPLIT_MAX_QUERY  # constants only: no torch or Triton at plugin load

MODES = ("auto", "0", "1")
ENV = "PREFILL_GATE_SPEC_AS_DECODE"
DECODE, VERIFY, PREFILL = 0, 1, 2
NAMES = ("decode", "verify", "prefill")


def mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    mode = (os.environ if environ is None else environ).get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected auto, 0 or 1")
    return mode


def split_query_cap(num_spec_tokens: int, mode: str) -> int:
    """The longest row that can take the split-KV launch in this mode."""
    return {"0": 1, "1": SPLIT_MAX_QUERY}.get(mode, min(1 + num_spec_tokens, SPLIT_MAX_QUERY))


def row_classes(query_lens: np.ndarray, is_prefilling: np.ndarray, num_spec_tokens: int,
                mode: str = "auto") -> np.ndarray:
    """DECODE / VERIFY / PREFILL per row, vectorized (the metadata builder's path)."""
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected auto, 0 or 1")
    if query_lens.shape != is_prefilling.shape:
        raise ValueError(f"{query_lens.shape[0]} query lengths for {is_prefilling.shape[0]} prefill flags")
    if num_spec_tokens < 0:
        raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
    if (query_lens < 0).any():
        raise ValueError(f"negative query length {int(query_lens.min())}")
    prefilling = is_prefilling.astype(bool)
    if mode == "1":
        short = query_lens <= SPLIT_MAX_QUERY
    else:
        short = ~prefilling & (query_lens <= split_query_cap(num_spec_tokens, mode))
    out = np.full(query_lens.shape, PREFILL, dtype=np.int8)
    out[short] = VERIFY
    out[(query_lens <= 1) & ~prefilling] = DECODE  # a decode, or a padding row of a captured graph
    return out


def classify_rows(query_lens: Sequence[int], is_prefilling: Sequence[bool], num_spec_tokens: int,
                  mode: str = "auto") -> list[str]:
    classes = row_classes(np.asarray(query_lens, dtype=np.int64), np.asarray(is_prefilling, dtype=bool),
                          num_spec_tokens, mode)
    return [NAMES[c] for c in classes]
