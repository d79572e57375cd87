"""The CUSTOM attention backend (prefill_gate.engine_patches.attention) on the CPU.

The builder is vLLM's own class hierarchy fed synthetic `CommonAttentionMetadata`: which
rows take the split-KV launch, the reorder threshold vLLM sorts by, the scratch sizing.
The impl runs its two launches under Triton's interpreter on vLLM's packed KV layout and
must match the float32 reference on every row, whatever the split point.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_gate.engine_patches import ATTENTION_BACKEND, register
from prefill_gate.engine_patches import attention as attn
from prefill_gate.kernels.reference import paged_attention_ref
from tests.engine.harness import MODEL_CONFIG, vllm_config

HQ, HKV, D = MODEL_CONFIG["num_attention_heads"], MODEL_CONFIG["num_key_value_heads"], MODEL_CONFIG["head_dim"]


def make_builder(model, monkeypatch, mode="auto", k=0, parallel=False, block_size=16, **config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    monkeypatch.setenv("PREFILL_GATE_SPEC_AS_DECODE", mode)
    cfg = vllm_config(model, num_spec_tokens=k, block_size=block_size, **config)
    if parallel:
        cfg.speculative_config.parallel_drafting = True
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    return attn.SplitRowsMetadataBuilder(spec, ["attn"], cfg, torch.device("cpu"))


def common(query_lens, context_lens, prefilling=None, *, num_reqs=None, block_size=16, seed=0):
    """CommonAttentionMetadata for rows with these query lengths and total contexts, their
    pages spread at random over a pool; rows past `num_reqs` are graph padding (0 tokens)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    pages = max(1, -(-max(context_lens) // block_size))
    table = torch.randperm(len(query_lens) * pages + 1, generator=gen)[: len(query_lens) * pages]
    flags = torch.tensor(prefilling if prefilling is not None else [False] * len(query_lens))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
        num_reqs=num_reqs or len(query_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens), max_seq_len=max(context_lens),
        block_table_tensor=table.view(len(query_lens), pages).to(torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), is_prefilling=flags,
    )


def test_plain_decode_batch_is_one_split_launch(tiny_model, monkeypatch):
    b = make_builder(tiny_model, monkeypatch)
    m = b.build(0, common([1, 1, 1], [40, 7, 300]))
    assert (m.num_split, m.max_split_query_len, m.num_reqs) == (3, 1, 3)
    assert b.reorder_batch_threshold == 1


@pytest.mark.parametrize("k", range(1, 8))
def test_verify_rows_for_every_k(tiny_model, monkeypatch, k):
    b = make_builder(tiny_model, monkeypatch, k=k)
    assert b.reorder_batch_threshold == b.query_cap == 1 + k
    lens = list(range(1, k + 2))  # accepted drafts differ per request
    m = b.build(0, common(lens, [100 + q for q in lens]))
    assert (m.num_split, m.max_split_query_len) == (len(lens), 1 + k)
    m = b.build(0, common([1 + k, 1 + k, 300], [500, 60, 300], [False, False, True]))
    assert (m.num_split, m.max_split_query_len) == (2, 1 + k)


def test_a_short_chunked_prefill_of_the_same_length_is_not_split(tiny_model, monkeypatch):
    b = make_builder(tiny_model, monkeypatch, k=3)
    # vLLM's reorder puts decodes first, then short extends: the split stops at the extend
    m = b.build(0, common([4, 4, 4], [90, 80, 70], [False, True, False]))
    assert m.num_split == 1


def test_a_final_prefill_chunk_and_a_first_chunk_are_2d(tiny_model, monkeypatch):
    b = make_builder(tiny_model, monkeypatch, k=3)
    m = b.build(0, common([2, 300], [700, 300], [True, True]))
    assert m.num_split == 0 and m.scratch is None


def test_padding_rows_of_a_captured_graph_count_as_split_rows(tiny_model, monkeypatch):
    b = make_builder(tiny_model, monkeypatch, k=2)
    m = b.build(0, common([3, 3, 0, 0], [50, 60, 1, 1]))
    assert (m.num_split, m.num_reqs) == (4, 4)
    assert m.scratch.acc.shape[0] >= 4 * 3  # every padded row's 1 + k tokens fit


def test_parallel_drafting_doubles_the_verify_length(tiny_model, monkeypatch):
    b = make_builder(tiny_model, monkeypatch, k=3, parallel=True)
    assert b.num_spec_tokens == 6 and b.query_cap == b.reorder_batch_threshold == 7
    assert b.build(0, common([7, 5], [80, 90])).num_split == 2
    b = make_builder(tiny_model, monkeypatch, k=5, parallel=True)
    assert b.query_cap == 8  # 1 + 10 tokens stay on the 2-D launch
    assert b.build(0, common([8, 11], [80, 90])).num_split == 1


@pytest.mark.parametrize("mode, cap", [("auto", 4), ("0", 1), ("1", 8)])
def test_modes_set_what_vllm_reorders(tiny_model, monkeypatch, mode, cap):
    b = make_builder(tiny_model, monkeypatch, mode=mode, k=3)
    assert b.reorder_batch_threshold == b.query_cap == cap
    m = b.build(0, common([1, 4, 6], [30, 40, 50], [False, False, True]))
    assert m.num_split == {"auto": 2, "0": 1, "1": 3}[mode]


@pytest.mark.parametrize("k, max_num_seqs", [(0, 16), (3, 16), (7, 64)])
def test_scratch_covers_every_batch_the_scheduler_can_form(tiny_model, monkeypatch, k, max_num_seqs):
    b = make_builder(tiny_model, monkeypatch, k=k, max_num_seqs=max_num_seqs)
    assert b._scratch[0].numel() == b.scratch_rows * HQ
    assert b._scratch[2].numel() == b.scratch_rows * HQ * D
    for n in range(1, b.max_split_seqs + 1):
        tokens, splits, s = b.scratch_for(n, b.query_cap)
        assert tokens * splits <= b.scratch_rows
        assert s.acc.shape == (tokens, HQ, splits, D) and s.m.shape == (tokens, HQ, splits)
        assert s.acc.data_ptr() == b._scratch[2].data_ptr()  # views: no allocation per step
        assert splits == attn.num_kv_splits(n, HKV, b.num_sms)
    with pytest.raises(RuntimeError, match="sized for"):
        b.scratch_for(b.max_split_seqs + 1, 1)


def test_split_counts_fill_the_gpu_and_stay_powers_of_two():
    for sms in (80, 132):
        for n in range(1, 600):
            s = attn.num_kv_splits(n, 8, sms)
            assert s & (s - 1) == 0 and 1 <= s <= attn.MAX_SPLITS
            assert n * 8 * s >= 2 * sms or s == attn.MAX_SPLITS
            assert s == 1 or n * 8 * (s // 2) < 2 * sms  # no more than needed


def make_impl(**kw):
    args = {"num_heads": HQ, "head_size": D, "scale": D ** -0.5, "num_kv_heads": HKV, "alibi_slopes": None,
            "sliding_window": None, "kv_cache_dtype": "auto"}
    return attn.SplitRowsAttentionImpl(**{**args, **kw})


def packed_cache(m, seed=0):
    """vLLM's logical (blocks, kv_heads, page, 2 * head) cache over physical NHD storage,
    and the (blocks, page, kv_heads, head) K and V views the reference reads."""
    gen = torch.Generator().manual_seed(seed)
    blocks = int(m.block_table.max()) + 1
    physical = torch.randn(blocks, 16, HKV, 2 * D, generator=gen)
    return physical.permute(0, 2, 1, 3), physical[..., :D], physical[..., D:]


@pytest.mark.parametrize("mode", ["auto", "0", "1"])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, 20.0)])
def test_forward_matches_the_reference_on_every_row(tiny_model, monkeypatch, mode, window, softcap):
    b = make_builder(tiny_model, monkeypatch, mode=mode, k=3)
    lens, ctx, pre = [1, 4, 3, 1, 4, 40, 2], [90, 33, 200, 5, 64, 100, 70], [False] * 4 + [True] * 3
    m = b.build(0, common(lens, ctx, pre, seed=len(mode)))
    assert 0 < m.num_split < m.num_reqs or mode == "0"
    kv, k_cache, v_cache = packed_cache(m)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(m.num_actual_tokens, HQ, D, generator=gen)
    out = torch.full_like(q, float("nan"))
    impl = make_impl(sliding_window=window, logits_soft_cap=softcap)
    ref = paged_attention_ref(q, k_cache, v_cache, m.block_table, m.seq_lens, m.query_start_loc,
                              scale=D ** -0.5, sliding_window=window, softcap=softcap)
    for _ in range(2):  # the first call checks layouts, later ones skip the checks
        out.fill_(float("nan"))
        impl.forward(None, q, None, None, kv, m, out)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("capturing, fused", [(False, True), (True, False)])
