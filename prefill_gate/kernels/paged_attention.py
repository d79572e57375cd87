"""Paged attention over any KV page size, with a 32-row query tile, in Triton.

One program owns a tile of BLOCK_M = 32 rows: BLOCK_Q query positions x the query
heads of one KV head (GROUP_PAD rows each; GQA-8 makes BLOCK_Q = 4, so a verify block
of 1 + 3 speculative tokens reads its KV once). It walks the sequence's KV positions in
TILE_N steps, gathering each position through the block table (page = pos // page_size,
slot = pos % page_size: any page size, e.g. the 544-1568-token pages of hybrid models in
align mode), with an online softmax in float32.

Two launches, chosen by the launcher from ``max_query_len``:
  2-D path    (query length > 8): one program per (query tile, KV head) walks all the
              positions its tile may see; writes ``out`` directly.
  split-KV    (query length <= 8: decode and speculative-verify rows): the positions are
              cut into ``num_kv_splits`` segments, one program each, writing partial
              (max, sum, acc) to a scratch buffer, merged either by the tile's last
              program to finish (an arrival counter in the scratch: one launch, what an
              eager step wants) or by a second, merge launch (faster on the GPU: what a
              CUDA graph should record). Short queries over long contexts otherwise leave
              most of the GPU idle.

Semantics are ``prefill_gate.kernels.reference.paged_attention_ref``'s (the executable
specification): causal within each sequence's new tokens, optional sliding window and
softcap. On sm_70 (V100) tl.dot runs on FMA (no tensor-core path in Triton) and only
fp16 applies (no bf16); elsewhere fp16 and bf16.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from prefill_gate.kernels.tiles import HEAD_DIMS, MERGE_ROWS, ROWS, SPLIT_MAX_QUERY  # noqa: F401  (re-exported)


class LaunchConfig(NamedTuple):
    tile_n: int  # KV positions per loop step
    num_warps: int
    num_stages: int | None = None  # Triton's software pipelining depth; None: its default


class Scratch(NamedTuple):
    """The split-KV path's partial results, one slot per (token, query head, split), and
    the arrival counters of the fused merge: one int32 per (query tile, KV head), zero
    between launches (the last program of each tile resets its own), so a buffer zeroed
    once serves every launch and every CUDA-graph replay."""

    m: torch.Tensor  # [tokens, num_q_heads, splits] float32
    l: torch.Tensor  # [tokens, num_q_heads, splits] float32
    acc: torch.Tensor  # [tokens, num_q_heads, splits, head_dim] float32
    counter: torch.Tensor | None = None  # [>= query tiles x KV heads] int32, zeroed; None: merge launch

    @classmethod
    def empty(cls, tokens: int, num_q_heads: int, splits: int, head_dim: int, device,
              num_kv_heads: int | None = None) -> Scratch:
        """With ``num_kv_heads``, counters for every tile ``tokens`` tokens can form."""
        m = torch.empty(tokens, num_q_heads, splits, dtype=torch.float32, device=device)
        counter = None if num_kv_heads is None else counters(tokens, num_kv_heads, device)
        return cls(m, torch.empty_like(m),
                   torch.empty(tokens, num_q_heads, splits, head_dim, dtype=torch.float32, device=device), counter)


def counters(tokens: int, num_kv_heads: int, device) -> torch.Tensor:
    """Zeroed arrival counters for split launches of up to ``tokens`` query tokens: the
    grid has (sequences x query tiles) <= tokens x SPLIT_MAX_QUERY tiles per KV head."""
    return torch.zeros(tokens * SPLIT_MAX_QUERY * num_kv_heads, dtype=torch.int32, device=device)


def launch_config(capability: tuple[int, int] | None, split: bool) -> LaunchConfig:
    """(TILE_N, num_warps, num_stages) for a GPU and path. On sm_70 tl.dot runs on FMA with
    its operands in registers: 32 KV positions x head_dim 128 on 4 warps spilled ~10 KB
    (ptxas then capped itself at 32 registers); 16 positions on 8 warps (split-KV) or 16
    warps (2-D, which also holds the output conversion) fit in 154 / 128 registers without
    spilling (`python -m prefill_gate.kernels.aot` reports it). Tensor-core GPUs: split-KV takes 64
    positions on 2 warps with 2 pipeline stages, found by `bench/gpu/kernel_h200.py --sweep`
    over 54 configurations on the H200 (decode at page 1568, 64k context: 95% of copy
    bandwidth against 65% with 4 warps and Triton's default 3 stages; 81% against 58% at
    8k; the same winner at page 16 and for verify rows). At head_dim 128 that launch spills
    ~1 KB per thread on sm_80/sm_90 (`prefill_gate.kernels.aot`; it stays in L1 and the kernel is still
    the fastest measured); the no-spill 4-warp launch was the 65% one. The 2-D path takes
    32 positions on 4 warps, without spills."""
    if capability is not None and capability < (7, 5):
        return LaunchConfig(16, 8 if split else 16)
    return LaunchConfig(64, 2, 2) if split else LaunchConfig(32, 4)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None  # Triton's interpreter on the CPU
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def _tile_attention(
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    k_ptr,  # [num_blocks, page_size, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_blocks, page_size, num_kv_heads, HEAD_DIM]
    out_ptr,  # 2-D path: [num_tokens, num_q_heads, HEAD_DIM]
    part_m_ptr,  # split path: [num_tokens, num_q_heads, NUM_SPLITS] float32
    part_l_ptr,  # split path: [num_tokens, num_q_heads, NUM_SPLITS] float32
    part_acc_ptr,  # split path: [num_tokens, num_q_heads, NUM_SPLITS, HEAD_DIM] float32
    counter_ptr,  # fused merge: [query tiles x KV heads] int32, zero on entry and on exit
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    scale, softcap, window, page_size, q_tiles,
    stride_q_t, stride_q_h,
    stride_k_b, stride_k_p, stride_k_h,
    stride_v_b, stride_v_p, stride_v_h,
    stride_o_t, stride_o_h,
    stride_bt_s,
    num_q_heads,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two
    BLOCK_Q: tl.constexpr,  # query positions per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSE_MERGE: tl.constexpr,  # split path: the tile's last program to finish merges
    MERGE_ROWS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact dots, not TF32
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    seq = tl.program_id(0) // q_tiles
    q_tile = tl.program_id(0) % q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_ptr + seq)
    n_new = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= n_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # which new token
    head = kv_head * GROUP + rows % GROUP_PAD  # which query head
    row_ok = (q_idx < n_new) & (rows % GROUP_PAD < GROUP)
    q_pos = seq_len - n_new + q_idx  # absolute position of the row's token
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]

    # The positions this tile may see: up to its last token; from the window's start.
    last_token = tl.minimum(n_new, (q_tile + 1) * BLOCK_Q) - 1
    hi = seq_len - n_new + last_token + 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, seq_len - n_new + q_tile * BLOCK_Q - window + 1)
    if SPLIT:
        seg = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), TILE_N) * TILE_N
        lo = lo + split * seg
        hi = tl.minimum(hi, lo + seg)

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)  # [TILE_N]
        pos_ok = pos < hi
        block = tl.load(block_table_ptr + seq * stride_bt_s + pos // page_size, mask=pos_ok, other=0)
        slot = pos % page_size
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_k_b + slot[:, None] * stride_k_p + kv_head * stride_k_h
                    + d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, TILE_N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_v_b + slot[:, None] * stride_v_p + kv_head * stride_v_h
                    + d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    token = q_start + q_idx
    if SPLIT:
        part = (token * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        if FUSE_MERGE:
            # Every thread's partials are stored before the (release) arrival; the last of
            # the tile's NUM_SPLITS programs (acquire) reads them all from L2 (.cg: not a
            # stale L1 line) and merges, saving the merge launch.
            tl.debug_barrier()
            tile = tl.program_id(0) * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:
                tl.atomic_xchg(counter_ptr + tile, 0)  # zero for the next launch or replay
                # MERGE_ROWS rows at a time, from the partials alone: the registers of the
                # loop above are dead here, and one [rows, splits, head_dim] tile stays small.
                sp = tl.arange(0, NUM_SPLITS)
                for c in tl.static_range(BLOCK_M // MERGE_ROWS):
                    r = c * MERGE_ROWS + tl.arange(0, MERGE_ROWS)
                    r_idx = q_tile * BLOCK_Q + r // GROUP_PAD
                    r_ok = (r_idx < n_new) & (r % GROUP_PAD < GROUP)
                    r_token = q_start + r_idx
                    r_head = kv_head * GROUP + r % GROUP_PAD
                    base = (r_token * num_q_heads + r_head) * NUM_SPLITS  # [MERGE_ROWS]
                    slot = base[:, None] + sp[None, :]  # [MERGE_ROWS, NUM_SPLITS]
                    m_s = tl.load(part_m_ptr + slot, mask=r_ok[:, None], other=-1e30, cache_modifier=".cg")
                    l_s = tl.load(part_l_ptr + slot, mask=r_ok[:, None], other=0.0, cache_modifier=".cg")
                    acc_s = tl.load(part_acc_ptr + slot[:, :, None] * HEAD_DIM + d[None, None, :],
                                    mask=r_ok[:, None, None] & d_ok[None, None, :], other=0.0,
                                    cache_modifier=".cg")  # [MERGE_ROWS, NUM_SPLITS, HEAD_DIM_PAD]
                    w = tl.exp(m_s - tl.max(m_s, 1)[:, None])  # empty segments carry -1e30: weight 0
                    merged = tl.sum(acc_s * w[:, :, None], 1) / tl.sum(l_s * w, 1)[:, None]
                    tl.store(out_ptr + r_token[:, None] * stride_o_t + r_head[:, None] * stride_o_h + d[None, :],
                             merged.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits(
    part_m_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] float32
    part_l_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] float32
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_DIM] float32
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    query_start_ptr,  # [num_seqs + 1] int32
    stride_o_t, stride_o_h,
    num_q_heads, max_query_len,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    # One program per (sequence, new-token index, head): only the launched sequences'
    # tokens are written, whatever else ``out`` holds (a mixed batch's 2-D rows).
    seq = tl.program_id(0) // max_query_len
    i = tl.program_id(0) % max_query_len
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    if i >= tl.load(query_start_ptr + seq + 1) - q_start:
        return
    token = q_start + i
    base = (token * num_q_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    m = tl.load(part_m_ptr + base + splits)  # [NUM_SPLITS]
    l = tl.load(part_l_ptr + base + splits)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :],
                  other=0.0)  # [NUM_SPLITS, HEAD_DIM_PAD]
    w = tl.exp(m - tl.max(m, 0))  # empty segments carry m = -1e30: weight 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, out):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("expected q [tokens, q_heads, head_dim] and k/v caches "
                         f"[blocks, page, kv_heads, head_dim]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    head_dim, num_q_heads, num_kv_heads = q.shape[2], q.shape[1], k_cache.shape[2]
    if head_dim not in HEAD_DIMS or k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim {head_dim} (cache {k_cache.shape[3]}): supported {HEAD_DIMS}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group onto {num_kv_heads} KV heads")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype}: supported float16, bfloat16, float32")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if query_start_loc.numel() != seq_lens.numel() + 1 or block_table.shape[0] < seq_lens.numel():
        raise ValueError("query_start_loc needs num_seqs + 1 entries and block_table a row per sequence")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and be contiguous in head_dim")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    split: bool | None = None, scratch: Scratch | None = None,
                    config: LaunchConfig | None = None, validate: bool = True,
                    fuse_merge: bool = False) -> torch.Tensor:
    """Attention of every new token over its sequence's paged KV (see the module doc and
    ``prefill_gate.kernels.reference`` for the layouts and semantics). Returns ``out``.

    ``split`` forces the path (None: split-KV when ``max_query_len`` <= SPLIT_MAX_QUERY).
    ``scratch`` is the split path's partials buffer, for callers that must not allocate
    per call (CUDA graphs): at least ``query_start_loc[-1]`` tokens and the splits used.
    ``config`` overrides ``launch_config`` (tuning). The sequences may be a slice of a
    larger batch: ``query_start_loc`` holds absolute token indices into ``q``/``out``.
    ``validate=False`` skips the argument checks (a caller on the hot path that checked
    its layouts once). A split launch with one segment per row writes ``out`` directly.
    The split path merges its segments inside the launch (the tile's last program to
    finish) when the scratch carries counters (``Scratch.counter``; allocated here when
    ``scratch`` is None and ``fuse_merge``), else with a second launch. Fused saves the
    host a launch (20-30 us on the H200) and costs the GPU 12-14% more time: worth it
    where the host, not the GPU, sets the pace (eager steps), not under CUDA graphs.
    """
    if validate:
        _check(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len, out)
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.numel(), k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, ROWS // group_pad)
    q_tiles = triton.cdiv(max_query_len, block_q)
    if split is None:
        split = max_query_len <= SPLIT_MAX_QUERY
    splits = triton.next_power_of_2(num_kv_splits or 8) if split else 1
    head_dim_pad = triton.next_power_of_2(head_dim)
    tile_n, num_warps, num_stages = config or launch_config(device_capability(q.device), split)
    split = split and splits > 1  # one segment: the tile is the whole row, no merge needed
    if not split:
        part = Scratch(out, out, out)  # unused (no counter: nothing to fuse)
    elif scratch is None:
        part = Scratch.empty(num_tokens, num_q_heads, splits, head_dim, q.device,
                             num_kv_heads if fuse_merge else None)
    else:
        fits = (scratch.acc.shape[0] >= num_tokens and tuple(scratch.acc.shape[1:]) == (num_q_heads, splits, head_dim)
                and scratch.m.shape == scratch.l.shape == scratch.acc.shape[:3]
                and all(t.is_contiguous() and t.dtype == torch.float32 for t in scratch[:3]))
        if not fits:
            raise ValueError(f"scratch {tuple(scratch.acc.shape)} does not fit [>= {num_tokens}, {num_q_heads}, "
                             f"{splits}, {head_dim}] (contiguous float32)")
        if scratch.counter is not None and (scratch.counter.dtype != torch.int32
                                            or scratch.counter.numel() < num_seqs * q_tiles * num_kv_heads):
            raise ValueError(f"scratch counter: int32 with >= {num_seqs * q_tiles * num_kv_heads} entries "
                             f"({num_seqs} sequences x {q_tiles} query tiles x {num_kv_heads} KV heads)")
        part = scratch
    fuse = split and part.counter is not None
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _tile_attention[(num_seqs * q_tiles, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part.m, part.l, part.acc, part.counter if fuse else seq_lens,
        block_table, seq_lens, query_start_loc,
        float(scale), float(softcap or 1.0), int(sliding_window or 0), k_cache.shape[1], q_tiles,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_table.stride(0),
        num_q_heads,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_n, NUM_SPLITS=splits, SPLIT=split, FUSE_MERGE=fuse, MERGE_ROWS=MERGE_ROWS,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, **extra,
    )
    if split and not fuse:
        _merge_splits[(num_seqs * max_query_len, num_q_heads)](
            part.m, part.l, part.acc, out, query_start_loc, out.stride(0), out.stride(1), num_q_heads, max_query_len,
            NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=4,
        )
    return out
