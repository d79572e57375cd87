"""A step's causal convolution for the Gated DeltaNet layers: vLLM's arithmetic, bounds from the device.

Before its recurrence each GDN layer runs a depthwise causal convolution (width 4) over every
sequence of the step, then SiLU, and keeps each sequence's last 3 inputs as its convolution
state. vLLM 0.26 does this in ``causal_conv1d_fn``: a Python wrapper that reads the step's
per-sequence chunk lists built on the host (``nums_dict``, ``batch_ptr``) and sizes its grid
from them, then one Triton launch with ~35 arguments through Triton's per-call work. On the
27B hybrid that runs 48 times a mixed step, on the host, while the streams wait (issue 50:
the mixed step is the host's, bench/results/hybrid/h100/run-0261253/).

``causal_conv`` is the same computation with two differences of form, none of arithmetic:
- every program finds its sequence and chunk on the device, from the step's ``query_start_loc``
  (a prefix sum of the sequences' chunk counts in the program), so the grid is any upper
  bound on the chunks (``tokens // 8 + sequences``, known on the host with no sync) and programs
  past the step's last chunk return at once: a grid a CUDA graph could replay over padded steps;
- it launches through ``kernels.launch.Launcher`` (repeat launches straight to the compiled
  kernel, ``PREFILL_GATE_FAST_LAUNCH``).

Arithmetic, kept op for op from vLLM's ``_causal_conv1d_fwd_kernel`` so that the bits match:
chunks of 8 tokens a program, 256 channels; a chunk's first window from the slot's state (its
first chunk; zeros for a sequence with nothing computed) or from the inputs before it; per token
``acc = bias (float32); acc += col0 * w0; acc += col1 * w1; acc += col2 * w2; acc += x * w3``
with each product in the inputs' dtype, then ``acc / (1 + exp(-acc))``, stored in the inputs'
dtype. The first chunk's program stores the sequence's new state (the last 3 inputs, shifted in
from the old state when the sequence is shorter), after it has read the old one. A sequence whose
slot is vLLM's null block (0, padding) gets neither output nor state, as in vLLM's kernel.

Not covered (the caller keeps vLLM's function for these): prefix caching's per-block states
(``block_idx_*``: the GDN patch does not pass them either), widths other than 4, inputs whose
channels are not contiguous, a state dtype other than the inputs'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefill_gate.kernels.launch import Launcher

WIDTH = 4  # Qwen3-Next / Qwen3.5 / Qwen3.6: linear_conv_kernel_dim
BLOCK_M = 8  # tokens a program, as vLLM's kernel
BLOCK_N = 256  # channels a program, as vLLM's kernel
MIN_SEQS = 64  # the programs' vector of sequences: one compiled kernel up to 64 sequences a step
NULL_SLOT = 0  # vLLM's NULL_BLOCK_ID: a padding entry


# One compiled kernel whatever a step's sequence count (1, 16, 32, ...) and the inputs' row stride (a
# view of the layer's projection), so that the warm-up's launch compiles what service runs.
@triton.jit(do_not_specialize=["n_seqs", "stride_x_tok", "stride_o_tok"])
def _causal_conv_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, has_initial_ptr, starts_ptr, out_ptr,
                        n_seqs, dim, stride_x_tok, stride_w_dim, stride_w_width,
                        stride_s_slot, stride_s_dim, stride_s_tok, stride_slots, stride_o_tok,
                        NULL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SEQS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # This program's chunk: the sequences' chunk counts from their starts, summed in order.
    pid = tl.program_id(0)
    seq = tl.arange(0, SEQS)
    lo = tl.load(starts_ptr + seq, mask=seq < n_seqs, other=0)
    hi = tl.load(starts_ptr + seq + 1, mask=seq < n_seqs, other=0)
    chunks = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(chunks, 0)  # chunks up to and including each sequence
    if pid >= tl.max(ends, 0):
        return  # past the step's last chunk (the grid is an upper bound)
    s = tl.sum((ends <= pid).to(tl.int32), 0)  # the first sequence whose chunks reach past pid
    k = pid - tl.sum(tl.where(seq < s, chunks, 0), 0)  # its chunk
    start = tl.load(starts_ptr + s)
    length = tl.load(starts_ptr + s + 1) - start
    slot = tl.load(slots_ptr + s * stride_slots).to(tl.int64)
    if slot == NULL:
        return

    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fmask = feats < dim
    x_seq = x_ptr + start * stride_x_tok + feats  # channels contiguous
    state = state_ptr + slot * stride_s_slot + feats * stride_s_dim
    if k == 0:
        initial = tl.load(has_initial_ptr + s).to(tl.int1)
        if initial:
            col2 = tl.load(state + 2 * stride_s_tok, fmask, 0.0)
            col1 = tl.load(state + 1 * stride_s_tok, fmask, 0.0)
            col0 = tl.load(state, fmask, 0.0)
        else:
            col0 = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
            col1 = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
            col2 = tl.zeros((BLOCK_N,), dtype=x_ptr.dtype.element_ty)
        # The new state: the last WIDTH - 1 inputs, the old state's tail first if the sequence is shorter.
        rows = tl.arange(0, 4)  # WIDTH - 1 = 3 rows, padded to a power of two
        keep = (rows < 3)[:, None] & fmask[None, :]
        target = state[None, :] + (rows * stride_s_tok)[:, None]
        if length >= 3:
            last = length - 3 + rows
            new = tl.load(x_seq[None, :] + (last * stride_x_tok)[:, None], keep, 0.0)
            tl.debug_barrier()
            tl.store(target, new, keep)
        else:
            back = rows - (3 - length)  # this row's input, counted from the sequence's first (< 0: the old state)
            from_x = (back >= 0)[:, None] & keep
            new = tl.load(x_seq[None, :] + (back * stride_x_tok)[:, None], from_x, 0.0)
            if initial:
                from_state = ((rows + length) < 3)[:, None] & keep
                old = tl.load(state[None, :] + ((rows + length) * stride_s_tok)[:, None], from_state, 0.0)
                tl.debug_barrier()
                new = tl.where(from_state, old, new)
            tl.store(target, new, keep)
    else:
        before = x_seq + (k * BLOCK_M - 1) * stride_x_tok
        col2 = tl.load(before, fmask, 0.0)
        col1 = tl.load(before - stride_x_tok, fmask, 0.0)
        col0 = tl.load(before - 2 * stride_x_tok, fmask, 0.0)

    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + feats, mask=fmask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w = w_ptr + feats * stride_w_dim
    w0 = tl.load(w, fmask, other=0.0)
    w1 = tl.load(w + stride_w_width, fmask, other=0.0)
    w2 = tl.load(w + 2 * stride_w_width, fmask, other=0.0)
    w3 = tl.load(w + 3 * stride_w_width, fmask, other=0.0)
    first = k * BLOCK_M
    for i in range(min(BLOCK_M, length - first)):
        x = tl.load(x_seq + (first + i) * stride_x_tok, mask=fmask)
        acc = acc0
        acc += col0 * w0
        acc += col1 * w1
        acc += col2 * w2
        acc += x * w3
        col0 = col1
        col1 = col2
        col2 = x
        if SILU:
            acc = acc / (1 + tl.exp(-acc))
        tl.store(out_ptr + (start + first + i) * stride_o_tok + feats, acc, mask=fmask)


def seq_buckets(max_seqs: int) -> list[int]:
    """The kernel's vector of sequences (``SEQS``) for steps of up to ``max_seqs`` sequences,
    each a compiled kernel: MIN_SEQS, then doublings."""
    buckets = [MIN_SEQS]
    while buckets[-1] < max_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


def supported(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> bool:
    """Can ``causal_conv`` take this layer's step (else vLLM's function should)?"""
    return (x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 2 and weight.shape[1] == WIDTH
            and state.dim() == 3 and state.shape[2] >= WIDTH - 1 and state.dtype == x.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                slots: torch.Tensor, has_initial: torch.Tensor, starts: torch.Tensor, *, silu: bool = True,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's convolution: ``x`` [tokens, dim] (channels contiguous), ``weight`` [dim, 4],
    ``state`` [slots, dim, >= 3] (any strides; updated in place), ``slots`` / ``has_initial`` an
    entry per sequence, ``starts`` [sequences + 1] (int32, on the device). Returns ``out``
    [tokens, dim] in ``x``'s dtype (a new contiguous tensor unless given)."""
    if not supported(x, weight, state):
        raise ValueError(f"causal_conv: want x [tokens, dim] with contiguous channels, weight [dim, {WIDTH}] and a "
                         f"state [slots, dim, >= {WIDTH - 1}] of x's dtype; got x {tuple(x.shape)} strides "
                         f"{x.stride()}, weight {tuple(weight.shape)}, state {tuple(state.shape)} {state.dtype}")
    tokens, dim = x.shape
    seqs = slots.shape[0]
    if starts.shape[0] < seqs + 1 or has_initial.shape[0] < seqs:
        raise ValueError(f"causal_conv: {seqs} sequences need {seqs + 1} starts and {seqs} has_initial entries, "
                         f"got {starts.shape[0]} and {has_initial.shape[0]}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens == 0 or seqs == 0:
        return out
    grid = (tokens // BLOCK_M + seqs, -(-dim // BLOCK_N))  # chunks, at most: sum(ceil(len / 8)) <= tokens / 8 + seqs
    _launch(grid, x, weight, bias if bias is not None else weight, state, slots, has_initial, starts, out,
            seqs, dim, x.stride(0), weight.stride(0), weight.stride(1), *state.stride(), slots.stride(0),
            out.stride(0), num_warps=4, NULL=NULL_SLOT, HAS_BIAS=bias is not None, SILU=silu,
            SEQS=max(MIN_SEQS, 1 << (seqs - 1).bit_length()), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)  # seq_buckets
    return out


# Repeat launches straight to the compiled kernel where PREFILL_GATE_FAST_LAUNCH=on (kernels/launch.py)
_launch = Launcher(_causal_conv_kernel)