def test_merge_fused_when_eager_and_a_launch_of_its_own_under_capture(tiny_model, monkeypatch, capturing, fused):
    """Eager steps pay the host per launch, so the split rows merge inside their launch;
    a captured graph replays launches for free, so it records the GPU-faster two launches."""
    b = make_builder(tiny_model, monkeypatch, mode="auto", k=3)
    m = b.build(0, common([1, 4, 1], [90, 33, 200], [False] * 3, seed=2))
    kv, k_cache, v_cache = packed_cache(m)
    q = torch.randn(m.num_actual_tokens, HQ, D, generator=torch.Generator().manual_seed(3))
    out = torch.full_like(q, float("nan"))
    seen = []
    real = attn.paged_attention

    def spy(*args, **kw):
        if kw.get("split"):
            seen.append(kw["scratch"].counter is not None)
        return real(*args, **kw)

    monkeypatch.setattr(attn, "paged_attention", spy)
    monkeypatch.setattr(attn, "_capturing", lambda t: capturing)
    make_impl().forward(None, q, None, None, kv, m, out)
    assert seen == [fused]
    ref = paged_attention_ref(q, k_cache, v_cache, m.block_table, m.seq_lens, m.query_start_loc, scale=D ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert not b._counter.any()


def test_the_profiling_run_zeroes_the_output():
    out = torch.ones(3, HQ, D)
    make_impl().forward(None, torch.ones(3, HQ, D), None, None, None, None, out)
    assert not out.any()


@pytest.mark.parametrize("kw, message", [
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype auto"),
    ({"sinks": torch.zeros(HQ)}, "attention sinks"),
    ({"alibi_slopes": [1.0] * HQ}, "ALiBi"),
    ({"head_size": 48}, "head size 48"),
])
def test_unsupported_features_name_the_setting(kw, message):
    with pytest.raises(ValueError, match=f"CUSTOM.*{message}"):
        make_impl(**kw)


def test_bf16_on_sm70_says_to_run_float16(monkeypatch):
    monkeypatch.setattr(attn, "device_capability", lambda device: (7, 0))
    with pytest.raises(ValueError, match="--dtype float16"):
        make_impl()._check_dtype(torch.ones(1, dtype=torch.bfloat16))
    make_impl()._check_dtype(torch.ones(1, dtype=torch.float16))


def test_register_points_vllms_custom_slot_here():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register()
    assert AttentionBackendEnum.CUSTOM.get_path() == ATTENTION_BACKEND
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend is attn.SplitRowsAttentionBackend and backend.get_name() == "CUSTOM"
    assert backend.get_builder_cls() is attn.SplitRowsMetadataBuilder
    assert backend.get_impl_cls() is attn.SplitRowsAttentionImpl


def test_vllm_refuses_configurations_the_backend_cannot_run():
    from vllm.platforms.interface import DeviceCapability

    reasons = attn.SplitRowsAttentionBackend.validate_configuration(
        head_size=48, dtype=torch.float16, kv_cache_dtype="fp8", block_size=16, use_mla=False, has_sink=True,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(7, 0), attn_type="decoder")
    assert {"head_size not supported", "kv_cache_dtype not supported", "attention sinks not supported"} <= set(reasons)
    assert attn.SplitRowsAttentionBackend.validate_configuration(
        head_size=128, dtype=torch.float16, kv_cache_dtype="auto", block_size=16, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(7, 0), attn_type="decoder") == []


def test_a_bad_mode_stops_the_plugin(monkeypatch):
    monkeypatch.setenv("PREFILL_GATE_SPEC_AS_DECODE", "yes")
    with pytest.raises(ValueError, match="PREFILL_GATE_SPEC_AS_DECODE='yes'"):
        register()


def test_flags_for_fewer_rows_than_the_padded_batch(tiny_model, monkeypatch):
    """vLLM's model runner V2 passes is_prefilling for the real rows only."""
    b = make_builder(tiny_model, monkeypatch, k=1)
    c = common([2, 2, 0, 0], [50, 60, 1, 1])
    c.is_prefilling = torch.tensor([False, False])
    assert b.build(0, c).num_split == 4
    c.is_prefilling = torch.tensor([False, True])
    assert b.build(0, c).num_split == 1
