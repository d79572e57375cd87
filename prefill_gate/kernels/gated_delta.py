"""The gated delta rule, token by token, for a step's decodes and short prefills at once.

A Gated DeltaNet layer keeps, per sequence and value head, a [V, K] state S. Each token
(q, k, v, a, b) updates it and reads it:

    g    = -exp(A_log) * softplus(a + dt_bias)        beta = sigmoid(b)
    q, k = q / |q|, k / |k|                            (L2 norm, eps 1e-6)
    S    = exp(g) * S
    S    = S + k (beta * (v - S k))^T                  (the delta rule)
    o    = S q * scale

vLLM 0.26 runs this two ways: a decode's one token through a recurrent kernel, a prefill's
tokens through FLA's chunked algorithm (about ten launches and a dozen torch operations a
layer: cumsum, kkt, solve_tril, wy, fwd_h, fwd_o, the state's gather, masked fill and scatter,
a torch.cat of the decodes' and the prefill's outputs). In a step that carries a short prompt
next to live streams that chunked path runs eagerly, outside the CUDA graphs, 48 times a step
on the 27B hybrid: on the H200 such a step costs the streams 85-115 ms against a 15 ms decode
step (issue 50; bench/results/graphs/h200/).

``gated_delta_recurrent`` runs every sequence of the step, decodes and prefills, in one launch
of one program per (value block, sequence, value head): the state loaded once from its slot
(or zero, for a prompt with nothing computed before), the tokens walked in order in float32,
each token's output written, the final state stored once. q, k, v are read in place from the
convolution's output (strided views, no copy) and the output goes straight into the layer's
buffer. The work per token is the decode's; a prompt of n tokens is n dependent updates, so
it pays only while prompts are short: the engine patch (``engine_patches.gdn``) sends a step
here only when its prompt tokens are few. On the H200 that walk is ~1.8 us a token, ~25 ms of
a 300-token prompt's step over 48 layers (bench/results/gdn/h200/).

With ``walk`` set, the prompts go in a second launch of their own shape (value rows and warps a
program), each token's inputs loaded while the one before updates the state and all of a
token's sums over the key columns taken in one round (``_update_walk``: the prompts round
differently); the decodes keep the first launch, its shape and its bits. The shape decides how
those sums compile (across warps: shared memory and barriers; within one: shuffles), which is
most of the walk's time (bench/gdn_walks_aot.py counts it in the PTX).

With ``chunk`` set, a prompt instead goes through the chunked form of the rule inside the same
program (``_chunk``): per chunk of C tokens a handful of matrix products and the in-chunk
system solved by blocked substitution (15 small products, and two more to merge two blocks for
chunks of 32), so a prompt costs n / C dependent rounds instead of n. The prompts go in a launch of
their own (16 value rows and 8 warps a program by default), those shorter than a chunk token by
token; the decodes keep the walk's decode launch, its compiled loop and its bits (in the chunks'
launch, chunks of 16 changed the decodes' last bits on an H100: CHUNK is a constant of the
program, and the decode loop compiled differently beside it).

Semantics are ``prefill_gate.kernels.reference.gated_delta_ref``'s (the executable
specification), and the decode's arithmetic is vLLM's own recurrent kernel's (float32 state,
the same softplus threshold and norm eps), so decodes match it to rounding; prefills match the
chunked algorithm to the precision of the chunked form's intermediate products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefill_gate.kernels.launch import Launcher

L2NORM_EPS = tl.constexpr(1e-6)  # as vLLM's l2norm in its recurrent kernel
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # softplus(x) = x above it, as vLLM's kernels
BLOCK_V = 32  # value rows of the state per program: a 32 x 128 float32 tile in registers
CHUNK_BLOCK_V, CHUNK_WARPS = 16, 8  # with chunks: 16 value rows and 8 warps a program, the shape that
# compiles without spills for sm_90 (python -m prefill_gate.kernels.aot; 4 warps or 32 rows spill)
MIN_DOT = 16  # tl.dot's least side: the chunk and both state blocks
SUB_BLOCK = 16  # rows a chunk's in-chunk system is solved in by substitution; larger chunks merge them
MAX_MERGES = tl.constexpr(1)
MAX_CHUNK = SUB_BLOCK << 1  # 32: one merge of substituted blocks. Chunks of 64 (two merges) were
# exact under the interpreter but wrong on an H100 past their first chunk, and not the same twice
# from one seed, besides 5x slower than the walk (bench/results/gdn/h100/run-b953a47/)
PRECISIONS = ("tf32", "tf32x3", "ieee")
# Which sequences a launch takes (``walk``: decodes and prompts in launches of their own shapes).
ROWS_ALL, ROWS_DECODES, ROWS_PROMPTS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
WARPS = (1, 2, 4, 8)


@triton.jit
def _inputs(q, k, v, a, b, t, stride_q, stride_k, stride_v, stride_a, stride_b, i_h, i_hv, o_k, o_v,
            mask_k, mask_v, K: tl.constexpr, V: tl.constexpr):
    """Token ``t``'s q, k, v rows and gate pre-activations, in float32."""
    b_q = tl.load(q + t * stride_q + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_k = tl.load(k + t * stride_k + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(v + t * stride_v + i_hv * V + o_v, mask=mask_v, other=0).to(tl.float32)
    x_a = tl.load(a + t * stride_a + i_hv).to(tl.float32)
    x_b = tl.load(b + t * stride_b + i_hv).to(tl.float32)
    return b_q, b_k, b_v, x_a, x_b


@triton.jit
def _token(h, q, k, v, a, b, t, stride_q, stride_k, stride_v, stride_a, stride_b, i_h, i_hv, o_k, o_v,
           mask_k, mask_v, decay, bias, scale, K: tl.constexpr, V: tl.constexpr):
    """One token's update of a [BV, BK] state tile: (the new tile, the token's output rows)."""
    b_q, b_k, b_v, x_a, x_b = _inputs(q, k, v, a, b, t, stride_q, stride_k, stride_v, stride_a, stride_b, i_h,
                                      i_hv, o_k, o_v, mask_k, mask_v, K, V)
    return _update(h, b_q, b_k, b_v, x_a, x_b, decay, bias, scale)


@triton.jit
def _update(h, b_q, b_k, b_v, x_a, x_b, decay, bias, scale):
    """The rule's step for one token's inputs (``_inputs``): (the new tile, the output rows)."""
    x = x_a + bias
    softplus = tl.where(x <= SOFTPLUS_THRESHOLD, tl.log(1 + tl.exp(x)), x)
    beta = tl.sigmoid(x_b)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
    h *= tl.exp(decay * softplus)
    b_v = (b_v - tl.sum(h * b_k[None, :], 1)) * beta
    h += b_v[:, None] * b_k[None, :]
    return h, tl.sum(h * b_q[None, :], 1)


@triton.jit
def _update_walk(h, b_q, b_k, b_v, x_a, x_b, decay, bias, scale):
    """``_update`` for the prompts' own launch, with every sum over the key columns taken from
    the tile before the token, in one round: the state times the raw key and the raw query, and
    the key's and the query's norms and product. Then the new tile is the decayed one plus
    u k^T, and its product with the query is gate (S q) + u (k . q), so no second round of
    sums waits on the update. The same rule in another order: rounding differs from ``_update``
    (prompts only; decodes keep ``_update``'s, vLLM's)."""
    x = x_a + bias
    softplus = tl.where(x <= SOFTPLUS_THRESHOLD, tl.log(1 + tl.exp(x)), x)
    beta = tl.sigmoid(x_b)
    gate = tl.exp(decay * softplus)
    h_k = tl.sum(h * b_k[None, :], 1)
    h_q = tl.sum(h * b_q[None, :], 1)
    r_k = tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
    r_q = tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS) * scale
    k_q = tl.sum(b_k * b_q)
    u = (b_v - gate * r_k * h_k) * beta
    h = h * gate + u[:, None] * (b_k * r_k)[None, :]
    return h, gate * r_q * h_q + u * (r_k * r_q * k_q)


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr, SUB: tl.constexpr):
    """(I + A)^-1 for a strictly lower triangular [C, C] tile A, in float32 products.

    Blocked as a triangular inverse is done by hand: forward substitution inside each diagonal
    block of SUB rows, one row of every block per round (row r: e_r - sum_j A_rj T_j over the
    block's earlier rows, which are final: one product for all blocks at once), SUB - 1 rounds;
    then neighbouring blocks merged, doubling: with D the inverse found so far (block diagonal)
    and L the coupling of each pair's second block to its first, T = D - D L D. Each step is the
    exact arithmetic of elimination, none of the powers of A whose sum cancels."""
    row = tl.arange(0, C)
    T = tl.where(row[:, None] == row[None, :], 1.0, 0.0)
    inside = (row[:, None] // SUB) == (row[None, :] // SUB)
    for i in tl.static_range(1, SUB):
        rows_i = tl.where(inside & ((row[:, None] % SUB) == i), A, 0.0)
        T -= tl.dot(rows_i, T, input_precision="ieee")
    for level in tl.static_range(MAX_MERGES):  # blocks of SUB << level merged in pairs, while smaller than C
        if (SUB << level) < C:
            pair = (row[:, None] // (SUB << (level + 1))) == (row[None, :] // (SUB << (level + 1)))
            L = tl.where(pair & ((row[:, None] // (SUB << level)) != (row[None, :] // (SUB << level))), A, 0.0)
            T -= tl.dot(tl.dot(T, L, input_precision="ieee"), T, input_precision="ieee")
    return T


@triton.jit
def _chunk(h, q, k, v, a, b, o, t0, eos, stride_q, stride_k, stride_v, stride_a, stride_b, stride_o,
           i_h, i_hv, o_k, o_v, mask_k, mask_v, decay, bias, scale,
           K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """C tokens from t0 (those at or past eos are padding: they change nothing) in the chunked
    form of the rule; returns the state tile after them and writes their outputs.

    With G the running sum of the log decays inside the chunk (token i's decay from the chunk's
    start is exp(G_i)), S0 the state before it (a [BV, BK] tile, rows of value), the chunk's
    pseudo-values U ([C, BV]) solve (I + A) U = beta * (v - exp(G) * k S0^T), with A strictly lower
    triangular, A_ij = beta_i exp(G_i - G_j) k_i.k_j. T = (I + A)^-1 (``_unit_lower_inverse``), then
        out   = exp(G) * q S0^T + M U,         M_ij = exp(G_i - G_j) q_i.k_j  (j <= i)
        S     = exp(G_last) S0 + (exp(G_last - G) * U)^T k
    Every exponent is a difference G_i - G_j with j <= i (or G itself), never positive. G is a
    float32 running sum, as in vLLM's chunked path (FLA's chunk-local cumsum over 64 tokens): where
    gates close hard (|G| in the thousands) a difference carries the sum's rounding."""
    o_t = t0 + tl.arange(0, C)
    mask_t = o_t < eos
    row = tl.arange(0, C)
    mask_qk = mask_t[:, None] & mask_k[None, :]
    b_q = tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :], mask=mask_qk, other=0).to(tl.float32)
    b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=mask_qk, other=0).to(tl.float32)
    b_v = tl.load(v + o_t[:, None] * stride_v + i_hv * V + o_v[None, :], mask=mask_t[:, None] & mask_v[None, :],
                  other=0).to(tl.float32)
    x = tl.load(a + o_t * stride_a + i_hv, mask=mask_t, other=0).to(tl.float32) + bias
    g = tl.where(mask_t, decay * tl.where(x <= SOFTPLUS_THRESHOLD, tl.log(1 + tl.exp(x)), x), 0.0)
    beta = tl.where(mask_t, tl.sigmoid(tl.load(b + o_t * stride_b + i_hv, mask=mask_t, other=0).to(tl.float32)), 0.0)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + L2NORM_EPS)[:, None] * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + L2NORM_EPS)[:, None]

    G = tl.cumsum(g, 0)
    causal = row[:, None] >= row[None, :]
    gap = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)  # exp(G_i - G_j), j <= i
    A = tl.where(row[:, None] > row[None, :], beta[:, None] * gap * tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION), 0.0)
    T = _unit_lower_inverse(A, C, SUB)

    decayed = tl.exp(G)
    U = tl.dot(T, b_v * beta[:, None], input_precision=PRECISION)
    W = tl.dot(T, b_k * (beta * decayed)[:, None], input_precision=PRECISION)
    U -= tl.dot(W, tl.trans(h), input_precision=PRECISION)
    M = gap * tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
    b_o = tl.dot(b_q * decayed[:, None], tl.trans(h), input_precision=PRECISION) + tl.dot(M, U, input_precision=PRECISION)
    tl.store(o + o_t[:, None] * stride_o + i_hv * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=mask_t[:, None] & mask_v[None, :])
    last = tl.sum(tl.where(row == C - 1, G, 0.0), 0)  # the cumsum's own last entry (padding adds 0): the
    # last token's weight is exp(0) = 1 exactly, where a separate sum would round differently
    return h * tl.exp(last) + tl.dot(tl.trans(U * tl.exp(last - G)[:, None]), b_k, input_precision=PRECISION)


