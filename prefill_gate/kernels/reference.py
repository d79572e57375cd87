"""The executable specification of ``paged_attention``: plain torch, one sequence and
one query head at a time, in float32.

Layouts (vLLM's):
    q            [num_tokens, num_q_heads, head_dim]      new tokens of every sequence
    k_cache      [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache      [num_blocks, page_size, num_kv_heads, head_dim]
    block_table  [num_seqs, max_blocks] int32             page i of sequence s: block_table[s, i]
    seq_lens     [num_seqs] int32                         context length, new tokens included
    query_start_loc [num_seqs + 1] int32                  sequence s owns q rows [qsl[s], qsl[s+1])

New token i (0-based) of a sequence with context L and n new tokens sits at position
L - n + i and attends to positions j with j <= L - n + i (causal), and, with a sliding
window W, L - n + i - j < W. Query head h reads KV head h // (num_q_heads // num_kv_heads).
Scores are q.k * scale, then softcap * tanh(score / softcap) when softcap is set.
"""

from __future__ import annotations

import torch


def paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, scale: float,
                        sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    page = k_cache.shape[1]
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    for s in range(len(seq_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        n, length = end - start, int(seq_lens[s])
        if n == 0:
            continue
        positions = torch.arange(length)
        blocks = block_table[s, positions // page].long()
        k = k_cache[blocks, positions % page].float()  # [L, Hkv, D]
        v = v_cache[blocks, positions % page].float()
        for i in range(n):
            pos = length - n + i
            visible = positions <= pos
            if sliding_window is not None:
                visible &= (pos - positions) < sliding_window
            for h in range(num_q_heads):
                scores = (k[:, h // group] @ q[start + i, h].float()) * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                scores = scores.masked_fill(~visible, float("-inf"))
                out[start + i, h] = torch.softmax(scores, dim=0) @ v[:, h // group]
    return out
