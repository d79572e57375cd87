"""Which attention launch each row of a batch takes (sm_70 decode-row routing).

vLLM 0.26's Triton backend picks its split-KV (decode) launch per batch, and only when
every row has one query token; speculative-verification rows (1 + k tokens) and every mixed
batch take the 2-D launch, the slow one on sm_70. Here the choice is per row:

    decode   one query token, not prefilling               -> split-KV launch
    verify   not prefilling, 1 < query length <= 1 + k     -> split-KV launch (mode auto)
    prefill  everything else                                -> 2-D launch

``PREFILL_GATE_SPEC_AS_DECODE`` picks the mode: ``auto`` (the rule above, the default),
``0`` (multi-token rows stay on the 2-D launch), ``1`` (every row of at most
``SPLIT_MAX_QUERY`` tokens takes the split-KV launch, prefilling or not). Pure: the
metadata builder calls it with CPU-side query lengths and prefill flags, no device sync.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels.paged_attention import SPLIT_MAX_QUERY

MODES = ("auto", "0", "1")


def classify_rows(query_lens: Sequence[int], is_prefilling: Sequence[bool], num_spec_tokens: int,
                  mode: str = "auto") -> list[str]:
    if mode not in MODES:
        raise ValueError(f"PREFILL_GATE_SPEC_AS_DECODE={mode!r}: expected auto, 0 or 1")
    if len(query_lens) != len(is_prefilling):
        raise ValueError(f"{len(query_lens)} query lengths for {len(is_prefilling)} prefill flags")
    if num_spec_tokens < 0:
        raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
    out = []
    for q, prefilling in zip(query_lens, is_prefilling):
        if q < 0:
            raise ValueError(f"negative query length {q}")
        if q <= 1 and not prefilling:  # a decode, or a padding row of a captured graph
            out.append("decode")
        elif mode == "1" and q <= SPLIT_MAX_QUERY or mode == "auto" and not prefilling and q <= 1 + num_spec_tokens:
            out.append("verify")
        else:
            out.append("prefill")
    return out
