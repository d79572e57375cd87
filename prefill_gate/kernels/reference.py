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


def gated_delta_ref(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_indices, has_initial=None, *,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of ``prefill_gate.kernels.gated_delta.gated_delta_recurrent``, in
    float64, one sequence, head and token at a time. Returns (out [tokens, HV, V] float64 with
    NaN where a sequence was skipped, the updated copy of ``state`` in float64)."""
    tokens, num_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    scale = head_k ** -0.5 if scale is None else scale
    out = torch.full((tokens, num_v_heads, head_v), float("nan"), dtype=torch.float64)
    new_state = state.double().clone()
    group = num_v_heads // num_heads
    for n in range(len(cu_seqlens) - 1):
        slot = int(state_indices[n])
        if slot <= 0:
            continue
        start, end = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        for hv in range(num_v_heads):
            s = new_state[slot, hv].clone() if has_initial is None or bool(has_initial[n]) else \
                torch.zeros(head_v, head_k, dtype=torch.float64)
            decay = -torch.exp(A_log[hv].double())
            for t in range(start, end):
                x = a[t, hv].double() + dt_bias[hv].double()
                g = decay * (torch.log1p(torch.exp(x)) if x <= 20 else x)
                beta = torch.sigmoid(b[t, hv].double())
                qt = q[t, hv // group].double()
                kt = k[t, hv // group].double()
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * scale
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                s = torch.exp(g) * s
                s = s + torch.outer(beta * (v[t, hv].double() - s @ kt), kt)
                out[t, hv] = s @ qt
            new_state[slot, hv] = s
    return out, new_state