@triton.jit
def _gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, o, state, cu_seqlens, state_indices, has_initial,
                        stride_q, stride_k, stride_v, stride_a, stride_b, stride_o, stride_slot, scale,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, MASK_INITIAL: tl.constexpr, STAGES: tl.constexpr,
                        CHUNK: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr, ROWS: tl.constexpr = 0):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)

    slot = tl.load(state_indices + i_n).to(tl.int64)
    if slot <= 0:
        return  # no state slot (vLLM's NULL block, padding): nothing to compute or keep
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if ROWS == ROWS_DECODES:
        if eos - bos > 1:
            return  # a prompt: the other launch's
    elif ROWS == ROWS_PROMPTS:
        if eos - bos <= 1:
            return

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    p_state = state + slot * stride_slot + i_hv * V * K + o_v[:, None] * K + o_k[None, :]

    h = tl.zeros([BV, BK], dtype=tl.float32)
    if MASK_INITIAL:
        if tl.load(has_initial + i_n) != 0:
            h += tl.load(p_state, mask=mask_h, other=0).to(tl.float32)
    else:
        h += tl.load(p_state, mask=mask_h, other=0).to(tl.float32)

    decay = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.load(dt_bias + i_hv).to(tl.float32)
    if CHUNK > 0 and eos - bos >= CHUNK:  # a prompt: in chunks, the last one padded
        for t0 in tl.range(bos, eos, CHUNK, num_stages=STAGES):
            h = _chunk(h, q, k, v, a, b, o, t0, eos, stride_q, stride_k, stride_v, stride_a, stride_b, stride_o,
                       i_h, i_hv, o_k, o_v, mask_k, mask_v, decay, bias, scale, K, V, CHUNK, SUB, PRECISION)
    elif ROWS == ROWS_PROMPTS and CHUNK == 0:  # the prompts' walk: token t + 1's inputs load while t updates
        n_q, n_k, n_v, n_a, n_b = _inputs(q, k, v, a, b, bos, stride_q, stride_k, stride_v, stride_a, stride_b,
                                          i_h, i_hv, o_k, o_v, mask_k, mask_v, K, V)
        for t in tl.range(bos, eos):
            c_q, c_k, c_v, c_a, c_b = n_q, n_k, n_v, n_a, n_b
            n_q, n_k, n_v, n_a, n_b = _inputs(q, k, v, a, b, tl.minimum(t + 1, eos - 1), stride_q, stride_k,
                                              stride_v, stride_a, stride_b, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                                              K, V)
            h, b_o = _update_walk(h, c_q, c_k, c_v, c_a, c_b, decay, bias, scale)
            tl.store(o + t * stride_o + i_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    else:  # decodes (and in the chunks' launch, prompts shorter than a chunk): vLLM's decode arithmetic
        # STAGES asks Triton's software pipeliner for the next tokens' loads; Triton 3.6 leaves this
        # loop as it is (the same PTX for 1-3 stages on sm_90; its pipeliner takes loads it can copy
        # asynchronously into shared memory). The prompts' own launch (above) loads ahead by hand.
        for t in tl.range(bos, eos, num_stages=STAGES):
            h, b_o = _token(h, q, k, v, a, b, t, stride_q, stride_k, stride_v, stride_a, stride_b, i_h, i_hv,
                            o_k, o_v, mask_k, mask_v, decay, bias, scale, K, V)
            tl.store(o + t * stride_o + i_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    tl.store(p_state, h.to(state.dtype.element_ty), mask=mask_h)


def valid_walk(walk: tuple[int, int]) -> bool:
    """Is ``walk`` (value rows, warps) a launch shape for the prompts' own launch?"""
    rows, warps = walk
    return rows >= 1 and not rows & (rows - 1) and warps in WARPS


def _rows(name: str, x: torch.Tensor, heads: int, dim: int) -> int:
    """The token stride of a [tokens, heads, dim] tensor whose heads and dims are packed
    (the conv output's split views are); raise for any other layout."""
    strides = x.stride()
    if len(strides) != 3 or x.shape[1:] != (heads, dim) or strides[1:] != (dim, 1):
        raise ValueError(f"{name}: want [tokens, {heads}, {dim}] with packed heads, got shape "
                         f"{tuple(x.shape)} strides {strides}")
    return strides[0]


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                          cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                          has_initial: torch.Tensor | None = None, *, scale: float | None = None,
                          out: torch.Tensor | None = None, num_warps: int | None = None,
                          block_v: int | None = None, stages: int = 1, chunk: int = 0,
                          precision: str = "tf32", walk: tuple[int, int] | None = None) -> torch.Tensor:
    """Run the gated delta rule over every sequence of a step; update ``state`` in place.

    q, k     [tokens, H, K]       (token stride free, heads packed: views of the conv output)
    v        [tokens, HV, V]      HV a multiple of H (grouped value heads)
    a, b     [tokens, HV]         the gate's and beta's pre-activations (token stride free)
    A_log, dt_bias [HV]
    state    [slots, HV, V, K]    float32, bfloat16 or float16; slot s of sequence n is
                                  ``state_indices[n]``, read at its start (unless
                                  ``has_initial[n]`` is false: zero) and written at its end;
                                  a slot <= 0 skips the sequence (output left as it was)
    cu_seqlens [N + 1] int32      sequence n owns tokens [cu_seqlens[n], cu_seqlens[n + 1])
    out      [tokens, HV, V]      (allocated in v's dtype when None) -> returned
    block_v, stages, num_warps    launch shape: value rows of the state per program (a power
                                  of two), software-pipeline depth of the token loop (1: none)
                                  and warps a program; the numerics do not depend on them.
                                  Default: 32 rows and 4 warps; with chunks, the prompts'
                                  launch, 16 and 8 (the decodes' then 32 and 4)
    chunk                         0: every token in turn (a decode's arithmetic); a power of
                                  two >= 16: a sequence of at least that many tokens (a prompt)
                                  goes in chunks of it, the chunked form of the rule with
                                  matrix products (``_chunk``), in a launch of its own;
                                  shorter ones token by token, decodes in the default launch
    precision                     the chunks' matrix products: Triton's ``input_precision``
                                  ("tf32" on tensor cores, "tf32x3", "ieee")
    walk                          (value rows, warps) a program for the prompts, token by
                                  token, in a launch of their own that loads each token's
                                  inputs while the one before updates the state; the
                                  decodes keep the launch shape above (and so their bits),
                                  in the first launch. None: one launch for all. Not with
                                  ``chunk``

    Nothing here reads a device value on the host: the launch never waits for the GPU."""
    tokens, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    strides = (_rows("q", q, H, K), _rows("k", k, H, K), _rows("v", v, HV, V))
    row_strides = []
    for name, x in (("a", a), ("b", b)):
        x_strides = x.stride()
        if len(x_strides) != 2 or x.shape[1] != HV or x_strides[1] != 1:
            raise ValueError(f"{name}: want [tokens, {HV}] with unit head stride, got {tuple(x.shape)} {x_strides}")
        row_strides.append(x_strides[0])
    state_strides = state.stride()
    if len(state_strides) != 4 or state.shape[1:] != (HV, V, K) or state_strides[1:] != (V * K, K, 1):
        raise ValueError(f"state: want [slots, {HV}, {V}, {K}] with contiguous slots, got {tuple(state.shape)}")
    if out is None:
        out = torch.empty(tokens, HV, V, dtype=v.dtype, device=v.device)
    out_stride = _rows("out", out, HV, V)
    n = cu_seqlens.numel() - 1
    if state_indices.numel() < n or (has_initial is not None and has_initial.numel() < n):
        raise ValueError("state_indices and has_initial need an entry per sequence")
    if n <= 0 or tokens == 0:
        return out
    block_k = _pow2(K)
    block_v = block_v or (CHUNK_BLOCK_V if chunk else BLOCK_V)
    num_warps = num_warps or (CHUNK_WARPS if chunk else 4)
    if block_v < 1 or block_v & (block_v - 1) or stages < 1:
        raise ValueError(f"block_v must be a power of two and stages >= 1, got {block_v}, {stages}")
    block_v = min(_pow2(V), block_v)
    if chunk and (not MIN_DOT <= chunk <= MAX_CHUNK or chunk & (chunk - 1) or min(block_v, block_k) < MIN_DOT):
        raise ValueError(f"chunk must be 0 or a power of two in {MIN_DOT}..{MAX_CHUNK}, with blocks of at least {MIN_DOT} "
                         f"key and value rows (a matrix product's least side); got chunk {chunk}, "
                         f"block_v {block_v}, K {K}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if walk is not None:
        walk_v, walk_warps = walk
        if chunk:
            raise ValueError("walk is the token walk's launch for prompts; with chunk, prompts go in chunks")
        if not valid_walk(walk):
            raise ValueError(f"walk: value rows a power of two and warps one of {WARPS}, got {walk}")
        walk_v = min(_pow2(V), walk_v)
        launches = [(block_v, num_warps, ROWS_DECODES, 0), (walk_v, walk_warps, ROWS_PROMPTS, 0)]
    elif chunk:
        # The decodes in a launch of their own, the walk's decode launch: the same compiled loop as
        # without chunks. In the chunks' launch their loop compiled differently on an H100 (CHUNK
        # is a constant of the program): chunks of 16 changed the decodes' last bits, and so the
        # states every later step reads (bench/results/gdn/h100/run-b953a47/decode-bits-*.json).
        launches = [(min(_pow2(V), BLOCK_V), 4, ROWS_DECODES, 0),
                    (block_v, num_warps, ROWS_PROMPTS, chunk)]
    else:
        launches = [(block_v, num_warps, ROWS_ALL, 0)]
    args = (q, k, v, a, b, A_log, dt_bias, out, state, cu_seqlens, state_indices,
            has_initial if has_initial is not None else state_indices,
            *strides, *row_strides, out_stride, state_strides[0],
            K ** -0.5 if scale is None else scale)
    for rows_v, warps, rows, launch_chunk in launches:
        _launch((-(-V // rows_v), n * HV), *args, H=H, HV=HV, K=K, V=V, BK=block_k, BV=rows_v,
                MASK_INITIAL=has_initial is not None, STAGES=stages, CHUNK=launch_chunk,
                SUB=min(launch_chunk, SUB_BLOCK) if launch_chunk else 1, PRECISION=precision, ROWS=rows.value,
                num_warps=warps)
    return out


def _pow2(n: int) -> int:
    """The least power of two >= n (``triton.next_power_of_2`` without its per-call JIT dispatch:
    this runs on the host between launches, several times a layer)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


# Repeat launches straight to the compiled kernel where PREFILL_GATE_FAST_LAUNCH=on (kernels/launch.py)
_launch = Launcher(_gated_delta_kernel)
