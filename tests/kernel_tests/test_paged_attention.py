"""The Triton kernel against its torch specification, in Triton's interpreter.

Every test draws fresh random inputs and poisons ``out`` with NaN before the run, so a
row the kernel forgets to write fails. Tolerances are against the float32 reference:
1e-5 for float32 inputs, 2e-3 (relative to the output scale) for float16.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from prefill_gate.kernels.paged_attention import Scratch, paged_attention
from prefill_gate.kernels.reference import paged_attention_ref
from tests.kernel_tests.cases import make_case

PAGES = (1, 16, 48, 544, 784, 1568)
QUERY_LENS = (1, 2, 4, 8, 33, 300)
GQA = ((4, 4), (8, 2), (8, 1))  # (q heads, kv heads): ratios 1, 4, 8
HEAD_DIMS = (64, 128)
DTYPES = (torch.float32, torch.float16)


def run(case: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(case["q"], float("nan"))
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    got = paged_attention(**args, scale=case["scale"], max_query_len=case["max_query_len"], out=out, **kw)
    assert got is out
    ref = paged_attention_ref(**args, scale=case["scale"], sliding_window=kw.get("sliding_window"),
                              softcap=kw.get("softcap"))
    return out, ref


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "rows left unwritten (NaN poison)"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


def _grid():
    """Every page size, query length, GQA ratio, head dim and dtype appears, and every
    pair of page size and query length; the rest rotates (the interpreter is slow)."""
    rng = random.Random(0)
    cases = []
    for i, (page, qlen) in enumerate(itertools.product(PAGES, QUERY_LENS)):
        hq, hkv = GQA[i % len(GQA)]
        cases.append((page, qlen, hq, hkv, HEAD_DIMS[(i // 3) % 2], DTYPES[i % 2], rng.randrange(1 << 30)))
    return cases


@pytest.mark.parametrize("page, qlen, hq, hkv, head_dim, dtype, seed", _grid())
def test_matches_the_reference(page, qlen, hq, hkv, head_dim, dtype, seed):
    # Contexts that cross page boundaries (and several pages for small pages).
    context = page + 7 if page > 1 else 37
    case = make_case(page, [qlen], [context], hq, hkv, head_dim, dtype, seed)
    assert_close(*run(case), dtype)


@pytest.mark.parametrize("two_d_first", [False, True])
def test_a_batch_split_between_the_two_paths(two_d_first):
    """The CUSTOM backend's use: leading rows on the split path with a caller-owned scratch,
    the rest forced onto the 2-D path (short rows included). Each launch writes only its
    own rows, in either order."""
    case = make_case(16, [1, 4, 3, 2, 40], [90, 33, 200, 70, 41], 8, 2, 64, torch.float32, random.randrange(1 << 30))
    q, k, v, bt, sl, qsl = (case[n] for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc"))
    out = torch.full_like(q, float("nan"))
    scratch = Scratch.empty(8, 8, 4, 64, "cpu")

    def split_rows():
        paged_attention(q[:8], k, v, bt, sl[:2], qsl[:3], scale=case["scale"], max_query_len=4, out=out[:8],
                        split=True, num_kv_splits=4, scratch=scratch)

    def other_rows():
        paged_attention(q, k, v, bt[2:], sl[2:], qsl[2:], scale=case["scale"], max_query_len=40, out=out,
                        split=False)

    for launch in ((other_rows, split_rows) if two_d_first else (split_rows, other_rows)):
        launch()
    ref = paged_attention_ref(q, k, v, bt, sl, qsl, scale=case["scale"])
    assert_close(out, ref, torch.float32)
    with pytest.raises(ValueError, match="scratch"):
        paged_attention(q[:8], k, v, bt, sl[:2], qsl[:3], scale=case["scale"], max_query_len=4, out=out[:8],
                        split=True, num_kv_splits=8, scratch=scratch)


def test_fused_merge_matches_the_merge_launch_and_leaves_counters_zero():
    """Split rows merged by the tile's last program (counters in the scratch) match the
    two-launch path (float32 rounding apart: the fused merge folds the segments in turn),
    the same launch repeated gives the same bits, and every counter is back at zero after
    each launch: one zeroed buffer serves every layer and every CUDA-graph replay."""
    case = make_case(16, [1, 4, 3, 2, 1], [90, 33, 200, 70, 500], 8, 2, 64, torch.float32, random.randrange(1 << 30))
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    fused = Scratch.empty(16, 8, 4, 64, "cpu", num_kv_heads=2)
    separate = Scratch(*fused[:3])  # no counters: the merge launch
    assert fused.counter is not None and separate.counter is None
    outs = []
    for scratch in (fused, separate, fused):  # the second fused launch reuses the counters
        out = torch.full_like(case["q"], float("nan"))
        paged_attention(**args, scale=case["scale"], max_query_len=4, out=out, split=True, num_kv_splits=4,
                        scratch=scratch)
        assert not fused.counter.any()
        outs.append(out)
    assert torch.equal(outs[0], outs[2])
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-6
    assert_close(outs[0], paged_attention_ref(**args, scale=case["scale"]), torch.float32)
    short = Scratch(*fused[:3], torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="scratch counter"):
        paged_attention(**args, scale=case["scale"], max_query_len=4, split=True, num_kv_splits=4, scratch=short)


@pytest.mark.parametrize("page", [16, 544])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batches(page, dtype):
    seed = random.randrange(1 << 30)
    # Prefill chunks, a verify row and decodes in one batch (the 2-D path: max len > 8).
    case = make_case(page, [33, 1, 4, 300, 1], [5, 700, 61, 0, 1100], 8, 2, 64, dtype, seed)
    assert_close(*run(case), dtype)
    # Decode and verify rows only (the split-KV path), several segments per sequence.
    case = make_case(page, [1, 4, 1, 2, 8], [3, 700, 1500, 40, 9], 8, 1, 128, dtype, seed + 1)
    for splits in (1, 3, 8, 16):
        assert_close(*run(case, num_kv_splits=splits), dtype)


@pytest.mark.parametrize("split", [True, False])
def test_the_sm70_tiling_matches_too(monkeypatch, split):
    """sm_70 walks KV in 16-position steps (``launch_config``): the same numerics."""
    import prefill_gate.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "device_capability", lambda device: (7, 0))
    assert pa.launch_config((7, 0), split)[0] == 16
    qlens = [1, 4, 2] if split else [40, 1, 9]
    case = make_case(48, qlens, [100, 47, 5], 8, 1, 128, torch.float16, random.randrange(1 << 30))
    assert_close(*run(case), torch.float16)


@pytest.mark.parametrize("qlen", [1, 4, 33])
def test_sliding_window_and_softcap(qlen):
    seed = random.randrange(1 << 30)
    case = make_case(16, [qlen, 2], [90, 20], 4, 2, 64, torch.float32, seed)
    assert_close(*run(case, sliding_window=24), torch.float32)
    assert_close(*run(case, softcap=3.0), torch.float32)
    assert_close(*run(case, sliding_window=7, softcap=30.0), torch.float32)


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_other_head_dims(head_dim):
    case = make_case(16, [3, 40], [50, 10], 4, 1, head_dim, torch.float32, random.randrange(1 << 30))
    assert_close(*run(case), torch.float32)


def test_allocates_out_when_not_given():
    case = make_case(16, [2], [20], 4, 2, 64, torch.float32, 1)
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    out = paged_attention(**args, scale=case["scale"], max_query_len=2)
    torch.testing.assert_close(out, paged_attention_ref(**args, scale=case["scale"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(q=c["q"][..., :48].contiguous()), "head_dim 48"),
    (lambda c: c.update(q=c["q"].half()), "share a dtype"),
    (lambda c: c.update(seq_lens=c["seq_lens"].long()), "seq_lens must be int32"),
    (lambda c: c.update(query_start_loc=c["query_start_loc"][:-1]), "num_seqs \\+ 1"),
    (lambda c: c.update(q=c["q"][:, :3]), "do not group"),
    (lambda c: c.update(max_query_len=0), "max_query_len"),
])
def test_bad_inputs_are_clear_errors(change, message):
    case = make_case(16, [2], [20], 4, 2, 64, torch.float32, 1)
    change(case)
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    with pytest.raises(ValueError, match=message):
        paged_attention(**args, scale=0.1, max_query_len=case["max_query_len"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_the_gpu_bf16_and_fp16(dtype):
    if not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    case = make_case(1568, [1, 4, 300], [30000, 9000, 2000], 32, 8, 128, dtype, 3, device="cuda")
    args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start_loc")}
    out = paged_attention(**args, scale=case["scale"], max_query_len=case["max_query_len"])
    ref = paged_attention_ref(**{k: v.cpu() for k, v in args.items()}, scale=case["scale"])
    rel = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-2
